"""The block-level graph the eager budget planner plans on (Spillway IR, docs/graph-format.md).

The eager path has no joint graph: it sees a model as a sequence of block
calls. The profiling step (_eager_budget.py) measures, per call, its forward
and backward time, the bytes it saves for backward and its input and output
bytes; this module writes them as a graph whose nodes stand for whole blocks:

    resident, offset                placeholders: bytes live all step
    pre_forward -> pre_saved        the work before the first block (embeddings)
    pre_output  -> X_-1             the first block's input (block 0's module stack)
    per call k (module stack of the block, e.g. ["model.layers.3"]):
      b{k}_input(X_k-1)   -> token  4 bytes, time 0 (see block_graph)
      b{k}_forward(token) -> S_k    everything the block saves for backward,
                                    one uint8 [1, bytes] tensor; time = forward
                                    (where C_k is split off: the rest, and
                                    forward - cheap)
      b{k}_linear(S_k)    -> L_k    where a block has them: the saved tensors
                                    a linear recipe rebuilds (_recipes.py,
                                    Note [Linear recipes]); time = its matmuls
      b{k}_cheap(L_k)     -> C_k    where a block has both: the saved tensors
                                    a selective recompute rebuilds from the
                                    rest (_recipes.py); time = the ops that
                                    rebuild them; its argument S_k where the
                                    block has no L_k
      b{k}_output(C_k)    -> X_k    the block output, time 0, with the module
                                    stack of block k+1 (whose input it is)
                                    (the last of S_k, L_k, C_k the block has)
    post_forward(X_last) -> post_saved; loss(post_saved) -> loss
    post_backward(post_saved, loss) -> G_last; other_param_grads(G_last)
    with the head split (Note [The head's late tensors]):
      head_saved(X_last) -> H        the last block's stack, before post_forward
      post_backward(post_saved, loss) -> token; head_backward(H, token) -> G_last
    per call k, last first:
      b{k}_backward(S_k, X_k-1, G_k) -> G_k-1    time = backward without recompute
                                      (S_k, L_k, C_k: those the block has)
      b{k}_param_grads(G_k-1) -> dW_k            the block's new .grad storages
    pre_backward(pre_saved, G_-1); output(loss, every dW)

The planner's candidates are then S_k (keep / offload / recompute: rebuild
S_k by running b{k}_forward again from X_k-1, i.e. checkpoint the block), C_k
(keep / offload / recompute from S_k: the block runs under _recipes.Recorder;
with S_k recomputed the block is checkpointed whatever C_k's choice, and the
plan counted C_k as held or moved, more than the run holds or moves), L_k
(as C_k; the planner sees it rebuilt from S_k, the run from the cheap set
and the block's weights: the time is the same, the matmuls) and
X_k (keep / offload; X_k-1 offloaded with S_k recomputed is a checkpointed
block whose saved input goes to host memory; X_-1 too, block 0's input) and H
(keep / offload, the head's late tensors). b{k}_output's schema says
`random` only to forbid recomputing X_k: in eager a block output cannot be
rebuilt on its own. b{k}_forward is deterministic as far as the planner is
concerned: torch.utils.checkpoint replays the RNG state.

Note [What a kept block holds]. S_k excludes the storages of the block's
tensor inputs and outputs (they are X_k-1 and X_k) and includes what only
the recipes of a selective recompute hold (BlockCall.extra_bytes: the bf16
input of the second RMSNorm's float copy, which autograd does not save).
The graph holds X_k-1 until b{k}_backward. Both are what a block needs
where the plan rebuilds S_k (X_k-1) or C_k (X_k-1 and the extras) in
backward, and the planner needs them in the graph: a recompute reads only
values backward saves. A block that rebuilds neither and does not save its
input (a bf16 Llama layer saves its RMSNorm's float copy, not the input)
holds neither: on T1 128 MiB per such block, the 2.0 GiB by which the graph
over-forecast the measured no-offload peak (34.74 against 32.74 GiB, H200
v12) and 1.37 GiB at the 24.6 GiB budget. Plans are made on the graph
(conservative), and the peak they forecast is as_run_peak's: the planned
timeline without those bytes, which gave every peak of the v7-v12 runs to
the MiB.

Known approximations (see the report of issue 10's eager item):
  * The backward around the blocks (the loss and head, the embeddings) is
    measured as one span each; without a measurement, twice the forward.

Thread-safety: pure functions over their arguments.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field

NAMESPACE = "eager_block"

_OPS = {
    # name: (argument names, random)
    "pre": (["resident"], False),
    "input": (["input"], False),
    "forward": (["input"], False),
    "cheap": (["saved"], False),
    "linear": (["saved"], False),
    "output": (["saved"], True),  # never recomputed: see the module docstring
    "post": (["input"], False),
    "loss": (["saved"], True),
    "post_backward": (["saved", "loss"], False),
    "head_backward": (["saved", "grad_output"], False),
    "backward": (["saved", "input", "grad_output"], False),
    "backward_split": (["saved", "cheap", "input", "grad_output"], False),
    "backward_split_linear": (["saved", "linear", "cheap", "input", "grad_output"], False),
    "param_grads": (["grad_input"], False),
    "pre_backward": (["saved", "grad_output"], False),
    # Note [Where the step peaks]: memory a stretch's nodes take while they run.
    "transient": (["anchor"], True),
}
# The nodes that run beside a transient: their op with it as one more argument.
_OPS.update({f"{name}_transient": (_OPS[name][0] + ["transient"], _OPS[name][1])
             for name in ("post", "post_backward", "backward", "backward_split",
                          "backward_split_linear")})


@dataclass
class BlockCall:
    """What the profiling step measured for one call of one block."""

    block: int                 # index into the context's block list
    path: str                  # the block's qualified module name
    forward_ms: float = 0.0
    backward_ms: float | None = None  # recompute + backward as measured; None: unknown
    saved_bytes: int = 0       # unique storages saved, inputs/outputs/parameters excluded
    input_bytes: int = 0       # the storage of its first tensor input (the hidden state)
    output_bytes: int = 0      # the storage of its first tensor output
    new_grad_bytes: int = 0    # .grad storages its backward allocates (grads None before)
    # Of saved_bytes, the storages a selective recompute rebuilds from the rest
    # (_recipes.py), and the time of the ops that rebuild them.
    cheap_bytes: int = 0
    cheap_ms: float = 0.0
    cheap_traffic: tuple[int, int] = (0, 0)  # bytes its ops move, op count
    cheap_timed: bool = False  # cheap_ms timed on the device; else estimated from cheap_traffic
    # Of saved_bytes, apart from cheap_bytes: the storages a linear recipe rebuilds from
    # the rest and the cheap set (_recipes.py, Note [Linear recipes]), and the time of the
    # matmuls that rebuild them, timed on the device (untimed: linear_bytes is 0).
    linear_bytes: int = 0
    linear_ms: float = 0.0
    # Note [What a kept block holds]: of saved_bytes, the storages only the recipes hold
    # (the bf16 input of an RMSNorm's float copy, which autograd does not save); whether
    # autograd saves the storage of the block's first input. None: not measured (a
    # profile recorded before 2026-12-06).
    extra_bytes: int = 0
    saves_input: bool | None = None
    # The launching thread's time (perf_counter) for the block's forward as the profiling
    # step ran it (checkpointed: no saves), and for its recompute in that step's backward
    # (under the Recorder, each save classified). The host lane scales the first by
    # Note [Host costs by mode] (host_lane); Note [The host's share] (_eager_budget.py).
    # None: not measured.
    forward_host_ms: float | None = None
    recorded_host_ms: float | None = None

    def plain_backward_ms(self) -> float:
        """Backward time without the checkpoint's recompute (measured as recompute + backward)."""
        if self.backward_ms is None:
            return 2.0 * self.forward_ms
        return max(0.0, self.backward_ms - self.forward_ms)


@dataclass
class StepProfile:
    """The profiling step: its block calls in forward order and the rest of the step."""

    calls: list[BlockCall] = field(default_factory=list)
    pre_forward_ms: float = 0.0    # model start to the first block
    post_forward_ms: float = 0.0   # the last block to the model's end
    pre_saved_bytes: int = 0       # saved outside blocks before the first block
    post_saved_bytes: int = 0      # saved outside blocks after the first block started
    other_new_grad_bytes: int = 0  # .grad storages of parameters outside the blocks
    resident_bytes: int = 0        # allocated at the step's start
    measured_peak_bytes: int | None = None  # max allocated over the step (CUDA only)
    # Measured backward around the blocks (None: unknown, twice the forward):
    # from the first gradient reaching a model output to the last block's
    # output, and from the first block's input to the end of backward.
    post_backward_ms: float | None = None
    pre_backward_ms: float | None = None
    step_ms: float | None = None   # the model call's start to the end of backward
    # CUDA: the peak allocated bytes of the step's three stretches (Note [Where the step
    # peaks]): to the model's end, from there to the last block's backward, the rest.
    segment_peak_bytes: tuple[int, int, int] | None = None
    # Note [The head's late tensors]: of post_saved_bytes, the storages saved in the model
    # call after the last block that backward reads only after the gradient has reached
    # the model's output, and the positions of their saves among the saves after the
    # last block (parameters included), which the plan's step counts to find them again.
    head_late_bytes: int = 0
    head_late_saves: tuple[int, ...] = ()


def graph_block_paths(paths: list[str]) -> list[list[str]]:
    """The module stack each block's nodes carry.

    The planner finds repeated blocks as module paths that end in a list
    index under one parent ("model.layers.3"). Blocks named that way keep
    their own path; others (the children of an nn.Sequential, "0"; a scope
    such as "model.layers.3.self_attn") sit under "blocks.<i>" with their own
    path below it.
    """
    parents = {m.group(1) for m in (re.fullmatch(r"(.+)\.\d+", p) for p in paths) if m}
    if len(parents) == 1 and all(re.fullmatch(r".+\.\d+", p) for p in paths):
        return [[p] for p in paths]
    return [[f"blocks.{i}", p] for i, p in enumerate(paths)]


class _Writer:
    def __init__(self, device: str):
        self.nodes: list[dict] = []
        self.device = device

    def tensor(self, nbytes: int, storage: int) -> dict:
        n = max(0, int(nbytes))
        return {"type": "tensor", "dtype": "uint8", "element_size": 1, "sizes": [1, n],
                "strides": [n, 1], "contiguous": True, "storage": storage,
                "device": self.device, "dtensor": False}

    def add(self, name: str, kind: str, target: str, args: list, phase: str,
            stack: list[str], nbytes: int | None, time_ms: float | None = None) -> int:
        node_id = len(self.nodes)
        node = {"id": node_id, "name": name, "kind": kind, "target": target,
                "args": [{"node": a} if isinstance(a, int) else a for a in args],
                "kwargs": {}, "phase": phase, "module_stack": stack,
                "value": {"type": "none"} if nbytes is None else self.tensor(nbytes, node_id)}
        if time_ms is not None:
            node["time_ms"] = float(max(0.0, time_ms))
        self.nodes.append(node)
        return node_id

    def op(self, name: str, args: list, phase: str, stack: list[str], nbytes: int | None,
           time_ms: float = 0.0, node_name: str | None = None) -> int:
        return self.add(node_name or name, "call_function", f"{NAMESPACE}.{name}.default", args,
                        phase, stack, nbytes, time_ms)


def _measured_or_twice(backward_ms: float | None, forward_ms: float) -> float:
    return 2.0 * forward_ms if backward_ms is None else backward_ms


def block_graph(profile: StepProfile, *, resident_bytes: int, offset_bytes: int,
                checkpointed: bool = False, device: str = "cuda:0",
                transients: tuple[int, int, int] = (0, 0, 0)) -> dict:
    """The block graph of `profile` as a JSON-ready dict.

    resident_bytes / offset_bytes: the two placeholders' sizes (see
    calibration_offset); the .grad storages backward allocates are the
    profile's new_grad_bytes. checkpointed: every block recomputes S_k in backward (a
    b{k}_recompute node before b{k}_backward), the profiling step itself;
    recomputed_ids() lists those nodes for the simulator. transients: bytes the
    head's forward, the loss's backward and each block's backward take while they
    run beyond what the graph holds (Note [Where the step peaks]; 0: no node).
    """
    t_forward, t_loss, t_block = (max(0, int(t)) for t in transients)
    w = _Writer(device)
    stacks = graph_block_paths([c.path for c in profile.calls])
    resident = w.add("resident", "placeholder", "resident", [], "forward", [], resident_bytes)
    offset = w.add("offset", "placeholder", "offset", [], "forward", [], offset_bytes)
    first_input = profile.calls[0].input_bytes if profile.calls else 0
    pre_saved = w.op("pre", [resident], "forward", [], profile.pre_saved_bytes,
                     profile.pre_forward_ms, "pre_forward")
    # X_-1 carries block 0's stack: the planner may offload it like every block's input.
    x = w.op("output", [pre_saved], "forward", stacks[0] if stacks else [], first_input, 0.0,
             "pre_output")
    inputs, saved = [], []
    for k, call in enumerate(profile.calls):
        inputs.append(x)
        # The block reads its input through a 4-byte token: X_k-1's last forward use is
        # then the token, so an offload of X_k-1, whose forward wait takes that last use
        # as an argument (offload_rewrite.h), does not hold S_k up to it.
        token = w.op("input", [x], "forward", stacks[k], 4, 0.0, f"b{k}_input")
        # The parts S_k, L_k, C_k that the block has, each made from the one before.
        rest = call.saved_bytes - call.cheap_bytes - call.linear_bytes
        apart = [(name, nbytes, ms) for name, nbytes, ms in (
                     ("linear", call.linear_bytes, call.linear_ms),
                     ("cheap", call.cheap_bytes, call.cheap_ms)) if nbytes > 0]
        if checkpointed or rest <= 0 or not apart:
            apart = []
        parts = [w.op("forward", [token], "forward", stacks[k],
                      rest if apart else call.saved_bytes,
                      max(0.0, call.forward_ms - sum(ms for _, _, ms in apart)),
                      f"b{k}_forward")]
        for name, nbytes, ms in apart:
            parts.append(w.op(name, [parts[-1]], "forward", stacks[k], nbytes, ms,
                              f"b{k}_{name}"))
        saved.append(parts)
        # X_k is the next block's input: it carries that block's stack, so the planner's
        # regions (release lag, reload lead) count from the block that saves it.
        x_stack = stacks[k + 1] if k + 1 < len(profile.calls) else stacks[k]
        x = w.op("output", [parts[-1]], "forward", x_stack, call.output_bytes, 0.0,
                 f"b{k}_output")
    def transient(nbytes: int, phase: str, stack: list[str], name: str) -> list[int]:
        return [w.op("transient", [resident], phase, stack, nbytes, 0.0, name)] if nbytes else []

    late_bytes = min(max(0, profile.head_late_bytes), profile.post_saved_bytes)
    late = ([w.op("output", [x], "forward", stacks[-1], late_bytes, 0.0, "head_saved")]
            if late_bytes and stacks else [])
    head = transient(t_forward, "forward", [], "post_forward_transient")
    post_saved = w.op("post_transient" if head else "post", [x, *head], "forward", [],
                      profile.post_saved_bytes - (late_bytes if late else 0),
                      profile.post_forward_ms, "post_forward")
    loss = w.op("loss", [post_saved], "forward", [], 4, 0.0, "loss")
    last_out = profile.calls[-1].output_bytes if profile.calls else first_input
    tail = transient(t_loss, "backward", [], "post_backward_transient")
    grad = w.op("post_backward_transient" if tail else "post_backward",
                [post_saved, loss, *tail], "backward", [], 4 if late else last_out,
                _measured_or_twice(profile.post_backward_ms, profile.post_forward_ms),
                "post_backward")
    if late:
        grad = w.op("head_backward", [late[0], grad], "backward", [], last_out, 0.0)
    grads = [w.op("param_grads", [grad], "backward", [],
                  profile.other_new_grad_bytes, 0.0, "other_param_grads")]
    for k in reversed(range(len(profile.calls))):
        call = profile.calls[k]
        parts = saved[k]
        if checkpointed:
            token = w.op("input", [inputs[k]], "backward", stacks[k], 4, 0.0,
                         f"b{k}_recompute_input")
            # The profiling step: no block split, everything rebuilt.
            parts = [w.op("forward", [token], "backward", stacks[k], call.saved_bytes,
                          call.forward_ms, f"b{k}_recompute")]
        grad_in_bytes = profile.calls[k - 1].output_bytes if k > 0 else first_input
        own = transient(t_block, "backward", stacks[k], f"b{k}_transient")
        suffix = "_transient" if own else ""
        # Two parts: S_k and C_k or L_k (backward_split's second argument is either).
        op = {1: "backward", 2: "backward_split", 3: "backward_split_linear"}[len(parts)]
        grad = w.op(f"{op}{suffix}", [*parts, inputs[k], grad, *own], "backward", stacks[k],
                    grad_in_bytes, call.plain_backward_ms(), f"b{k}_backward")
        grads.append(w.op("param_grads", [grad], "backward", stacks[k],
                          call.new_grad_bytes, 0.0, f"b{k}_param_grads"))
    done = w.op("pre_backward", [pre_saved, grad], "backward", [], 4,
                _measured_or_twice(profile.pre_backward_ms, profile.pre_forward_ms))
    w.add("output", "output", "output", [[{"node": n} for n in [loss, offset, done, *grads]]],
          "backward", [], None)
    ops = {f"{NAMESPACE}.{name}.default": {
        "namespace": NAMESPACE, "mutable": False, "view": False,
        **({"random": True} if random else {}),
        "arguments": [{"name": a} for a in args]} for name, (args, random) in _OPS.items()}
    return {"format": "spillway.graph", "version": 1,
            "name": "eager block graph" + (" (every block checkpointed)" if checkpointed else ""),
            "metadata": {"exporter": "spillway.activations._budget_graph/1",
                         "blocks": str(len(profile.calls))},
            "ops": ops, "nodes": w.nodes}


# Note [Host costs by mode]. The host lane (Note [The host lane],
# src/plan/budget_problem.cc) needs, per block call, what launching it costs the host
# under each decision. The profiling step measures one launch per call: the block
# checkpointed (BlockCall.forward_host_ms, P). The costs of the other ways are P times
# these ratios, fitted (non-negative least squares, one ratio per way of launching, the
# first and last block left out) to the per-block host ms of every planned step of the
# T1 runs v16, v17 (H100) and v18 (H200): 294 blocks. The fit's median error per block
# is 28 % (90th percentile 90 %): the host's speed moves within a process between the
# profiling step and the planned ones (v18's 15 GiB run launched checkpointed blocks in
# 1.6 ms while profiling, then rebuilt blocks in 7.5-10.9 ms). The figures are a cost
# model, not a measurement of the running process; _eager_budget._HOST_LANE uses them.
HOST_RATIOS = {
    "keep": 0.76,            # every save kept, by position
    "checkpointed": 1.23,    # S_k recomputed: the block runs under a checkpoint
    "saved_offload": 0.75,   # + S_k offloaded
    "linear_offload": 0.26,  # + L_k offloaded (also C_k offloaded: a few storages)
    "linear_rebuild": 0.0,   # + L_k rebuilt by its recipes
    "cheap_rebuild": 1.49,   # + C_k rebuilt by its recipes
    "input_offload": 0.12,   # + the block's input offloaded
}


def mode_ratio(saved: str, linear: str | None, cheap: str | None, input: str) -> float:
    """A block call's host time under these decisions (BlockChoice's fields) over its
    checkpointed launch's, by Note [Host costs by mode]."""
    r = HOST_RATIOS
    if saved == "recompute":
        ratio = r["checkpointed"]
    else:
        ratio = r["keep"] + (r["saved_offload"] if saved == "offload" else 0.0)
        for part, rebuild in ((linear, "linear_rebuild"), (cheap, "cheap_rebuild")):
            ratio += {"offload": r["linear_offload"], "recompute": r[rebuild]}.get(part, 0.0)
    return ratio + (r["input_offload"] if input == "offload" else 0.0)


def host_lane(graph: dict, profile: StepProfile, *, scale: float = 1.0,
              between_ms: float = 0.0) -> list[dict]:
    """Writes each block call's host time as cpu_ms onto `graph` (block_graph's dict)
    and returns the decisions' host costs (BudgetOptions::host_costs as JSON-ready
    dicts) by Note [Host costs by mode], each forward_host_ms times `scale` (the
    host's speed as measured since: Note [Replanning on the host's speed] in
    _eager_budget.py), plus `between_ms` a call whatever its decisions (the host's
    time between block calls: the hooks around them). Writes nothing and returns []
    where a call has no forward_host_ms: the planner then does not model the host."""
    if not profile.calls or any(c.forward_host_ms is None for c in profile.calls):
        return []
    nodes = {n["name"]: n for n in graph["nodes"]}
    r = HOST_RATIOS
    costs = []
    for k, call in enumerate(profile.calls):
        p = call.forward_host_ms * scale
        forward = f"b{k}_forward"
        nodes[forward]["cpu_ms"] = r["keep"] * p + between_ms
        costs.append({"value": forward, "offload_ms": r["saved_offload"] * p,
                      "recompute_ms": (r["checkpointed"] - r["keep"]) * p})
        for part, rebuild in (("linear", "linear_rebuild"), ("cheap", "cheap_rebuild")):
            if f"b{k}_{part}" in nodes:
                costs.append({"value": f"b{k}_{part}", "offload_ms": r["linear_offload"] * p,
                              "recompute_ms": r[rebuild] * p, "unless_recomputed": forward})
        # X_k, block k+1's input (the last one's is the head's: charged at its producer).
        output = "pre_output" if k == 0 else f"b{k - 1}_output"
        costs.append({"value": output, "offload_ms": r["input_offload"] * p})
    return costs


def measured_host_lane(graph: dict, profile: StepProfile, ratios: list[float],
                       block_host_ms: list[float], forward_host_ms: float
                       ) -> tuple[list[dict], float, float]:
    """host_lane at the host's speed as a planned step measured it (Note [Replanning on
    the host's speed], _eager_budget.py): `ratios` are mode_ratio of each call's
    decisions, `block_host_ms` each call's host ms in that step and `forward_host_ms`
    its whole forward's. Returns the host costs, the scale (the median of each call's
    measured over modelled ms) and the host ms a call takes outside its block call
    (the forward's time beyond them, spread evenly)."""
    scale = statistics.median(h / (r * c.forward_host_ms)
                              for h, r, c in zip(block_host_ms, ratios, profile.calls))
    between = max(0.0, forward_host_ms - sum(block_host_ms)) / len(profile.calls)
    return host_lane(graph, profile, scale=scale, between_ms=between), scale, between


def charge_host(planned: dict, graph: dict, costs: list[dict], decisions: dict) -> dict:
    """`planned` (a plan's rewritten graph, plan_memory_budget's planned_graph) with the
    host times of `graph` (host_lane's) and each decision's cost added at its producer,
    as the planner charges them (Note [The host lane]): the plan simulated on a host
    model it was not made with. Changes and returns `planned`."""
    by_name = {n["name"]: n for n in planned["nodes"]}
    for node in graph["nodes"]:
        if "cpu_ms" in node:
            by_name[node["name"]]["cpu_ms"] = node["cpu_ms"]
    for cost in costs:
        if decisions.get(cost.get("unless_recomputed")) == "recompute":
            continue
        added = {"offload": cost.get("offload_ms", 0.0),
                 "recompute": cost.get("recompute_ms", 0.0)}.get(
                     decisions.get(cost["value"], "keep"), 0.0)
        node = by_name[cost["value"]]
        node["cpu_ms"] = max(0.0, node.get("cpu_ms", 0.0) + added)
    return planned


def rebuild_ms(simulate, traffic: int, ops: int, device: str) -> float:
    """The time of `ops` pointwise ops moving `traffic` bytes (a selective recompute,
    _recipes.py), as the simulator estimates an op it has no time for: bytes at the
    device profile's memory bandwidth, plus a launch each. (Timing the rebuild in the
    profiling step would time the Python that records it.)
    simulate(graph_json, recomputed) -> dict is the simulator binding."""
    if ops <= 0:
        return 0.0
    w = _Writer(device)
    x = w.add("x", "placeholder", "x", [], "forward", [], max(1, traffic // 2))
    w.op("cheap", [x], "forward", [], traffic - traffic // 2, None, "rebuild")
    graph = {"format": "spillway.graph", "version": 1, "name": "rebuild probe",
             "ops": {f"{NAMESPACE}.cheap.default": {"namespace": NAMESPACE, "mutable": False,
                                                    "view": False, "pointwise": True,
                                                    "arguments": [{"name": "saved"}]}},
             "nodes": w.nodes}
    one = simulate(json.dumps(graph), [])["step_ms"]
    w.nodes[1]["value"]["sizes"] = [1, 0]
    w.nodes[0]["value"]["sizes"] = [1, 0]
    launch = simulate(json.dumps(graph), [])["step_ms"]
    return one + (ops - 1) * launch


def as_run_peak(timeline: list[dict], decisions: dict[str, str],
                profile: StepProfile) -> tuple[int, str | None]:
    """(peak bytes, node) of a planned block graph as the run holds them (Note [What a
    kept block holds]): the planned step's timeline (plan_memory_budget's or
    simulate_graph's, with timeline=True) less, from b{k}_output to b{k}_backward, for
    each block whose plan rebuilds neither S_k nor C_k (a linear recipe holds neither
    X_k-1 nor extras: Note [Linear recipes]): X_k-1 where the block does not
    save its input and the plan keeps X_k-1 (an offloaded one's device bytes stay), and
    the extras where the plan keeps S_k. decisions: candidate name -> decision (absent:
    keep). A profile without the measurement (saves_input None) changes nothing."""
    phantom: dict[int, int] = {}
    for k, call in enumerate(profile.calls):
        saved = decisions.get(f"b{k}_forward", "keep")
        if saved == "recompute" or decisions.get(f"b{k}_cheap") == "recompute":
            continue
        x = decisions.get(f"b{k - 1}_output" if k else "pre_output", "keep")
        nbytes = call.input_bytes if call.saves_input is False and x == "keep" else 0
        if saved == "keep" and call.saves_input is not None:
            nbytes += call.extra_bytes
        if nbytes:
            phantom[k] = nbytes
    starts = {f"b{k}_output": n for k, n in phantom.items()}
    ends = {f"b{k}_backward": n for k, n in phantom.items()}
    held, peak, where = 0, -1, None
    for entry in timeline:
        name = entry["name"]
        held += starts.get(name, 0)
        live = entry["live_bytes"] - held
        if live > peak:
            peak, where = live, name
        held -= ends.get(name, 0)
    return peak, where


def recomputed_ids(graph: dict) -> list[int]:
    """The b{k}_recompute nodes of a checkpointed block graph."""
    return [n["id"] for n in graph["nodes"] if re.fullmatch(r"b\d+_recompute(_input)?", n["name"])]


def calibration_offset(simulate, profile: StepProfile, device: str) -> tuple[int, dict]:
    """The offset placeholder's bytes that make the graph match the measured step.

    The block graph knows what blocks save and what they pass on, not the
    transient memory of the work around them (logits and their float copy in
    the loss, the loss gradient, the allocator's slack) nor the bytes a block
    allocates while it runs. One constant stands for all of it: the offset
    placeholder, live the whole step, sized so that the simulated peak of the
    profiling step as it ran (every block checkpointed, the resident bytes of
    its start, its .grad storages allocated in backward) equals the measured
    peak (the facts also hold the step's measured and simulated time: the
    block times tile the step, so the two differ by the gaps between marks,
    e.g. work between the model's return and backward). A constant shifts every plan's peak by the same amount; it is exact
    for plans whose peak falls where the profiling step's did (the end of
    forward or the loss, for a transformer) and errs on the safe side
    elsewhere. Without a measured peak (CPU) the offset is 0.

    The offset may come out negative (the graph overestimates); the caller
    then takes it off the resident placeholder (placeholder_bytes).
    simulate(graph_json, recomputed) -> dict is the simulator binding.
    Returns (offset, facts for the plan's report).
    """
    graph = block_graph(profile, resident_bytes=profile.resident_bytes, offset_bytes=0,
                        checkpointed=True, device=device)
    result = simulate(json.dumps(graph), recomputed_ids(graph))
    simulated = result["peak_bytes"]
    offset = 0 if profile.measured_peak_bytes is None else (
        profile.measured_peak_bytes - simulated)
    return offset, {"measured_peak_bytes": profile.measured_peak_bytes,
                    "simulated_peak_bytes": simulated, "offset_bytes": offset,
                    "measured_step_ms": profile.step_ms,
                    "simulated_step_ms": result["step_ms"]}


def calibrate(simulate, profile: StepProfile, device: str
              ) -> tuple[int, tuple[int, int, int], dict]:
    """(offset placeholder bytes, transients for block_graph, facts for the plan's report).

    Note [Where the step peaks]: one whole-step offset (calibration_offset) stands
    for the loss backward's float logits and their gradients, 3.85 GiB on T1, at
    every node of the step. A plan whose peak falls elsewhere is then forecast with
    memory that is not there: on the H200 (v6, 24.6 GiB) the simulated peak was
    the head's forward, with a block's 864 MiB offload still in flight and the
    loss backward's 3.85 GiB beside it, 2.2 GiB above the measured peak. Where
    the profiling step measured the peaks of its three stretches
    (StepProfile.segment_peak_bytes: to the model's end, from there to the last
    block's backward, the rest), each stretch gets what its simulation lacks
    where it happens instead: a transient of the head's forward node
    (post_forward), of the loss's backward node (post_backward) and of every
    block's backward, each the measured peak of its stretch less what the
    profiling step's graph holds live at that node (at the fullest block
    backward for the blocks), never below 0; the offset is then 0. Without
    them (CPU, or a profile recorded before), calibration_offset's one constant.
    simulate(graph_json, recomputed, timeline=...) -> dict is the simulator binding.
    """
    if profile.segment_peak_bytes is None:
        offset, facts = calibration_offset(simulate, profile, device)
        return offset, (0, 0, 0), facts
    graph = block_graph(profile, resident_bytes=profile.resident_bytes, offset_bytes=0,
                        checkpointed=True, device=device)
    result = simulate(json.dumps(graph), recomputed_ids(graph), timeline=True)
    live = {p["name"]: p["live_bytes"] + p["scratch_bytes"] for p in result["timeline"]}
    blocks = [v for name, v in live.items() if re.fullmatch(r"b\d+_backward", name)]
    forward, loss, rest = profile.segment_peak_bytes
    transients = (max(0, forward - live["post_forward"]), max(0, loss - live["post_backward"]),
                  max(0, rest - max(blocks, default=0)))
    calibrated = block_graph(profile, resident_bytes=profile.resident_bytes, offset_bytes=0,
                             checkpointed=True, device=device, transients=transients)
    check = simulate(json.dumps(calibrated), recomputed_ids(calibrated))
    return 0, transients, {"measured_peak_bytes": profile.measured_peak_bytes,
                           "segment_peak_bytes": list(profile.segment_peak_bytes),
                           "transient_bytes": list(transients),
                           "simulated_peak_bytes": check["peak_bytes"], "offset_bytes": 0,
                           "measured_step_ms": profile.step_ms,
                           "simulated_step_ms": check["step_ms"]}


def placeholder_bytes(resident: int, offset: int) -> tuple[int, int]:
    """(resident placeholder, offset placeholder) for a signed calibration offset."""
    if offset >= 0:
        return resident, offset
    return max(0, resident + offset), 0
