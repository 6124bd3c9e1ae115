"""The engine core's process: its loop (`engine_core`: schedule -> forward -> sample) and the
bookkeeping the loop owns.

Requests and their state (`request`), the scheduler with its token budget and preemption
(`scheduler`), the paged KV cache's blocks and prefix hashes (`kv_cache`), hybrid models' state
slots (`state_slots`), the batch window an idle core waits out (`batch_window`), and grammar-
constrained decoding (`structured_output`). The bookkeeping is plain Python; the loop and the
grammar masks touch torch. Tensors and the model itself are the runner's (`engine.runner`).
"""
