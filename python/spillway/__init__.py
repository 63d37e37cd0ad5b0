"""Spillway: plan and run tensor offload between GPU memory and pinned host memory.

    with spillway.offload_activations(model, scope="self_attn"):   # eager
        loss = model(x).loss
    loss.backward()

    compiled = spillway.compile(model, scope="self_attn")           # torch.compile

    handle = spillway.offload_weights(model)    # weights: each block's on the device only
    with torch.inference_mode():                # while it runs (pinned host slabs, a
        out = model(x)                          # prefetch ring over the observed order)

    ctx = spillway.offload_activations(model, memory_budget="12GiB")  # eager, planned:
    with ctx:                                   # keep / offload / checkpoint per block;
        loss = model(x).loss                    # the first step profiles, ctx.plan after
    loss.backward()

The submodules load lazily (importing spillway alone stays cheap and does not
import torch): spillway.activations (eager.py, compiled.py: activation
offload), spillway.weights (layerwise.py: weight offload), spillway.trace (a
step recorded op by op: trace and replay), spillway.optim (HostAdamW: AdamW
state on the host, updated on the CPU), spillway.ops (the custom ops),
spillway.fx_export (the FX graph exporter).
"""

__version__ = "0.1.0"

__all__ = ["offload_activations", "compile", "offload_weights"]


def __getattr__(name):
    if name == "offload_activations":
        from spillway.activations.eager import offload_activations
        return offload_activations
    if name == "compile":
        from spillway.activations.compiled import compile
        return compile
    if name == "offload_weights":
        from spillway.weights.layerwise import offload_weights
        return offload_weights
    if name in ("trace", "optim"):
        import importlib
        return importlib.import_module(f"spillway.{name}")
    raise AttributeError(f"module 'spillway' has no attribute {name!r}")
