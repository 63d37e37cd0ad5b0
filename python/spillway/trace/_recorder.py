"""The op recorder: one step of a PyTorch program as a Spillway graph.

Note [The op recorder]
~~~~~~~~~~~~~~~~~~~~~~
A TorchDispatchMode sees every aten op that runs below autograd: the forward,
the backward (the autograd engine carries the mode to its threads) and the
optimizer step. Each op becomes one call_function node of a Spillway graph
(docs/graph-format.md) in the order it ran, so the planners and the simulator
read a recorded step as they read an exported joint graph:

- Storages are real storage identities: a small integer per storage, taken the
  first time a tensor in it is seen, so views, in-place writes and `out=`
  results share the id of their base. A weak reference to the storage (torch
  keeps one Python object per live storage) retires the id when the storage is
  freed, with the position of the op after which that happened (that node's
  `frees`: the residency model keeps a storage alive until then), so an
  address the allocator hands out again gets an id of its own.
- An op's args name the nodes that produced its inputs: the node that last
  produced a tensor of the same storage, offset, sizes, strides and dtype, or
  else the last node that produced anything in that storage (a read of the
  storage is what the simulator needs). A tensor whose storage the step did
  not create (a parameter, a buffer, an optimizer state, a gradient kept from
  before, an input) gets a placeholder node, named after what it is when a
  model or optimizer is given (`model.layers.0.mlp.up_proj.weight`,
  `optimizer.model.layers.0.mlp.up_proj.weight.exp_avg`); the simulator holds
  a placeholder's storage for the whole step.
- Phases: an op that the autograd engine runs for a backward node is
  `backward`; an op inside Optimizer.step (global step hooks) is `optimizer`;
  any other op keeps the phase of the op before it (gradient clipping after
  backward is backward), except that the outermost module call of a forward
  starts `forward` again (gradient accumulation interleaves phases).
- module_stack: the qualified names of the modules whose forward is running
  (global module hooks; backward ops have none).
- time_ms: each op's own time, from CUDA events around it when a tensor it
  reads or writes is on a GPU (read once, at the end), else the host clock.
  The GPU's time, not the CPU's: the recorder's Python runs between ops, so
  the GPU waits for every op and would reach the start event before the op's
  kernels are launched (a view, no kernel, measured 18 us; T3's step summed
  340 ms, its GPU 155 ms). So before the start event, a sleep kernel holds
  the stream for longer than the op takes to launch (twice the longest launch
  seen for that op, 50 us to 2 ms; 200 us the first time): the op's kernels
  are queued by the time the GPU gets to them.
- cpu_ms (ops timed on a GPU): the host's time on the op, which on a GPU may set
  the pace rather than the kernels: the program's since the recorder last handed
  control back (its Python, the autograd engine, the dispatch machinery around
  the mode) and the op's own dispatch and launches. The recorder's own work is
  left out; an op that waits for the GPU (a .item()) counts its wait.
- Storages still alive when recording stops and created during it are
  retained (the gradients, new optimizer state): the output node reads them,
  so the simulator keeps them to the end as the program does.

An opaque region (spillway.trace.opaque) is recorded as one node in forward and
one in backward: the ops inside it run unrecorded, identity autograd functions
at its entry and exit mark where its backward starts and ends. Ops of other
branches that the autograd engine runs while the region's backward is under
way are not recorded either; regions are meant for chains (a layer, a custom
kernel).

The recorder keeps no tensor alive: it holds integers, shapes and weak
references only, so what it records is the program's own memory behaviour.
"""
from __future__ import annotations

import collections
import functools
import itertools
import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from spillway.fx_export._serialize import FORMAT, VERSION, op_schema_entry

_active: list["Recorder"] = []  # the recorder in use (at most one)


@dataclass
class StorageInfo:
    """What the recorder learned about one storage."""
    id: int
    bytes: int
    name: str             # the placeholder's name, or the node that created it
    kind: str             # parameter, buffer, gradient, optimizer_state, input, or created
    created_at: int       # the position of the node that created it; -1: before the step
    freed_at: int | None  # freed after the node at this position; None: alive at the end
    device: str


@dataclass
class Trace:
    """A recorded step: `graph` is a Spillway graph dict (docs/graph-format.md),
    `storages` what happened to each storage id the graph uses."""
    graph: dict
    storages: dict[int, StorageInfo] = field(default_factory=dict)
    # Weak references to the storages that were there before the step (parameters,
    # optimizer state), by id: a replay binds them before its first step.
    refs: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def retained(self) -> list[int]:
        """Storage ids alive when recording stopped."""
        return sorted(s.id for s in self.storages.values() if s.freed_at is None)


def _names_of(model, optimizer) -> dict[int, tuple[str, str]]:
    """Storage key -> (name, kind) for what a model and an optimizer hold."""
    names: dict[int, tuple[str, str]] = {}

    def add(tensor, name, kind):
        if isinstance(tensor, torch.Tensor):
            names.setdefault(tensor.untyped_storage()._cdata, (name, kind))

    param_names: dict[int, str] = {}
    if model is not None:
        for name, p in model.named_parameters(remove_duplicate=True):
            param_names[id(p)] = name
            add(p, name, "parameter")
            if p.grad is not None:
                add(p.grad, f"{name}.grad", "gradient")
        for name, b in model.named_buffers():
            add(b, name, "buffer")
    if optimizer is not None:
        for group_index, group in enumerate(optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                pname = param_names.get(id(p), f"param_groups.{group_index}.params.{k}")
                add(p, pname, "parameter")
                if p.grad is not None:
                    add(p.grad, f"{pname}.grad", "gradient")
                for key, value in optimizer.state.get(p, {}).items():
                    add(value, f"optimizer.{pname}.{key}", "optimizer_state")
    return names


def _short(func) -> str:
    """'mm' for aten.mm.default: the base of a node's name."""
    name = getattr(func, "__name__", None) or str(func)
    return name.split(".")[0]


def _encode(value: Any, tensor_arg) -> Any:
    if isinstance(value, torch.Tensor):
        return tensor_arg(value)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, (list, tuple)):
        return [_encode(v, tensor_arg) for v in value]
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return {"other": str(value)}
    return {"other": repr(value)}


@functools.cache
def _cycles_per_us() -> float:
    """The current GPU's clock for torch.cuda._sleep, measured once (time_ms)."""
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end) * 1e3, 1.0)


class Recorder(TorchDispatchMode):
    """Records what runs while it is active (Note [The op recorder]). Use through
    spillway.trace.record()."""

    def __init__(self, model=None, optimizer=None, *, timed: bool = True):
        super().__init__()
        self._names = _names_of(model, optimizer)
        self._module_names = ({id(m): n for n, m in model.named_modules()}
                              if model is not None else {})
        self._timed = timed
        self._launch_us: dict = {}  # op -> the sleep before its start event (time_ms)
        self._lock = threading.RLock()  # the autograd engine's threads record too
        self.nodes: list[dict] = []
        self.ops: dict[str, dict] = {}
        self._ids: dict[int, int] = {}                  # live storage key -> storage id
        self._refs: dict[int, weakref.ref] = {}         # storage id -> its weak reference
        self._before_refs: dict[int, weakref.ref] = {}  # the same, for placeholders
        self.storages: dict[int, StorageInfo] = {}
        self._by_view: dict[int, dict[tuple, int]] = collections.defaultdict(dict)
        self._last: dict[int, int] = {}                 # storage id -> last producing node id
        self._name_counts: collections.Counter = collections.Counter()
        self._inputs = itertools.count()
        self._phase = "forward"
        self._in_optimizer = 0
        self._modules: list[str] = []
        self._opaque = 0
        self._events: list[tuple[int, Any, Any]] = []   # (node position, start, end)
        self._left = 0.0  # when the recorder last handed control back to the program (cpu_ms)
        self._hooks: list = []
        self._closed = False
        self.trace: Trace | None = None

    # ---- the context ----

    def __enter__(self):
        if _active:
            raise RuntimeError("[trace] a recording is already in progress: record one step "
                               "at a time")
        _active.append(self)
        self._left = time.perf_counter()
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim
        self._hooks = [
            nn_module.register_module_forward_pre_hook(self._module_starts),
            nn_module.register_module_forward_hook(self._module_ends),
            optim.register_optimizer_step_pre_hook(self._optimizer_starts),
            optim.register_optimizer_step_post_hook(self._optimizer_ends),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            _active.remove(self)
            self._finish()

    def _module_starts(self, module, args):
        if not self._modules:
            self._phase = "forward"
        # The model itself has the empty name and stands in no stack.
        self._modules.append(self._module_names.get(id(module), type(module).__name__) or None)

    def _module_ends(self, module, args, output):
        if self._modules:
            self._modules.pop()

    def _optimizer_starts(self, optimizer, args, kwargs):
        self._in_optimizer += 1

    def _optimizer_ends(self, optimizer, args, kwargs):
        self._in_optimizer = max(0, self._in_optimizer - 1)

    # ---- storages ----

    def _storage_id(self, tensor: torch.Tensor, created_at: int) -> int | None:
        """The id of the tensor's storage; a new one (created at `created_at`, -1 for a
        placeholder) when the recorder has not seen the storage alive."""
        try:
            storage = tensor.untyped_storage()
            key = storage._cdata
        except (RuntimeError, NotImplementedError, AttributeError):
            return None  # no storage (some subclasses): identity unknown
        sid = self._ids.get(key)
        if sid is not None:
            return sid
        sid = len(self.storages)
        self._ids[key] = sid
        self._refs[sid] = weakref.ref(storage, self._freed_callback(key, sid))
        if created_at < 0:
            self._before_refs[sid] = weakref.ref(storage)
        name, kind = self._names.get(key, ("", "created" if created_at >= 0 else "input"))
        self.storages[sid] = StorageInfo(sid, int(storage.nbytes()), name, kind, created_at,
                                         None, str(tensor.device))
        return sid

    def _freed_callback(self, key: int, sid: int):
        def freed(_ref):
            with self._lock:
                if self._closed:
                    return
                if self._ids.get(key) == sid:
                    del self._ids[key]
                info = self.storages.get(sid)
                if info is not None and info.freed_at is None:
                    info.freed_at = len(self.nodes) - 1
        return freed

    @staticmethod
    def _view_key(tensor: torch.Tensor) -> tuple:
        return (tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()),
                tensor.dtype)

    def _tensor_value(self, tensor: torch.Tensor, sid: int | None) -> dict:
        try:
            strides = [int(s) for s in tensor.stride()]
            contiguous = bool(tensor.is_contiguous())
        except (RuntimeError, NotImplementedError):
            strides, contiguous = None, False
        return {"type": "tensor", "dtype": str(tensor.dtype).removeprefix("torch."),
                "element_size": int(tensor.element_size()),
                "sizes": [int(s) for s in tensor.shape], "strides": strides,
                "contiguous": contiguous, "storage": sid, "device": str(tensor.device),
                "dtensor": False}

    def _value(self, out: Any, node_id: int, produced: list) -> dict:
        """The node's value; every tensor in it is registered as produced by node_id."""
        if isinstance(out, torch.Tensor):
            sid = self._storage_id(out, node_id)
            if sid is not None:
                produced.append((sid, self._view_key(out)))
            return self._tensor_value(out, sid)
        if isinstance(out, (tuple, list)):
            return {"type": "sequence", "elements": [self._value(o, node_id, produced)
                                                     for o in out]}
        if out is None:
            return {"type": "none"}
        if isinstance(out, bool) or isinstance(out, float):
            return {"type": "scalar", "repr": repr(out)}
        if isinstance(out, int):
            return {"type": "sym_int", "value": int(out)}
        return {"type": "other", "repr": repr(out)}

    def _input_node(self, tensor: torch.Tensor) -> dict:
        """A tensor whose storage the step did not create: a placeholder node."""
        node_id = len(self.nodes)
        sid = self._storage_id(tensor, -1)
        info = self.storages.get(sid) if sid is not None else None
        if info is not None and info.name:
            name, target = info.name, info.kind
        else:
            name, target = f"input_{next(self._inputs)}", "input"
            if info is not None:
                info.name = name
        if name in self._name_counts:  # a second view of an input seen before
            name = f"{name}@{self._name_counts[name]}"
        self._name_counts[name] += 1
        node = {"id": node_id, "name": name, "kind": "placeholder", "target": target,
                "args": [], "kwargs": {}, "phase": self._phase, "module_stack": [],
                "value": self._tensor_value(tensor, sid)}
        self.nodes.append(node)
        if sid is not None:
            self._by_view[sid][self._view_key(tensor)] = node_id
            self._last[sid] = node_id
        return node

    def _arg(self, tensor: torch.Tensor) -> dict:
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, AttributeError):
            key = None
        sid = self._ids.get(key) if key is not None else None
        if sid is None:
            return {"node": self._input_node(tensor)["id"]}
        node_id = self._by_view[sid].get(self._view_key(tensor))
        if node_id is None:
            node_id = self._last[sid]
        return {"node": node_id}

    # ---- ops ----

    def _phase_now(self) -> str:
        if self._in_optimizer:
            self._phase = "optimizer"
        elif torch._C._current_autograd_node() is not None:
            self._phase = "backward"
        return self._phase

    def record(self, target: str, schema: dict | None, args, kwargs, out,
               time_ms: float | None = None) -> dict:
        """Appends the node of one op (or opaque region) that read args/kwargs and
        returned out."""
        phase = self._phase_now()
        encoded_args = [_encode(a, self._arg) for a in args]
        encoded_kwargs = {k: _encode(v, self._arg) for k, v in kwargs.items()}
        node_id = len(self.nodes)
        parts = target.split(".")
        if target.startswith("spillway.opaque."):
            base = "opaque_" + "_".join(parts[2:])
        else:  # namespace.op.overload: the op
            base = parts[1] if len(parts) >= 3 else parts[-1]
        count = self._name_counts[base]
        self._name_counts[base] += 1
        produced: list = []
        node = {"id": node_id, "name": base if count == 0 else f"{base}_{count}",
                "kind": "call_function", "target": target, "args": encoded_args,
                "kwargs": encoded_kwargs, "phase": phase,
                "module_stack": [m for m in self._modules if m] if phase == "forward" else [],
                "value": self._value(out, node_id, produced)}
        if time_ms is not None:
            node["time_ms"] = time_ms
        if schema is not None and target not in self.ops:
            self.ops[target] = schema
        self.nodes.append(node)
        for sid, view in produced:
            self._by_view[sid][view] = node_id
            self._last[sid] = node_id
        return node

    def begin_virtual(self, target: str, inputs: list) -> None:
        """An opaque region starts (spillway.trace.opaque): nothing to do before it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        entered = time.perf_counter()
        kwargs = kwargs or {}
        if self._opaque or self._closed:
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        cuda = self._timed and any(isinstance(t, torch.Tensor) and t.is_cuda for t in flat)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            lead_us = self._launch_us.get(func, 200.0)
            torch.cuda._sleep(int(lead_us * _cycles_per_us()))
            start.record()
            began = time.perf_counter()
            out = func(*args, **kwargs)
            launch_us = (time.perf_counter() - began) * 1e6
            end.record()
            # (an op that waits for the GPU counts the sleep in its launch: at most 2 ms)
            self._launch_us[func] = min(max(self._launch_us.get(func, 0.0), 2 * launch_us,
                                            50.0), 2000.0)
            elapsed = None
        else:
            began = time.perf_counter()
            out = func(*args, **kwargs)
            elapsed = (time.perf_counter() - began) * 1e3 if self._timed else None
        with self._lock:
            target = str(func)
            schema = op_schema_entry(func) if target not in self.ops else None
            node = self.record(target, schema, args, kwargs, out, elapsed)
            if cuda:
                self._events.append((node["id"], start, end))
                # The host's time on it: the program's since the op before, and the launch.
                node["cpu_ms"] = max(0.0, entered - self._left) * 1e3 + launch_us / 1e3
            self._left = time.perf_counter()
        return out

    # ---- the end ----

    def _finish(self) -> None:
        with self._lock:
            if self._events:
                torch.cuda.synchronize()
                for node_id, start, end in self._events:
                    self.nodes[node_id]["time_ms"] = max(0.0, start.elapsed_time(end))
                self._events = []
            # Where each storage made in the step went (the node's "frees"): a gradient
            # zero_grad lets go of lives on long after its last use.
            for sid in sorted(self.storages):
                info = self.storages[sid]
                if info.created_at >= 0 and info.freed_at is not None and info.freed_at >= 0:
                    self.nodes[info.freed_at].setdefault("frees", []).append(sid)
            retained = [sid for sid, info in self.storages.items()
                        if info.freed_at is None and info.created_at >= 0
                        and sid in self._last]
            if retained:
                self.nodes.append({
                    "id": len(self.nodes), "name": "output", "kind": "output",
                    "target": "output", "args": [[{"node": self._last[sid]} for sid in retained]],
                    "kwargs": {}, "phase": self._phase, "module_stack": [],
                    "value": {"type": "none"}})
            self._closed = True
            self._refs.clear()
            self._ids.clear()
            self._by_view.clear()
        metadata = {"recorder": "spillway.trace", "torch": torch.__version__,
                    "ops": str(sum(n["kind"] == "call_function" for n in self.nodes))}
        untracked = _untracked_cuda_bytes(self.storages)
        if untracked is not None:
            metadata["untracked_bytes"] = str(untracked)
        graph = {"format": FORMAT, "version": VERSION, "name": "recorded step",
                 "metadata": metadata, "ops": self.ops, "nodes": self.nodes}
        self.trace = Trace(graph, self.storages, refs=dict(self._before_refs))


def _untracked_cuda_bytes(storages: dict) -> int | None:
    """Bytes the CUDA caching allocator holds that no storage of the trace accounts for,
    when recording stops: cuBLAS's workspaces (one per handle and stream, made through
    the allocator: 2 x 32 MiB on T3, the main thread's and autograd's), tensors the
    step never touched. They stay allocated through every step, so the residency plan
    leaves room for them (metadata "untracked_bytes"; T3's measured peaks were the
    forecast's plus 65.1 MiB at every budget). None off CUDA or over several devices."""
    devices = {info.device for info in storages.values() if info.device.startswith("cuda")}
    if len(devices) != 1 or not torch.cuda.is_initialized():
        return None
    device = torch.device(devices.pop())
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    from spillway._device import allocation_rounded
    tracked = sum(allocation_rounded(info.bytes) for info in storages.values()
                  if info.freed_at is None and torch.device(info.device) == device)
    return max(0, torch.cuda.memory_allocated(device) - tracked)


def active() -> Recorder | None:
    return _active[-1] if _active else None
