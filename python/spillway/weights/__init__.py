"""Weight offload: a model's block weights live in pinned host memory and come to the
device only while their block runs.

    layerwise.py   offload_weights(): per-block host slabs, a prefetch ring over the
                   observed block order, release after each block (eager; inference
                   and training)
    _training.py   the offloaded weights in backward
    compiled.py    the compiled piecewise executor: spillway.compile(model,
                   weights="offload") cuts each Dynamo graph at weight-group
                   boundaries and streams the weights between its pieces (inference)

The public entry points are spillway.offload_weights and
spillway.compile(weights="offload"); this package imports nothing itself.
"""
