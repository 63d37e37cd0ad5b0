"""Eager activation offload under a memory budget: keep, offload or checkpoint each block.

    ctx = spillway.offload_activations(model, memory_budget="12GiB")
    for batch in data:
        with ctx:
            loss = model(batch).loss
        loss.backward()
    ctx.plan.forecast()   # {"step_ms": ..., "peak_bytes": ..., ...}

What happens (offload_activations(memory_budget=...) returns a BudgetedOffload):

  1. The blocks are the elements of the model's largest nn.ModuleList (the
     decoder layers), or, without one, the model read as a sequence (eager.py's
     layer rules); `scope` restricts them to the matching modules (outermost
     ones only).
  2. The first `profile_steps` steps (default 2) under the context are
     profiling steps. Every block runs under torch.utils.checkpoint
     (non-reentrant, RNG state preserved), so they fit in about the memory
     of full checkpointing and their results are bitwise those of plain
     steps. The first measures, per block call, the bytes the block saves
     for backward when not checkpointed, counted during the checkpoint's own
     recompute by a saved-tensor hook that hands every tensor on to the
     checkpoint's (no extra forward: no RNG draw, no extra module state
     update), which of those a selective recompute could rebuild from the
     rest (_recipes.py: C_k, and the bytes its elementwise ops move, timed
     by the simulator's bandwidth estimate when the plan is made), which
     others a linear recipe could rebuild with F.linear (with _LINEAR_RECIPES:
     L_k, Note [Linear recipes]: the MLP's gate and up projections; its
     rebuild timed on the device when the plan is made, not offered where it
     cannot be), and its
     input and output bytes; for the step: the bytes
     allocated at its start and its peak (torch.cuda.max_memory_allocated
     after torch.cuda.reset_peak_memory_stats at the step's start), also
     stretch by stretch: to the model's end, from there to the last block's
     backward, the rest (the statistics restart at each: the caller's peak
     statistics after this step cover its last stretch only), and the bytes
     saved outside the blocks, with those saved after the last block that
     only the head's backward reads (Note [The head's late tensors]). Every
     profiling step times (CUDA events, perf_counter on the
     CPU) each block's forward and its backward, from the gradient reaching
     the block's output to it reaching the block's input (tensor hooks), and
     the spans around the blocks: from the first gradient reaching a model
     output to the last block, and from the first block to the end of
     backward. The plan takes the last step's times: the counting hooks of
     the first run Python per saved tensor, which slows the recompute down.
  3. At the start of the next step, the measurements become a block graph in
     Spillway IR (_budget_graph.py), calibrated on the measured peaks of the
     three stretches (_budget_graph.calibrate), and the
     C++ budget planner (spillway._C.plan_memory_budget, with
     release_when_copied) picks, per block's saved tensors S_k, their
     rebuildable part C_k and per block output X_k, keep, offload or
     recompute (L_k too), and for each offload the block
     call at whose end its device memory goes: the first by which the
     planner expects its copy to have finished (at least `lag` calls later),
     else the last block's end, else the model call's end.
  4. Decisions become actions per block call:
       S_k keep                 nothing;
       S_k offload              the block's saved tensors go through the
                                offload store (eager.py: prefetch), their
                                forward wait at the end of call k + lag_k;
       S_k recompute            the block runs under checkpoint (C_k with it);
       C_k unlike S_k           the block runs under a _recipes.Recorder and
                                the pack hook sorts its saved tensors: C_k's
                                are kept, offloaded, or (recompute) packed as
                                recipes rebuilt in backward;
       L_k unlike S_k           the same for L_k's (their recipes run F.linear);
       X_k-1 offload            the block's saved input goes through the store
                                (with S_k recompute: the checkpoint's saved
                                input; otherwise the saved tensors that share
                                the input's storage); X_-1: block 0's input.
       H offload                the head's late tensors go through the store
                                in a layer of their own, released at the
                                model's end, reloaded when the head's backward
                                unpacks them (Note [The head's late tensors]).
     A call has one lag, the smaller of its saved tensors' and its input's.
     They apply from that step on; `ctx.plan` is the EagerBudgetPlan.

A budget below the smallest peak the planner reaches raises its MemoryError
at the start of the first step after profiling (inside the model call; the context exits
and the model is as it was). Results stay bitwise equal to the run without
spillway on every step: checkpoint replays the RNG, the store moves bytes,
a recipe runs the same elementwise functions (or F.linear) on the same inputs.

Thread-safety: as eager.py (one context per model; backward hooks take the
context's lock).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import statistics
import time
import warnings

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from spillway import _C, _budget
from spillway.activations import eager
from spillway.activations._eager_store import _Handle, _Kept, _Layer
from spillway.activations._recipes import (RebuildProbe, Recipe, RecipeScope, Recorder, SaveParts,
                                           nodes_of, save_layout, storage_key)
from spillway.activations._budget_graph import (BlockCall, StepProfile, as_run_peak,
                                                block_graph, calibrate, charge_host,
                                                host_lane, measured_host_lane, mode_ratio,
                                                placeholder_bytes,
                                                rebuild_ms)

__all__ = ["BudgetedOffload", "EagerBudgetPlan", "BlockChoice", "parse_memory_budget"]

_MISSING = object()
# Prefetch distances (block calls) the plan is tried at, beside the context's own.
_PREFETCH_DISTANCES = (1, 2, 3, 4, 6, 8)
# Timed runs of a block's rebuild (RebuildProbe) whose median the planner takes.
_REBUILD_RUNS = 5
# Linear recipes (L_k, Note [Linear recipes] in _recipes.py) and the planner's search
# from both ends (BudgetOptions::relax): on since the T1 eager curve was measured with
# them (v15, H100, bench/results/2026-12-07-t1-eager-budget-v15-h100.md): 7.1 GiB of
# activation in 1.15x the step without a plan, where v14 took 1.25x. Off, the plans are
# v14's.
_LINEAR_RECIPES = True
_SEARCH_BOTH_ENDS = True
# Note [Parts by position]: a block call whose cheap and linear parts are kept or
# offloaded apart, none rebuilt, takes which saves are which from its last call under
# the Recorder instead of running under it again. On since T1 was measured with it
# (v16 probe, H100, bench/results/2026-12-07-t1-eager-budget-v16-probe-h100.md): such a
# block launched in 2.0-2.8 ms against 4.2-10.4 under the Recorder, and the 24.6 GiB
# plan took 1.012x the step without a plan.
_PARTS_BY_POSITION = True
# Note [Recipes by position] (_recipes.py): the same for a call that rebuilds its cheap or
# linear part, its recipes bound from templates learned under the Recorder and checked
# against each save's autograd history (with _PARTS_BY_POSITION).
_RECIPES_BY_POSITION = True
# Note [Catching in a window] (_recipes.py): a call rebuilding by position catches its
# extra inputs in the submodule calls that take them, not across the whole block call.
# Off until measured on T1 (H100 host, 2026-12-07: with a block-wide _Catcher a bf16 block
# rebuilding its parts took +3.96 ms of host over a plain forward, keeping them +1.90).
_CATCH_IN_WINDOWS = False
# Note [Kept saves in C++] (python/csrc/fast_keep.cc): a call by position keeps the saves
# its table's first such call kept in C++, where nothing Python's hook reads of them
# changed. Off until measured on T1.
_FAST_KEEP = False
# Note [The host lane] (src/plan/budget_problem.cc): the first plan sees what each block
# call costs the thread that launches it, from the profiling step's launches (Note [Host
# costs by mode], _budget_graph.py), and that the device cannot run a block before it
# is launched. Off: on the recorded T1 runs v16-v18 those costs forecast 12 of 21 plans
# within 5 % of their steps, the device alone 11 (the host's speed moves after the
# profiling step; bench/results/2026-12-08-host-lane-replay-cpu.md).
_HOST_LANE = False
# Note [Replanning on the host's speed]: the planned step that starts when _REPLAN_AT
# planned steps have begun is planned again with the host lane, its host costs scaled
# to the speed the host ran the step before at; the new plan is taken where its
# forecast beats the running plan's, both with that host, by _REPLAN_MARGIN. Off until
# measured on T1 (on the recorded runs v16-v18, the cost model scaled to a planned
# step's speed forecast that step within 3.6 % for all 21 plans).
_HOST_REPLAN = False
_REPLAN_AT = 3
_REPLAN_MARGIN = 0.01
# Note [Offloaded saves by position] (with _FAST_KEEP): a call by position offloads in
# one step the saves its table's first such call offloaded.
_FAST_OFFLOAD = False
_REASONS = eager._SKIP_REASONS  # FastKeep counts by index
_PARTS = (None, "cheap", "linear")  # FastKeep's offloads by index


def parse_memory_budget(value) -> tuple[int | None, float | None]:
    """(bytes, None) or (None, fraction of the no-offload peak); ValueError naming the
    problem (spillway._budget.parse_memory_budget, the compiled path's too)."""
    kind, number = _budget.parse_memory_budget(value, "eager")
    return (int(number), None) if kind == "bytes" else (None, float(number))


def budget_blocks(model: nn.Module, scope) -> list[tuple[str, nn.Module]]:
    """The blocks a budget plans over (module docstring, point 1); ValueError when none."""
    if scope is None or (isinstance(scope, str) and scope == "*"):
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        best = max(lists, key=lambda nm: len(nm[1]), default=None)
        if best is not None and len(best[1]) > 0:
            found = [(f"{best[0]}.{i}" if best[0] else str(i), m) for i, m in enumerate(best[1])]
        else:
            found = eager._layer_sequence("", model)
    else:
        found = eager._scope_modules(model, scope)
    blocks, seen = [], set()
    for name, m in found:
        if id(m) in seen or any(name.startswith(f"{outer}.") for outer, _ in blocks):
            continue  # a module registered twice is one block; nested ones belong to the outer
        seen.add(id(m))
        blocks.append((name, m))
    if not blocks:
        raise ValueError(f"[eager] memory_budget: {type(model).__name__} has no blocks to plan "
                         "over (no nn.ModuleList, no children with parameters)")
    return blocks


def _bindings():
    from spillway import _C
    missing = [f for f in ("plan_memory_budget", "simulate_graph") if not hasattr(_C, f)]
    if missing:
        raise RuntimeError(f"[eager] memory_budget needs spillway._C.{missing[0]}, which this "
                           "build lacks: rebuild the extension (cmake --preset python && "
                           "cmake --build --preset python)")
    return _C


def _warm_checkpoint() -> None:
    """Runs torch.utils.checkpoint once on a scalar: its first call imports torch._dynamo
    (seconds), which would otherwise be timed as the first block's forward."""
    x = torch.zeros((), requires_grad=True)
    checkpoint(torch.sin, x, use_reentrant=False, preserve_rng_state=False).backward()


def _input_storages(args) -> frozenset[int]:
    """The addresses of a block call's input storages (UntypedStorage._cdata, as
    StorageWeakRef.cdata). Read only while the call runs, whose caller holds its inputs,
    so no other storage can have one of them; comparing ints spares a StorageWeakRef a
    save."""
    return frozenset(k.cdata for k in map(storage_key, _tensors(args)) if k is not None)


def _tensors(value, depth: int = 3) -> list[torch.Tensor]:
    """The tensors in a value and in its tuples, lists and dict values, in order (a few
    levels deep: Llama's position_embeddings=(cos, sin) keyword)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v, depth - 1)]
    return []


# Note [The head's late tensors]
# At the step's peak, the loss's backward on T1 (three fp32 buffers of the
# logits' size), the blocks' saved tensors can all be gone (recomputed, or on
# the host), but what the head saved stays: the loss's own saved tensors, which
# that backward reads, and the final norm's and the LM head's inputs (0.25 GiB
# on T1), which only the head's backward reads, after the loss's. The
# profiling step numbers the saves made after the last block call up to the
# model's end and notes which were first read (unpacked) before the gradient
# reached a non-scalar output of the model (the logits: the loss's backward is
# over by then, whether the loss is computed in the model or after it): a
# storage none of whose saves was is late. Their bytes become the block
# graph's head_saved, a candidate the planner may offload (never recompute)
# with the last block's stack; the loss's backward then takes a token and
# head_backward the gradient. With the plan offloading it, the step counts the
# saves after its last block call again: the late positions go through the
# store in a layer of their own, whose forward wait is the model's end (as the
# last blocks' waits); the others are kept, and their unpack starts no reload,
# so the late tensors come back when the head's backward unpacks them, after
# the peak (on demand: the planner's reload right before head_backward). A
# model whose head saves differ from step to step would be misnumbered; every
# model of the tests, and T1, save the same sequence each step.
class _HeadKept(_Kept):
    """A tensor the profiling step saved after the last block (so far): kept as any tensor
    outside the blocks, numbered so that its first unpack can be placed before or after
    the gradient reaching the model's output (Note [The head's late tensors])."""

    __slots__ = ("generation", "save")

    def __init__(self, owner, tensor, generation: int, save: int):
        super().__init__(owner, tensor, None)
        self.generation, self.save = generation, save


@dataclasses.dataclass(frozen=True)
class BlockChoice:
    """The plan for one block call of a step (calls in forward order)."""

    call: int                   # position among the step's block calls
    block: str                  # the block's qualified module name
    saved: str                  # "keep" | "offload" | "recompute" (recompute: checkpointed)
    input: str                  # "keep" | "offload": the block's saved input
    lag: int | None             # offloads: block calls until their forward wait (eager's lag)
    saved_bytes: int            # what the block saves for backward, input and output aside
    input_bytes: int
    forward_ms: float
    backward_ms: float          # without recompute
    # The saved tensors a selective recompute can rebuild (_recipes.py), part of
    # saved_bytes: "keep" | "offload" | "recompute" (rebuilt in backward from the rest);
    # with saved == "recompute" the whole block is checkpointed whatever this says.
    cheap: str = "keep"
    cheap_bytes: int = 0
    # The same for the saved tensors a linear recipe rebuilds (Note [Linear recipes]).
    linear: str = "keep"
    linear_bytes: int = 0

    @property
    def checkpoint(self) -> bool:
        return self.saved == "recompute"

    def summary(self, sep: str = " ") -> str:
        """The decisions in a word: S_k's, each part's that goes another way, the input's
        ("offload+linear recompute+cheap recompute+input offload", sep " ")."""
        out = self.saved
        for part, decision in (("linear", self.linear), ("cheap", self.cheap)):
            if decision != self.saved and not self.checkpoint:
                out += f"+{part}{sep}{decision}"
        return out + (f"+input{sep}offload" if self.input == "offload" else "")


@dataclasses.dataclass(frozen=True)
class _CallPolicy:
    checkpoint: bool
    offload_saved: bool
    offload_input: bool
    lag: int | None = None  # the release lag of what the call offloads; None: the context's
    # The rebuildable saved tensors (_recipes.py), cheap and linear (Note [Linear
    # recipes]): None: as the rest; "keep" | "offload" | "recompute" otherwise. A call
    # with either runs under a Recorder.
    cheap: str | None = None
    linear: str | None = None

    @property
    def offload_cheap(self) -> bool:
        return self.offload_saved if self.cheap is None else self.cheap == "offload"

    @property
    def offload_linear(self) -> bool:
        return self.offload_saved if self.linear is None else self.linear == "offload"

    @property
    def recorded(self) -> bool:
        return self.cheap is not None or self.linear is not None


# Note [The host's share]. The simulator replays the device's streams; an eager step
# also needs a thread to launch it, and a block call whose saves go through Python
# hooks (a Recorder, recipes, the store) can take that thread longer than the device
# takes to run it. Then the device waits. The profiling step times each block's
# forward on the host (BlockCall.forward_host_ms: checkpointed, no saves) and its
# recompute under the Recorder (recorded_host_ms), and planned steps time each block
# call, hooks included (stats()["block_forward_host_ms"]); t1.py prints the sums.
# On T1 (H100, 2026-12-07, bench/results/2026-12-07-t1-eager-budget-v16-probe-h100.md) a
# block's kernels take 5.1 ms on the device and 1.4-2.5 ms to launch plainly; a block
# under the Recorder took 4.2-10.4 ms to launch (rebuilding C_k, offloading S_k: ~7),
# by position (Note [Parts by position]) 2.0-2.8 ms. A two-stage pipeline over the
# planned steps' own host times (the device cannot finish block k before the host
# issued it) accounts for most of each plan's miss (15 GiB: 27.9 of 31.7 ms), but the
# profiling step does not give those times beforehand: its recompute runs in backward,
# where the first one took 66-89 ms and the others 3.7-7.6 ms against 4.2-10.4 planned.
# The simulator has that pipeline now (Note [The host lane], src/plan/budget_problem.cc),
# fed with the profile's launches (_HOST_LANE) or, better, with the host's speed as the
# planned steps measure it (Note [Replanning on the host's speed]); both off until
# measured on T1. Making the hooks cheaper is what keeps the device's forecast true.


class EagerBudgetPlan:
    """What the planner chose for a BudgetedOffload, and what it forecasts.

    choices: a BlockChoice per block call. head: "offload" when the head's late
    tensors go to host memory through the loss's backward (Note [The head's late
    tensors]), "keep", or None (none). budget_bytes: the budget in bytes
    (a fraction resolved against the baseline's peak). calibration: the
    measured and simulated peaks of the profiling step and the offset
    between them (_budget_graph.calibration_offset). result: the planner's
    JSON answer as a dict. graph: the block graph planned on (a dict).
    """

    def __init__(self, *, choices, budget_bytes, result, graph, options, calibration, profile,
                 head=None, as_run=None, planner_budget_bytes=None):
        self.choices: list[BlockChoice] = choices
        # The head's late tensors (Note [The head's late tensors]): "keep" | "offload";
        # None where the graph planned on had none.
        self.head: str | None = head
        self.budget_bytes: int = budget_bytes
        self.result: dict = result
        self.graph: dict = graph
        self.calibration: dict = calibration
        self.profile: StepProfile = profile
        self._options = options
        # _budget_graph.as_run_peak of the plan and of the baseline: peak_bytes, peak_node,
        # baseline_peak_bytes; None: the graph's (the planner's) figures stand.
        self._as_run = as_run
        # The budget the planner was given: budget_bytes, or the graph's own peak where
        # the run fits budget_bytes without a plan (Note [What a kept block holds]).
        self.planner_budget_bytes: int = (budget_bytes if planner_budget_bytes is None
                                          else planner_budget_bytes)

    def forecast(self) -> dict:
        """The predicted step: step_ms, peak_bytes, bytes_offloaded (each way),
        bytes_recomputed, recompute_ms, compute_wait_ms, peak_node, peak_phase, and
        baseline_step_ms / baseline_peak_bytes (every block kept), budget_bytes: the
        device's step (Note [The host's share]).
        peak_bytes, peak_node and baseline_peak_bytes are what the run holds (Note [What
        a kept block holds], _budget_graph.as_run_peak); graph_peak_bytes and
        graph_baseline_peak_bytes the planner's, which it fitted to the budget."""
        f, b = self.result["forecast"], self.result["baseline"]
        out = {k: f[k] for k in ("step_ms", "peak_bytes", "bytes_offloaded", "bytes_recomputed",
                                 "recompute_ms", "compute_wait_ms", "peak_node", "peak_phase",
                                 "host_ms", "host_wait_ms")
               if k in f}
        out.update(baseline_step_ms=b["step_ms"], baseline_peak_bytes=b["peak_bytes"],
                   budget_bytes=self.budget_bytes, graph_peak_bytes=f["peak_bytes"],
                   graph_baseline_peak_bytes=b["peak_bytes"])
        if self._as_run is not None:
            out.update(self._as_run)
        return out

    @property
    def prefetch(self) -> int:
        """How many block calls ahead of its backward an offloaded call is reloaded (the
        distance whose plan forecast the fastest step)."""
        return self._options["prefetch_regions"]

    @property
    def planner_options(self) -> dict:
        """The keyword arguments of the spillway._C.plan_memory_budget call that made
        this plan from `graph` and `budget_bytes` (a copy): with them the plan can be
        made again, on any machine, bit for bit."""
        return dict(self._options)

    def _replan(self, **extra) -> dict:
        _C = _bindings()
        return json.loads(_C.plan_memory_budget(json.dumps(self.graph),
                                                self.planner_budget_bytes, **self._options,
                                                **extra))

    def chrome_trace(self, path: str | os.PathLike) -> None:
        """Writes the simulator's Chrome trace (Perfetto-readable JSON) of the planned step."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self._replan(trace=True)["chrome_trace"])

    def memory_svg(self, path: str | os.PathLike, title: str = "eager step under a budget"
                   ) -> None:
        """Writes the simulator's memory-over-time picture (SVG) of the planned step."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self._replan(svg_title=title)["memory_svg"])

    def __repr__(self) -> str:
        mix = dict(collections.Counter(c.summary() for c in self.choices))
        if self.head == "offload":
            mix["head offload"] = 1
        f = self.forecast()
        return (f"EagerBudgetPlan(budget={self.budget_bytes / 2**30:.2f} GiB, {mix}, "
                f"prefetch {self.prefetch}, "
                f"forecast {f['step_ms']:.1f} ms at {f['peak_bytes'] / 2**30:.2f} GiB)")


class _Clock:
    """Marks on the device's compute stream (CUDA events) or the host clock (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ms(self, start, end) -> float:
        if start is None or end is None:
            return 0.0
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)


class _Recording:
    """The profiling step in progress: marks and byte counts, turned into a StepProfile."""

    def __init__(self, clock: _Clock):
        self.clock = clock
        self.calls: list[BlockCall] = []
        # Per call (its index in calls) with rebuildable saved tensors: their rebuild,
        # apart from the step's tensors (the planner times it).
        self.probes: dict[int, RebuildProbe] = {}
        # The same for each call's linear recipes (Note [Linear recipes], _recipes.py).
        self.linear_probes: dict[int, RebuildProbe] = {}
        self.marks: list[dict] = []  # per call: fwd_start, fwd_end, bwd_start, bwd_end
        self.model_start = clock.mark()
        self.model_end = None
        self.backward_end = None
        self.pre_saved: dict = {}
        self.post_saved: dict = {}
        self.resident_bytes = 0
        self.peak_bytes: int | None = None
        # CUDA: the peaks of the step's three stretches (Note [Where the step peaks]):
        # to the model's end, from there to the last block's backward, the rest.
        self.segment_peaks: list[int] = []
        self.backward_seen = False
        self.backward_begin = None  # the first gradient reaching a model output
        self.complete = False
        self.count_saved = True  # the first profiling step counts; later ones only time
        self.grads: tuple[list[int], int] = ([], 0)  # BudgetedOffload._new_grad_bytes at the start
        self.params: set = set()  # parameter and buffer storages (never counted as saved)
        # Note [The head's late tensors]: the saves since the last block call ended (each a
        # device storage's key and bytes, or None: a parameter, another device), which of
        # them backward read before the gradient reached the model's output, and whether
        # it has; `head_generation` counts block calls (saves between blocks start over).
        self.head: list[tuple[object, int] | None] = []
        self.head_early: set[int] = set()
        self.head_generation = 0
        self.output_grad_seen = False

    def head_late(self) -> tuple[int, tuple[int, ...]]:
        """(bytes, save positions) of the head's late storages: every save of the storage
        first read after the gradient reached the model's output."""
        early_keys = {self.head[i][0] for i in self.head_early if self.head[i] is not None}
        late = {}
        for i, entry in enumerate(self.head):
            if entry is not None and entry[0] not in early_keys:
                late.setdefault(entry[0], (entry[1], []))[1].append(i)
        saves = sorted(i for _, positions in late.values() for i in positions)
        return sum(n for n, _ in late.values()), tuple(saves)

    def profile(self, grads: tuple[list[int], int]) -> StepProfile:
        ms = self.clock.ms
        for call, mark in zip(self.calls, self.marks):
            call.forward_ms = ms(mark["fwd_start"], mark["fwd_end"])
            if "fwd_host" in mark:
                call.forward_host_ms = round(mark["fwd_host"], 4)
            start, end = mark.get("bwd_start"), mark.get("bwd_end") or self.backward_end
            call.backward_ms = ms(start, end) if start is not None and end is not None else None
        per_call, other = grads
        for call, nbytes in zip(self.calls, per_call):
            call.new_grad_bytes = nbytes
        first = self.marks[0]["fwd_start"] if self.marks else None
        last = self.marks[-1]["fwd_end"] if self.marks else None
        last_bwd = self.marks[-1].get("bwd_start") if self.marks else None
        first_bwd = self.marks[0].get("bwd_end") if self.marks else None
        known = (lambda a, b: ms(a, b) if a is not None and b is not None else None)
        late_bytes, late_saves = self.head_late() if self.output_grad_seen else (0, ())
        return StepProfile(
            calls=self.calls,
            pre_forward_ms=ms(self.model_start, first) if first is not None else 0.0,
            post_forward_ms=ms(last, self.model_end) if last is not None else 0.0,
            post_backward_ms=known(self.backward_begin, last_bwd),
            pre_backward_ms=known(first_bwd, self.backward_end),
            step_ms=known(self.model_start, self.backward_end),
            pre_saved_bytes=sum(self.pre_saved.values()),
            post_saved_bytes=sum(self.post_saved.values()),
            other_new_grad_bytes=other, resident_bytes=self.resident_bytes,
            measured_peak_bytes=self.peak_bytes,
            segment_peak_bytes=tuple(self.segment_peaks) if len(self.segment_peaks) == 3
            else None,
            head_late_bytes=late_bytes, head_late_saves=late_saves)


class BudgetedOffload(eager.OffloadActivations):
    """offload_activations(memory_budget=...): see the module docstring."""

    def __init__(self, model, memory_budget, *, scope=None, min_bytes=1 << 20, prefetch=1,
                 device=None, lag=1, layers=None, device_profile=None, profile_steps=2):
        if layers is not None:
            raise ValueError("[eager] layers= and memory_budget= do not go together: the plan "
                             "chooses what each block does (use scope= to restrict the blocks)")
        self._budget_bytes, self._budget_fraction = parse_memory_budget(memory_budget)
        if (isinstance(profile_steps, bool) or not isinstance(profile_steps, int)
                or profile_steps < 1):
            raise ValueError(f"[eager] profile_steps must be an int >= 1, got "
                             f"{eager._shown(profile_steps)}")
        self._profile_steps = profile_steps
        self._min_prefetch = prefetch
        self._profiled: list[_Recording] = []  # completed profiling steps
        super().__init__(model, scope=scope, min_bytes=min_bytes, prefetch=prefetch,
                         device=device, lag=lag)
        if not self._enabled:
            raise ValueError(f"[eager] memory_budget: the model is on {self._device}, which has "
                             "no device memory to plan; move it to a CUDA device, or pass "
                             "device='cpu' to drive the path through the fake copy backend "
                             "(for testing)")
        self._blocks = budget_blocks(model, scope)
        self._scope = self._blocks
        self._position = {id(m): i for i, (_, m) in enumerate(self._blocks)}
        self._profile_json = _budget.device_profile_json(device_profile, "eager")
        _C = _bindings()
        try:  # reject a bad profile now, not at the second step
            _C.simulate_graph(json.dumps({"format": "spillway.graph", "version": 1, "nodes": []}),
                              device_profile_json=self._profile_json)
        except ValueError as e:
            raise ValueError(f"[eager] device_profile: {e}") from None
        _warm_checkpoint()
        self._clock = _Clock(self._device)
        self.plan: EagerBudgetPlan | None = None
        self._policies = []  # per block call of a planned step (the property's setter)
        self._recording: _Recording | None = None
        self._pass_mode = "plain"
        self._call_ordinal = 0
        self._call_state = None  # (ordinal, mode, policy) of the block call whose forward is next
        # Per offloading block call (its layer's index): its policy and its input's storages
        # (_select_layer).
        self._layer_policy: dict[int, tuple[_CallPolicy, frozenset]] = {}
        self._saved_forwards: list = []
        self._warned_cache = False
        # The block call running under a Recorder (plan mode, a policy with `cheap` or
        # `linear`): its RecipeScope (or SaveParts, Note [Parts by position]) and policy;
        # the part ("cheap", "linear") of the call's saved tensors the store is packing,
        # None: the rest.
        self._recipes: tuple[RecipeScope | SaveParts, _CallPolicy] | None = None
        self._packing_part: str | None = None
        self._recomputed = {"tensors_recomputed": 0, "bytes_recomputed": 0,
                            "parts_by_position": 0, "parts_departed": 0,
                            "recipes_by_position": 0}
        # Note [Parts by position]: per block call, the policy and each save's layout and
        # part as its last run under the Recorder found them, or None where a recipe of
        # that run could not be learned (its calls keep the Recorder); the list being
        # filled.
        self._save_parts: dict[int, tuple[_CallPolicy, list[tuple] | None]] = {}
        self._learning: list[tuple] | None = None
        # Per block call: (a table of _save_parts, _CATCH_IN_WINDOWS, SaveParts.needs_of).
        self._save_needs: dict[int, tuple] = {}
        # Note [Kept saves in C++]: the pack hook (while entered), the one armed for the
        # block call running by position, and per block call (a table, its FastTable).
        self._fast = None
        self._fast_armed = None
        self._fast_tables: dict[int, tuple] = {}
        self._block_host_ms: dict[int, float] = {}  # stats(): per block call ordinal
        # Note [Replanning on the host's speed]: planned steps begun, when the running
        # planned forward began (perf_counter), the host's ms for the last one, and what
        # the replan found (stats()).
        self._planned_steps = 0
        self._forward_start = 0.0
        self._forward_host_ms = 0.0
        self._host_replan: dict | None = None
        self._params: dict | None = None  # _params_by_ptr's, reset at each model call
        # Note [The head's late tensors]: the plan offloads them (from the profile: the
        # positions of their saves after the last block); the head's layer of this step,
        # and the saves counted in it so far.
        self._head_offload = False
        self._head_late: frozenset[int] = frozenset()
        self._head_layer: _Layer | None = None
        self._head_saves = 0

    @property
    def _policies(self) -> list[_CallPolicy]:
        return self._call_policies

    @_policies.setter
    def _policies(self, policies: list[_CallPolicy]) -> None:
        # Set as a whole (the plan, or tests and benches by hand), never changed in place:
        # what every block call of a step would otherwise ask of the whole list is read
        # here, once.
        self._call_policies = policies
        self._any_offloads = any(p.offload_saved or p.offload_input or p.offload_cheap
                                 or p.offload_linear for p in policies)

    # ---- context ------------------------------------------------------------

    def __enter__(self):
        super().__enter__()
        if self._inactive is None:
            self._module_hooks.append(
                self._model.register_forward_hook(self._on_model_end, always_call=True))
            for _, module in self._blocks:
                self._saved_forwards.append((module, module.__dict__.get("forward", _MISSING)))
                module.forward = self._forward_of(module, module.forward)
        return self

    def _pack_hook(self):
        if not _FAST_KEEP:
            return self._pack
        # Note [Kept saves in C++]: held while entered (it holds the context's methods).
        self._fast = _C.FastKeep(self._pack, self._pack_at,
                                 self._offload_at if _FAST_OFFLOAD else None)
        self._fast.set_reasons(len(_REASONS))
        self._fast.set_weights([k.cdata for k in self._param_storages])
        return self._fast

    # Note [Offloaded saves by position]. With _FAST_OFFLOAD (and _FAST_KEEP) a save that
    # a table's learning call offloaded (Python packed it to a _Handle, no recipe) goes,
    # at later calls whose signature at that position is the learned one (Note [Kept
    # saves in C++]), straight to the store's offload: _pack's head, part and skip checks
    # are what the signature fixes (the save's type, autograd maker, layout, bytes,
    # weight and input storage; the call's policy and part are the table's), so they
    # would answer as they did. What is not fixed runs as before: the store's dedup, its
    # pinned budget (a full one keeps the save, counted), the statistics, and the call's
    # SaveParts noting what recipes read. Off until measured on T1.
    def _offload_at(self, t, position: int, part: int):
        scope = self._recipes[0]
        scope.at = position + 1  # as SaveParts.next() leaves it
        self._packing_part = _PARTS[part]
        try:
            with self._lock:
                self._stats["tensors_seen"] += 1
                storage = t.untyped_storage()
                packed = self._pack_offloaded(t, storage, StorageWeakRef(storage))
        finally:
            self._packing_part = None
        scope.saved(t, packed)
        return packed

    def _pack_at(self, t, position: int):
        """The pack hook for a call's save at `position` (FastKeep counted it)."""
        recipes = self._recipes
        if recipes is not None and isinstance(recipes[0], SaveParts) and not recipes[0].departed:
            recipes[0].at = position
        return self._pack(t)

    def __exit__(self, *exc):
        self._fast = self._fast_armed = None
        for module, old in reversed(self._saved_forwards):
            if old is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = old
        self._saved_forwards = []
        self._call_state = None
        return super().__exit__(*exc)

    # ---- per step -----------------------------------------------------------

    def _on_model_call(self, module, args):
        super()._on_model_call(module, args)
        if self._in_backward():
            return
        self._call_ordinal = 0
        self._call_state = None
        self._layer_policy.clear()
        self._params = None
        if not torch.is_grad_enabled():
            self._pass_mode = "plain"  # nothing is saved: nothing to plan
            return
        with self._lock:
            ready = self._recording is not None and self._recording.complete
        if self.plan is None and ready:
            self._profiled.append(self._recording)
            self._recording = None
            if len(self._profiled) >= self._profile_steps:
                self._make_plan()  # the planner's MemoryError leaves through the model call
        if self.plan is not None:
            self._planned_steps += 1
            if _HOST_REPLAN and self._host_replan is None and self._planned_steps >= _REPLAN_AT:
                self._replan_on_host()
            self._pass_mode = "plan"
            self._forward_start = time.perf_counter()
        elif self._recording is None:
            self._pass_mode = "profile"
            self._start_recording()
        else:
            self._pass_mode = "checkpoint"  # the profiling step's backward has not run yet

    def _on_model_end(self, module, args, output):
        if self._pass_mode == "plan":
            self._forward_host_ms = 1e3 * (time.perf_counter() - self._forward_start)
            # The plan's waits that are due after the last block (its lag points past it:
            # the end of forward) run here and let the device copies go. Without this the
            # store would keep them resident when backward starts. The head's layer ends.
            with self._lock:
                while self._pending:
                    self._finish_layer(self._pending.popleft(), keep_resident=False)
                if self._head_layer is not None and self._current is self._head_layer:
                    self._current = None
                self._head_layer = None
        rec = self._recording
        if self._pass_mode == "profile" and rec is not None and rec.model_end is None:
            rec.model_end = self._clock.mark()
            self._segment_peak(rec)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._backward_begin_mark(rec))
                    if t.numel() > 1:  # not a loss: its gradient comes after the loss's backward
                        t.register_hook(self._output_grad_mark(rec))

    def _segment_peak(self, rec) -> None:
        """Ends one stretch of the profiling step (Note [Where the step peaks]): its peak
        allocated bytes, and the peak statistics restart for the next."""
        if self._device.type == "cuda" and rec.count_saved:
            rec.segment_peaks.append(torch.cuda.max_memory_allocated(self._device))
            torch.cuda.reset_peak_memory_stats(self._device)

    def _backward_begin_mark(self, rec):
        def hook(grad):
            if rec.backward_begin is None:
                rec.backward_begin = self._clock.mark()
        return hook

    @staticmethod
    def _output_grad_mark(rec):
        def hook(grad):
            rec.output_grad_seen = True
        return hook

    def _on_layer_end(self, module, args, output):
        super()._on_layer_end(module, args, output)
        # Note [The head's late tensors]: after the plan's last block call, the saves up to
        # the model's end go to a layer of their own, whose forward wait is the model's end.
        if (self._head_offload and self._pass_mode == "plan" and self._depth == 0
                and self._current is None and self._head_layer is None and self._outer is None
                and not self._in_backward() and self._call_ordinal == len(self._policies)):
            with self._lock:
                layer = _Layer(self._next_layer, self._pass_id, True)
                self._next_layer += 1
                self._layers[layer.index] = layer
                self._current = self._head_layer = layer
                self._head_saves = 0

    def _start_recording(self) -> None:
        rec = _Recording(self._clock)
        rec.count_saved = not self._profiled
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
            rec.resident_bytes = torch.cuda.memory_allocated(self._device)
        else:
            rec.resident_bytes = self._host_resident_bytes()
        rec.grads = self._new_grad_bytes()
        rec.params = {StorageWeakRef(t.untyped_storage()) for t in
                      (*self._model.parameters(), *self._model.buffers())}
        self._recording = rec

    def _host_resident_bytes(self) -> int:
        """What a CPU model holds at a step's start: weights, buffers and .grad storages."""
        seen = {}
        for t in (*self._model.parameters(), *self._model.buffers()):
            for x in (t, t.grad if isinstance(t, nn.Parameter) else None):
                if x is not None and x.device == self._device:
                    seen[StorageWeakRef(x.untyped_storage())] = x.untyped_storage().nbytes()
        return sum(seen.values())

    def _new_grad_bytes(self) -> tuple[list[int], int]:
        """Bytes of the .grad storages backward will allocate (grads None now): per block
        (indexed by block), then for the parameters outside the blocks."""
        counted, per_block = set(), []
        for _, module in self._blocks:
            total = 0
            for p in module.parameters():
                if p.requires_grad and p.grad is None and id(p) not in counted:
                    counted.add(id(p))
                    total += p.nbytes
            per_block.append(total)
        other = sum(p.nbytes for p in self._model.parameters()
                    if p.requires_grad and p.grad is None and id(p) not in counted)
        return per_block, other

    def _grads_per_call(self, calls: list[BlockCall], grads) -> tuple[list[int], int]:
        """A block's new .grad bytes go to its last call (backward reaches it first)."""
        per_block, other = grads
        last = {c.block: i for i, c in enumerate(calls)}
        return [per_block[c.block] if last[c.block] == i else 0
                for i, c in enumerate(calls)], other

    # ---- block calls --------------------------------------------------------

    def _select_layer(self, module, args) -> bool:
        ordinal = self._call_ordinal
        self._call_ordinal += 1
        policy = None
        if self._pass_mode == "plan" and ordinal < len(self._call_policies):
            policy = self._call_policies[ordinal]
        self._call_state = (ordinal, self._pass_mode, policy)
        if policy is None or not (policy.offload_saved or policy.offload_input
                                  or policy.offload_cheap or policy.offload_linear):
            return False
        self._layer_policy[self._next_layer] = (policy, _input_storages(args))
        return True

    def _skip_reason(self, t):
        reason = super()._skip_reason(t)
        if reason == "outside_scope" and self._pass_mode == "profile":
            self._count_outside(t)
        elif reason is None:
            policy, input_keys = self._layer_policy.get(self._current.index, (None, None))
            if policy is not None:
                part = self._packing_part
                offload = (policy.offload_cheap if part == "cheap" else
                           policy.offload_linear if part == "linear" else policy.offload_saved)
                # A save sharing the call's input's storage goes as the input; asked only
                # where that differs. (A storage without bytes has no key: not the input.)
                if (policy.offload_input != offload
                        and t.untyped_storage()._cdata in input_keys):
                    offload = policy.offload_input
                if not offload:
                    reason = "layer_not_selected"  # the plan keeps this part of the layer
        return reason

    def _count_outside(self, t) -> None:
        rec = self._recording
        key = storage_key(t)
        if rec is None or key is None or key in rec.params or t.device != self._device:
            return
        where = rec.post_saved if rec.calls else rec.pre_saved
        where[key] = t.untyped_storage().nbytes()

    def _forward_of(self, module, original):
        def forward(*args, **kwargs):
            state, self._call_state = self._call_state, None
            if state is None or self._in_backward() or not torch.is_grad_enabled():
                return original(*args, **kwargs)
            ordinal, mode, policy = state
            if mode == "profile" and self._recording is not None:
                return self._profiled_call(module, original, args, kwargs)
            host = time.perf_counter()
            if mode == "checkpoint" or (policy is not None and policy.checkpoint):
                self._warn_cache(kwargs)
                out = checkpoint(original, *args, use_reentrant=False, preserve_rng_state=True,
                                 **kwargs)
            elif policy is not None and policy.recorded:
                out = self._recorded_call(module, ordinal, policy, original, args, kwargs)
            else:
                out = original(*args, **kwargs)
            if mode == "plan":
                self._hook_prefetch(out)
                # The launching thread's time for this call, hooks and all (stats).
                self._block_host_ms[ordinal] = 1e3 * (time.perf_counter() - host)
            return out
        return forward

    def _params_by_ptr(self) -> dict[int, torch.Tensor]:
        """The model's parameters and buffers by data pointer (once per model call)."""
        if self._params is None:
            self._params = self._weights.by_ptr()  # Note [Weights between calls]
        return self._params

    def _recorded_call(self, module, ordinal: int, policy: _CallPolicy, original, args,
                       kwargs):
        """A block call whose rebuildable saved tensors the plan treats apart (_recipes.py):
        under the Recorder, or by position as its last call under it found them (Notes
        [Parts by position], [Recipes by position])."""
        rebuilds = "recompute" in (policy.cheap, policy.linear)
        by_position = _PARTS_BY_POSITION and (_RECIPES_BY_POSITION or not rebuilds)
        learned = self._save_parts.get(ordinal)
        if by_position and learned is not None and learned[0] == policy:
            if learned[1] is not None:
                return self._call_by_position(ordinal, learned[1], policy, original, args,
                                              kwargs)
            by_position = False  # its recipes cannot be named by position: the Recorder
        recorder = Recorder(self._params_by_ptr())
        self._recipes = (RecipeScope(recorder, pack_extra=self._pack_extra, learn=by_position),
                         policy)
        self._learning = [] if by_position else None
        handles = recorder.watch(module) if by_position and _CATCH_IN_WINDOWS else []
        try:
            with recorder:
                out = original(*args, **kwargs)
            if by_position:  # None: a recipe could not be learned
                self._save_parts[ordinal] = (policy, self._learning)
            return out
        finally:
            self._recipes = self._learning = None
            for handle in handles:
                handle.remove()

    def _call_by_position(self, ordinal: int, table: list, policy: _CallPolicy, original, args,
                          kwargs):
        # What the table's templates read, worked out at its first call (SaveParts.needs_of;
        # the table is held, so `is` names it).
        known = self._save_needs.get(ordinal) if eager._LEAN_HOST else None
        if known is None or known[0] is not table or known[1] != _CATCH_IN_WINDOWS:
            known = (table, _CATCH_IN_WINDOWS, SaveParts.needs_of(table, _CATCH_IN_WINDOWS))
            self._save_needs[ordinal] = known
        parts = SaveParts(table, self._params_by_ptr(), self._pack_extra,
                          by_window=_CATCH_IN_WINDOWS, needs=known[2])
        self._recipes = (parts, policy)
        fast = self._fast if _FAST_KEEP else None
        if fast is not None:  # Note [Kept saves in C++]
            pair = self._fast_tables.get(ordinal)
            if pair is None or pair[0] is not table:
                pair = self._fast_tables[ordinal] = (table, _C.FastTable())
            # The call's input storages, as _select_layer found them for an offloading call.
            _, inputs = self._layer_policy.get(self._current.index, (None, None))
            fast.arm(pair[1], self, self._current,
                     list(inputs if inputs is not None else _input_storages(args)))
            self._fast_armed = fast
        handles = parts.watch()
        try:
            if parts.catcher is None:
                return original(*args, **kwargs)
            with parts.catcher:  # the extra inputs its recipes hold
                return original(*args, **kwargs)
        finally:
            self._recipes = None
            for handle in handles:
                handle.remove()
            if fast is not None:
                self._fast_armed = None
                seen, kept = fast.disarm()
                if not parts.departed:
                    parts.at = seen  # every save matched, in C++ or in Python
                if any(kept):
                    with self._lock:
                        self._stats["tensors_seen"] += sum(kept)
                        for reason, n in zip(_REASONS, kept):
                            self._stats["skipped"][reason] += n
            if parts.departed:
                del self._save_parts[ordinal]  # learned again at its next call
            with self._lock:
                self._recomputed["parts_by_position"] += parts.at
                self._recomputed["parts_departed"] += parts.departed
                self._recomputed["recipes_by_position"] += parts.bound

    def _pack(self, t):
        # A planned step has nothing for _head_save before its head's layer begins: most
        # saves skip the call.
        if (self._head_layer is not None or self._pass_mode != "plan"
                or not eager._LEAN_HOST):
            head = self._head_save(t)
            if head is not None:
                return head
        recipes = self._recipes
        if recipes is None or self._in_backward():
            return super()._pack(t)
        scope, policy = recipes
        if isinstance(scope, SaveParts):  # learned under this policy: its parts and recipes
            part, template = scope.next(t)
            if template is not None:
                node = scope.bind(template, t)
                if node is not None:
                    packed = self._recipe(node, t, scope.results, scope.chain(node))
                    scope.saved(t, packed)
                    return packed
                scope.depart()  # t and the call's later saves go as the rest
                part = None
            self._kept_reason = None
            packed = self._pack_part(t, part)
            scope.saved(t, packed)
            fast = self._fast_armed
            if fast is not None:  # Note [Kept saves in C++]
                if scope.departed:
                    fast.depart()
                elif (self._kept_reason is not None and type(packed) is _Kept
                      and scope.at - 1 not in scope.needed):
                    fast.note(scope.at - 1, _REASONS.index(self._kept_reason))
                elif type(packed) is _Handle:  # Note [Offloaded saves by position]
                    fast.note_offload(scope.at - 1, _PARTS.index(part))
            return packed
        if isinstance(t, nn.Parameter):
            self._learned(t, None)
            return self._pack_part(t, None)
        # Which part t is of: cheap (elementwise recipes), linear (Note [Linear recipes]:
        # asked only where the plan treats that part apart), or the rest.
        part, node = None, None
        if t.device == self._device:
            node = scope.node_for(t)
            part = "cheap" if node is not None else None
            if node is None and policy.linear is not None:
                node = scope.node_for(t, linear=True)
                part = "linear" if node is not None else None
        decision = policy.cheap if part == "cheap" else policy.linear if part == "linear" else None
        if node is not None and decision == "recompute":
            template = None
            if self._learning is not None:
                template = scope.template(node, t, linear=part == "linear")
                if template is None:  # this call keeps the Recorder
                    self._learning, scope.learning = None, False
            scope.pack_extras(node)
            packed = self._recipe(node, t, scope.results)
            # A linear recipe reads the cheap set as packed; the rest of the cheap set reads a
            # rebuilt linear output as any packed input (its recipe unpacks it).
            scope.note_packed(t, packed, cheap=part == "cheap",
                              position=self._learned(t, part, template))
            return packed
        packed = self._pack_part(t, part)
        scope.note_packed(t, packed, position=self._learned(t, part))
        return packed

    def _recipe(self, node, t, results, chain=None) -> Recipe:
        with self._lock:
            self._recomputed["tensors_recomputed"] += 1
            self._recomputed["bytes_recomputed"] += t.untyped_storage().nbytes()
        return Recipe(self, node, t, results, chain)

    def _learned(self, t, part: str | None, template=None) -> int | None:
        """Under the Recorder, learning (Note [Parts by position]): notes t, the call's next
        save, and what the call did with it; its position."""
        if self._learning is None:
            return None
        self._learning.append((save_layout(t), type(t.grad_fn), part, template))
        return len(self._learning) - 1

    def _pack_part(self, t, part: str | None):
        """t saved by the store as of `part` ("cheap", "linear"; None: the rest)."""
        self._packing_part = part
        try:
            return super()._pack(t)
        finally:
            self._packing_part = None

    def _pack_extra(self, t):
        """An input a recipe holds that the block does not save: saved as the rest is."""
        return eager.OffloadActivations._pack(self, t)

    def _unpack(self, packed):
        if isinstance(packed, Recipe) and packed.owner is self:
            return packed.unpack(self._unpack)
        if isinstance(packed, _HeadKept) and packed.owner is self:
            rec = self._recording
            if (rec is not None and packed.generation == rec.head_generation
                    and not rec.output_grad_seen):
                rec.head_early.add(packed.save)
        return super()._unpack(packed)

    def _head_save(self, t):
        """Note [The head's late tensors]: what a save after the last block call packs
        to, or None where the store's usual way applies. Profiling: kept, numbered (its
        first unpack tells early from late) and counted outside the blocks. Plan: a late
        save goes through the store in the head's layer (None); any other is kept, its
        unpack starting no reload (the loss's backward runs at the step's peak)."""
        if self._in_backward():
            return None
        if self._pass_mode == "plan":
            if self._head_layer is None or self._current is not self._head_layer:
                return None
            save, self._head_saves = self._head_saves, self._head_saves + 1
            if save in self._head_late:
                return None
            with self._lock:
                self._stats["tensors_seen"] += 1
                self._stats["skipped"]["layer_not_selected"] += 1
            return _Kept(self, t, None)
        rec = self._recording
        if (self._pass_mode != "profile" or rec is None or not rec.count_saved
                or not rec.calls or rec.model_end is not None or self._current is not None
                or self._outer is not None):
            return None
        key, nbytes = storage_key(t), t.untyped_storage().nbytes()
        movable = (key is not None and key not in rec.params and t.device == self._device
                   and 0 < nbytes and nbytes >= self._min_bytes)  # what the store would move
        rec.head.append((key, nbytes) if movable else None)
        self._count_outside(t)
        with self._lock:
            self._stats["tensors_seen"] += 1
            self._stats["skipped"]["outside_scope"] += 1
        return _HeadKept(self, t, rec.head_generation, len(rec.head) - 1)

    def _hook_prefetch(self, out) -> None:
        """Backward reaching this call's output starts the reloads of the `prefetch` calls
        before it: the store's own trigger, an unpack, only fires in calls that offloaded
        something, and a kept or checkpointed call between them must trigger too."""
        layer = self._current
        if layer is None or self._prefetch == 0 or not self._any_offloads:
            return
        grad_output = next((t for t in _tensors(out) if t.requires_grad), None)
        if grad_output is not None:
            grad_output.register_hook(self._prefetch_trigger(layer.index, layer.pass_id))

    def _prefetch_trigger(self, index: int, pass_id: int):
        def hook(grad):
            task = torch._C._current_graph_task_id()
            if task == -1:
                return
            with self._lock:
                if task not in self._tasks_seen:
                    self._start_backward(task)
                self._reload_before(index, pass_id, task)
        return hook

    def _warn_cache(self, kwargs) -> None:
        if kwargs.get("use_cache") is True and not self._warned_cache:
            self._warned_cache = True
            warnings.warn("[eager] memory_budget checkpoints blocks called with use_cache=True: "
                          "each recompute appends the block's keys and values to the cache "
                          "again (the results are unchanged, the memory and time are not, and "
                          "the profiling step overcounts what blocks save). Call the model "
                          "with use_cache=False when training", UserWarning, stacklevel=4)

    def _profiled_call(self, module, original, args, kwargs):
        """One block call of the profiling step: checkpointed, timed, its saved bytes counted."""
        rec, clock = self._recording, self._clock
        index = self._position[id(module)]
        call = BlockCall(block=index, path=self._blocks[index][0])
        rec.head, rec.head_early = [], set()  # saves after a block: after this one only
        rec.head_generation += 1
        marks: dict = {}
        position = len(rec.calls)
        rec.calls.append(call)
        rec.marks.append(marks)
        inputs = _tensors(args) + _tensors(kwargs)
        input_keys = {k for k in map(storage_key, inputs) if k is not None}
        first_input = storage_key(inputs[0]) if inputs else None
        if inputs:
            call.input_bytes = inputs[0].untyped_storage().nbytes()
            if inputs[0].requires_grad:
                inputs[0].register_hook(self._backward_mark(marks, "bwd_end"))

        def counted(*a, **kw):
            if not self._in_backward():
                return original(*a, **kw)
            if not rec.count_saved:
                self._note_backward()
                return original(*a, **kw)
            return self._count_recompute(call, position, original, a, kw, input_keys,
                                         first_input)

        self._warn_cache(kwargs)
        marks["fwd_start"] = clock.mark()
        host = time.perf_counter()
        out = checkpoint(counted, *args, use_reentrant=False, preserve_rng_state=True,
                         early_stop=False, **kwargs)
        marks["fwd_host"] = 1e3 * (time.perf_counter() - host)
        marks["fwd_end"] = clock.mark()
        outputs = _tensors(out)
        if outputs:
            call.output_bytes = outputs[0].untyped_storage().nbytes()
            if outputs[0].requires_grad:
                outputs[0].register_hook(self._backward_mark(marks, "bwd_start"))
        return out

    def _backward_mark(self, marks: dict, name: str):
        def hook(grad):
            if name not in marks:
                marks[name] = self._clock.mark()
                rec = self._recording
                if name == "bwd_start" and rec is not None and len(rec.segment_peaks) == 1:
                    self._segment_peak(rec)  # the first block backward: the loss's is over
            self._note_backward()
        return hook

    def _count_recompute(self, call: BlockCall, position: int, original, args, kwargs,
                         input_keys, first_input):
        """The checkpoint's recompute, with a saved-tensor hook that counts what the block
        saves and hands every tensor on to the checkpoint's own hook (innermost before)."""
        self._note_backward()
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            return original(*args, **kwargs)
        outer_pack, outer_unpack = top
        rec, seen = self._recording, {}
        # Which saved storages a selective recompute could rebuild (_recipes.py), and
        # the recorded ops it would run again (timed on the clock).
        recorder = Recorder(self._params_by_ptr())
        cheap: dict = {}
        ops: dict[int, object] = {}
        roots: dict = {}  # what rebuilds each rebuildable saved storage
        # The same for the linear recipes (Note [Linear recipes]): None where a save of
        # the storage was not one.
        linear: dict = {}
        saved_by_autograd = set()

        def extra(t):  # held by a recipe: saved like the rest
            key = storage_key(t)
            if key is not None:
                seen[key] = t.untyped_storage().nbytes()
                cheap[key] = False
            return t.detach()  # never t: see _recipes._Arg

        scope = RecipeScope(recorder, share_handles=False, pack_extra=extra)

        def pack(t):
            key = storage_key(t)
            if key is not None and key not in rec.params and t.device == self._device:
                seen[key] = t.untyped_storage().nbytes()
                saved_by_autograd.add(key)
                node = scope.node_for(t)
                cheap[key] = cheap.get(key, True) and node is not None
                if node is not None:
                    ops.update((id(n.made), n.made) for n in nodes_of(node))
                    roots.setdefault(key, node)
                    scope.note_packed(t, t.detach(), cheap=True)  # never t: see _recipes._Arg
                else:
                    node = scope.node_for(t, linear=True) if _LINEAR_RECIPES else None
                    linear[key] = node if linear.get(key, node) is not None else None
                    scope.note_packed(t, t.detach())
                if node is not None:
                    scope.pack_extras(node)  # counted (`extra`): what a rebuild would hold
            return outer_pack(t)

        host = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack), recorder:
            out = original(*args, **kwargs)
        call.recorded_host_ms = round(1e3 * (time.perf_counter() - host), 4)
        output_keys = {k for k in map(storage_key, _tensors(out)) if k is not None}
        outside = input_keys | output_keys
        call.saved_bytes = sum(n for k, n in seen.items() if k not in outside)
        call.cheap_bytes = sum(n for k, n in seen.items() if k not in outside and cheap[k])
        linear_roots = {k: node for k, node in linear.items()
                        if node is not None and k not in outside and not cheap.get(k, False)}
        call.linear_bytes = sum(seen[k] for k in linear_roots)
        # Note [What a kept block holds] (_budget_graph.py).
        call.extra_bytes = sum(n for k, n in seen.items()
                               if k not in outside and k not in saved_by_autograd)
        call.saves_input = first_input in saved_by_autograd
        # The rebuild: its ops' bytes (the estimate where it cannot be timed) and the
        # ops themselves, apart from this step's tensors, which the planner times
        # (_time_rebuilds; timing them here would time the Python that records them).
        call.cheap_traffic = (sum(m.traffic for m in ops.values()), len(ops))
        rebuilt = [node for k, node in roots.items() if k not in outside and cheap[k]]
        if rebuilt:
            rec.probes[position] = RebuildProbe(rebuilt)
        if linear_roots:
            rec.linear_probes[position] = RebuildProbe(list(linear_roots.values()))
        # Every tensor the recompute saved holds its pack hook, `pack`, and so this scope:
        # let go of the tensors it and the roots hold, or each block's recompute stays on
        # the device until the step ends (the CUDA test's Llama then peaked 14 % above a
        # plain step in the profiling step's backward).
        scope.release()
        roots.clear()
        linear.clear()
        return out

    def _note_backward(self) -> None:
        """The profiling step's backward is running: have its end recorded."""
        rec = self._recording
        with self._lock:
            if rec is None or rec.backward_seen:
                return
            rec.backward_seen = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        rec = self._recording
        rec.backward_end = self._clock.mark()
        if self._device.type == "cuda":
            rec.peak_bytes = torch.cuda.max_memory_allocated(self._device)
            if len(rec.segment_peaks) == 2:
                rec.segment_peaks.append(rec.peak_bytes)
            if rec.segment_peaks:
                rec.peak_bytes = max(rec.segment_peaks + [rec.peak_bytes])
        with self._lock:
            rec.complete = True

    # ---- planning -----------------------------------------------------------

    def _fastest_plan(self, text: str, budget: int, input_bytes: int,
                      host_costs: list[dict] = ()) -> tuple[dict, dict]:
        """The planner at each prefetch distance from the context's `prefetch` up (the
        store reloads a block's tensors that many block calls ahead of its backward; a
        copy longer than a block needs more), with and without the blocks' inputs as
        candidates (min_bytes above a hidden state's bytes); the fastest forecast wins,
        the first tried on a tie. Raises the planner's MemoryError when none fits.

        Why without the inputs: the graph holds a kept block's input until its backward,
        but a block that does not save its input (a Llama layer saves its RMSNorm's
        float copy) lets it go after forward. The planner then offloads such inputs
        for nothing: the store moves no bytes, but the plan counted their copies on
        the link and left that much less for the blocks' saved tensors."""
        best, error = None, None
        floors = [self._min_bytes]
        if input_bytes >= self._min_bytes:
            floors.append(input_bytes + 1)
        for distance in sorted({self._min_prefetch, *_PREFETCH_DISTANCES}):
            if distance < self._min_prefetch:
                continue
            if best is not None and distance > 2 * best[0]["prefetch_regions"] + 1:
                break  # two distances past the best gained nothing: a longer one will not
            for floor in floors:
                options = self._planner_options(distance)
                options["min_bytes"] = floor
                if host_costs:  # Note [The host lane]
                    options["host_costs_json"] = json.dumps(host_costs)
                try:
                    # With the planned timeline, for the run's peak (as_run_peak).
                    result = json.loads(_bindings().plan_memory_budget(text, budget, **options,
                                                                       timeline=True))
                except MemoryError as e:
                    # Without its traceback: kept with one, the exception holds this
                    # frame and, through f_back, the model call that made the plan,
                    # whose locals end up holding that step's outputs (the logits,
                    # 1000 MiB on T1) in a cycle only Python's collector frees.
                    error = error or e.with_traceback(None)
                    continue
                if (best is None
                        or result["forecast"]["step_ms"] < best[1]["forecast"]["step_ms"]):
                    best = (options, result)
        if best is None:
            raise error
        return best

    def _planner_options(self, prefetch: int | None = None) -> dict:
        # eager's lag L waits at the end of layer i + L: before the first node of
        # region i + L + 1, the planner's release_lag L + 1 (the smallest it picks
        # with release_when_copied).
        return dict(scope="", allow_offload=True, allow_recompute=True,
                    prefetch_regions=self._prefetch if prefetch is None else prefetch,
                    release_lag=self._lag + 1,
                    min_bytes=self._min_bytes, device_profile_json=self._profile_json,
                    release_when_copied=True, relax=_SEARCH_BOTH_ENDS)

    def _simulate(self, graph_json: str, recomputed=(), timeline: bool = False) -> dict:
        return json.loads(_bindings().simulate_graph(graph_json,
                                                     device_profile_json=self._profile_json,
                                                     recomputed=list(recomputed),
                                                     timeline=timeline))

    def _make_plan(self) -> None:
        if self._clock.cuda:
            torch.cuda.synchronize(self._device)
        measured = self._measured_profile()
        device = str(self._device)
        self._time_rebuilds(measured.calls)
        # This step's state: the optimizer's and the grads' storages that now exist.
        now = dataclasses.replace(measured, calls=[dataclasses.replace(c) for c in measured.calls])
        per_call, other = self._grads_per_call(now.calls, self._new_grad_bytes())
        for call, nbytes in zip(now.calls, per_call):
            call.new_grad_bytes = nbytes
        now.other_new_grad_bytes = other
        allocated = (torch.cuda.memory_allocated(self._device) if self._clock.cuda
                     else self._host_resident_bytes())
        # The graph with the head's late tensors as a candidate of their own, and without
        # (Note [The head's late tensors]): the greedy search does not always find the
        # plan of the second in the first; the fastest plan of either wins.
        # (Each calibrated on the profiling step as it ran, its .grad storages included.)
        variants = [(measured, now)]
        if now.head_late_bytes > 0:
            flat = dict(head_late_bytes=0, head_late_saves=())
            variants.append((dataclasses.replace(measured, **flat),
                             dataclasses.replace(now, **flat)))
        budget, best, error = self._budget_bytes, None, None
        inputs = max((c.output_bytes for c in now.calls), default=0)
        for profiled, profile in variants:
            offset, transients, calibration = calibrate(self._simulate, profiled, device)
            resident, offset_bytes = placeholder_bytes(allocated, offset)
            graph = block_graph(profile, resident_bytes=resident, offset_bytes=offset_bytes,
                                device=device, transients=transients)
            host_costs = host_lane(graph, profile) if _HOST_LANE and self._host_apart() else []
            text = json.dumps(graph)
            unplanned = self._simulate(text, timeline=True)
            baseline, _ = as_run_peak(unplanned["timeline"], {}, profile)
            if budget is None:  # a fraction of the peak the run holds without a plan
                budget = max(1, int(self._budget_fraction * baseline))
            # A budget the run fits without a plan changes nothing, though the graph's
            # own peak may lie above it (Note [What a kept block holds]).
            planned = max(budget, unplanned["peak_bytes"]) if budget >= baseline else budget
            try:
                options, result = self._fastest_plan(text, planned, inputs, host_costs)
            except MemoryError as e:
                # The first graph's reaches the lowest peak. No traceback: see _fastest_plan.
                error = error or e.with_traceback(None)
                continue
            if best is None or result["forecast"]["step_ms"] < best[1]["forecast"]["step_ms"]:
                best = (options, result, graph, calibration, profile, planned, baseline)
        if best is None:
            raise error
        self._adopt(*best, budget=budget)

    def _adopt(self, options: dict, result: dict, graph: dict, calibration: dict,
               profile: StepProfile, planned: int, baseline: int, *, budget: int) -> None:
        """Makes `result` (the planner's answer on `graph` for `planned` bytes; the
        user's budget: `budget`) the context's plan."""
        decisions = {c["name"]: c["decision"] for c in result["choices"]}
        as_run = dict(zip(("peak_bytes", "peak_node"),
                          as_run_peak(result.pop("timeline"), decisions, profile)))
        as_run["baseline_peak_bytes"] = baseline
        self._prefetch = options["prefetch_regions"]
        self._policies, choices = self._policies_of(result, profile)
        head = self._head_of(result)
        self._head_offload = head == "offload"
        self._head_late = frozenset(profile.head_late_saves)
        self.plan = EagerBudgetPlan(choices=choices, budget_bytes=budget, result=result,
                                    graph=graph, options=options, calibration=calibration,
                                    profile=profile, head=head, as_run=as_run,
                                    planner_budget_bytes=planned)

    # Note [Replanning on the host's speed]. The host lane (Note [The host lane],
    # src/plan/budget_problem.cc) forecasts a step well when it knows the host's time per
    # block call: replayed on T1's recorded runs (v16, v17 on the H100, v18 on the H200:
    # bench/results/2026-12-08-host-lane-replay-cpu.md), each plan with each block's
    # host ms from its last planned step forecast that step within 2.6 %, where the
    # device's forecast missed by up to 19.6 %. But the profiling step's launches do not
    # predict those times: the host's speed moves between the profiling step and the
    # planned ones (Note [Host costs by mode]). So the context plans once more when
    # _REPLAN_AT planned steps have begun, from the step before's (the first planned
    # step learns by position and is slower): its blocks' host ms over what Note [Host
    # costs by mode] gives the decisions they ran give the host's speed now (the median
    # ratio, `scale`), and its forward's host time beyond its block calls (the hooks
    # around them) is spread over the calls. The running plan is simulated with that
    # host, and the planner plans with it; the new plan is taken where its forecast is
    # faster by _REPLAN_MARGIN. It is made once: a host whose speed keeps moving would
    # otherwise move the plan with it. Each plan is exact, so the switch changes no bit;
    # the new plan's first step learns its calls by position again.
    def _host_apart(self) -> bool:
        """Whether the device runs apart from the thread that launches its work (CUDA), as
        the host lane assumes; on the CPU (the fake backend) they are one."""
        return self._device.type == "cuda"

    def _replan_on_host(self) -> None:
        plan = self.plan
        calls, choices = plan.profile.calls, plan.choices
        record: dict = {"planned_step": self._planned_steps, "adopted": False}
        self._host_replan = record
        if not self._host_apart():
            record["skipped"] = "the device runs on the launching thread"
            return
        host = [self._block_host_ms.get(k) for k in range(len(calls))]
        if (any(h is None for h in host) or len(choices) != len(calls)
                or any(not c.forward_host_ms for c in calls) or self._forward_host_ms <= 0):
            record["skipped"] = "a block call without host times"
            return
        graph = json.loads(json.dumps(plan.graph))
        for node in graph["nodes"]:
            node.pop("cpu_ms", None)
        ratios = [mode_ratio(c.saved, c.linear, c.cheap, c.input) for c in choices]
        costs, scale, between = measured_host_lane(graph, plan.profile, ratios, host,
                                                   self._forward_host_ms)
        # The running plan, made again (its graph and options give it bit for bit), with
        # this host instead of any it was made with.
        running = json.loads(_bindings().plan_memory_budget(
            json.dumps(plan.graph), plan.planner_budget_bytes, **plan.planner_options,
            planned_graph=True))
        for node in running["graph"]["nodes"]:
            node.pop("cpu_ms", None)
        decisions = {c["name"]: c["decision"] for c in running["choices"]}
        charged = charge_host(running["graph"], graph, costs, decisions)
        now = self._simulate(json.dumps(charged), running["recomputed_nodes"])
        record.update(scale=round(scale, 4), between_ms=round(between, 4),
                      running_ms=now["step_ms"], running_host_wait_ms=now["host_wait_ms"],
                      running_device_ms=running["forecast"]["step_ms"])
        inputs = max((c.output_bytes for c in calls), default=0)
        try:
            new_options, result = self._fastest_plan(json.dumps(graph),
                                                     plan.planner_budget_bytes, inputs, costs)
        except MemoryError as e:  # the running plan fits: keep it
            record["skipped"] = str(e.with_traceback(None))
            return
        record["replanned_ms"] = result["forecast"]["step_ms"]
        if result["forecast"]["step_ms"] >= (1.0 - _REPLAN_MARGIN) * now["step_ms"]:
            return
        record["adopted"] = True
        self._adopt(new_options, result, graph, plan.calibration, plan.profile,
                    plan.planner_budget_bytes, plan.forecast()["baseline_peak_bytes"],
                    budget=plan.budget_bytes)

    def _time_rebuilds(self, calls: list[BlockCall]) -> None:
        """Each call's cheap_ms: its selective recompute (the profiling step's
        RebuildProbe) run on this device and timed, once per signature, the median of
        _REBUILD_RUNS after a warm-up; where a call has no probe or the device has no room
        for one, the simulator's estimate from the ops' bytes (rebuild_ms). That estimate
        is low for these ops: in the H200 profile of 2026-12-02 (v8), a 19 GiB step whose
        11 blocks rebuild ran 11.8 ms more kernel time than the step without a plan,
        where the estimate gave the rebuilds 6.8 ms."""
        recording = self._profiled[0]
        timed: dict = {}  # signature -> ms (None: no room), shared by both kinds of probe

        def ms_of(probe: RebuildProbe | None) -> float | None:
            if probe is None:
                return None
            if probe.signature not in timed:
                timed[probe.signature] = self._time_probe(probe)
            return timed[probe.signature]

        for k, call in enumerate(calls):
            ms = ms_of(recording.probes.get(k))
            call.cheap_timed = ms is not None
            call.cheap_ms = ms if ms is not None else rebuild_ms(
                self._simulate, *call.cheap_traffic, str(self._device))
            # Linear recipes (Note [Linear recipes]): timed, or not offered (their matmuls
            # have no estimate worth planning on).
            ms = ms_of(recording.linear_probes.get(k))
            call.linear_ms = ms or 0.0
            if ms is None:
                call.linear_bytes = 0

    def _time_probe(self, probe: RebuildProbe) -> float | None:
        try:
            stand_ins = probe.stand_ins(self._device)
            probe.run(stand_ins)  # warm: the allocator's blocks, each kernel's first launch
            marks = []
            for _ in range(_REBUILD_RUNS):
                start = self._clock.mark()
                probe.run(stand_ins)
                marks.append((start, self._clock.mark()))
            if self._clock.cuda:
                torch.cuda.synchronize(self._device)
            return statistics.median(self._clock.ms(a, b) for a, b in marks)
        except torch.OutOfMemoryError:
            return None

    def _measured_profile(self) -> StepProfile:
        """The profiling steps as one StepProfile: bytes, peak and resident memory from
        the first (which counted what blocks save), times from the last when it made the
        same block calls (the first's otherwise)."""
        first = self._profiled[0]
        measured = first.profile(self._grads_per_call(first.calls, first.grads))
        last = self._profiled[-1]
        if last is first:
            return measured
        timed = last.profile(self._grads_per_call(last.calls, last.grads))
        if [c.path for c in timed.calls] != [c.path for c in measured.calls]:
            return measured
        for call, t in zip(measured.calls, timed.calls):
            call.forward_ms, call.backward_ms = t.forward_ms, t.backward_ms
        for name in ("pre_forward_ms", "post_forward_ms", "post_backward_ms",
                     "pre_backward_ms", "step_ms"):
            setattr(measured, name, getattr(timed, name))
        return measured

    @staticmethod
    def _policies_of(result: dict, profile: StepProfile):
        n = len(profile.calls)
        saved, output, cheap, linear = ["keep"] * n, ["keep"] * n, [None] * n, [None] * n
        saved_lag, output_lag, cheap_lag, linear_lag = [None] * n, [None] * n, [None] * n, [None] * n
        first_input, first_input_lag = "keep", None  # X_-1, block 0's input
        for choice in result["choices"]:
            if choice["name"] == "pre_output":
                first_input, first_input_lag = choice["decision"], choice.get("release_lag")
                continue
            m = re.fullmatch(r"b(\d+)_(forward|output|cheap|linear)", choice["name"])
            if m is None:
                continue
            k = int(m.group(1))
            decisions, lags = {"forward": (saved, saved_lag), "output": (output, output_lag),
                               "cheap": (cheap, cheap_lag),
                               "linear": (linear, linear_lag)}[m.group(2)]
            decisions[k] = choice["decision"]
            lags[k] = choice.get("release_lag")
        policies, choices = [], []
        for k, call in enumerate(profile.calls):
            input_decision = output[k - 1] if k > 0 else first_input
            input_lag = output_lag[k - 1] if k > 0 else first_input_lag
            # The planner's lag P waits before region k + P: at the end of call k + P - 1,
            # eager lag P - 1, for S_k and for X_k-1 alike (the graph gives X_k-1 block
            # k's stack: region k). A call has one lag: the larger of its two (a block's
            # input waiting longer than planned holds one hidden state a little longer;
            # its saved tensors waiting too early would stall on their copy).
            lags = []
            if saved[k] == "offload" and saved_lag[k] is not None:
                lags.append(max(0, saved_lag[k] - 1))
            for part, part_lag in ((cheap, cheap_lag), (linear, linear_lag)):
                if part[k] == "offload" and part_lag[k] is not None:
                    lags.append(max(0, part_lag[k] - 1))
            # A block whose rebuildable tensors go their own way runs under a Recorder.
            def apart(part):
                return part is not None and part != saved[k] and saved[k] != "recompute"
            if input_decision == "offload" and input_lag is not None:
                lags.append(max(0, input_lag - 1))
            lag = max(lags) if lags else None
            policies.append(_CallPolicy(checkpoint=saved[k] == "recompute",
                                        offload_saved=saved[k] == "offload",
                                        offload_input=input_decision == "offload", lag=lag,
                                        cheap=cheap[k] if apart(cheap[k]) else None,
                                        linear=linear[k] if apart(linear[k]) else None))
            choices.append(BlockChoice(call=k, block=call.path, saved=saved[k],
                                       input=input_decision, lag=lag,
                                       saved_bytes=call.saved_bytes,
                                       input_bytes=call.input_bytes,
                                       forward_ms=call.forward_ms,
                                       backward_ms=call.plain_backward_ms(),
                                       cheap=cheap[k] or saved[k],
                                       cheap_bytes=call.cheap_bytes,
                                       linear=linear[k] or saved[k],
                                       linear_bytes=call.linear_bytes))
        return policies, choices

    @staticmethod
    def _head_of(result: dict) -> str | None:
        """The plan's decision for the head's late tensors; None: the graph had none."""
        return next((c["decision"] for c in result["choices"] if c["name"] == "head_saved"),
                    None)

    def _release_lag(self, layer) -> int:
        policy, _ = self._layer_policy.get(layer.index, (None, None))
        if policy is None or policy.lag is None:
            return self._lag
        return policy.lag

    def stats(self) -> dict:
        """eager's counters, plus "pass_mode" (plain / profile / checkpoint / plan)."""
        out = super().stats()
        out["pass_mode"] = self._pass_mode
        with self._lock:
            out.update(self._recomputed)
            # Per block call of the planned steps (the latest of each): the host's ms to
            # run its forward, the plan's hooks included (BlockCall.forward_host_ms is the
            # profiling step's, without them).
            out["block_forward_host_ms"] = [round(self._block_host_ms[k], 3)
                                            for k in sorted(self._block_host_ms)]
            if self._host_replan is not None:  # Note [Replanning on the host's speed]
                out["host_replan"] = dict(self._host_replan)
        return out
