"""Model sources on disk: the architecture (`model_config`), GGUF files read (`gguf_file`) and
dequantized (`gguf_import`), HF directories and GGUF files loaded into a model (`loader`), and
where the default model lives (`default_model`).

`loader` and `gguf_import` build tensors and run in the core process; `model_config`, `gguf_file`
and `default_model` import no torch, so the worker's process reads a source's tokenizer through
them (`engine.frontend.model_source`).
"""
