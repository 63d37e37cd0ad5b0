"""The timed joint-graph export (`python -m spillway.fx_export --time`).

Every call_function node of the exported graph carries a measured time_ms
that the format and the C++ reader accept, the metadata says how the times
were taken, timing changes nothing else in the export, fake-tensor models are
refused before anything is captured, and the t1 presets are the T1
benchmark's own model. The CUDA test times on the GPU (CUDA events).
"""
from __future__ import annotations

import gc
import json
import math
import os
import sys

import pytest
import torch

from graph_format import check_graph
from spillway.fx_export import _io, dumps, export_joint_graph, load, save
from spillway.fx_export.__main__ import main
from spillway.fx_export._models import PRESETS, _llama, t1_benchmark
from spillway.fx_export._timing import CPU_METHOD, CUDA_METHOD

if os.environ.get("SPILLWAY_REQUIRE_EXTENSION") == "1":
    from spillway import _C  # scripts/test built it: failing to import is a failure
else:
    _C = None  # _extension() imports it or skips

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")


def _extension():
    if _C is not None:
        return _C
    try:
        from spillway import _C as extension
    except ImportError:
        pytest.skip("spillway._C is not built (cmake --preset python && cmake --build --preset python)")
    return extension


def _export(preset_name: str, *, time_nodes: bool, **overrides) -> dict:
    preset = PRESETS[preset_name](**overrides)
    return export_joint_graph(
        preset.model, preset.args, loss_fn=lambda _model, *a: preset.fn(*a),
        name=preset_name, metadata={"preset": preset_name, **preset.metadata},
        time_nodes=time_nodes, time_passes=2)


@pytest.fixture(scope="module")
def timed(tmp_path_factory):
    """t1-tiny timed on the CPU through the CLI, read back from its .json.zst."""
    path = tmp_path_factory.mktemp("timed") / "t1-tiny.json.zst"
    assert main(["--model", "t1-tiny", "--time", "--time-passes", "2", "--out", str(path)]) == 0
    return load(path)


def test_every_call_function_node_has_a_finite_time(timed):
    check_graph(timed)
    kinds = {n["kind"] for n in timed["nodes"]}
    assert "call_function" in kinds
    for node in timed["nodes"]:
        if node["kind"] == "call_function":
            assert math.isfinite(node["time_ms"]) and node["time_ms"] >= 0, node["name"]
        else:
            assert "time_ms" not in node, node["name"]
    # Where the C++ writer puts it: after `value`.
    mm = next(n for n in timed["nodes"] if n["target"] == "aten.mm.default")
    assert list(mm)[list(mm).index("value") + 1] == "time_ms"


def test_metadata_says_how_the_times_were_taken(timed):
    meta = timed["metadata"]
    assert meta["timing"] == CPU_METHOD and "meaningless as a GPU forecast" in meta["timing"]
    assert meta["timing_device"] == "cpu"
    assert meta["timing_passes"] == "2" and meta["timing_warmup_passes"] == "1"
    assert meta["timing_torch"] == torch.__version__
    timed_nodes = [n for n in timed["nodes"] if "time_ms" in n]
    assert meta["timing_nodes"] == str(len(timed_nodes))
    total = sum(n["time_ms"] for n in timed_nodes)
    assert float(meta["timing_total_node_ms"]) == pytest.approx(total, abs=1e-2)
    assert float(meta["timing_untimed_pass_wall_ms"]) > 0
    assert "timing_peak_allocated_bytes" not in meta  # a CUDA figure


def test_timing_changes_nothing_else_in_the_export(timed):
    plain = _export("t1-tiny", time_nodes=False)
    untimed_nodes = [{k: v for k, v in n.items() if k != "time_ms"} for n in timed["nodes"]]
    assert untimed_nodes == plain["nodes"]
    assert timed["ops"] == plain["ops"]
    assert {k: v for k, v in timed["metadata"].items() if not k.startswith("timing")} == plain["metadata"]


def test_the_cpp_reader_accepts_the_times(timed):
    extension = _extension()
    # The planner binding parses the graph with the C++ reader, which validates time_ms.
    extension.plan_activation_offload(dumps(timed), mode="none")
    broken = json.loads(dumps(timed))
    node = next(n for n in broken["nodes"] if "time_ms" in n)
    node["time_ms"] = -1.0
    with pytest.raises(ValueError, match=rf"node {node['id']} \({node['name']}\): field 'time_ms'"):
        extension.plan_activation_offload(dumps(broken), mode="none")


def test_fake_tensor_models_are_refused_before_capture(capsys):
    # A one-layer Llama built from FakeTensors, as the llama3-8b preset is.
    preset = _llama(hidden=64, layers=1, heads=2, kv_heads=1, mlp=128, vocab=128, batch=1, seq=16,
                    dtype=torch.float32, fake=True, dynamic=False, tie=False)
    with pytest.raises(ValueError, match=r"^\[fx_export\] timing runs the joint graph on real "
                                         r"tensors, but the parameter or buffer '.*' is a FakeTensor"):
        export_joint_graph(preset.model, preset.args, loss_fn=lambda _m, *a: preset.fn(*a),
                           time_nodes=True)
    with pytest.raises(SystemExit):
        main(["--model", "llama3-8b", "--seq", "64", "--time", "--out", os.devnull])
    assert "--time needs real tensors, and preset llama3-8b is built from FakeTensors" in \
        capsys.readouterr().err


def test_timing_through_the_api_on_a_plain_module():
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(32, 64)
            self.down = torch.nn.Linear(64, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x))).square().mean()

    torch.manual_seed(0)
    graph = export_joint_graph(Mlp(), (torch.randn(16, 32),), time_nodes=True, time_passes=1)
    check_graph(graph)
    times = [n["time_ms"] for n in graph["nodes"] if n["kind"] == "call_function"]
    assert times and all(math.isfinite(t) and t >= 0 for t in times)
    assert graph["metadata"]["timing_passes"] == "1"
    with pytest.raises(ValueError, match="time_passes must be >= 1"):
        export_joint_graph(Mlp(), (torch.randn(16, 32),), time_nodes=True, time_passes=0)


def test_t1_presets_are_the_benchmarks_model():
    bench = t1_benchmark()
    # BENCHMARKS.md, workload T1.
    assert bench.T1 == dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                            num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                            batch=4, seq=4096)
    preset = PRESETS["t1-tiny"]()
    model, ids = bench._build(bench.TINY, "cpu", torch.bfloat16)
    assert preset.model.config.to_dict() == model.config.to_dict()
    assert preset.model.config.tie_word_embeddings is False
    ours = {n: (p.shape, p.dtype) for n, p in preset.model.named_parameters()}
    assert ours == {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    assert torch.equal(preset.args[0], ids)
    assert preset.metadata["construction"] == "bench/torch/t1.py _build(TINY shape)"
    assert (preset.metadata["batch"], preset.metadata["seq"], preset.metadata["dtype"]) == (
        str(bench.TINY["batch"]), str(bench.TINY["seq"]), "bfloat16")


def test_zst_round_trips_through_libzstd_alone(tmp_path, monkeypatch):
    if _io._libzstd() is None:
        pytest.skip("libzstd is not installed")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard fails
    monkeypatch.setattr(_io.shutil, "which", lambda _name: None)
    graph = {"format": "spillway.graph", "version": 1, "metadata": {"x": "y" * 100000},
             "ops": {}, "nodes": []}
    save(graph, tmp_path / "g.json.zst")
    assert (tmp_path / "g.json.zst").stat().st_size < 10000
    assert load(tmp_path / "g.json.zst") == graph
    monkeypatch.undo()
    assert load(tmp_path / "g.json.zst") == graph  # and read back by the usual route


@needs_cuda
def test_cuda_times_come_from_cuda_events_and_free_their_memory():
    # Big enough that a leaked step would show: ~40 MiB of activations.
    preset = PRESETS["t1-tiny"](device="cuda", batch=4, seq=2048)
    for dtype in (torch.bfloat16, torch.float32):  # cuBLAS(Lt) workspaces stay allocated
        a = torch.ones(64, 64, device="cuda", dtype=dtype)
        (a @ a).sum().item()
    del a
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = export_joint_graph(preset.model, preset.args, loss_fn=lambda _m, *a: preset.fn(*a),
                               time_nodes=True, time_passes=3)
    gc.collect()
    assert torch.cuda.memory_allocated() - before < 4 << 20  # the step's values were freed
    check_graph(graph)
    meta = graph["metadata"]
    assert meta["timing"] == CUDA_METHOD
    assert meta["timing_device"] == f"{torch.cuda.get_device_name()} (cuda:{torch.cuda.current_device()})"
    step_bytes = int(meta["timing_peak_allocated_bytes"]) - int(meta["timing_allocated_before_pass_bytes"])
    assert step_bytes > 16 << 20
    times = [n["time_ms"] for n in graph["nodes"] if n["kind"] == "call_function"]
    assert all(math.isfinite(t) and t >= 0 for t in times)
    mms = [n["time_ms"] for n in graph["nodes"] if n["target"] == "aten.mm.default"]
    assert mms and all(t > 0 for t in mms)  # a kernel ran between the events
    attention = [n for n in graph["nodes"] if "scaled_dot_product" in n["target"]]
    assert attention and attention[0]["value"]["elements"][0]["device"].startswith("cuda")
    assert float(meta["timing_untimed_pass_wall_ms"]) > 0
