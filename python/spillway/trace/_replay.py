"""The replay executor: later steps run under a residency plan (Note [Replay]).

Note [Replay]
~~~~~~~~~~~~~
A plan (spillway.trace.plan) names, per moved storage, the gaps between its
uses that it spends in host memory. Replay runs each step under a dispatch
mode that counts ops as the recorder did and acts at each op index: before
it, copies back that are due are issued and the op's storages that are off
the device are waited for; after it, storages are written back after their
last write before a gap, and leave the device where a gap starts.

Storage swapping keeps every Python reference valid: a storage that leaves
the device is resized to zero bytes (its memory goes back to the caching
allocator) and the same storage is resized and copied into when it comes
back, so parameters, optimizer state, autograd's saved tensors and every view
of them are the same objects throughout. Nothing reads a storage while it is
away: every op that runs under the mode, inside a step or between steps,
first brings back any storage it touches (counted as on_demand when the plan
did not foresee it).

Copies run on two side streams: a D2H stream that waits for the compute
stream, then copies into the storage's host buffer (one per moved storage,
made at its first write-back by the runtime's copy engine: a pinned block of
the storage's size rounded to a page, so pinned bytes are the moved bytes);
an H2D stream that waits for the compute stream (the
storage's new memory is allocated in its order), then copies back. The
compute stream waits for a storage's H2D event before the op that needs it,
and for its D2H event before an op that writes it. A storage leaves once its
write-back has landed (polled at each op), as the simulator has it; one that
is needed again before that keeps its memory. Where the forecast has the
write-back landed and the storage freed (the plan's "landed"), a copy still
under way is let go anyway and the compute stream waits for it: a copy later
than forecast, or a CPU that runs ahead of the GPU and allocates for later
ops, would otherwise hold memory the plan gave away (T3 at 75 % went 2.4 %
over its budget so). That covers a storage the forecast frees at once where
it leaves, its host copy landed by the forecast's clock: its real write-back
may still be under way (a first step, where the weights have no host copy
yet, writes them back as they leave and backs up the D2H stream: T3 went
0.29-0.33 GiB over on an H100 until these were named too). The wait is the
GPU's, not the host's: a host that waited there left the GPU idle behind it
each time. A gap's planned wait
(HostGap::wait, the plan's "wait_pos": the compute stream waits for copies
queued past a peak) is such a place too, so it needs nothing of its own.

Storages are numbered by first appearance, as the recorder numbered them, so
the trace's storage ids name the same storages in every step. An op whose
target, output shapes or output storages differ from the trace's at that
index is a divergence: every storage comes back at once, the miss is
counted, and the rest of the step runs with everything on the device
(exact, just not planned). After max_misses steps in a row that diverged,
or when asked (rerecord()), the next step is recorded again and planned
anew for the same budget.

Most ops of a step need nothing from the plan but its checks. Those run in
C++ where this torch allows it (Note [Replay dispatch in C++],
python/csrc/replay_dispatch.cc): the mode below is then entered only for ops
the plan acts at, ops that read a storage away from the device or bind a moved
storage's number, and ops that diverge. The storage numbering lives there for
both sides. SPILLWAY_REPLAY_DISPATCH=python keeps every op in Python.

On a CPU "device" (tests, the fake backend's stand-in) copies are
synchronous and host buffers are plain CPU tensors: the storage really is
freed and restored, so exactness is tested for real.

Note [Host updates in replay]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A plan may run AdamW steps on the host (plan(..., host_adamw_gbs=...); the
simulator's side is Note [Residency replay]). Per update, in the step:
after the op where a parameter's gradient is complete, the gradient is
written back and leaves the device (its host buffer is the update's input).
At the AdamW op itself (aten._fused_adamw_), nothing runs on the device:
for each parameter the moments leave the device if they are on it (they
live on the host from then on), the parameter's host copy becomes its
master (taken from the device when it is not valid, as on the first step),
and a worker thread waits for those copies' events and runs the update on
the host buffers: with the device's own fused kernel when the device is the
CPU (the unplanned step ran that very kernel), else with the host form that
spillway.optim probed to equal the GPU's AdamW(fused=True) (a plan no form
matches is refused when the replay is made). The hyperparameters are the
op's own arguments of that step (a scheduler's lr is followed); the step
count is read from the device once and counted after. Until its update is
applied a parameter counts as away: an op that touches it waits for the
update; one on the device then gets the new value by an H2D into its own
memory (issued as soon as the update is seen done, at any op), one spending
the wrap on the host is copied back from the master when its copy is
issued, or, where that copy is due before the update op in the same step (a
lead longer than what is left of the step), once the update is seen done, as
the simulator defers it. Updates still running when step() returns go on while the next
step starts (as the simulator has them: a parameter's next use waits for its
update, and the forward reaches the last layers, whose gradients complete
first, last); leaving the context or detach() waits for every one, and so
does anything that touches a parameter, between steps too. The worker waits
for the copies into the buffers it reads and for the last copy out of the
master it writes (the compute stream waited for that one, the host not); a
copy into or out of a gradient's or moment's buffer waits for the update
that uses it (a moment read between steps). A divergence waits
for the updates and brings everything back (the moments too); the next
step takes the moments and masters from the device again and reads the
step counts anew. An AdamW op with AMSGrad, a gradient scaler or a tensor
lr runs on the device as recorded.
"""
from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import os
import threading
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spillway import _C

_active: list["Replay"] = []


def active() -> "Replay | None":
    return _active[-1] if _active else None


_Tensor = torch.Tensor


def _tensors(value, out: list) -> list:
    """Tensors in args order (lists depth-first, then kwargs), as the recorder walks them."""
    if isinstance(value, _Tensor):
        out.append(value)
        return out
    items = value.values() if isinstance(value, dict) else value
    if isinstance(items, (list, tuple)) or isinstance(value, dict):
        for v in items:
            if isinstance(v, _Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple, dict)):
                _tensors(v, out)
    return out


def _key(tensor: torch.Tensor):
    try:
        storage = tensor.untyped_storage()
        return storage._cdata, storage
    except (RuntimeError, NotImplementedError, AttributeError):
        return None, None


def _cpp_dispatch() -> tuple[bool, str]:
    """Whether the replay's quiet ops may run in C++ here, and if not why."""
    if os.environ.get("SPILLWAY_REPLAY_DISPATCH", "cpp") == "python":
        return False, "SPILLWAY_REPLAY_DISPATCH=python"
    return _C.ReplayDispatch.available()


class _Away(dict):
    """Storage key -> a moved storage away from the device, each change mirrored into
    the C++ dispatch (an op that reads one goes the Python way, which brings it back)."""

    __slots__ = ("_fast",)

    def __init__(self, fast):
        super().__init__()
        self._fast = fast

    def __setitem__(self, key, m):
        super().__setitem__(key, m)
        self._fast.away_add(key)

    def __delitem__(self, key):
        super().__delitem__(key)
        self._fast.away_remove(key)

    def pop(self, key, *default):
        if key in self:
            self._fast.away_remove(key)
        return super().pop(key, *default)

    def clear(self):
        super().clear()
        self._fast.away_clear()


def _gate(name: str) -> property:
    """A flag that decides whether quiet ops may run in C++: set, it tells the C++ side."""
    slot = name + "_"

    def get(self):
        return getattr(self, slot)

    def set(self, value):
        setattr(self, slot, value)
        self._tell_enabled()
    return property(get, set)


class _Moved:
    """One storage the plan moves: its host buffer, where it is, its copies."""

    __slots__ = ("sid", "nbytes", "name", "ref", "host", "host_valid", "state", "d2h", "h2d",
                 "read", "update", "step", "seq", "owner", "fetch_updated")

    def __init__(self, sid: int, nbytes: int, name: str):
        self.sid, self.nbytes, self.name = sid, nbytes, name
        self.ref = None          # weakref to its UntypedStorage in this step
        self.host = None         # its host buffer (uint8), made at its first write-back
        self.host_valid = False
        self.state = "device"    # device, leaving (write-back under way), host, coming
        self.d2h = None          # the write-back's event (CUDA), None when done
        self.h2d = None          # the copy back's event (CUDA), until the compute stream waits
        self.read = None         # the last copy back's event, kept: a host update that
        #                          writes the host buffer waits for it (CUDA)
        self.update = None       # a parameter's host update under way (threading.Event)
        self.step = None         # a parameter's AdamW step count, as the host update counts
        self.seq = -1            # its write-back's place on the D2H stream (-1: another stream)
        self.owner = None        # a gradient's or moment's parameter, whose host update
        #                          reads or writes its host buffer
        self.fetch_updated = False  # a parameter's copy back, due before its host
        #                             update: issued once the update is done


class Replay(TorchDispatchMode):
    """Steps under a residency plan (Note [Replay]); made by spillway.trace.replay()."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ in torch._disable_dynamo, a Python frame
        # and an eval-frame swap on every op: 12 of the 40 us a planned op cost on the
        # CI machine's CPU. Dynamo never traces this mode: it runs eager steps only (a
        # compiled region's kernels are no aten ops it could follow).
        return False

    # Read and written as plain attributes; each write tells the C++ dispatch whether
    # it may run quiet ops (and op k is counted there).
    _in_step = _gate("_in_step")
    _following = _gate("_following")
    _opaque = _gate("_opaque")
    _watching = _gate("_watching")
    _in_step_ = _following_ = _watching_ = False
    _opaque_ = 0
    _cpp_on = False

    def _tell_enabled(self) -> None:
        """Whether the C++ dispatch may run quiet ops now (each gate's write calls this)."""
        self._fast.set_enabled(bool(self._cpp_on and self._in_step_ and self._following_ and
                                    not self._opaque_ and not self._watching_))

    @property
    def _k(self) -> int:
        return self._fast.k

    @_k.setter
    def _k(self, k: int) -> None:
        self._fast.k = k

    def __init__(self, trace, plan: dict, *, budget=None, max_misses: int = 3,
                 min_bytes: int = 1 << 20, device_profile=None, host_adamw_gbs=None):
        super().__init__()
        self._fast = _C.ReplayDispatch()
        self._budget, self._min_bytes, self._profile = budget, min_bytes, device_profile
        self._host_adamw_gbs = host_adamw_gbs
        self.max_misses = max_misses
        self._lock = threading.RLock()
        self._stats = {"steps": 0, "misses": 0, "on_demand": 0, "left": 0, "write_backs": 0,
                       "copies_back": 0, "bytes_d2h": 0, "bytes_h2d": 0, "recorded": 0,
                       # ms the host AdamW worker computed, and ms the step waited for it
                       "host_busy_ms": 0.0, "update_wait_ms": 0.0,
                       # ms the host waited for a write-back to land (_land)
                       "land_wait_ms": 0.0,
                       # the compute stream's waits for write-backs the forecast has
                       # landed (_wait_landed)
                       "landing_waits": 0,
                       # planned copies back of parameters whose host update was still
                       # running: issued once it is done, the host not waiting
                       "deferred_copies": 0}
        # host_busy_ms by the step (its index in "steps") whose backward submitted them
        self._busy_by_step: dict[int, float] = {}
        self._entered = False
        self._record_next = False
        self._diverged_in_a_row = 0
        self._moved: dict[int, _Moved] = {}
        self._off: dict[int, _Moved] = _Away(self._fast)  # storage key -> a moved storage
        #                                                    not on the device
        self._streams = None
        self._virtual: list = []  # (following, k) of opaque regions under way
        self._by_key: dict[int, _Moved] = {}  # storage key -> the moved storage it is
        self._names: dict = {}  # OpOverload -> its name, as the trace spells it
        self._updating: set = set()  # parameters whose host update is under way or unapplied
        # Polled at every op, so queues rather than scans of everything away: storages
        # leaving before their write-back landed, by the order of their copies on the D2H
        # stream (they land in that order: the first not landed ends the poll), those
        # whose copy ran on another stream, and parameters whose host update is done.
        self._leaving: list = []  # heap of (D2H sequence number, push count, _Moved)
        self._pushes = itertools.count()
        self._leaving_other: list = []
        self._watched_events = ()
        self._d2h_seq = 0
        self._updated: collections.deque = collections.deque()
        self._dead: collections.deque = collections.deque()  # (key, _Moved) of dead storages
        self._jobs = None  # the host updates' worker: a queue, made at the first
        self._worker_error: BaseException | None = None
        self._in_step = False
        self._k, self._following = 0, True  # the op to come, and whether the step follows the trace
        self._watching = False
        self._memory: list = []
        self._on_demand_log: list = []  # this step's copies back on demand (on_demand_copies())
        self._host_times = None
        self._load(trace, plan)

    # ---- the plan as per-op actions ----

    def _load(self, trace, plan: dict) -> None:
        self.trace, self.plan = trace, plan
        nodes = trace.graph["nodes"]
        self._op_pos = [p for p, n in enumerate(nodes) if n["kind"] == "call_function"]
        n_ops = len(self._op_pos)
        k, index_of = 0, {}  # position -> the first op at or after it (one past the last too)
        for p in range(len(nodes) + 1):
            while k < n_ops and self._op_pos[k] < p:
                k += 1
            index_of[p] = k if k < n_ops else 0  # past the last op: the next step's first
        op_at = {p: i for i, p in enumerate(self._op_pos)}
        self._expected = []
        for p in self._op_pos:
            node = nodes[p]
            outs = []
            _values(node["value"], outs)
            self._expected.append((node["target"], outs))
        before = [[] for _ in range(n_ops)]
        after_write_back = [[] for _ in range(n_ops)]
        after_leave = [[] for _ in range(n_ops)]
        writes = [[] for _ in range(n_ops)]
        old = self._moved
        self._moved = {}
        for sid_text, info in plan.get("storages", {}).items():
            sid = int(sid_text)
            moved = old.get(sid) if old.get(sid) is not None and old[sid].nbytes == info["bytes"] \
                else _Moved(sid, info["bytes"], info["name"])
            self._moved[sid] = moved
            for p in info["writes"]:
                writes[op_at[p]].append(sid)
        # A parameter updated on the host whose copy back for the next step is due
        # before its update op in this step: copied once the update is done (its new
        # value), as the simulator has it, not when due (the old one).
        update_k = {sid: op_at[u["op_positions"][0]] for u in plan.get("host_updates", [])
                    for sid in u["params"]}
        after_update = [[] for _ in range(n_ops)]
        for gap in plan.get("gaps", []):
            sid = gap["storage"]
            issue_k, after_k = index_of[gap["issue_pos"]], op_at[gap["after_pos"]]
            if gap["wrap"] and sid in update_k and after_k < issue_k <= update_k[sid]:
                after_update[issue_k].append(sid)
            else:
                before[issue_k].append(sid)
            after_leave[after_k].append(sid)
            # Once after the last write before a gap, however many gaps follow it (a
            # weight written by the optimizer has its forward and backward gaps after
            # the same write): a second copy of the same bytes moved nothing new (T3
            # at 50 % wrote 4.9 GB of 27.7 twice a step).
            if gap["write_back_pos"] >= 0:
                written = after_write_back[op_at[gap["write_back_pos"]]]
                if sid not in written:
                    written.append(sid)
        # Host updates (Note [Host updates in replay]): the op each replaces, where each
        # gradient is complete, and the storages each keeps on the host.
        self._host_ops: dict[int, dict] = {}
        self._grad_done = [[] for _ in range(n_ops)]
        for u in plan.get("host_updates", []):
            self._host_ops[op_at[u["op_positions"][0]]] = u
            for sid, pos in zip(u["grads"], u["grad_complete_pos"]):
                self._grad_done[op_at[pos]].append(sid)
            for sid in (*u["params"], *u["grads"], *u["states"]):
                if sid not in self._moved:
                    kept = old.get(sid)
                    self._moved[sid] = kept if kept is not None else _Moved(sid, 0, f"storage {sid}")
        if self._host_ops:
            self._host_form = _host_form(trace, plan)
        self._before, self._write_back, self._leave, self._writes = (
            before, after_write_back, after_leave, writes)
        self._after_update = after_update
        # Where the forecast has a write-back landed and its storage freed: before that
        # op the replay waits for a copy still under way (a late copy would otherwise
        # keep memory the plan has given to the op's allocations).
        self._landed = [[] for _ in range(n_ops)]
        for sid, pos in plan.get("landed", []):
            if sid in self._moved:
                self._landed[index_of[pos]].append(sid)
        # Most ops have nothing to do after them: one test skips the four lists.
        self._acts_after = [bool(writes[k] or after_write_back[k] or after_leave[k] or
                                 self._grad_done[k]) for k in range(n_ops)]
        self._n_ops = n_ops
        # Ops with nothing to do before or after them but their checks: most of a step
        # (T3: 6 of every 7). __torch_dispatch__ runs those inline (_quiet_op).
        self._quiet = [not (before[k] or after_update[k] or self._landed[k] or
                            self._acts_after[k] or k in self._host_ops)
                       for k in range(n_ops)]
        # What spends the wrap between steps on the host (_prime), made once per plan.
        self._away_between_steps = [gap["storage"] for gap in plan.get("gaps", []) if gap["wrap"]]
        for u in plan.get("host_updates", []):
            self._away_between_steps.extend(u["states"])
        # The C++ dispatch's share (Note [Replay dispatch in C++]): quiet ops none of
        # whose outputs is a moved storage (Python binds those to their host copies).
        moved = self._moved
        self._fast.load(
            [target for target, _ in self._expected],
            [quiet and all(e[1] is not None and e[1] not in moved for e in outs)
             for quiet, (_, outs) in zip(self._quiet, self._expected)],
            [[(list(e[0]), -1 if e[1] is None else e[1]) for e in outs]
             for _, outs in self._expected],
            sorted(moved))

    # ---- the mode ----

    def __enter__(self):
        if _active:
            raise RuntimeError("[replay] a replay is already active")
        # The step's state takes the plan's residency between steps now, not at the first
        # step: from here on the device holds what the plan has it hold. A failure
        # (pinned memory exhausted) brings back what left: nothing is lost.
        with self._lock:
            try:
                self._prime()
            except BaseException:
                self._bring_all_back()
                self._drain()
                raise
        _active.append(self)
        self._entered = True
        result = super().__enter__()
        if _cpp_dispatch()[0]:
            self._fast.install(self, self._cpp_mismatch)
            self._cpp_on = True
            self._tell_enabled()
        return result

    def __exit__(self, *exc):
        try:
            if self._cpp_on:
                self._cpp_on = False
                self._tell_enabled()
                self._fast.uninstall()
            self._bring_all_back()
            self._drain()
        finally:
            result = super().__exit__(*exc)
            _active.remove(self)
            self._entered = False
        return result

    def detach(self) -> None:
        """Every moved storage back on the device (also what leaving the context does)."""
        with self._lock:
            self._bring_all_back()
            self._drain()

    def _drain(self) -> None:
        """No copy of ours is under way: host buffers may be freed after this."""
        if self._streams is not None:
            for stream in self._streams:
                stream.synchronize()

    def rerecord(self) -> None:
        """Record the next step again and plan it anew for the same budget."""
        self._record_next = True

    def stats(self) -> dict:
        return dict(self._stats, away=len(self._off), cpp_ops=self._fast.quiet_ops)

    def host_busy_ms_by_step(self) -> dict[int, float]:
        """The host AdamW worker's ms by the step that submitted the updates (0 = the first
        step under this replay), however far into the next step they ran: complete for a
        step once the updates were waited for (a later step used the parameters, or the
        replay was left)."""
        return dict(self._busy_by_step)

    def on_demand_copies(self) -> list[tuple[int, int, str, int, str]]:
        """The copies back the plan did not foresee in the last step (the first 64): (op
        index, or -1 between steps; storage id; its name; bytes; where it was: "host", or
        "leaving" when its write-back had not landed). Each one holds memory the forecast
        has free from there to the storage's next planned move."""
        return list(self._on_demand_log)

    def host_times_ms(self) -> list[float] | None:
        """The host's time on each op of the last step that followed the trace, in ms
        from the op before it until the op was issued (the program's own work between
        them, the dispatch and the replay's included): the nodes' cpu_ms of a trace
        that forecasts this host (spillway.trace.with_host_times). None before such a
        step."""
        times = self._host_times
        if times is None or any(t is None for t in times):
            return None
        return list(times)

    def watch_memory(self, on: bool = True) -> None:
        """From the next step on (until turned off), the bytes the CUDA caching allocator
        holds allocated just before each op of the step are recorded: memory_by_op()."""
        self._watching = on

    def memory_by_op(self) -> list[tuple[int, int, str, int]]:
        """The last watched step, one entry per op it ran under the plan: (op index, the
        op's position in the trace's graph, its target, bytes allocated before it; 0 on a
        CPU device). Beside plan(..., live_bytes=True)["forecast"]["live_bytes"][position],
        it shows where the measured memory leaves the simulated."""
        return list(self._memory)

    @contextlib.contextmanager
    def step(self):
        """One training step under the plan (or recorded again: rerecord(), or after
        max_misses diverged steps in a row)."""
        if not self._entered:
            raise RuntimeError("[replay] step() runs inside `with replay:` (the mode that "
                               "guards every storage away from the device)")
        if self._record_next:
            yield from self._recorded_step()
            return
        with self._lock:
            self._prime()
            self._k, self._following = 0, True
            self._on_demand_log = []
            self._fast.reset_numbering()
            self._in_step = True
            if self._watching:
                self._memory = []
        try:
            yield self
        finally:
            # Host updates still under way go on into the next step, as the plan has them
            # (Note [Host updates in replay]).
            with self._lock:
                self._in_step = False
                if self._following and self._k != self._n_ops:
                    self._diverge(f"the step ran {self._k} ops, the trace {self._n_ops}")
                self._stats["steps"] += 1
                if self._following:
                    self._diverged_in_a_row = 0
                    self._host_times = self._fast.host_times_ms()
                else:
                    self._diverged_in_a_row += 1
                    if self._diverged_in_a_row >= self.max_misses and self._budget is not None:
                        self._record_next = True

    def _recorded_step(self):
        from spillway.trace import _recorder, plan as make_plan
        self._bring_all_back()
        # The recorder runs beneath this mode: pop ours while it records.
        super().__exit__(None, None, None)
        recording = _recorder.Recorder()
        try:
            with recording:
                yield self
        finally:
            super().__enter__()
        self._record_next = False
        self._diverged_in_a_row = 0
        self._stats["recorded"] += 1
        self._stats["steps"] += 1
        new_plan = make_plan(recording.trace, self._budget, min_bytes=self._min_bytes,
                             device_profile=self._profile, host_adamw_gbs=self._host_adamw_gbs)
        with self._lock:
            self._load(recording.trace, new_plan)

    def _prime(self) -> None:
        """Before each step: what spends the wrap between steps on the host leaves now if it
        is on the device (the first step, one after a divergence, one after reads between
        steps brought it back), as at the end of a step under the plan, so the step starts
        in the plan's steady state; in that state nothing here moves. The moments of the
        parameters updated on the host go too: they live there, and a first step that held
        them until its AdamW op would go over the budget."""
        sent = []
        with torch.utils._python_dispatch._disable_current_modes():
            for sid in self._away_between_steps:
                m = self._moved.get(sid)
                ref = self.trace.refs.get(sid)
                if m is None or ref is None or ref() is None:
                    continue
                m.ref = ref
                self._by_key[ref()._cdata] = m
                if m.state == "device" and ref().nbytes():
                    sent.append(m)
                self._leave_now(m)
        # What left here is gone before the step allocates: else the step's first ops,
        # issued while those copies are still under way, take memory the plan has free
        # (the first replayed step went 9 GiB over a T3 budget). Not what left in the
        # step before: the plan has that land where it does.
        for m in sent:
            self._land(m)

    # ---- copies ----

    def _copy_streams(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams

    @staticmethod
    def _bytes_of(storage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, 0, (storage.nbytes(),))

    def _write_back_now(self, m: _Moved, storage) -> None:
        self._wait_owner(m)
        m.nbytes = storage.nbytes()
        source = self._bytes_of(storage)
        streams = self._copy_streams(storage.device)
        if m.host is None or m.host.numel() != m.nbytes:
            # The first write-back: the runtime's copy engine makes the host buffer, a
            # pinned block of the storage's size rounded to a page (torch's pinned
            # allocator would round to a power of two), waited for on the compute stream.
            from spillway import ops
            m.host = ops.wait_tensor(ops.offload(source, exact=True), keepalive=source)
            m.d2h, m.seq = None, -1
            if storage.device.type == "cuda":  # for a host reader (the host update)
                m.d2h = torch.cuda.Event()
                m.d2h.record(torch.cuda.current_stream(storage.device))
        elif streams is None:
            m.host.copy_(source)
            m.d2h, m.seq = None, -1
        else:
            d2h = streams[0]
            d2h.wait_stream(torch.cuda.current_stream(storage.device))
            with torch.cuda.stream(d2h):
                m.host.copy_(source, non_blocking=True)
                m.d2h = torch.cuda.Event()
                m.d2h.record(d2h)
            m.seq, self._d2h_seq = self._d2h_seq, self._d2h_seq + 1
        m.host_valid = True
        self._stats["write_backs"] += 1
        self._stats["bytes_d2h"] += m.nbytes

    def _storage(self, m: _Moved):
        return m.ref() if m.ref is not None else None

    def _leave_now(self, m: _Moved) -> None:
        storage = self._storage(m)
        if storage is None or m.state != "device" or storage.nbytes() == 0:
            return
        if not m.host_valid:
            self._write_back_now(m, storage)
        m.state = "leaving"
        self._off[storage._cdata] = m
        self._poll_one(m, storage)
        if m.state == "leaving":
            if m.seq >= 0:
                heapq.heappush(self._leaving, (m.seq, next(self._pushes), m))
            else:
                self._leaving_other.append(m)
            self._tell_leaving()

    def _land(self, m: _Moved) -> float:
        """A storage leaving is gone once this returns: its write-back waited for (the ms
        the host waited), its memory let go."""
        storage = self._storage(m)
        if m.state != "leaving" or storage is None:
            return 0.0
        waited = 0.0
        if m.d2h is not None and not m.d2h.query():
            began = time.perf_counter()
            m.d2h.synchronize()
            waited = (time.perf_counter() - began) * 1e3
            self._stats["land_wait_ms"] += waited
        self._poll_one(m, storage)
        return waited

    def _poll_one(self, m: _Moved, storage) -> None:
        if m.state == "leaving" and (m.d2h is None or m.d2h.query()):
            m.d2h = None
            storage.resize_(0)
            m.state = "host"
            self._stats["left"] += 1

    def _poll(self) -> None:
        dead = self._dead
        while dead:
            key, m = dead.popleft()
            self._fast.settle_pending(1)
            if self._off.get(key) is m:
                del self._off[key]
            if self._by_key.get(key) is m:
                del self._by_key[key]
        updated = self._updated
        while updated:
            m = updated.popleft()
            self._fast.settle_pending(1)
            # Finished already (an op waited for it), or updated again since: skipped.
            if m in self._updating and m.update is not None and m.update.is_set():
                self._finish_update(m)
        leaving = self._leaving
        while leaving:
            seq, _, m = leaving[0]
            if m.state == "leaving" and m.seq == seq:  # else: stale, it came back or left anew
                storage = self._storage(m)
                if storage is not None:
                    self._poll_one(m, storage)
                    if m.state == "leaving":
                        break  # its copy has not landed, nor have those after it
            heapq.heappop(leaving)
        if self._leaving_other:
            for m in self._leaving_other:
                storage = self._storage(m)
                if m.state == "leaving" and storage is not None:
                    self._poll_one(m, storage)
            self._leaving_other = [m for m in self._leaving_other if m.state == "leaving"]
        self._tell_leaving()

    def _tell_leaving(self) -> None:
        """What the next poll waits for, for the C++ dispatch (Note [Replay dispatch in
        C++]): the write-back events of the first storage leaving on the D2H stream (the
        rest land after it) and of those leaving on other streams; none known (a CPU
        device, a stale entry) sends every op to the poll while any storage is leaving."""
        leaving = self._leaving
        while leaving and not (leaving[0][2].state == "leaving" and leaving[0][2].seq == leaving[0][0]):
            heapq.heappop(leaving)  # stale (came back, or left anew under a later number)
        heads = self._leaving_other + ([leaving[0][2]] if leaving else [])
        events = [m.d2h for m in heads]
        handles = [getattr(e, "cuda_event", 0) for e in events]  # 0: not a recorded CUDA event
        known = bool(handles) and all(handles)
        self._fast.set_leaving(bool(heads), handles if known else [])
        self._watched_events = events if known else ()  # alive while the C++ side may query

    def _wait_owner(self, m: _Moved) -> None:
        """A host update that reads or writes m's host buffer (a gradient's, a moment's)
        is done before a copy touches that buffer (a moment read between steps)."""
        owner = m.owner
        if owner is not None and owner.update is not None:
            self._finish_update(owner)

    def _issue(self, m: _Moved, resize: bool = True, wait_update: bool = True) -> None:
        """Copies m back (an H2D the compute stream waits for at m's next use). For a
        parameter whose host update is still running, the copy carries the new value:
        with wait_update the host waits for the update here; without (a planned copy
        back, due ahead of the use) it is issued once the update is seen done, at any
        op, and the use waits for it if it is not (the host would otherwise stop
        issuing the ops in between, and the GPU run dry behind it)."""
        storage = self._storage(m)
        if storage is None:
            return
        if not wait_update and m.update is not None and not m.update.is_set():
            m.fetch_updated = True
            self._stats["deferred_copies"] += 1
            return
        m.fetch_updated = False
        self._wait_owner(m)
        if m.update is not None:  # the master is being updated: copy it back once it is
            self._finish_update(m)
            if m.state != "host":
                return
        if m.state == "leaving":  # its write-back has not landed: keep the memory
            m.state = "device"
            self._off.pop(storage._cdata, None)
            if m.d2h is not None:
                torch.cuda.current_stream(storage.device).wait_event(m.d2h)
                m.d2h = None
            return
        if m.state != "host":
            return
        if resize:
            storage.resize_(m.nbytes)
        target = self._bytes_of(storage)
        streams = self._copy_streams(storage.device)
        if streams is None:
            target.copy_(m.host)
            m.h2d = None
        else:
            h2d = streams[1]
            h2d.wait_stream(torch.cuda.current_stream(storage.device))
            with torch.cuda.stream(h2d):
                target.copy_(m.host, non_blocking=True)
                m.h2d = torch.cuda.Event()
                m.h2d.record(h2d)
                m.read = m.h2d
        m.state = "coming"
        self._stats["copies_back"] += 1
        self._stats["bytes_h2d"] += m.nbytes

    def _ensure(self, m: _Moved, storage, planned: bool) -> None:
        """The storage is on the device, and the compute stream has waited for it."""
        if m.update is not None:
            self._finish_update(m)
        if m.state in ("host", "leaving"):
            if not planned:
                self._stats["on_demand"] += 1
                if len(self._on_demand_log) < 64:  # which, where: the first of them a step
                    k = self._k if self._in_step else -1
                    self._on_demand_log.append((k, m.sid, m.name, m.nbytes, m.state))
            self._issue(m)
        if m.state == "coming":
            if m.h2d is not None:
                torch.cuda.current_stream(storage.device).wait_event(m.h2d)
                m.h2d = None
            m.state = "device"
            self._off.pop(storage._cdata, None)

    def _bring_all_back(self) -> None:
        # Our own copies must not pass through this mode when called from outside it.
        with torch.utils._python_dispatch._disable_current_modes():
            self._finish_updates()
            for m in list(self._off.values()):
                storage = self._storage(m)
                if storage is not None:
                    self._ensure(m, storage, planned=True)
        self._off.clear()

    def _diverge(self, why: str) -> None:
        self._following = False
        # From here on writes are not followed: no host copy can be trusted.
        self._finish_updates()
        for m in self._moved.values():
            m.host_valid = False
            m.step = None
        self._stats["misses"] += 1
        self.last_miss = why
        self._bring_all_back()

    # ---- host updates (Note [Host updates in replay]) ----

    def _host_update(self, u: dict, args, kwargs) -> bool:
        """Op k's AdamW runs on the host instead; False when it cannot (AMSGrad, a
        gradient scaler, a tensor lr, a parameter list unlike the plan's): the op then
        runs on the device as recorded."""
        params, grads, exp_avgs, exp_avg_sqs, _, steps = args[:6]
        lr = kwargs.get("lr")
        if (kwargs.get("amsgrad") or kwargs.get("grad_scale") is not None or
                kwargs.get("found_inf") is not None or isinstance(lr, torch.Tensor) or
                len(params) != len(u["params"])):
            return False
        hyper = (float(lr), float(kwargs["beta1"]), float(kwargs["beta2"]),
                 float(kwargs["weight_decay"]), float(kwargs["eps"]), bool(kwargs.get("maximize")))
        with torch.utils._python_dispatch._disable_current_modes():
            moved = []
            for tensors in (params, grads, exp_avgs, exp_avg_sqs):
                entries = []
                for t in tensors:
                    key, storage = _key(t)
                    m = self._by_key.get(key)
                    if m is None or m.ref is None or m.ref() is not storage:
                        return False
                    entries.append(m)
                moved.append(entries)
            if any(g.host is None or not g.host_valid for g in moved[1]):
                return False  # a gradient did not reach the host: run on the device
            for i, (p, g, m1, m2) in enumerate(zip(*moved)):
                for state in (m1, m2):  # the moments live on the host from now on
                    self._ensure_on_host(state)
                if not p.host_valid:  # the master is taken again from the device
                    self._write_back_now(p, self._storage(p))
                p.step = float(steps[i].item()) if p.step is None else p.step + 1
                # The copies into the buffers it reads, and the last copy out of the master
                # it writes: the compute stream waited for that one, the host did not (a
                # parameter brought back for a backward use after its gradient completed
                # may still be copying when the update starts).
                events = [e for e in (g.d2h, p.d2h, m1.d2h, m2.d2h, p.read) if e is not None]
                p.update = threading.Event()
                self._updating.add(p)
                key, _ = _key(params[i])
                self._off[key] = p  # its device copy is stale until the update is applied
                g.owner = m1.owner = m2.owner = p  # their buffers wait for it too
                self._submit(p, g, m1, m2, hyper, events)
        self._stats["host_updates"] = self._stats.get("host_updates", 0) + len(params)
        return True

    def _ensure_on_host(self, m: _Moved) -> None:
        storage = self._storage(m)
        if storage is None or m.state != "device":
            return
        if not m.host_valid:
            self._write_back_now(m, storage)
        self._leave_now(m)

    def _submit(self, p: _Moved, g: _Moved, m1: _Moved, m2: _Moved, hyper, events) -> None:
        import queue
        if self._jobs is None:
            self._jobs = queue.Queue()
            threading.Thread(target=self._work, name="spillway-replay-host-adamw",
                             daemon=True).start()
        device = self._storage(p).device
        self._jobs.put((p, g, m1, m2, hyper, events, p.step, device, self._stats["steps"]))

    def _work(self) -> None:
        while True:
            p, g, m1, m2, hyper, events, step, device, submitted_in = self._jobs.get()
            try:
                for event in events:
                    event.synchronize()
                if self._worker_error is None:
                    began = time.perf_counter()
                    _host_adamw(self._host_form, p.host, g.host, m1.host, m2.host, hyper, step,
                                device)
                    ms = (time.perf_counter() - began) * 1e3
                    self._stats["host_busy_ms"] += ms
                    self._busy_by_step[submitted_in] = self._busy_by_step.get(submitted_in,
                                                                              0.0) + ms
            except BaseException as e:  # reported by the main thread
                self._worker_error = e
            finally:
                p.update.set()
                self._updated.append(p)
                self._fast.note_pending()

    def _finish_update(self, m: _Moved) -> None:
        """Waits for the parameter's host update; a parameter on the device gets the new
        value by an H2D (waited for at its next use), one away keeps it in its host copy."""
        if not m.update.is_set():  # the step waits for the host: counted
            began = time.perf_counter()
            m.update.wait()
            self._stats["update_wait_ms"] += (time.perf_counter() - began) * 1e3
        m.update = None
        self._updating.discard(m)
        if self._worker_error is not None:
            error, self._worker_error = self._worker_error, None
            raise RuntimeError(f"[replay] a host AdamW update failed: {error}") from error
        storage = self._storage(m)
        if storage is None:
            return
        self._land(m)
        if m.state in ("device", "coming"):
            # Its memory holds the old value, or will (a copy back issued before the
            # update was): the new one is copied in after it.
            m.state = "host"
            self._issue(m, resize=False)
        elif m.fetch_updated and m.state == "host":
            self._issue(m)

    def _finish_updates(self) -> None:
        for m in list(self._updating):
            self._finish_update(m)

    # ---- numbering, as the recorder numbers ----

    def _sid(self, tensor: torch.Tensor) -> int | None:
        sid, new = self._fast.number(tensor)
        if sid < 0:
            return None
        m = self._moved.get(sid) if new else None
        if m is not None:
            key, storage = _key(tensor)
            old = m.ref() if m.ref is not None else None
            if old is not None and old is not storage and m.state != "device":
                self._ensure(m, old, planned=True)  # the trace's storage is still away
            if old is not storage and m.state != "device":
                # The last step's storage died away (a gradient its host update took):
                # this one starts on the device, with no host copy of its own yet.
                for stale in [k for k, v in self._off.items() if v is m]:
                    del self._off[stale]
                m.state, m.host_valid, m.d2h, m.h2d = "device", False, None, None
            m.ref = weakref.ref(storage, self._forget(m, key))
            self._by_key[key] = m
        return sid

    def _forget(self, m: _Moved, key: int):
        """A weakref callback: the storage died away (a gradient zero_grad let go of while
        its bytes were on the host), so its key, which a new storage may reuse, must no
        longer name it (nothing would come back into the new one, but it would count as
        a fetch and stay in what each op looks through). The callback runs in whichever
        thread let go, the autograd engine's too: it only queues; the next poll forgets."""
        dead, fast = self._dead, self._fast

        def forget(_ref):
            dead.append((key, m))
            fast.note_pending()
        return forget

    def _before_op(self, target: str, inputs: list, bring: bool = True) -> tuple[bool, int]:
        """What happens before op k: the divergence check on its target, the numbering
        of its inputs, the copies back due, and every input storage that is away back
        (unless `bring` is False: an op run on the host instead, which reads the host
        copies)."""
        if self._dead or self._updated or self._leaving or self._leaving_other:
            self._poll()
        in_step = self._in_step
        following = in_step and self._following
        k = self._k if in_step else -1
        if following and (k >= self._n_ops or self._expected[k][0] != target):
            self._diverge(f"op {k}: {target} where the trace has "
                          f"{self._expected[k][0] if k < self._n_ops else 'nothing'}")
            following = False
        keyed = [_key(t) for t in inputs]  # each input's storage, found once
        if in_step:
            for t in inputs:
                self._sid(t)
        if following and self._landed[k]:
            self._wait_landed(k)
        if following and self._before[k]:
            for sid in self._before[k]:
                m = self._moved.get(sid)
                if m is not None:
                    self._issue(m, wait_update=False)
        if following and self._after_update[k]:
            for sid in self._after_update[k]:
                self._moved[sid].fetch_updated = True
        if bring or not (following and k in self._host_ops):
            self._bring_inputs(inputs, following, k, keyed)
        if following and self._watching:  # after its copies back, before its outputs
            allocated = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
            self._memory.append((k, self._op_pos[k], target, allocated))
        return following, k

    def _wait_landed(self, k: int) -> None:
        """Storages the forecast has freed before op k, their write-backs landed: one
        still leaving is let go now, the compute stream waiting for its write-back
        (counted in landing_waits). The wait is the GPU's, as the simulator's stall is:
        a host that waited instead would leave the GPU's queue empty behind it, and
        each wait would cost the time the host then takes to get ahead again. The
        memory goes back to the caching allocator on the compute stream, so whatever
        takes it runs after the wait; the H2D stream allocates nothing and follows
        the compute stream before it copies into new memory."""
        for sid in self._landed[k]:
            m = self._moved[sid]
            storage = self._storage(m)
            if m.state != "leaving" or storage is None:
                continue
            if m.d2h is not None and not m.d2h.query():
                torch.cuda.current_stream(storage.device).wait_event(m.d2h)
                self._stats["landing_waits"] += 1
                # Gone from the device now; the event stays, for host readers of the
                # buffer (the host update waits for it).
                storage.resize_(0)
                m.state = "host"
                self._stats["left"] += 1
            else:
                self._poll_one(m, storage)

    def _bring_inputs(self, inputs: list, following: bool, k: int, keyed=None) -> None:
        """Nothing reads a storage while it is away. An op the plan does not follow
        (between steps, after a divergence, inside an opaque region) may write what it
        touches: the host copy of a moved storage it touches is stale from then on."""
        if following and not self._off:
            return  # nothing away, and nothing whose host copy this op could stale
        for i, t in enumerate(inputs):
            key, storage = keyed[i] if keyed is not None else _key(t)
            if not following and key is not None:
                touched = self._by_key.get(key)
                if touched is not None:
                    touched.host_valid = False
            m = self._off.get(key) if key is not None else None
            if m is not None:
                planned = following and any(m is self._moved.get(sid) for sid in self._before[k])
                self._ensure(m, storage, planned or m.state == "coming")

    def _after_op(self, target: str, outputs: list, following: bool, k: int) -> None:
        """After op k: the numbering of its outputs and their check against the trace,
        then write-backs and storages leaving."""
        if not self._in_step or k < 0:
            return
        sids = [self._sid(t) for t in outputs]
        if following and self._following:
            expected = self._expected[k][1]
            if len(outputs) != len(expected) or any(
                    sid != e[1] or t.shape != e[0]  # a torch.Size is a tuple
                    for t, sid, e in zip(outputs, sids, expected)):
                shapes = [tuple(t.shape) for t in outputs]
                self._diverge(f"op {k} ({target}): outputs {shapes} in storages {sids}, the "
                              f"trace's {[e[0] for e in expected]} in {[e[1] for e in expected]}")
                following = False
        if following and self._following and self._acts_after[k]:
            for sid in self._writes[k]:
                self._moved[sid].host_valid = False
            for sid in self._write_back[k]:
                m = self._moved[sid]
                storage = self._storage(m)
                if storage is not None and m.state == "device":
                    self._write_back_now(m, storage)
            for sid in self._leave[k]:
                self._leave_now(self._moved[sid])
            for sid in self._grad_done[k]:  # complete: to the host, for the host update
                m = self._moved[sid]
                storage = self._storage(m)
                if storage is not None and m.state == "device":
                    self._write_back_now(m, storage)
                    self._leave_now(m)
        self._k += 1

    # ---- opaque regions (spillway.trace.opaque): one virtual op each way ----

    _closed = False

    # These two run outside __torch_dispatch__ (from the region's wrapper and its
    # autograd functions), with this mode on the stack: the copies they start must not
    # pass through it (a copy's torch.empty would count as the step's next op).

    def begin_virtual(self, target: str, inputs: list):
        with self._lock, torch.utils._python_dispatch._disable_current_modes():
            self._virtual.append(self._before_op(target, list(inputs)))

    def record(self, target, schema, args, kwargs, out, time_ms=None):
        with self._lock, torch.utils._python_dispatch._disable_current_modes():
            following, k = self._virtual.pop()
            self._after_op(target, _tensors(out, []), following, k)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = []
        for a in args:  # _tensors(args), without a call for the common flat case
            if isinstance(a, _Tensor):
                inputs.append(a)
            elif isinstance(a, (list, tuple, dict)):
                _tensors(a, inputs)
        if kwargs:
            _tensors(kwargs, inputs)
        else:
            kwargs = {}
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = str(func)
        with self._lock:
            k = self._k
            quiet = (self._in_step and self._following and not self._opaque and
                     not self._watching and k < self._n_ops and self._quiet[k] and
                     self._expected[k][0] == name and
                     not (self._dead or self._updated or self._leaving or self._leaving_other))
            if quiet:
                self._quiet_inputs(inputs)
        if quiet:
            out = func(*args, **kwargs)
            with self._lock:
                self._quiet_outputs(out, k)
            return out
        with self._lock:
            if self._opaque:  # inside an opaque region: not counted, but guarded
                self._poll()
                self._bring_inputs(inputs, False, -1)
                return func(*args, **kwargs)
            host_op = self._host_ops.get(self._k) if self._in_step else None
            following, k = self._before_op(name, inputs, bring=host_op is None)
            if host_op is not None and following:
                if self._host_update(host_op, args, kwargs):
                    self._after_op(name, [], following, k)
                    return None
                self._bring_inputs(inputs, following, k)  # it runs on the device after all
        out = func(*args, **kwargs)
        with self._lock:
            self._after_op(name, _tensors(out, []), following, k)
        return out

    # An op followed with nothing planned at it (self._quiet[k]), its target checked:
    # what _before_op and _after_op do for it, inline (the dispatch mode is the replay's
    # whole overhead where nothing moves: T3 runs 6643 ops a step, 5 of 6 of them quiet).
    # An output unlike the trace's goes the general way, which says how it diverged.

    def _quiet_inputs(self, inputs: list) -> None:
        off = self._off
        for t in inputs:
            self._sid(t)
            if off:
                key, storage = _key(t)
                m = off.get(key) if key is not None else None
                if m is not None:
                    self._ensure(m, storage, m.state == "coming")

    def _quiet_outputs(self, out, k: int) -> None:
        expected = self._expected[k][1]
        if isinstance(out, _Tensor):
            outputs = [out]
        elif out is None:
            outputs = []
        else:
            outputs = _tensors(out, [])
        if len(outputs) == len(expected):
            for t, e in zip(outputs, expected):
                sid = self._sid(t)
                if sid is None or sid != e[1] or t.shape != e[0]:
                    break
            else:
                self._k = k + 1
                return
        self._after_op(self._expected[k][0], outputs, True, k)  # diverged: it says how

    def _cpp_mismatch(self, k: int, outputs: list) -> None:
        """A quiet op the C++ dispatch ran whose outputs are not the trace's (Note [Replay
        dispatch in C++]): they come here unnumbered, from inside torch's dispatch with
        this mode still on the stack, so whatever runs here runs with the modes off."""
        with self._lock, torch.utils._python_dispatch._disable_current_modes():
            self._after_op(self._expected[k][0], outputs, True, k)


def _values(value: dict, out: list) -> None:
    """(sizes, storage) of every tensor in a graph value, in order."""
    if value["type"] == "tensor":
        out.append((tuple(value["sizes"]), value.get("storage")))
    elif value["type"] == "sequence":
        for element in value["elements"]:
            _values(element, out)


def _host_form(trace, plan: dict) -> str:
    """How this replay updates parameters on the host: with torch's own fused AdamW when
    the device is the CPU (the reference ran that very kernel), else with the host form
    the device's AdamW(fused=True) was probed to equal (Note [Probing the device
    optimizer]). ValueError when none equals it."""
    nodes = trace.graph["nodes"]
    node = nodes[plan["host_updates"][0]["op_positions"][0]]
    by_id = {n["id"]: n for n in nodes}
    device = by_id[node["args"][0][0]["node"]]["value"]["device"]
    if device == "cpu":
        return "torch-cpu"
    from spillway.optim import probe_adamw
    kw = node["kwargs"]
    found = probe_adamw(device, lr=kw["lr"], betas=(kw["beta1"], kw["beta2"]), eps=kw["eps"],
                        weight_decay=kw["weight_decay"], maximize=bool(kw.get("maximize")))
    if found["arithmetic"] is None:
        detail = "; ".join(f"{a}: {m}" for a, m in found["mismatch"].items())
        raise ValueError(f"[trace] this plan runs AdamW on the host, but no host form "
                         f"reproduces {device}'s AdamW(fused=True) bit for bit ({detail}); "
                         f"plan without host_adamw_gbs")
    return found["arithmetic"]


def _host_adamw(form: str, param, grad, exp_avg, exp_avg_sq, hyper, step: float,
                device) -> None:
    """One parameter's AdamW on its host buffers (uint8, viewed as float32), in place."""
    lr, beta1, beta2, weight_decay, eps, maximize = hyper
    p, g = param.view(torch.float32), grad.view(torch.float32)
    m, v = exp_avg.view(torch.float32), exp_avg_sq.view(torch.float32)
    if form == "torch-cpu":
        torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(step)], lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                            maximize=maximize)
        return
    from spillway.optim._probe import arithmetic_code, device_powers, host_threads
    p1, p2 = device_powers(form, beta1, beta2, step, device)
    torch.ops.spillway.adamw_update_(p, g, m, v, lr, beta1, beta2, eps, weight_decay, maximize,
                                     p1, p2, arithmetic_code(form), host_threads())
