"""Weight offload: a model's block weights live in pinned host memory and come to the
device only while their block runs.

    layerwise.py   offload_weights(): per-block host slabs, a prefetch ring over the
                   observed block order, release after each block (eager, inference)

The public entry point is spillway.offload_weights; this package imports nothing
itself.
"""
