"""Export PyTorch joint forward+backward FX graphs to the Spillway graph format.

    from spillway.fx_export import export_joint_graph, save
    graph = export_joint_graph(model, (input_ids,), loss_fn=lambda m, ids: m(ids, labels=ids).loss)
    save(graph, "model.json.zst")

With time_nodes=True the joint graph is also run on the model's real tensors
and every call_function node gets a measured `time_ms` (_timing.py says how).
The format is docs/graph-format.md; the CLI is `python -m spillway.fx_export`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from ._capture import capture_joint_graph
from ._io import dumps, load, save
from ._serialize import FORMAT, VERSION, ExportError, export_graph_module, op_schema_entry
from ._timing import attach_times, copy_graph_module, fake_tensors_in, joint_inputs, time_joint_graph

__all__ = [
    "FORMAT", "VERSION", "ExportError", "capture_joint_graph", "dumps", "export_graph_module",
    "export_joint_graph", "load", "op_schema_entry", "save",
]

EXPORTER = "spillway.fx_export/1"


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    try:
        import transformers

        versions["transformers"] = transformers.__version__
    except ImportError:
        pass
    return versions


def export_joint_graph(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    loss_fn: Callable[..., Any] | None = None,
    dynamic: Sequence[tuple[int, int]] = (),
    decompositions: str | None = None,
    name: str = "",
    metadata: Mapping[str, str] | None = None,
    time_nodes: bool = False,
    time_passes: int = 3,
) -> dict:
    """The joint forward+backward graph of one training step, as a Spillway graph dict.

    The step is loss_fn(model, *example_inputs, **example_kwargs), or
    model(*example_inputs, **example_kwargs) when loss_fn is None; every output
    that requires grad gets a tangent. The graph is the one aot_autograd hands
    to its partitioner under torch.compile(fullgraph=True). Inputs and
    parameters may be FakeTensors (nothing real is allocated then). dynamic:
    (positional input index, dim) pairs traced as symbolic sizes.
    decompositions: None (ATen as dispatched) or "inductor".
    Module stacks use model.named_modules() names. Does not modify the model;
    raises RuntimeError if the step does not compile as one graph, ExportError
    if the graph cannot be expressed in the format.

    time_nodes: after the capture, run the joint graph on the model's real
    parameters and inputs (on their device; tangents of ones), one warm-up
    pass, one untimed pass (its wall time) and time_passes timed passes, and
    give every call_function node the median of its times as `time_ms`; the
    metadata then says how (timing_* keys: method, device, passes, torch, the
    total of the node times and the untimed pass's wall time). CUDA times come
    from CUDA events; CPU times from time.perf_counter, which say nothing about
    a GPU. The step needs the memory of one real training step. Raises
    ValueError before capturing anything when the model or the inputs hold
    FakeTensors (timing needs real tensors).
    """
    if time_nodes:
        if time_passes < 1:
            raise ValueError(f"[fx_export] time_passes must be >= 1, got {time_passes}")
        fake = fake_tensors_in(model, [*example_inputs, *(example_kwargs or {}).values()])
        if fake is not None:
            raise ValueError(
                f"[fx_export] timing runs the joint graph on real tensors, but {fake} is a "
                "FakeTensor (a fake-tensor preset such as llama3-8b); time a real-tensor "
                "preset (llama-tiny, t1, t1-tiny) instead")
    module_names = {n: type(m) for n, m in model.named_modules(remove_duplicate=False)}
    step = (lambda *a, **k: loss_fn(model, *a, **k)) if loss_fn is not None else model
    info = {**_versions(), "exporter": EXPORTER, "model": type(model).__name__,
            "decompositions": decompositions or "none",
            "capture": "torch.compile(fullgraph=True) + aot_autograd: partition_fn input"}
    info.update(metadata or {})

    def on_joint(joint_module, _joint_inputs, num_fwd_outputs):
        info["num_fwd_outputs"] = str(num_fwd_outputs)
        graph = export_graph_module(joint_module, module_names=module_names,
                                    name=name, metadata=info)
        # The partitioner runs next and edits the joint graph in place.
        return graph, copy_graph_module(joint_module) if time_nodes else None

    graph_inputs: list[list] = []
    graph, joint = capture_joint_graph(
        step, tuple(example_inputs), example_kwargs, on_joint=on_joint, dynamic=dynamic,
        decompositions=decompositions, on_graph_inputs=graph_inputs.append if time_nodes else None)
    if time_nodes:
        if len(graph_inputs) != 1:
            raise RuntimeError(f"[fx_export] expected one compiled graph, got {len(graph_inputs)}")
        inputs = joint_inputs(joint, graph_inputs.pop())
        attach_times(graph, time_joint_graph(joint, inputs, passes=time_passes))
    return graph
