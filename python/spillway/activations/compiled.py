"""Activation offload under torch.compile: the compiled-graph pass.

    import spillway
    from spillway.activations import compiled
    model = spillway.compile(model, scope="self_attn", min_bytes=1 << 20)  # compiled.compile
    loss = model(ids, labels=ids).loss
    loss.backward()
    compiled.last_plans()   # what each compiled joint graph planned

For every joint forward+backward graph that aot_autograd builds, the pass
exports the graph to the Spillway IR (spillway.fx_export), asks the C++
planner (spillway._C.plan_activation_offload) which saved activations move to
host memory, and replays the plan's edits on the FX graph with
torch.ops.spillway.{offload, wait_tensor, reload}, before the partitioner
splits it. The forward then saves the host copy instead of the activation.

Where the pass hooks in (Note [Joint hook]):
  * backend="inductor": Inductor's joint_custom_post_pass (torch._inductor.config),
    which runs on the joint graph inside Inductor's partition_fn, after
    Inductor's own joint passes and right before the min-cut partitioner. The
    nodes still carry meta["val"], nn_module_stack and the partitioner tags
    (is_forward / is_backward) that the exporter reads.
  * backend="aot_eager": an aot_autograd backend whose partition_fn runs the
    same pass and then the min-cut partitioner (what torch's aot_eager uses),
    with no-op forward/backward compilers. For debugging the edits without
    Inductor.
Both bypass Inductor's FX graph cache and AOTAutograd's cache (the pass has no
cache key), so each compile re-plans and last_plans() sees every graph.

Note [Keepalive under Inductor]: the offload's D2H is asynchronous, and
Inductor frees or reuses a buffer right after its last reader in the graph.
The forward wait takes the offloaded value as `keepalive`, so the value's
buffer stays live (and unreused) until the wait. Inductor output code
(TORCH_LOGS=output_code) for the tiny Llama shows exactly that: each offload
source appears again as the wait's keepalive and is deleted or reused only
after it; the backward keeps the saved host tensor until the reload's wait.
A view is the exception: to meet an op's stride contract Inductor may lay
it out in a buffer written for the offload alone (dense_storages: the permute
of rotary Q, computed in a pointwise kernel), which the keepalive, naming the
FX value, would not cover; with that buffer reused before the wait, the tiny
Llama's gradients were off by ~3e-3 under injected copy delays. So under
Inductor the offload and wait are lowered by _compiled_inductor.py: the
offload reads a buffer realised contiguous, and its wait keeps that very
buffer alive.

Dynamic shapes: the exporter and the edits read size hints only, with guard
recording suppressed; unbacked sizes are never offloaded (the planner's
unknown_size rule). The pass adds no guard.

Scope and graph breaks: a model whose forward Dynamo splits into several
graphs (Hugging Face GPT-2 called with labels breaks at the loss function)
compiles one joint graph per piece, and a piece may hold no scope module at
all (the loss alone). Such a graph plans nothing and is left unchanged; its
plan says so (CompiledPlan.scope_in_graph). A scope that matches no module of
the model is an error at compile() (for a plain function, whose modules are
unknown up front, a warning names each graph without a scope module).

Errors: a bad option (a value of the wrong type or out of range, an unknown
backend, a scope naming no module of the model: the message lists the
model's modules) raises ValueError from compile() at once; a graph the
planner refuses raises the planner's ValueError from the first call that
compiles it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import warnings
from typing import Any, Callable

import torch
import torch.fx

from spillway import _C
from spillway._budget import budget_bytes, parse_memory_budget
from spillway import ops as _ops  # registers the fake kernels  # noqa: F401
from spillway.activations._compiled_apply import EditReplayer
from spillway.activations._compiled_cse import merge_common_subexpressions
from spillway.activations._module_labels import leaf_name, module_labels
from spillway.fx_export import export_graph_module
from spillway.fx_export._serialize import _hint_of

__all__ = ["CompiledPlan", "compile", "last_plans", "spillway_op_counts"]

_SPILLWAY_OPS = {
    torch.ops.spillway.offload.default: "offload",
    torch.ops.spillway.reload.default: "reload",
    torch.ops.spillway.wait_tensor.default: "wait_tensor",
}


@dataclasses.dataclass
class CompiledPlan:
    """What the pass planned for one compiled joint graph, and where the edits landed.

    plan: the planner's JSON as a dict (the fields of `spillway plan --json`:
    decisions with rule names, offloads, replays, counts; plus edit_list).
    forward_ops / backward_ops: spillway ops per name ("offload", "reload",
    "wait_tensor") in the forward and backward graph modules handed to the
    compiler (filled in when those graphs are compiled).
    forward_outputs: names of the forward graph's outputs: the model's outputs,
    then what the forward saves for backward (a chosen activation's forward
    wait, "spillway_wait_offload_<name>", is saved instead of the activation).
    forward_output_bytes: bytes of each of forward_outputs (as forward_outputs;
    0 where the graph carries no tensor metadata or the output is no tensor).
    forward_replays / backward_replays: names of the replayed nodes
    ("spillway_replay_<name>": views and, with replay_pointwise, pointwise
    ops rebuilt from reloads) in the forward and backward graphs.
    scope_in_graph: whether a module of the scope runs in this graph; when not
    (a piece of a model split by a graph break), the graph is left unchanged.
    """

    plan: dict
    forward_ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    backward_ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    forward_outputs: list[str] = dataclasses.field(default_factory=list)
    forward_output_bytes: list[int] = dataclasses.field(default_factory=list)
    forward_replays: list[str] = dataclasses.field(default_factory=list)
    backward_replays: list[str] = dataclasses.field(default_factory=list)
    scope_in_graph: bool = True
    # memory_budget mode: the budget planner's result for this graph (the
    # JSON of spillway._C.plan_memory_budget as a dict), and where the
    # partitioned forward departs from it (filled in when the forward compiles).
    budget: dict | None = None
    departures: list[str] = dataclasses.field(default_factory=list)
    # memory_budget mode: the joint graph's storage id per node name, and how
    # many of the forward's outputs are the model's (the rest it saves), for
    # matching what the forward saves to the plan by storage.
    joint_storages: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)
    model_outputs: int = 0
    # memory_budget mode: bytes the step holds outside this graph
    # (spillway.compile's grads_kept), taken off the budget before planning.
    outside_bytes: int = 0

    def forecast(self) -> dict:
        """What the budget planner predicts for this graph's step: step_ms, peak_bytes,
        peak_node, peak_phase, bytes_offloaded, bytes_recomputed, recompute_ms,
        compute_wait_ms, and the budget. ValueError outside memory_budget mode."""
        if self.budget is None:
            raise ValueError("[compiled] forecast() needs spillway.compile(..., memory_budget=...)")
        forecast = dict(self.budget["forecast"], budget_bytes=self.budget["budget_bytes"],
                        baseline=self.budget["baseline"], outside_bytes=self.outside_bytes)
        # The step's peak as the allocator sees it: the graph's, plus what the
        # graph does not hold and the step does (grads_kept).
        forecast["peak_bytes"] += self.outside_bytes
        return forecast

    def chrome_trace(self, path: str) -> None:
        """Writes the simulated step of this graph's plan as a Chrome trace (Perfetto)."""
        self._write("chrome_trace", path)

    def memory_svg(self, path: str) -> None:
        """Writes the picture of live device memory over the simulated step."""
        self._write("memory_svg", path)

    def _write(self, key: str, path: str) -> None:
        if self.budget is None or key not in self.budget:
            raise ValueError(f"[compiled] {key}() needs spillway.compile(..., memory_budget=...)")
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.budget[key])

    @property
    def chosen(self) -> list[str]:
        """Names of the offloaded activations, largest first."""
        return [o["name"] for o in self.plan["offloads"]]

    @property
    def bytes_offloaded(self) -> int:
        """Bytes the plan moves to host (replayed values excluded)."""
        return int(self.plan["bytes_offloaded"])

    @property
    def replayed(self) -> list[str]:
        """Names of the values recomputed in backward instead of moved, graph order."""
        return [r["name"] for r in self.plan.get("replays", [])]

    @property
    def bytes_replayed(self) -> int:
        """Bytes of the replayed values: what the forward no longer saves, unmoved."""
        return int(self.plan.get("bytes_replayed", 0))


def spillway_op_counts(graph: torch.fx.Graph) -> collections.Counter:
    """How many offload / reload / wait_tensor nodes `graph` has."""
    return collections.Counter(
        _SPILLWAY_OPS[n.target] for n in graph.nodes
        if n.op == "call_function" and n.target in _SPILLWAY_OPS)


class _PlanRejected(Exception):
    """The planner refused a graph (ValueError); carried out of the compiler stack."""

    def __init__(self, error: ValueError) -> None:
        super().__init__(str(error))
        self.error = error


def _find_rejection(error: BaseException) -> _PlanRejected | None:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, _PlanRejected):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _raise_on_call(error: ValueError) -> Callable[..., Any]:
    """A compiled callable that raises `error` on every call.

    Dynamo wraps an exception raised while compiling into BackendCompilerFailed;
    a planner refusal is a configuration error the caller should see as the
    planner's ValueError, so the backend returns this instead, and the call
    that triggered the compile (and any later one) raises it.
    """

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise ValueError(str(error))

    return refuse


# Note [Recomputing values used far apart]: torch's min-cut partitioner saves
# a fusible value whose forward and backward uses are far apart rather than
# recompute it (config.ban_recompute_used_far_apart, on by default). Recomputed,
# such a value is rebuilt inside the backward kernel that reads it, in fp32,
# from what the forward computed it from; saved, it was rounded to its 16-bit
# dtype when written. On T1 (bf16 Llama, H200, 2026-12-02, results v9) lifting
# that ban alone took plain torch.compile's gradient error against an fp32
# reference from 3.157e-2 to 2.845e-2 (activation_memory_budget 0.7, which
# lifts it among others: 2.876e-2), at the same peak (23.06 GiB); its median
# step of three, 256.4 ms against 251.8, is within plain compile's own spread
# there (251.5 to 262.6 ms).
_FAR_APART = "ban_recompute_used_far_apart"

# The partitioner settings the joint pass may change for the graph it planned
# (the budget pass turns CSE off; recompute_far_apart lifts a ban): the user's
# come back after each compile.
_PARTITIONER_FLAGS = ("cse", _FAR_APART)


def _guarded(compile_graph: Callable[..., Any], gm: Any, example_inputs: Any) -> Any:
    config = torch._functorch.config
    saved = {flag: getattr(config, flag) for flag in _PARTITIONER_FLAGS if hasattr(config, flag)}
    try:
        return compile_graph(gm, example_inputs)
    except Exception as e:
        rejection = _find_rejection(e)
        if rejection is None:
            raise
        return _raise_on_call(rejection.error)
    finally:
        for flag, value in saved.items():
            setattr(config, flag, value)


class _Session:
    """The options of one compile() call and the plans of the graphs it compiled."""

    def __init__(self, plan_options: dict, module_names: dict | None,
                 budget: dict | None = None) -> None:
        self.plan_options = plan_options
        # memory_budget mode: {"spec": parse_memory_budget(...), "options": the
        # budget planner's keyword arguments}; None: the scope policy.
        self.budget = budget
        self.module_names = module_names
        self.plans: list[CompiledPlan] = []
        self.lock = threading.Lock()
        # The plan whose forward graph comes next (aot_autograd compiles the
        # forward right after partitioning), and the plans whose backward has
        # not been seen, with the node names of their joint graphs. Backwards
        # compile later and, with a graph break, in another order (the last
        # piece's backward runs first): each goes to the plan whose joint
        # graph shares the most node names with it (the partitioner keeps them).
        self.pending_forward: CompiledPlan | None = None
        self.pending_backward: list[tuple[CompiledPlan, frozenset[str]]] = []
        self.warned_zero_gradients = False  # _budget_pass warns once per compile()
        # Note [Recomputing values used far apart]: compile(recompute_far_apart=...);
        # None: the budget pass decides per graph.
        self.recompute_far_apart: bool | None = None

    # -- the joint pass -----------------------------------------------------------

    def joint_pass(self, graph: torch.fx.Graph) -> None:
        gm = graph.owning_module
        if self.recompute_far_apart:
            # The partitioner runs right after this pass; _guarded restores the flag.
            setattr(torch._functorch.config, _FAR_APART, False)
        # The partitioner's CSE would merge values the plan moves separately
        # (and then their offloads): merge them first (_compiled_cse.py).
        merged = merge_common_subexpressions(graph)
        exported = export_graph_module(gm, module_names=self.module_names,
                                       name="torch.compile joint graph")
        if self.budget is not None:
            self._budget_pass(graph, gm, exported, merged)
            return
        scope = self.plan_options["scope"]
        in_graph = _scope_in_graph(exported, scope)
        options = self.plan_options if in_graph else dict(self.plan_options, mode="none")
        if not in_graph and self.module_names is None:
            warnings.warn(f"[compiled] scope {scope!r} matches no module of a compiled graph: "
                          "nothing in it is offloaded", stacklevel=2)
        try:
            plan_json = _C.plan_activation_offload(json.dumps(exported), **options)
        except ValueError as e:
            raise _PlanRejected(e) from e
        plan = json.loads(plan_json)
        if plan["edit_list"]:
            EditReplayer(graph).apply(plan["edit_list"])
        if plan["edit_list"] or merged:
            graph.lint()
            gm.recompile()
        record = CompiledPlan(plan, scope_in_graph=in_graph)
        with self.lock:
            self.plans.append(record)
            self.pending_forward = record
            self.pending_backward.append((record, frozenset(n.name for n in graph.nodes)))

    def _budget_pass(self, graph: torch.fx.Graph, gm: Any, exported: dict, merged: bool) -> None:
        """memory_budget mode: keep / offload / recompute per saved value (budget.h)."""
        if not self.warned_zero_gradients:
            count, total = _tensor_tangents(graph)
            if count > 1:
                self.warned_zero_gradients = True
                warnings.warn(
                    f"[compiled] a compiled graph returns {count} tensors that require grad "
                    f"({total / 2**30:.2f} GiB) besides its scalars: its backward takes a "
                    "gradient for each, zeros allocated when backward starts where only the "
                    "loss is backpropagated, and the memory budget holds them. A Hugging Face "
                    "model returns its keys and values too unless called with use_cache=False",
                    stacklevel=2)
        text = json.dumps(exported)
        options = self.budget["options"]
        spec = self.budget["spec"]
        # A fraction is of the planner's baseline: the graph with the
        # partitioner's own recomputes, what plain torch.compile would peak at.
        fraction = spec[1] if spec[0] == "fraction" else 0.0
        outside = self.budget["outside_bytes"]
        requested = budget_bytes(spec, 0) if spec[0] == "bytes" else 0
        budget = requested - outside if spec[0] == "bytes" else 0
        if spec[0] == "bytes" and budget <= 0:
            raise _PlanRejected(ValueError(
                f"memory_budget {requested / 2**30:.2f} GiB is no more than the "
                f"{outside / 2**30:.2f} GiB of gradients kept between steps (grads_kept): "
                "nothing is left for the step's graph"))
        try:
            plan = json.loads(_C.plan_memory_budget(text, budget, trace=True,
                                                    svg_title="torch.compile joint graph",
                                                    budget_fraction=fraction, **options))
        except ValueError as e:
            if "no repeated blocks" in str(e) or "matches no module" in str(e):
                plan = None  # a piece of the model without its blocks (a graph break)
            else:
                raise _PlanRejected(e) from e
        except MemoryError as e:
            raise _PlanRejected(ValueError(str(e))) from e
        recomputes = plan is not None and any(
            c["decision"] == "recompute" and not c["by_partitioner"] for c in plan["choices"])
        if (self.recompute_far_apart is None and plan is not None and
                hasattr(torch._functorch.config, _FAR_APART) and
                (recomputes or options.get("offload_materialised"))):
            # Note [Recomputing values used far apart], the default: a plan that is
            # not bit-exact anyway gets activation_memory_budget's accuracy; one that
            # recomputes nothing stays bit-equal to plain compile. _guarded restores it.
            setattr(torch._functorch.config, _FAR_APART, False)
        if plan is not None and plan["edit_list"]:
            EditReplayer(graph).apply(plan["edit_list"])
            if recomputes:
                # A recompute is a copy of the forward's op that the backward
                # reads instead of the original; the partitioner's CSE would merge
                # it back into the original, which the forward then saves (the plan
                # undone). merge_common_subexpressions has already merged what was
                # common before planning. _guarded restores the setting.
                torch._functorch.config.cse = False
        if (plan is not None and plan["edit_list"]) or merged:
            graph.lint()
            gm.recompile()
        summary = {"edit_list": plan["edit_list"] if plan else [], "offloads": [],
                   "bytes_offloaded": plan["forecast"]["bytes_offloaded"] if plan else 0}
        record = CompiledPlan(summary, scope_in_graph=plan is not None, budget=plan,
                              outside_bytes=outside if plan is not None else 0)
        if plan is not None:
            record.joint_storages, record.model_outputs = _joint_storages(exported)
        with self.lock:
            self.plans.append(record)
            self.pending_forward = record
            self.pending_backward.append((record, frozenset(n.name for n in graph.nodes)))

    # -- seeing the partitioned graphs ----------------------------------------------

    def saw_graph(self, graph: torch.fx.Graph, backward: bool) -> None:
        counts = spillway_op_counts(graph)
        replays = [n.name for n in graph.nodes if n.name.startswith("spillway_replay_")]
        with self.lock:
            if backward:
                if self.pending_backward:
                    names = {n.name for n in graph.nodes if n.op == "call_function"}
                    best = max(range(len(self.pending_backward)),
                               key=lambda i: len(names & self.pending_backward[i][1]))
                    record, _ = self.pending_backward.pop(best)
                    record.backward_ops = counts
                    record.backward_replays = replays
            else:
                record, self.pending_forward = self.pending_forward, None
                if record is not None:
                    record.forward_ops = counts
                    record.forward_outputs, record.forward_output_bytes = _outputs(graph)
                    record.forward_replays = replays
                    if record.budget is not None:
                        record.departures = _departures(
                            record.budget, record.forward_outputs[record.model_outputs:],
                            record.forward_output_bytes[record.model_outputs:],
                            record.joint_storages)


_latest: _Session | None = None


def last_plans() -> list[CompiledPlan]:
    """The plans of every joint graph compiled so far by the latest compile() call.

    Graphs compile lazily (on the first call, and on recompiles), so the list
    grows as the compiled model runs. Returns a copy.
    """
    if _latest is None:
        return []
    with _latest.lock:
        return list(_latest.plans)


# ---- custom-pass and backend plumbing ---------------------------------------------------


def _custom_graph_pass(fn: Callable[[torch.fx.Graph], None]) -> Any:
    """fn as an Inductor CustomGraphPass without a cache key (so caches are bypassed)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            fn(graph)

        def uuid(self) -> None:
            # No key: the plan depends on the graph and the options, and
            # last_plans() must see every compile, so never serve from a cache.
            return None

    return _Pass()


def _outputs(graph: torch.fx.Graph) -> tuple[list[str], list[int]]:
    """Names of the graph's outputs and each one's storage bytes (0 where its
    node carries no tensor metadata)."""
    (output,) = graph.find_nodes(op="output")
    names: list[str] = []
    sizes: list[int] = []

    def visit(node: torch.fx.Node) -> None:
        names.append(node.name)
        value = node.meta.get("val")
        sizes.append(value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0)

    torch.fx.node.map_arg(output.args, visit)
    return names, sizes


def _tensor_tangents(graph: torch.fx.Graph) -> tuple[int, int]:
    """How many of a joint graph's tangents (the gradients of its outputs that
    require grad) are tensors of more than one element, and their bytes."""
    count = total = 0
    for node in graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if not node.name.startswith("tangents") or not isinstance(value, torch.Tensor):
            continue
        numel = value.numel()
        if isinstance(numel, torch.SymInt):
            # The hint, not int(): int() would guard the compiled graph on the size.
            numel = _hint_of(numel.node)
            if numel is None:  # no hint: counted, its bytes unknown
                count += 1
                continue
        if numel > 1:
            count += 1
            total += numel * value.element_size()
    return count, total


def _is_backward_graph(graph: torch.fx.Graph) -> bool:
    return any(n.op == "placeholder" and "tangents" in n.name for n in graph.nodes)


def _inductor_backend(session: _Session, mode: str | None, options: dict | None,
                      dynamic: bool | None) -> Any:
    from spillway.activations import _compiled_inductor

    def post_grad(graph: torch.fx.Graph) -> None:
        _compiled_inductor.place_forward_waits(graph)
        session.saw_graph(graph, _is_backward_graph(graph))

    options = dict(options or {})
    for key in ("joint_custom_post_pass", "post_grad_custom_post_pass"):
        if options.get(key) is not None:
            raise ValueError(f"[compiled] options['{key}'] is taken by spillway.compile")
    _compiled_inductor.install()
    if not _compiled_inductor.pins_supported():
        # Without ordering pins the peak-memory reordering hoists every reload to
        # the start of the backward (Note [Reload order under Inductor]).
        options.setdefault("reorder_for_peak_memory", False)
    if session.budget is not None:
        # Note [Buffer reuse under a budget]: Inductor hands a freed buffer to the
        # next allocation of its size and keeps it allocated until then, and the
        # budget planner's simulation frees each value after its last reader. On
        # T1 at a 7 GiB budget (H200, 2026-12-02) the backward's 176 MiB MLP
        # buffers of one layer stayed allocated through its attention backward
        # until the next layer's MLP took them: the step peaked at 8.36 GiB
        # against the plan's 7.00. Off, the caching allocator still reuses the
        # memory, and the step peaks where the plan says.
        options.setdefault("allow_buffer_reuse", False)
    options["joint_custom_post_pass"] = _custom_graph_pass(session.joint_pass)
    options["post_grad_custom_post_pass"] = _custom_graph_pass(post_grad)
    return _InductorWithPlan(mode, options, dynamic)


class _InductorWithPlan(torch._TorchCompileInductorWrapper):
    """backend="inductor" (same config handling), with planner refusals surfaced."""

    def __call__(self, model_: Any, inputs_: Any) -> Any:
        return _guarded(super().__call__, model_, inputs_)


def _aot_eager_backend(session: _Session) -> Any:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition_fn(joint_module, joint_inputs, **kwargs):
        session.joint_pass(joint_module.graph)
        return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)

    def compiler(backward: bool):
        def compile_graph(gm: torch.fx.GraphModule, _example_inputs):
            session.saw_graph(gm.graph, backward)
            return make_boxed_func(gm.forward)

        return compile_graph

    backend = aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True),
                           partition_fn=partition_fn, keep_inference_input_mutations=True)
    return lambda gm, example_inputs: _guarded(backend, gm, example_inputs)


def _joint_storages(exported: dict) -> tuple[dict[str, int], int]:
    """The storage id of each call_function node of the exported joint graph that
    holds a tensor, by name, and how many values of the forward phase its output
    node returns (the model's outputs, which the partitioned forward returns
    first)."""
    storages: dict[str, int] = {}
    phase: dict[int, str] = {}
    returned = 0
    for node in exported["nodes"]:
        phase[node["id"]] = node.get("phase", "")
        value = node.get("value") or {}
        if (node.get("kind") == "call_function" and value.get("type") == "tensor"
                and value.get("storage") is not None):
            storages[node["name"]] = value["storage"]
        if node.get("kind") == "output":
            refs: list[int] = []
            _node_refs(node.get("args"), refs)
            returned = sum(phase.get(ref) == "forward" for ref in refs)
    return storages, returned


def _node_refs(arg: Any, into: list[int]) -> None:
    if isinstance(arg, dict):
        if set(arg) == {"node"}:
            into.append(arg["node"])
            return
        for value in arg.values():
            _node_refs(value, into)
    elif isinstance(arg, list):
        for value in arg:
            _node_refs(value, into)


def _departures(plan: dict, saved: list[str], saved_bytes: list[int],
                storages: dict[str, int]) -> list[str]:
    """Where the partitioned forward departs from the budget plan, one line each:
    a value the plan keeps that the partitioner recomputes anyway (frees more than
    planned), a value the plan offloads or recomputes that the forward still saves
    on the device (frees less), and, largest first, each value the forward saves
    that is no candidate of the plan (the simulator's model of the partitioner,
    execution model (11) in include/spillway/sim.h, decides those). `saved` are
    the forward's saved outputs (after the model's outputs) with their bytes;
    values match by storage, so a view the forward saves (view_18 of mul_11)
    stands for its base. Inputs (parameters) and the forward's new nodes (waits,
    replays) are not listed."""
    saved_by_storage: dict[int, tuple[str, int]] = {}
    for name, nbytes in zip(saved, saved_bytes):
        if name in storages:
            saved_by_storage.setdefault(storages[name], (name, nbytes))
    lines = []
    planned: set[int] = set()
    for choice in plan["choices"]:
        name, decision = choice["name"], choice["decision"]
        storage = storages.get(name)
        planned.add(storage)
        is_saved = storage in saved_by_storage
        if decision == "keep" and not is_saved:
            lines.append(f"{name}: kept by the plan, recomputed by the partitioner")
        elif decision in ("offload", "recompute") and is_saved:
            lines.append(f"{name}: {decision} in the plan, saved on the device by the partitioner"
                         f" (as {saved_by_storage[storage][0]})")
    others = [(nbytes, name) for storage, (name, nbytes) in saved_by_storage.items()
              if storage not in planned]
    for nbytes, name in sorted(others, key=lambda item: -item[0]):
        lines.append(f"{name}: saved by the partitioner, no candidate ({nbytes} bytes)")
    return lines


def _scope_in_graph(exported: dict, scope: str) -> bool:
    """Whether a module named `scope` (its last component) runs in the exported graph."""
    return any(leaf_name(path) == scope
               for node in exported["nodes"] for path in node.get("module_stack", ()))


def _check_types(plan_options: dict, backend: Any) -> None:
    """ValueError naming the option for a value of the wrong type."""
    def shown(value: Any) -> str:
        return f"{value!r} ({type(value).__name__})"

    scope = plan_options["scope"]
    if not isinstance(scope, str) or not scope:
        raise ValueError("[compiled] scope must be the name of a module (the last component "
                         f"of its qualified name, e.g. 'mlp'), got {shown(scope)}")
    for name in ("host_budget_bytes", "min_bytes", "prefetch_regions", "release_lag"):
        value = plan_options[name]
        if isinstance(value, bool) or not isinstance(value, int):
            shown_name = "prefetch" if name == "prefetch_regions" else name
            raise ValueError(f"[compiled] {shown_name} must be an int, got {shown(value)}")
    if not isinstance(plan_options["prefetch_anchor"], str):
        raise ValueError("[compiled] prefetch_anchor must be 'start' or 'end', got "
                         f"{shown(plan_options['prefetch_anchor'])}")
    if not isinstance(backend, str):
        raise ValueError("[compiled] backend must be 'inductor' or 'aot_eager', got "
                         f"{shown(backend)}")


def _budget_session(memory_budget: Any, allow_offload: Any, allow_recompute: Any,
                    device_profile: Any, scope: Any, min_bytes: Any, prefetch: Any,
                    release_lag: Any) -> dict:
    """The memory_budget options, checked now (ValueError naming the bad one)."""
    spec = parse_memory_budget(memory_budget, "compiled")
    for name, value in (("allow_offload", allow_offload), ("allow_recompute", allow_recompute)):
        if not isinstance(value, bool):
            raise ValueError(f"[compiled] {name} must be a bool, got {value!r}")
    if not (allow_offload or allow_recompute):
        raise ValueError("[compiled] allow_offload and allow_recompute are both False: nothing "
                         "could meet a memory budget")
    profile = ""
    if device_profile is not None:
        if not isinstance(device_profile, str):
            raise ValueError(f"[compiled] device_profile must be a path, got {device_profile!r}")
        try:
            with open(device_profile, encoding="utf-8") as f:
                profile = f.read()
        except OSError as e:
            raise ValueError(f"[compiled] device_profile {device_profile!r}: {e}") from e
    options = {"scope": scope or "", "allow_offload": allow_offload,
               "allow_recompute": allow_recompute, "prefetch_regions": prefetch,
               "release_lag": release_lag, "min_bytes": min_bytes,
               "device_profile_json": profile, "partitioner": True}
    # Out-of-range options fail now, on a probe graph, with the planner's message.
    probe = {"format": "spillway.graph", "version": 1, "nodes": [
        {"id": 0, "name": "x", "kind": "placeholder", "target": "x"}]}
    try:
        _C.simulate_graph(json.dumps(probe), device_profile_json=profile)
    except ValueError as e:
        raise ValueError(f"[compiled] device_profile {device_profile!r}: {e}") from e
    return {"spec": spec, "options": options}


def _kept_grad_bytes(model_or_fn: Any, grads_kept: Any) -> int:
    """grads_kept's bytes: the gradients of the module's trainable parameters."""
    if not isinstance(grads_kept, bool):
        raise ValueError(f"[compiled] grads_kept must be a bool, got {grads_kept!r}")
    if not grads_kept:
        return 0
    if not isinstance(model_or_fn, torch.nn.Module):
        raise ValueError("[compiled] grads_kept needs an nn.Module (its parameters' gradients "
                         f"are what it counts), got {type(model_or_fn).__name__}")
    return sum(p.nbytes for p in model_or_fn.parameters() if p.requires_grad)


def _check_options(plan_options: dict) -> None:
    """Raises the planner's ValueError now for options out of range."""
    probe = {"format": "spillway.graph", "version": 1, "nodes": [
        {"id": 0, "name": "x", "kind": "placeholder", "target": "x",
         "module_stack": [plan_options["scope"]]}]}
    _C.plan_activation_offload(json.dumps(probe), **plan_options)


def _check_scope_in_model(model: torch.nn.Module, module_names: dict, scope: str) -> None:
    """ValueError listing the model's modules when none of `module_names` is named `scope`."""
    if any(leaf_name(name) == scope for name in module_names):
        return
    classes = sorted({leaf_name(name) for name, kind in module_names.items()
                      if kind.__name__ == scope and name})
    hint = (f" ({scope!r} is a class name here; the compiled path takes module names: "
            f"{', '.join(repr(c) for c in classes)})" if classes else "")
    raise ValueError(f"[compiled] scope {scope!r} matches no module of "
                     f"{type(model).__name__}{hint}; modules there include: "
                     f"{module_labels(model)}")


def compile(model_or_fn: Any, *, memory_budget: Any = None, allow_offload: bool = True,
            allow_recompute: bool = True, device_profile: str | None = None,
            scope: str | None = None, host_budget_bytes: int = 0,
            min_bytes: int = 1 << 20, prefetch: int | None = None, prefetch_anchor: str = "end",
            release_lag: int = 1, grads_kept: bool = False,
            offload_materialised: bool = False, recompute_far_apart: bool | None = None,
            offload_tuple_outputs: bool = False,
            dense_storages: bool = False, replay_pointwise: bool = True,
            backend: str = "inductor",
            dynamic: bool | None = None, weights: str | None = None, gpu_budget: Any = None,
            blocks: str | None = None, granularity: str = "block", device: Any = None,
            **torch_compile_kwargs: Any) -> Any:
    """torch.compile(model_or_fn) with activation offload planned into every joint graph,
    or (weights="offload") with the model's block weights on the host.

    weights="offload": the compiled piecewise executor (Note [Piecewise executor] in
    python/spillway/weights/compiled.py), for inference and training (the optimizer
    steps inside the handle's mutate_weights()). Each block's weights (an entry
    of the model's largest nn.ModuleList, or of `blocks`; with granularity="children"
    each direct child of a block) live in a pinned host slab; every graph Dynamo
    captures is cut into pieces at group boundaries, each piece compiled by `backend`
    (any torch.compile backend name, "inductor" by default, or "eager") and run by the
    executor, which streams the weights through prefetch + 1 device buffers (prefetch
    None: the scheduler's choice, or 1 without a budget). gpu_budget: the weights on the
    device at most, bytes or a fraction of the model's weights, as
    spillway.offload_weights takes it: the resident-set scheduler keeps the groups it
    chooses on the device, planned from sizes, then again from the second call's
    profile. device_profile: the scheduler's device profile; device: where the model
    runs (None: the current CUDA device; "cpu": the fake copy backend, for tests). The
    returned module's `spillway_weights` is the handle (forecast(), stats(),
    mutate_weights(), state_dict(), detach()). Not combined with activation offload
    (memory_budget, scope) yet.

    memory_budget: the peak device memory the step may use: bytes (int), a
    string ("12GiB", "800MiB"), or a fraction of the no-offload peak (0.6,
    "60%"). With it, the budget planner (include/spillway/budget.h) decides
    per saved activation of the model's repeated blocks: keep, offload
    (allow_offload) or recompute in backward (allow_recompute), the fastest
    plan whose simulated peak fits, simulated on device_profile (a device
    profile JSON file, docs/device-profile.md; default: the shipped H200
    one). scope then only restricts the candidates. A fraction is taken of
    each joint graph's simulated peak; bytes apply to each graph. Each
    graph's plan says what it predicts (last_plans()[i].forecast()) and where
    the partitioner departed from it (.departures). Every output that
    requires grad gets a gradient in the compiled backward, zeros where only
    the loss is backpropagated, and the budget holds them: a graph with more
    than one such tensor output warns once (a Hugging Face model's key/value
    cache: call it with use_cache=False). Without memory_budget: the scope
    policy below.
    grads_kept: with memory_budget in bytes, the training loop keeps the
    parameters' .grad from one step to the next (gradient accumulation, or no
    zero_grad(set_to_none=True) before the step): those gradients are held
    through the whole step beside the graph's own memory, which never sees
    them, so their bytes come off the budget before each graph is planned and
    are added to forecast()["peak_bytes"] (forecast()["outside_bytes"]). Only
    for an nn.Module. Other memory outside the graph (optimizer state, other
    models) is the caller's to take off the budget.
    offload_materialised: with memory_budget, pointwise values that backward's
    weight-gradient matmuls read (SiLU(gate) * up, the projections' normalised
    inputs) may be offloaded too, and so may the bf16 residual stream each
    RMSNorm upcasts (its fp32 cast is rebuilt in backward from the reload;
    Note [Upcast sources], src/plan/upcast_sources.h; with allow_recompute). Faster at small budgets, but not bit-exact:
    plain torch.compile's partitioner rebuilds some of them in backward in
    other kernels (4.8e-7 on a bf16 tiny Llama, H200). Off, a plan that
    recomputes nothing is bit-equal to plain torch.compile: only such values
    that no kernel can round are offloaded (the attention mask, a where
    between tensors of its dtype; a widening cast; clone).
    recompute_far_apart: True: the partitioner may recompute in backward a
    fusible value whose forward and backward uses are far apart, in fp32
    inside the kernel that reads it, instead of saving it rounded to its
    16-bit dtype (it lifts torch._functorch.config.ban_recompute_used_far_apart
    for the graphs this compiles; Note [Recomputing values used far apart]).
    Closer to fp32 gradients, as close as activation_memory_budget's, with no
    cost above the noise of a 3-step run on T1 (plain torch.compile, H200);
    results then differ from plain torch.compile's in the last bits. False:
    never. None (default): with memory_budget, for each graph whose plan is
    not bit-exact anyway (it recomputes a value the partitioner would not, or
    offload_materialised); a plan that recomputes nothing stays bit-equal to
    plain torch.compile. The budget planner's model of the partitioner does
    not model that ban either way (execution model (11), include/spillway/sim.h).
    scope: leaf module name whose activations may move ("self_attn", "mlp");
    default "self_attn" without memory_budget, every block with it.
    host_budget_bytes: host bytes the plan may fill per graph; 0 = unlimited.
    min_bytes: smallest activation worth a transfer. prefetch: how many scope
    regions early each reload starts (None: 1). prefetch_anchor: where a prefetched
    reload is issued: "end" (default) right after the last node of the scope
    region `prefetch` regions earlier, so it overlaps the out-of-scope backward
    that follows that region (the attention backward between two MLP regions)
    without keeping the value resident during the region; "start" before the
    region's first node, as the reference pass does (ActivationPlanOptions::
    prefetch_anchor in include/spillway/plan.h). With scope "mlp", 4 layers,
    prefetch 1, "start" left two layers' MLP values live at the backward's peak
    (see test_cuda_offload_lowers_peak_memory). When scope regions follow each
    other with no gap, "end" gives prefetch - 1 regions of lead.
    release_lag: how many scope regions a moved value's device copy outlives
    its last forward use (ActivationPlanOptions::release_lag): with 1 (the
    default here; 0 in the planner) the forward wait sits at the start of the
    next layer's scope region, so the D2H overlaps the rest of the layer
    instead of stalling the stream when the last use follows the producer
    closely (T1, scope self_attn with both relaxations, H200, 2026-11-30:
    with 0 the compute stream sat idle 32 ms of a 272 ms step, 29 ms of it
    in the forward right after each SDPA and o_proj).
    offload_tuple_outputs, dense_storages: the
    planner's opt-in relaxations (include/spillway/plan.h): values whose last
    forward use returns a tuple (SDPA), and non-contiguous dense values (rotary
    Q/K) become offloadable. replay_pointwise: a cheap pointwise value of moved
    values (SiLU(gate), SiLU(gate) * up) is recomputed in backward from their
    reloads instead of moved (the planner option of that name; on by default
    here, off in the planner itself). backend: "inductor" or "aot_eager";
    with memory_budget, Inductor's buffer reuse is off unless options says
    otherwise (Note [Buffer reuse under a budget]: it held buffers the plan
    counts as freed).
    Other keyword arguments go to torch.compile (fullgraph, mode, options —
    the last two for inductor only).

    Returns what torch.compile returns. Raises ValueError at once for an
    option of the wrong type or out of range, an unknown backend, or a scope
    that names no module of the model (the message lists the model's
    modules); see the module docstring for errors at compile time.
    Thread-safety: as torch.compile.
    """
    global _latest
    if weights is not None:
        return _compile_weights(model_or_fn, weights, memory_budget, scope, gpu_budget, blocks,
                                prefetch, granularity, device, device_profile, backend,
                                dynamic, torch_compile_kwargs)
    for name, value in (("gpu_budget", gpu_budget), ("blocks", blocks), ("device", device)):
        if value is not None:
            raise ValueError(f"[compiled] {name} applies with weights='offload' only")
    if granularity != "block":
        raise ValueError("[compiled] granularity applies with weights='offload' only")
    if prefetch is None:
        prefetch = 1
    budget = None
    if memory_budget is not None:
        budget = _budget_session(memory_budget, allow_offload, allow_recompute, device_profile,
                                 scope, min_bytes, prefetch, release_lag)
        budget["outside_bytes"] = _kept_grad_bytes(model_or_fn, grads_kept)
        if not isinstance(offload_materialised, bool):
            raise ValueError(f"[compiled] offload_materialised must be a bool, got "
                             f"{offload_materialised!r}")
        budget["options"]["offload_materialised"] = offload_materialised
    elif grads_kept is not False:
        raise ValueError("[compiled] grads_kept applies with memory_budget only")
    if scope is None:
        scope = "self_attn"
    plan_options = {"scope": scope, "host_budget_bytes": host_budget_bytes,
                    "min_bytes": min_bytes, "prefetch_regions": prefetch,
                    "prefetch_anchor": prefetch_anchor, "release_lag": release_lag,
                    "offload_tuple_outputs": bool(offload_tuple_outputs),
                    "dense_storages": bool(dense_storages),
                    "replay_pointwise": bool(replay_pointwise)}
    _check_types(plan_options, backend)
    _check_options(plan_options)
    module_names = None
    if isinstance(model_or_fn, torch.nn.Module):
        module_names = {n: type(m) for n, m in model_or_fn.named_modules(remove_duplicate=False)}
        if budget is None or budget["options"]["scope"]:
            _check_scope_in_model(model_or_fn, module_names, scope)
    if recompute_far_apart is not None and not isinstance(recompute_far_apart, bool):
        raise ValueError(f"[compiled] recompute_far_apart must be a bool or None, got "
                         f"{recompute_far_apart!r}")
    if recompute_far_apart and not hasattr(torch._functorch.config, _FAR_APART):
        raise ValueError(f"[compiled] recompute_far_apart needs a torch whose partitioner has "
                         f"torch._functorch.config.{_FAR_APART} (this is {torch.__version__})")
    session = _Session(plan_options, module_names, budget)
    session.recompute_far_apart = recompute_far_apart
    mode = torch_compile_kwargs.pop("mode", None)
    options = torch_compile_kwargs.pop("options", None)
    if backend == "inductor":
        compiler = _inductor_backend(session, mode, options, dynamic)
    elif backend == "aot_eager":
        if mode is not None or options is not None:
            raise ValueError("[compiled] mode and options apply to backend='inductor' only")
        compiler = _aot_eager_backend(session)
    else:
        raise ValueError(f"[compiled] unknown backend '{backend}': expected 'inductor' or "
                         "'aot_eager'")
    _latest = session
    return torch.compile(model_or_fn, backend=compiler, dynamic=dynamic, **torch_compile_kwargs)


def _compile_weights(model, weights, memory_budget, scope, gpu_budget, blocks, prefetch,
                     granularity, device, device_profile, backend, dynamic, kwargs):
    """compile(weights="offload"): the piecewise executor of spillway.weights.compiled."""
    if weights != "offload":
        raise ValueError(f"[compiled] weights must be 'offload' or None, got {weights!r}")
    if memory_budget is not None or scope is not None:
        raise ValueError("[compiled] weights='offload' does not combine with activation "
                         "offload (memory_budget, scope) yet: compile with one of them")
    from spillway.weights.compiled import compile_offloaded
    return compile_offloaded(model, gpu_budget=gpu_budget, blocks=blocks, prefetch=prefetch,
                             granularity=granularity, device=device,
                             device_profile=device_profile, backend=backend, dynamic=dynamic,
                             **kwargs)
