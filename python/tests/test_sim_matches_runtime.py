"""The simulator's memory timeline is what the runtime does, node by node.

The joint forward+backward graph that torch.compile builds for a tiny Hugging
Face model is planned by the budget planner at a budget that makes it offload
and recompute (spillway._C.plan_memory_budget), the plan's edits are replayed
on the FX graph as the compiled path replays them (EditReplayer), and the
edited graph runs op by op on CPU, where CPU tensors stand for device memory
and the runtime's fake backend moves the offloaded ones. After each node, the
device bytes still alive (every storage a node's value or an input holds,
views counted once, host copies left out, each rounded as the caching
allocator rounds it) must equal the simulator's live bytes at that node
(execution model (6) and (7), include/spillway/sim.h) for the same planned
graph: same nodes in the same order, same bytes at every one.

The measurement sees the runtime's own references too (the storage an
offload holds until its forward wait, the reload target held until its
backward wait), and a reference kept one node too long shows up as a
difference; the test checks both.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

if os.environ.get("SPILLWAY_REQUIRE_EXTENSION") == "1":
    from spillway import ops
else:
    ops = pytest.importorskip(
        "spillway.ops", reason="spillway._C is not built (cmake --preset python && "
        "cmake --build --preset python)", exc_type=ImportError)
pytest.importorskip("transformers")

from spillway import _C  # noqa: E402
from spillway.activations._compiled_apply import EditReplayer  # noqa: E402
from spillway.fx_export import export_graph_module  # noqa: E402

from _models import fresh_dynamo, tiny_gpt2, tiny_llama  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

H200 = pathlib.Path(__file__).resolve().parents[2] / "src/sim/profiles/nvidia-h200.json"
# Three layers and 4 x 64 tokens: big enough that saved activations, not the
# weights and the loss, set the peak, so that at this fraction of the graph's
# simulated peak the plan offloads and recomputes on both models.
SIZES = dict(layers=3, batch=4, seq=64)
BUDGET_FRACTION = 0.75


def _round_allocation(nbytes: int, granularity: int) -> int:
    """round_allocation of include/spillway/sim.h."""
    if nbytes == 0:
        return 0
    return max(granularity, -(-nbytes // granularity) * granularity)


# ---- the joint graph and its real inputs ---------------------------------------------


def _joint_graphs(model, ids) -> list[tuple[torch.fx.GraphModule, list[torch.Tensor]]]:
    """Each joint graph torch.compile builds for one training step of model(ids,
    labels=ids) (a graph break gives several), with the real values of its
    placeholders (primals from the forward's call, tangents from the backward's)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    joints: list[torch.fx.GraphModule] = []
    values: list[dict[str, torch.Tensor]] = []  # per joint graph: placeholder name -> value

    def partition_fn(joint_module, joint_inputs, **kwargs):
        # A copy (node meta shared, fake values included): the partitioner may
        # rewrite the graph it is given.
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(joint_module.graph, {}))
        joints.append(torch.fx.GraphModule(joint_module, graph))
        values.append({})
        return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)

    def compiler(gm: torch.fx.GraphModule, _example_inputs):
        # A forward compiles right after its partition; a backward later, and
        # after a graph break in another order: it belongs to the joint graph
        # it shares the most node names with.
        placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        joint = len(joints) - 1
        if any(name.startswith("tangents") for name in placeholders):
            names = {n.name for n in gm.graph.nodes if n.op == "call_function"}
            joint = max(range(len(joints)),
                        key=lambda i: len(names & {n.name for n in joints[i].graph.nodes}))
        record = values[joint]

        def run(*args):
            record.update(zip(placeholders, args))
            return gm(*args)

        return make_boxed_func(run)

    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                           partition_fn=partition_fn, keep_inference_input_mutations=True)
    torch.compile(model, backend=backend, dynamic=False)(ids, labels=ids).loss.backward()
    out = []
    for gm, record in zip(joints, values):
        placeholders = gm.graph.find_nodes(op="placeholder")
        out.append((gm, [record[n.name] for n in placeholders]))
    return out


def _plan(model, gm: torch.fx.GraphModule, profile: dict) -> dict | None:
    """The budget plan of one joint graph with its simulated timeline; None for a
    piece of the model without its blocks."""
    names = {n: type(m) for n, m in model.named_modules(remove_duplicate=False)}
    exported = export_graph_module(gm, module_names=names, name="joint graph")
    try:
        return json.loads(_C.plan_memory_budget(
            json.dumps(exported), 0, budget_fraction=BUDGET_FRACTION, min_bytes=0,
            device_profile_json=json.dumps(profile), timeline=True))
    except ValueError as e:
        if "no repeated blocks" in str(e):
            return None
        raise


# ---- the runtime's live bytes ---------------------------------------------------------


class LiveBytes(torch.fx.Interpreter):
    """Runs a graph op by op and records, after each node ran (its outputs alive,
    before the values whose last use it was are dropped), the rounded bytes of
    every storage still alive that a node's value or an input holds. Storages
    made by spillway.offload (the host copies, and the waits' aliases of them)
    are host memory and not counted. A value is dropped after its last reader,
    and one nothing reads right after its node, as in the code FX generates
    for a graph module (what aot_eager runs).

    hold: the name of a node whose value is never dropped (a negative check).
    """

    def __init__(self, gm: torch.fx.GraphModule, granularity: int, hold: str | None = None):
        super().__init__(gm)
        for node in gm.graph.nodes:
            if not node.users and node.op not in ("placeholder", "output"):
                self.user_to_last_uses.setdefault(node, []).append(node)
        self.granularity = granularity
        self.hold = hold
        self.held = None
        self.storages: dict[int, tuple[StorageWeakRef, int, bool]] = {}
        self.timeline: list[tuple[str, int]] = []

    def _track(self, value, host: bool) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            ref = StorageWeakRef(storage)
            # The weak reference keeps the StorageImpl (not its bytes) alive, so
            # a key is never reused by another storage while it is tracked.
            self.storages.setdefault(ref.cdata, (ref, storage.nbytes(), host))
        elif isinstance(value, (tuple, list)):
            for element in value:
                self._track(element, host)

    def run(self, *args):
        for arg in args:  # the caller holds the inputs through the step
            self._track(arg, host=False)
        return super().run(*args)

    def run_node(self, n: torch.fx.Node):
        value = super().run_node(n)
        self._track(value, host=n.target is torch.ops.spillway.offload.default)
        if n.name == self.hold:
            self.held = value
        live = sum(_round_allocation(nbytes, self.granularity)
                   for ref, nbytes, host in self.storages.values()
                   if not host and not ref.expired())
        self.timeline.append((n.name, live))
        return value


def _run(gm: torch.fx.GraphModule, inputs: list[torch.Tensor], granularity: int,
         hold: str | None = None) -> list[tuple[str, int]]:
    interpreter = LiveBytes(gm, granularity, hold)
    with torch.no_grad():
        interpreter.run(*inputs)
    ops.synchronize()
    return interpreter.timeline


def _differences(runtime: list[tuple[str, int]], simulated: list[dict]) -> dict[str, str]:
    """Node name -> what differs, for each node where the two timelines differ."""
    assert [name for name, _ in runtime] == [p["name"] for p in simulated]
    return {name: f"runtime {live} B, simulator {point['live_bytes']} B "
                  f"({live - point['live_bytes']:+d})"
            for (name, live), point in zip(runtime, simulated) if live != point["live_bytes"]}


def _report(differences: dict[str, str]) -> str:
    lines = [f"{name}: {what}" for name, what in differences.items()]
    return "\n".join(lines[:10] + ([f"... {len(lines) - 10} more"] if len(lines) > 10 else []))


# ---- the tests ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def profile() -> dict:
    return json.loads(H200.read_text())


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_runtime_live_bytes_equal_the_simulated_timeline(make_model, profile):
    model, ids = make_model(0, **SIZES)
    granularity = profile["allocation_granularity"]
    planned = 0
    for gm, inputs in _joint_graphs(model, ids):
        plan = _plan(model, gm, profile)
        if plan is None:
            continue
        planned += 1
        decisions = {c["decision"] for c in plan["choices"]}
        assert {"offload", "recompute"} <= decisions, decisions
        EditReplayer(gm.graph).apply(plan["edit_list"])
        gm.graph.lint()
        gm.recompile()

        # Copies that take a while: what the runtime holds must not depend on
        # when they finish.
        _C.set_fake_copy_delay(0, 300, seed=7)
        differences = _differences(_run(gm, inputs, granularity), plan["timeline"])
        assert not differences, _report(differences)

        # The comparison can fail: a runtime that kept one offloaded value's
        # storage past its forward wait holds bytes the simulator freed.
        offloads = [n for n in gm.graph.nodes if n.target is torch.ops.spillway.offload.default]
        held = _run(gm, inputs, granularity, hold=offloads[0].args[0].name)
        assert _differences(held, plan["timeline"])

        # It sees the runtime's own references: with no keepalive in the graph,
        # the runtime still holds each offloaded storage until its forward wait
        # (which lets it go while it runs, where the simulator counts it), with
        # copies that finish late or early.
        forward_waits = {user for offload in offloads for user in offload.users}
        for wait in forward_waits:
            wait.args = (wait.args[0], None, None)
        gm.recompile()
        without = _differences(_run(gm, inputs, granularity), plan["timeline"])
        assert without and without.keys() <= {w.name for w in forward_waits}, _report(without)
    assert planned == 1
