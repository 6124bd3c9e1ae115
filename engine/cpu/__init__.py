"""What the core process does only on a CPU: which dtypes this CPU runs (`cpu_support`) and which
is fastest here (`dtype_choice`, remembered by `dtype_cache`), linear layers from prepacked
weights (`cpu_linear`), the decode step's one-call layer stack (`cpu_decode_stack`), and malloc
kept from handing step memory back (`cpu_memory`).
"""
