"""Measure every call_function node of a joint graph by running it on real tensors.

The joint graph (the partitioner's input) is executed node by node with a
torch.fx.Interpreter, as one eager training step: forward, then backward,
with tangents of ones for the outputs that need them. Values are freed at
their last use, so memory behaves as in a real step (weights, inputs and
tangents live throughout; every other value only until its last reader).

On CUDA each node sits between two CUDA events on the current stream, so a
node's time is the GPU time its kernels took (plus launch latency when the
GPU was idle waiting for the host). On the CPU the clock is time.perf_counter
around the call: good enough to exercise the path in CI, meaningless as a
forecast of a GPU step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Any, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from ._serialize import ExportError, dim

CUDA_METHOD = "per-node CUDA events, eager execution of the joint graph"
CPU_METHOD = ("per-node time.perf_counter, eager execution of the joint graph on the CPU "
              "(exercises the path; meaningless as a GPU forecast)")


@dataclasses.dataclass
class NodeTimes:
    """Median milliseconds per call_function node, and how they were measured."""

    ms: dict[str, float]  # node name -> median over the timed passes
    method: str
    device: str           # "NVIDIA H200 (cuda:0)", "cpu"
    passes: int
    warmup_passes: int
    wall_ms: float        # one untimed pass of the whole graph, synchronized at both ends
    allocated_before_bytes: int | None = None  # CUDA: allocated when the untimed pass began
    peak_allocated_bytes: int | None = None    # CUDA: peak allocated during it

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())

    def metadata(self) -> dict[str, str]:
        """The graph metadata entries that say how the times were taken."""
        info = {
            "timing": self.method,
            "timing_device": self.device,
            "timing_torch": torch.__version__,
            "timing_passes": str(self.passes),
            "timing_warmup_passes": str(self.warmup_passes),
            "timing_statistic": "median over the timed passes, per node",
            "timing_nodes": str(len(self.ms)),
            "timing_total_node_ms": f"{self.total_ms:.3f}",
            "timing_untimed_pass_wall_ms": f"{self.wall_ms:.3f}",
        }
        if self.peak_allocated_bytes is not None:
            info["timing_allocated_before_pass_bytes"] = str(self.allocated_before_bytes)
            info["timing_peak_allocated_bytes"] = str(self.peak_allocated_bytes)
        return info


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy with its own nodes (same names and order), immune to later edits of gm's
    graph and of its nodes' metadata dicts (the partitioner edits both in place)."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    if output is not None:
        graph.output(output[0] if isinstance(output, tuple) else output)
    return torch.fx.GraphModule(gm, graph)


def fake_tensors_in(model: torch.nn.Module, values: Sequence[Any]) -> str | None:
    """What of the model or the values is a FakeTensor or on the meta device, or None."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(tensor, FakeTensor) or tensor.is_meta:
            return f"the parameter or buffer '{name}'"
    for index, value in enumerate(values):
        if isinstance(value, torch.Tensor) and (isinstance(value, FakeTensor) or value.is_meta):
            return f"input {index}"
    return None


def _hint_sizes(tensor: torch.Tensor) -> list[int]:
    sizes = []
    for size in tensor.shape:
        encoded = dim(size)
        sizes.append(encoded["hint"] if isinstance(encoded, dict) else encoded)
    return sizes


def joint_inputs(joint: torch.fx.GraphModule, graph_inputs: Sequence[Any]) -> list:
    """Values for the joint graph's placeholders, in order.

    Primals are dynamo's graph inputs (graph_inputs, from capture_joint_graph's
    on_graph_inputs) with repeats of one tensor dropped, as aot_autograd
    dedupes them; each must match its placeholder's dtype and sizes. Tangents
    are ones of the placeholder's dtype, sizes (hints) and device.
    Raises ExportError naming the placeholder that does not match.
    """
    seen: set[int] = set()
    primal_values = []
    for value in graph_inputs:
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                continue
            seen.add(id(value))
        primal_values.append(value)
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    primals = [n for n in placeholders if not n.name.startswith("tangents")]
    tangents = [n for n in placeholders if n.name.startswith("tangents")]
    if len(primals) != len(primal_values):
        raise ExportError(
            f"[fx_export] the joint graph has {len(primals)} primals but dynamo compiled "
            f"{len(primal_values)} distinct inputs; cannot time it")
    values: list = []
    for node, value in zip(primals, primal_values):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.dtype != val.dtype or (
                    list(value.shape) != _hint_sizes(val)):
                got = (f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise ExportError(
                    f"[fx_export] placeholder {node.name}: expected {val.dtype} "
                    f"{_hint_sizes(val)}, dynamo's input is {got}; cannot time the graph")
        values.append(value)
    for node in tangents:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ExportError(f"[fx_export] placeholder {node.name}: a tangent that is not a tensor")
        values.append(torch.ones(_hint_sizes(val), dtype=val.dtype, device=val.device))
    return values


class _CpuClock:
    def __init__(self, nodes: Sequence[torch.fx.Node]) -> None:
        self._started = 0.0
        self._ms: dict[torch.fx.Node, float] = {}

    def start(self, node: torch.fx.Node) -> None:
        self._started = time.perf_counter()

    def stop(self, node: torch.fx.Node) -> None:
        self._ms[node] = (time.perf_counter() - self._started) * 1e3

    def read(self) -> dict[torch.fx.Node, float]:
        return dict(self._ms)


class _CudaClock:
    """Two events per node on the current stream, reused pass after pass."""

    def __init__(self, nodes: Sequence[torch.fx.Node]) -> None:
        self._starts = {n: torch.cuda.Event(enable_timing=True) for n in nodes}
        self._ends = {n: torch.cuda.Event(enable_timing=True) for n in nodes}

    def start(self, node: torch.fx.Node) -> None:
        self._starts[node].record()

    def stop(self, node: torch.fx.Node) -> None:
        self._ends[node].record()

    def read(self) -> dict[torch.fx.Node, float]:
        torch.cuda.synchronize()
        return {n: self._starts[n].elapsed_time(self._ends[n]) for n in self._starts}


class _Runner(torch.fx.Interpreter):
    """An Interpreter that frees values at their last use and times call_function nodes."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.clock: _CpuClock | _CudaClock | None = None
        self._node: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self._node = n
        return super().run_node(n)

    def call_function(self, target, args, kwargs) -> Any:
        if self.clock is None:
            return super().call_function(target, args, kwargs)
        self.clock.start(self._node)
        result = super().call_function(target, args, kwargs)
        self.clock.stop(self._node)
        return result

    def one_pass(self, inputs: Sequence[Any]) -> None:
        with torch.no_grad():
            outputs = self.run(*inputs, enable_io_processing=False)
        del outputs
        self.env.clear()  # values no node reads (the outputs) are still here


def _device_of(inputs: Sequence[Any]) -> torch.device:
    devices = {v.device for v in inputs if isinstance(v, torch.Tensor)}
    cuda = sorted((d for d in devices if d.type == "cuda"), key=str)
    if cuda:
        return cuda[0]
    if devices - {torch.device("cpu")}:
        raise ExportError(f"[fx_export] timing runs on CUDA or the CPU, not on {sorted(map(str, devices))}")
    return torch.device("cpu")


def time_joint_graph(
    joint: torch.fx.GraphModule, inputs: Sequence[Any], *, passes: int = 3, warmup_passes: int = 1,
) -> NodeTimes:
    """Run the joint graph warmup_passes times untimed, once more untimed for the
    wall time, then `passes` times with a clock around every call_function node;
    return each node's median time.

    inputs: real values for every placeholder (joint_inputs). The device is
    that of the inputs (CUDA when any input is on a GPU). Holds nothing after
    it returns: every value the graph computed is freed (and on CUDA the
    caching allocator's free blocks are released).
    Raises ValueError for passes < 1, ExportError when a node's time is not a
    finite number >= 0.
    """
    if passes < 1 or warmup_passes < 0:
        raise ValueError(f"[fx_export] passes must be >= 1 and warmup_passes >= 0, got "
                         f"{passes} and {warmup_passes}")
    device = _device_of(inputs)
    on_cuda = device.type == "cuda"
    nodes = [n for n in joint.graph.nodes if n.op == "call_function"]
    runner = _Runner(joint)
    samples: dict[torch.fx.Node, list[float]] = {n: [] for n in nodes}
    before = peak = None
    with torch.cuda.device(device) if on_cuda else contextlib.nullcontext():
        try:
            for _ in range(warmup_passes):
                runner.one_pass(inputs)
            if on_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            runner.one_pass(inputs)
            if on_cuda:
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
            wall_ms = (time.perf_counter() - start) * 1e3
            for _ in range(passes):
                clock = _CudaClock(nodes) if on_cuda else _CpuClock(nodes)
                runner.clock = clock
                runner.one_pass(inputs)
                runner.clock = None
                for node, ms in clock.read().items():
                    samples[node].append(ms)
        finally:
            runner.env.clear()
            if on_cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    ms = {}
    for node in nodes:
        median = statistics.median(samples[node])
        if not (math.isfinite(median) and median >= 0):
            raise ExportError(f"[fx_export] node {node.name}: measured time {median} ms is not "
                              "a finite number >= 0")
        ms[node.name] = median
    name = f"{torch.cuda.get_device_name(device)} ({device})" if on_cuda else "cpu"
    return NodeTimes(ms=ms, method=CUDA_METHOD if on_cuda else CPU_METHOD, device=name,
                     passes=passes, warmup_passes=warmup_passes, wall_ms=wall_ms,
                     allocated_before_bytes=before, peak_allocated_bytes=peak)


def attach_times(graph: dict, times: NodeTimes) -> None:
    """Give every call_function node of the exported graph its time_ms (after `value`,
    where the C++ writer puts it) and add times.metadata() to the graph's metadata.
    Raises ExportError when a call_function node of the graph was not timed."""
    nodes = graph["nodes"]
    for index, entry in enumerate(nodes):
        if entry["kind"] != "call_function":
            continue
        if entry["name"] not in times.ms:
            raise ExportError(f"[fx_export] node {entry['id']} ({entry['name']}) was not timed")
        timed = {k: v for k, v in entry.items() if k != "recompute"}
        timed["time_ms"] = round(times.ms[entry["name"]], 6)
        if "recompute" in entry:
            timed["recompute"] = entry["recompute"]
        nodes[index] = timed
    graph["metadata"].update(times.metadata())
