"""Optimizers whose state lives on the host.

    opt = spillway.optim.HostAdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    loss.backward()      # each gradient goes to pinned host memory as it completes,
    opt.step()           # and AdamW runs on the CPU, bitwise equal to AdamW(fused=True)
    opt.zero_grad()      # on the GPU: the moments never cross the link

See Note [Host AdamW] (src/optim/adamw.cc) for the arithmetic, and
_host_adamw.py (Note [The host optimizer]) for the pipeline.
"""

from spillway.optim._host_adamw import HostAdamW
from spillway.optim._probe import (ARITHMETICS, measure_host_adamw, measure_host_adamw_gbs,
                                   probe_adamw)

__all__ = ["HostAdamW", "probe_adamw", "measure_host_adamw", "measure_host_adamw_gbs",
           "ARITHMETICS"]
