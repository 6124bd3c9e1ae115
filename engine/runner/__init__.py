"""Runs the model for the core process, on any device: the model runner and what one step needs.

The runner (`model_runner`), the step's flat inputs and attention metadata (`step_metadata`),
hybrid models' state tensors (`state_cache`), the sampler (`sampler`), decode CUDA graphs
(`cuda_graphs`) and the GPU's GEMV choice (`gpu_linear`); and the hot ops the models call
(`ops`, which picks an implementation: the Triton kernels and references in `helexa_kernels`,
the fewer-call PyTorch forms in `helexa_kernels/<op>/aten.py`, the paged attention of `attention` as planned by
`attention_plan`). What only the CPU needs lives in `engine.cpu`.
"""
