"""The engine as the worker's asyncio process sees it; nothing here imports torch.

The wire types between worker and core (`protocol`), the client that starts and talks to the core
process (`core_client`), the engine's settings (`engine_config`), tokenizing and detokenizing
(`tokenizer`), reading a model source without its weights (`model_source`), checking grammars
(`grammars`), the scripted engine that stands in for a model (`scripted`), and the parent-death
signal that ties a child process to the one that started it (`parent_death`). The core process
imports these too: they are the torch-free ground both sides stand on.
"""
