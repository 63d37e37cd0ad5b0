"""Export PyTorch joint forward+backward FX graphs to the Spillway graph format.

    from spillway.fx_export import export_joint_graph, save
    graph = export_joint_graph(model, (input_ids,), loss_fn=lambda m, ids: m(ids, labels=ids).loss)
    save(graph, "model.json.zst")

The format is docs/graph-format.md; the CLI is `python -m spillway.fx_export`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from ._capture import capture_joint_graph
from ._io import dumps, load, save
from ._serialize import FORMAT, VERSION, ExportError, export_graph_module, op_schema_entry

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
    """
    module_names = {n: type(m) for n, m in model.named_modules(remove_duplicate=False)}
    step = (lambda *a, **k: loss_fn(model, *a, **k)) if loss_fn is not None else model
    info = {**_versions(), "exporter": EXPORTER, "model": type(model).__name__,
            "decompositions": decompositions or "none",
            "capture": "torch.compile(fullgraph=True) + aot_autograd: partition_fn input"}
    info.update(metadata or {})

    def on_joint(joint_module, _joint_inputs, num_fwd_outputs):
        info["num_fwd_outputs"] = str(num_fwd_outputs)
        return export_graph_module(joint_module, module_names=module_names,
                                   name=name, metadata=info)

    return capture_joint_graph(step, tuple(example_inputs), example_kwargs, on_joint=on_joint,
                               dynamic=dynamic, decompositions=decompositions)
