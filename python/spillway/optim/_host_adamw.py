"""HostAdamW: AdamW whose moments and master values live in pinned host memory.

Note [The host optimizer]
Per parameter, the host holds four fp32 arrays, each a pinned block of exactly its
size (the runtime's pool, not torch's power-of-two pinned allocator): the moments
exp_avg and exp_avg_sq, a copy of the parameter, and a gradient buffer. The device
keeps only the parameter (and its gradient, unless free_grads).

- Backward: when a parameter's gradient is complete (its post-accumulate-grad
  hook), an event is recorded on the stream that made it, and a D2H stream copies
  the gradient into the host buffer after that event (record_stream keeps its memory
  from reuse until the copy has read it). With free_grads the device gradient is
  dropped at once, and p.grad is None afterwards; host_grad(p) returns the host copy.
- The update: a worker waits for the gradient's copy, runs the host AdamW on the
  host arrays (Note [Host AdamW]: the same bits as AdamW(fused=True) on the GPU, in
  the form probe_adamw() found this torch to use), and an H2D stream writes the
  new parameter back, after the same event (so after every read of the old value
  that backward had enqueued). With step_in_backward the update starts as soon as
  the gradient is complete, overlapping the rest of backward; otherwise step()
  starts them all.
- step() returns when every update has run and its write-back is enqueued; the
  compute stream then waits for the H2D stream, so the next forward reads the new
  values. No host synchronisation with the compute stream happens anywhere.

The device parameter is written through p.data, which does not bump p's version
counter; a write by anyone else does, and the host copy is then taken again from the
device before the next update (so loading a checkpoint into the model, or changing
a weight in place, is seen). load_state_dict() keeps the moments on the host.

Exactness: with one backward per step, the parameters, moments and (host) gradients
are torch.equal to those of torch.optim.AdamW(fused=True) on the device, on every
step. step_in_backward=True writes a parameter back once its gradient is complete, as
torch's optimizer-in-backward pattern does: a backward op that still reads the
parameter after that (one used through .detach()) could see the new value. It also
changes what a user may do between backward and step():
the update has already used the gradient, so clipping or scaling it there is
refused (a second backward before step() raises), and so is reading p.grad after
backward with free_grads.

Under spillway.trace (record or replay) HostAdamW refuses to run: its parameter
writes come from another thread, unseen by the trace. A traced step uses
torch.optim.AdamW(fused=True), and a plan made with host_adamw_gbs runs the same host
update inside the replay (Note [Host updates in replay]).
"""

from __future__ import annotations

import math
import queue
import threading
import weakref

import torch

from spillway.optim._probe import (ARITHMETICS, arithmetic_code, device_powers, host_threads,
                                   probe_adamw)

_COMPONENT = "[optim]"


class _Slot:
    """The host side of one parameter."""

    __slots__ = ("param", "grad", "version", "data_ptr", "seen", "ready", "done")

    def __init__(self, p: torch.Tensor):
        self.param = _pinned_copy(p)
        self.grad = _pinned_copy(p)
        self.version = p._version
        self.data_ptr = p.data_ptr()
        self.seen = False  # a gradient reached the host since the last step()
        self.ready = None  # the event after the last read of the old value
        self.done = None  # the event after the gradient's copy


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of t in an exact-size pinned block (on CPU, a plain copy). On CUDA
    its bytes land after the compute stream's current point (the stream waits for the
    copy; the host does not): readers on the host wait for an event recorded later on
    that stream, as the pipeline's do."""
    from spillway import ops
    src = t.detach()
    return ops.wait_tensor(ops.offload(src.contiguous(), exact=True), keepalive=src)


def _pinned_zeros(t: torch.Tensor) -> torch.Tensor:
    # Zeros copied from the device, not a copy zeroed on the host: on CUDA the copy may
    # land after a host-side zero_() and overwrite it.
    return _pinned_copy(torch.zeros_like(t))


class HostAdamW(torch.optim.Optimizer):
    """AdamW with its state on the host and its update on the CPU, bitwise equal to
    torch.optim.AdamW(fused=True) on the device (Note [The host optimizer]).

    Parameters must be dense float32 tensors requiring grad, all on one device (cuda,
    or cpu, where the same pipeline runs with plain copies).

    arithmetic: "probe" (default) runs probe_adamw() with each group's hyperparameters
    and uses the form that reproduces the device's AdamW(fused=True) bit for bit; a
    ValueError names the mismatch when none does. "cuda-fused-double" or
    "cuda-fused-float" skips the probe (no bitwise promise unless that form is the
    device's). threads: the host update's threads (default: the CPUs this process may
    use, less two when there are more than four: the threads that launch the step's
    kernels keep theirs). step_in_backward: update each parameter as soon as its gradient is complete.
    free_grads: drop each device gradient once it is on the host.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False,
                 arithmetic: str = "probe", threads: int | None = None,
                 step_in_backward: bool = False, free_grads: bool = False):
        _check_hyper(lr, betas, eps, weight_decay)
        if arithmetic != "probe" and arithmetic not in ARITHMETICS:
            raise ValueError(f"{_COMPONENT} arithmetic must be 'probe' or one of "
                             f"{ARITHMETICS}, got {arithmetic!r}")
        if threads is None:
            threads = host_threads()
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"{_COMPONENT} threads must be an int >= 1, got {threads!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        maximize=maximize)
        super().__init__(params, defaults)
        self._threads = threads
        self._step_in_backward = bool(step_in_backward)
        self._free_grads = bool(free_grads)
        self._device = self._check_params()
        self._arithmetic = {}  # group index -> form
        for i, group in enumerate(self.param_groups):
            self._arithmetic[i] = self._resolve(arithmetic, group)
        self._slots: dict[torch.Tensor, _Slot] = {}
        self._group_of: dict[torch.Tensor, int] = {}
        self._hooks = []
        self._cuda = self._device.type == "cuda"
        self._d2h = torch.cuda.Stream(self._device) if self._cuda else None
        self._h2d = torch.cuda.Stream(self._device) if self._cuda else None
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._slots[p] = _Slot(p)
                self._group_of[p] = i
                state = self.state[p]
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = _pinned_zeros(p)
                state["exp_avg_sq"] = _pinned_zeros(p)
                self._hooks.append(p.register_post_accumulate_grad_hook(_hook(self)))
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        self._worker_error: BaseException | None = None
        self._waiting: list[torch.Tensor] = []  # gradients on the host, updates not started
        self._lock = threading.Lock()

    # ---- setup -----------------------------------------------------------------

    def _check_params(self) -> torch.device:
        device = None
        for group in self.param_groups:
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            for p in group["params"]:
                if not isinstance(p, torch.Tensor) or p.layout != torch.strided:
                    raise ValueError(f"{_COMPONENT} HostAdamW takes dense tensors, got "
                                     f"{type(p).__name__}")
                if p.dtype != torch.float32:
                    raise ValueError(f"{_COMPONENT} HostAdamW updates float32 parameters; a "
                                     f"parameter of shape {tuple(p.shape)} is {p.dtype}")
                if not p.requires_grad:
                    raise ValueError(f"{_COMPONENT} a parameter of shape {tuple(p.shape)} "
                                     f"does not require grad")
                if not p.is_contiguous():
                    raise ValueError(f"{_COMPONENT} a parameter of shape {tuple(p.shape)} is "
                                     f"not contiguous")
                if device is None:
                    device = p.device
                elif p.device != device:
                    raise ValueError(f"{_COMPONENT} HostAdamW's parameters must share one "
                                     f"device: {device} and {p.device}")
        if device is None:
            raise ValueError(f"{_COMPONENT} HostAdamW got no parameters")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"{_COMPONENT} parameters on {device}: cpu or cuda only")
        return device

    def _resolve(self, arithmetic: str, group: dict) -> str:
        if arithmetic != "probe":
            return arithmetic
        found = probe_adamw(self._device, lr=group["lr"], betas=group["betas"],
                            eps=group["eps"], weight_decay=group["weight_decay"],
                            maximize=group["maximize"])
        if found["arithmetic"] is None:
            detail = "; ".join(f"{a}: {m}" for a, m in found["mismatch"].items())
            raise ValueError(
                f"{_COMPONENT} no host form reproduces this torch's AdamW(fused=True) on "
                f"{self._device} bit for bit ({detail}). Pass arithmetic='cuda-fused-double' "
                f"or 'cuda-fused-float' to run on the host anyway, without that promise")
        return found["arithmetic"]

    # ---- the pipeline ----------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        traced = _spillway_trace_mode()
        if traced is not None:
            raise RuntimeError(
                f"{_COMPONENT} HostAdamW ran under spillway.trace ({traced}): its updates "
                f"write parameters from another thread, unseen by the trace, so a replay "
                f"would bring back stale copies. Record and replay the step with "
                f"torch.optim.AdamW(fused=True) instead and plan with host_adamw_gbs: the "
                f"replay then runs AdamW on the host itself")
        slot = self._slots[p]
        if slot.seen and (self._step_in_backward or self._free_grads):
            raise RuntimeError(
                f"{_COMPONENT} a second backward reached a parameter of shape "
                f"{tuple(p.shape)} before step(): with step_in_backward or free_grads each "
                f"gradient is consumed when complete, so gradients cannot accumulate "
                f"across backward calls (use HostAdamW(step_in_backward=False, "
                f"free_grads=False) to accumulate)")
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
            self._d2h.wait_event(ready)
            with torch.cuda.stream(self._d2h):
                if self._host_param_stale(p, slot):
                    slot.param.copy_(p.detach(), non_blocking=True)
                slot.grad.copy_(p.grad, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._d2h)
            # The gradient's memory is not reused before its copy has read it, whoever
            # drops it (free_grads, zero_grad) and whenever.
            p.grad.record_stream(self._d2h)
            slot.ready, slot.done = ready, done
        else:
            if self._host_param_stale(p, slot):
                slot.param.copy_(p.detach())
            slot.grad.copy_(p.grad)
        again, slot.seen = slot.seen, True
        if self._free_grads:
            p.grad = None
        if self._step_in_backward:
            self._start_worker()
            self._queue.put(p)
        elif not again:  # a later backward's gradient replaces the host copy
            with self._lock:
                self._waiting.append(p)

    def _host_param_stale(self, p: torch.Tensor, slot: _Slot) -> bool:
        stale = p._version != slot.version or p.data_ptr() != slot.data_ptr
        slot.version, slot.data_ptr = p._version, p.data_ptr()
        return stale

    def _update(self, p: torch.Tensor, after=None) -> None:
        """Runs one parameter's update and enqueues its write-back: after `after` (an
        event on the compute stream), else after the event its gradient completed at."""
        slot = self._slots[p]
        i = self._group_of[p]
        group = self.param_groups[i]
        state = self.state[p]
        if slot.done is not None:
            slot.done.synchronize()
        state["step"] += 1
        form = self._arithmetic[i]
        beta1, beta2 = group["betas"]
        p1, p2 = device_powers(form, beta1, beta2, float(state["step"]), self._device)
        torch.ops.spillway.adamw_update_(
            slot.param, slot.grad, state["exp_avg"], state["exp_avg_sq"], float(group["lr"]),
            float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            bool(group["maximize"]), p1, p2, arithmetic_code(form), self._threads)
        if self._cuda:
            self._h2d.wait_event(after if after is not None else slot.ready)
            with torch.cuda.stream(self._h2d):
                p.data.copy_(slot.param, non_blocking=True)
        else:
            p.data.copy_(slot.param)

    def _start_worker(self) -> None:
        if self._worker is not None:
            return
        self._queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="spillway-host-adamw",
                                        daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while True:
            p = self._queue.get()
            try:
                if p is None:
                    return
                if self._worker_error is None:
                    if self._cuda:
                        with torch.cuda.device(self._device):
                            self._update(p)
                    else:
                        self._update(p)
            except BaseException as e:  # reported by step()
                self._worker_error = e
            finally:
                self._queue.task_done()

    @torch.no_grad()
    def step(self, closure=None):
        """Finishes the step: every parameter whose gradient reached the host since the
        last step() is updated and written back; the compute stream waits for the
        write-backs. Parameters without a gradient are left as they are."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._queue is not None:
            self._queue.join()
        if self._worker_error is not None:
            error, self._worker_error = self._worker_error, None
            raise RuntimeError(f"{_COMPONENT} a host update failed: {error}") from error
        with self._lock:
            waiting, self._waiting = self._waiting, []
        # Write-backs started here wait for everything enqueued before step(): a
        # parameter backward still reads after its gradient is complete (one used
        # through .detach(), say) keeps its old value for that read.
        after = None
        if self._cuda and waiting:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self._device))
        for p in waiting:
            self._update(p, after)
        for slot in self._slots.values():
            slot.seen = False
        if self._cuda:
            torch.cuda.current_stream(self._device).wait_stream(self._h2d)
        return loss

    def host_grad(self, p: torch.Tensor) -> torch.Tensor:
        """The host copy of p's last gradient (pinned, float32). Valid after step()."""
        return self._slots[p].grad

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch.optim.Optimizer's, with the moments kept in pinned host memory."""
        super().load_state_dict(state_dict)
        for p, slot in self._slots.items():
            state = self.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                value = state[key]
                state[key] = _pinned_copy(value.to(torch.float32))
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
            slot.version = -1  # take the parameter again at its next gradient

    def __del__(self):
        for h in getattr(self, "_hooks", ()):
            h.remove()

    def close(self) -> None:
        """Removes the hooks and stops the worker; the optimizer is unusable after."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None


def _hook(optimizer: HostAdamW):
    """A parameter's post-accumulate-grad hook that does not keep the optimizer alive:
    once it is gone (dropped without close()), the hook does nothing."""
    ref = weakref.ref(optimizer)

    def on_grad(p: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive._on_grad(p)
    return on_grad


def _spillway_trace_mode() -> str | None:
    """The name of a spillway.trace dispatch mode (Recorder, Replay) active here, if any."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    for mode in _get_current_dispatch_mode_stack():
        if type(mode).__module__.startswith("spillway.trace"):
            return type(mode).__name__
    return None


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)) \
                or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{_COMPONENT} {name} must be a finite number >= 0, got "
                             f"{value!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"{_COMPONENT} betas must be two numbers in [0, 1), got {betas!r}")
