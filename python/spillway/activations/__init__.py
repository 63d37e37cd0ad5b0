"""Activation offload: saved activations go to pinned host memory in forward and
come back for backward.

    eager.py      offload_activations(): autograd's saved-tensor hooks, for eager models
    compiled.py   compile(): the plan written into torch.compile's joint graph

The public entry points are spillway.offload_activations and spillway.compile;
this package imports nothing itself, so loading one path does not load the other.
"""
