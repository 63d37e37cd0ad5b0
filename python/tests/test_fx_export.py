"""The FX exporter turns real joint graphs into faithful Spillway graphs.

Each property here is one a planner relies on: phases, module scopes, storage
identity, in-place writes, symbolic sizes with hints, and that exporting never
specialises a dynamic graph. The shipped graphs in examples/graphs/ are checked
against their README, and the export contract is run end to end through the
C++ `spillway plan` command.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from graph_format import GraphFormatError, check_graph
from spillway.fx_export import (
    capture_joint_graph,
    export_graph_module,
    export_joint_graph,
    load,
    op_schema_entry,
    save,
)
from spillway.fx_export._models import PRESETS

REPO = pathlib.Path(__file__).resolve().parents[2]
GRAPHS = REPO / "examples" / "graphs"


def _export(preset_name: str):
    preset = PRESETS[preset_name]()
    graph = export_joint_graph(
        preset.model, preset.args, loss_fn=lambda _model, *a: preset.fn(*a),
        dynamic=preset.dynamic, name=preset_name, metadata=preset.metadata,
    )
    return preset.model, graph


@pytest.fixture(scope="module")
def llama():
    return _export("llama-tiny")


@pytest.fixture(scope="module")
def gpt2():
    return _export("gpt2-tiny")


@pytest.fixture(scope="module")
def llama_dynamic():
    """The dynamic-sequence Llama, exported with the shape environment watched."""
    preset = PRESETS["llama-tiny-dynamic"]()
    names = {n: type(m) for n, m in preset.model.named_modules()}
    seen = {}

    def on_joint(joint, _inputs, _num_fwd_outputs):
        shape_env = next(
            n.meta["val"].fake_mode.shape_env
            for n in joint.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)
        )
        seen["before"] = (len(shape_env.guards), dict(shape_env.replacements))
        graph = export_graph_module(joint, module_names=names)
        seen["after"] = (len(shape_env.guards), dict(shape_env.replacements))
        return graph

    graph = capture_joint_graph(preset.fn, preset.args, on_joint=on_joint, dynamic=preset.dynamic)
    return graph, seen


def _nodes_by_id(graph):
    return {n["id"]: n for n in graph["nodes"]}


# ---- format ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_export_follows_the_format_and_round_trips(which, request, tmp_path):
    _, graph = request.getfixturevalue(which)
    check_graph(graph)
    for suffix in (".json", ".json.zst"):
        path = tmp_path / f"g{suffix}"
        save(graph, path)
        assert load(path) == graph
    assert graph["metadata"]["torch"] == torch.__version__


def test_validator_rejects_a_forward_reference(llama):
    # The validator used above can fail: a reference to a later node is caught.
    _, graph = llama
    broken = json.loads(json.dumps(graph))
    mm = next(n for n in broken["nodes"] if n["target"] == "aten.mm.default")
    mm["args"][0] = {"node": broken["nodes"][-1]["id"]}
    with pytest.raises(GraphFormatError, match="refers to unknown or later node"):
        check_graph(broken)


# ---- phases and scopes -------------------------------------------------------------


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_forward_then_backward(which, request):
    _, graph = request.getfixturevalue(which)
    calls = [n for n in graph["nodes"] if n["kind"] == "call_function"]
    phases = [n["phase"] for n in calls]
    assert "forward" in phases and "backward" in phases
    # Every forward op precedes every backward op: one forward region, then one
    # backward region, as the planner's forward-wait / backward-reload logic assumes.
    first_backward = phases.index("backward")
    assert all(p == "backward" for p in phases[first_backward:])
    # Tangents (the incoming gradients) are backward inputs; parameters are forward.
    placeholders = [n for n in graph["nodes"] if n["kind"] == "placeholder"]
    assert all(n["phase"] == ("backward" if n["name"].startswith("tangents") else "forward")
               for n in placeholders)
    # The loss gradient flows from the loss: nll_loss_backward is backward, its forward is forward.
    targets = {n["target"]: n["phase"] for n in calls}
    assert targets["aten.nll_loss_forward.default"] == "forward"
    assert targets["aten.nll_loss_backward.default"] == "backward"


@pytest.mark.parametrize("which, scope", [("llama", "self_attn"), ("gpt2", "attn")])
def test_attention_modules_on_stacks_of_both_phases(which, scope, request):
    model, graph = request.getfixturevalue(which)
    known = {name for name, _ in model.named_modules()}
    for phase in ("forward", "backward"):
        in_scope = [
            n for n in graph["nodes"]
            if n["phase"] == phase and any(m.split(".")[-1] == scope for m in n["module_stack"])
        ]
        layers = {next(m for m in n["module_stack"] if m.split(".")[-1] == scope) for n in in_scope}
        assert len(layers) == 2, (phase, layers)  # both decoder layers
    # Every name is the model's own (named_modules), outermost first.
    for node in graph["nodes"]:
        stack = node["module_stack"]
        assert all(name in known for name in stack), (node["name"], stack)
        assert all(inner.startswith(outer + ".") for outer, inner in zip(stack, stack[1:])), stack


def test_llama_attention_stack_is_qualified(llama):
    _, graph = llama
    attention = next(
        n for n in graph["nodes"]
        if n["target"] == "aten._scaled_dot_product_flash_attention_for_cpu.default"
    )
    assert attention["module_stack"] == ["model", "model.layers.0", "model.layers.0.self_attn"]
    grad = next(
        n for n in graph["nodes"]
        if n["target"] == "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    )
    assert grad["phase"] == "backward"
    assert grad["module_stack"][-1].endswith(".self_attn")


# ---- storages, views, in-place writes ----------------------------------------------


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_views_share_their_base_storage(which, request):
    _, graph = request.getfixturevalue(which)
    by_id = _nodes_by_id(graph)
    ops = graph["ops"]
    views = 0
    for node in graph["nodes"]:
        if node["kind"] != "call_function" or node["value"]["type"] != "tensor":
            continue
        schema = ops.get(node["target"])
        aliasing = (schema and schema["view"]) or node["target"] == "aten._unsafe_view.default"
        if not aliasing:
            continue
        base = by_id[node["args"][0]["node"]]["value"]
        assert node["value"]["storage"] is not None
        assert node["value"]["storage"] == base["storage"], node["name"]
        views += 1
    assert views > 20
    # Computations get storages of their own.
    for node in graph["nodes"]:
        if node["target"] == "aten.mm.default":
            inputs = {by_id[a["node"]]["value"]["storage"] for a in node["args"]}
            assert node["value"]["storage"] not in inputs


def test_getitem_of_split_shares_the_split_storage(gpt2):
    _, graph = gpt2
    by_id = _nodes_by_id(graph)
    splits = [n for n in graph["nodes"] if n["target"] == "aten.split.Tensor"]
    assert splits
    checked = 0
    for node in graph["nodes"]:
        if node["target"] == "operator.getitem" and by_id[node["args"][0]["node"]] in splits:
            source = by_id[node["args"][0]["node"]]
            base = by_id[source["args"][0]["node"]]["value"]["storage"]
            element = source["value"]["elements"][node["args"][1]]
            assert node["value"]["storage"] == element["storage"] == base
            checked += 1
    assert checked >= 3


def test_in_place_ops_are_mutable_with_their_written_argument():
    def step(x, y):
        z = torch.mm(x, y)
        z.add_(1.0)
        torch.relu_(z)
        return z.t()

    gm = make_fx(step, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 4))
    graph = export_graph_module(gm)
    check_graph(graph)
    ops = graph["ops"]
    for target in ("aten.add_.Tensor", "aten.relu_.default"):
        assert ops[target]["mutable"] and not ops[target]["view"]
        assert ops[target]["arguments"][0] == {"name": "self", "write": True}
    assert not ops["aten.mm.default"]["mutable"]
    assert ops["aten.t.default"]["view"]
    # The in-place results and the view all live in the mm result's storage.
    storages = {n["target"]: n["value"]["storage"] for n in graph["nodes"] if n["kind"] == "call_function"}
    assert storages["aten.add_.Tensor"] == storages["aten.relu_.default"] == storages["aten.mm.default"]
    assert storages["aten.t.default"] == storages["aten.mm.default"]
    # Kwarg-only arguments are recorded as such.
    add = op_schema_entry(torch.ops.aten.add_.Tensor)
    assert {"name": "alpha", "kwarg_only": True} in add["arguments"]
    # A graph without autograd tags is all forward.
    assert {n["phase"] for n in graph["nodes"]} == {"forward"}


def test_op_tags_and_recompute_tags_are_exported_only_when_set():
    from torch.utils.checkpoint import CheckpointPolicy

    def step(x, w):
        h = torch.mm(x, w)
        return torch.nn.functional.dropout(torch.nn.functional.silu(h), 0.5) * h

    gm = make_fx(step, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 4))
    policies = {"mm": CheckpointPolicy.PREFER_RECOMPUTE, "silu": CheckpointPolicy.MUST_RECOMPUTE,
                "mul_1": CheckpointPolicy.MUST_SAVE}
    for node in gm.graph.nodes:
        for prefix, policy in policies.items():
            if node.name == prefix:
                node.meta["recompute"] = policy
    graph = export_graph_module(gm)
    check_graph(graph)
    ops = graph["ops"]
    assert ops["aten.silu.default"].get("pointwise") is True
    assert ops["aten.mul.Tensor"].get("pointwise") is True
    assert "pointwise" not in ops["aten.mm.default"] and "random" not in ops["aten.mm.default"]
    random_ops = {t for t, o in ops.items() if o.get("random")}
    assert random_ops and all("dropout" in t or "bernoulli" in t or "rand" in t
                              for t in random_ops), random_ops
    assert not any(o.get("pointwise") for t, o in ops.items() if t in random_ops)
    tagged = {n["name"] for n in graph["nodes"] if n.get("recompute")}
    assert tagged == {"mm", "silu"}  # MUST_SAVE and untagged nodes carry no field
    assert all(n.get("recompute", True) is True for n in graph["nodes"])


# ---- dynamic shapes ----------------------------------------------------------------


def test_dynamic_sizes_carry_hints_and_export_installs_no_guard(llama_dynamic):
    graph, seen = llama_dynamic
    check_graph(graph)
    assert seen["before"] == seen["after"]
    symbolic = []
    for node in graph["nodes"]:
        value = node["value"]
        if value["type"] == "tensor":
            symbolic += [d for d in value["sizes"] if isinstance(d, dict)]
    assert len(symbolic) > 100
    sequence = {d["sym"]: d["hint"] for d in symbolic if re.fullmatch(r"s\d+", d["sym"])}
    assert len(sequence) == 1 and list(sequence.values()) == [256]
    assert all(d["hint"] is not None for d in symbolic)
    # The sequence length is a placeholder of its own, a sym_int with its hint.
    first = graph["nodes"][0]
    assert first["kind"] == "placeholder" and first["value"]["type"] == "sym_int"
    assert first["value"]["value"]["hint"] == 256


# ---- shipped graphs ----------------------------------------------------------------


def _readme_rows():
    rows = {}
    for line in (GRAPHS / "README.md").read_text().splitlines():
        match = re.match(r"^\|\s*`([^`]+\.json\.zst)`\s*\|(.*)\|\s*$", line)
        if match:
            cells = [c.strip() for c in match.group(2).split("|")]
            rows[match.group(1)] = cells
    return rows


def test_shipped_graphs_load_and_match_the_readme():
    rows = _readme_rows()
    assert set(rows) == {p.name for p in GRAPHS.glob("*.json.zst")}
    assert {"llama-tiny.json.zst", "gpt2-tiny.json.zst", "llama3-8b-s8192.json.zst",
            "llama-tiny-dynamic.json.zst", "llama3-8b-s8192-cuda.json.zst"} <= set(rows)
    for name, cells in rows.items():
        graph = load(GRAPHS / name)
        check_graph(graph)
        nodes, forward, backward, ops = (int(c) for c in cells[-4:])
        phases = [n["phase"] for n in graph["nodes"]]
        assert (len(phases), phases.count("forward"), phases.count("backward"), len(graph["ops"])) == (
            nodes, forward, backward, ops), name
        assert graph["metadata"]["torch"] in (GRAPHS / "README.md").read_text()


@pytest.mark.parametrize("name, attention_op, device", [
    ("llama3-8b-s8192.json.zst", "aten._scaled_dot_product_flash_attention_for_cpu.default", "cpu"),
    ("llama3-8b-s8192-cuda.json.zst", "aten._scaled_dot_product_cudnn_attention.default", "cuda:0"),
])
def test_shipped_llama3_8b_has_real_shapes(name, attention_op, device):
    graph = load(GRAPHS / name)
    attention = [n for n in graph["nodes"] if n["target"] == attention_op]
    assert len(attention) == 32
    output = attention[0]["value"]["elements"][0]
    assert output["sizes"] == [1, 32, 8192, 128] and output["dtype"] == "bfloat16"
    assert output["device"] == device
    assert {m for n in graph["nodes"] for m in n["module_stack"] if m.endswith("self_attn")} == {
        f"model.layers.{i}.self_attn" for i in range(32)}


# ---- end to end through the C++ CLI ------------------------------------------------


def _cli() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("SPILLWAY_CLI") or REPO / "build/release/src/cli/spillway")
    if not path.exists():
        pytest.fail(f"the spillway command is not built at {path}: run scripts/test "
                    "(or set SPILLWAY_CLI to the binary)")
    return path


def test_cli_validates_and_plans_an_exported_graph(llama, tmp_path):
    cli = _cli()
    _, graph = llama
    path = tmp_path / "llama-tiny.json.zst"
    save(graph, path)
    validate = subprocess.run([cli, "validate", path], capture_output=True, text=True)
    assert validate.returncode == 0, validate.stderr
    assert f"{len(graph['nodes'])} nodes" in validate.stdout

    def plan(*options):
        run = subprocess.run([cli, "plan", path, "--json", "--min-bytes", "65536", *options],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    # The default scope (self_attn) plans and reports a decision for every value.
    default = plan()
    assert default["nodes"] == len(graph["nodes"])
    assert default["scope"] == "self_attn"
    # In a real Hugging Face Llama every large self_attn activation read by
    # backward is a view, non-contiguous (rotary on transposed q/k, SDPA's
    # output), or feeds the tuple-returning SDPA (mask, repeat_kv clones), so
    # the seed rules choose none there; the MLP's activations are offloadable.
    mlp = plan("--scope", "mlp")
    assert mlp["chosen"] > 0
    assert mlp["bytes_offloaded"] >= 65536 * mlp["chosen"]


def test_get_attr_constants_and_non_finite_literals_are_exported():
    class WithConstant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.full((4, 4), 2.0))

        def forward(self, x):
            return torch.clamp(x * self.scale, max=float("inf"))

    gm = torch.fx.symbolic_trace(WithConstant())
    graph = export_graph_module(gm)
    check_graph(graph)
    scale = next(n for n in graph["nodes"] if n["kind"] == "get_attr")
    assert scale["value"]["sizes"] == [4, 4] and scale["value"]["dtype"] == "float32"
    clamp = next(n for n in graph["nodes"] if n["target"].endswith("clamp"))
    assert clamp["kwargs"]["max"] == {"other": "inf"}
