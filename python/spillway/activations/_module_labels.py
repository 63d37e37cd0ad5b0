"""How error messages name a model's modules (shared by the eager and compiled paths)."""

from __future__ import annotations

from torch import nn


def leaf_name(qualified: str) -> str:
    """The last component of a qualified module name ("mlp" for "model.layers.3.mlp")."""
    return qualified.rsplit(".", 1)[-1]


def module_labels(model: nn.Module, limit: int = 12) -> str:
    """The first `limit` distinct "leaf (Class)" labels of `model`'s modules, in order."""
    seen: list[str] = []
    for name, module in model.named_modules():
        label = f"{leaf_name(name) or '<root>'} ({type(module).__name__})"
        if label not in seen:
            seen.append(label)
    more = len(seen) - limit
    return ", ".join(seen[:limit]) + (f" and {more} more" if more > 0 else "")
