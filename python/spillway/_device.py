"""What the Python paths share about devices and argument errors: the device a user
names, checked once the same way for every path (activations, weights)."""
from __future__ import annotations

import torch

from spillway import ops


ALLOCATION_GRANULE = 512  # the caching allocator's rounding (a device profile's
#                          allocation_granularity)


def allocation_rounded(nbytes: int) -> int:
    """The bytes the CUDA caching allocator counts for an allocation of `nbytes`."""
    return -(-nbytes // ALLOCATION_GRANULE) * ALLOCATION_GRANULE if nbytes > 0 else 0


def shown(value) -> str:
    """A received argument for an error message: its repr (shortened) and its type."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def parse_device(device, component: str) -> torch.device:
    """`device` (a str or a torch.device) as a usable torch.device; ValueError whose
    message starts with [component] otherwise."""
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"[{component}] device must be cpu, cuda or cuda:N (a str or a "
                         f"torch.device), got {shown(device)}") from None
    return usable_device(target, component, device)


def usable_device(target: torch.device, component: str, given=None) -> torch.device:
    """`target` with its CUDA index resolved, after checking that torch and spillway._C
    can move its tensors; ValueError whose message starts with [component] otherwise."""
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"[{component}] device {target}: torch has no usable CUDA here")
        if not ops.cuda_built():
            raise ValueError(f"[{component}] device {target}: spillway._C was built without "
                             f"CUDA")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        if target.index >= torch.cuda.device_count():
            raise ValueError(f"[{component}] device {target}: there are "
                             f"{torch.cuda.device_count()} CUDA devices")
    elif target.type != "cpu":
        raise ValueError(f"[{component}] device must be cpu, cuda or cuda:N, got "
                         f"{shown(target if given is None else given)}: spillway moves tensors "
                         f"of cpu or cuda devices only")
    return target
