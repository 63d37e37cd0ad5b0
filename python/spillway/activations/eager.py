"""Eager activation offload: saved tensors of chosen modules go to host memory.

    with spillway.offload_activations(model, scope="self_attn", min_bytes=1 << 20):
        loss = model(x).loss
    loss.backward()

Under the context, autograd's saved-tensor hooks hand every tensor saved for
backward to spillway. Those saved while a *scope module* runs (a layer) are
copied to pinned host memory with spillway::offload and their device memory is
handed back to the caching allocator; backward brings them back with
spillway::reload, a layer or more ahead of need. Everything else is left alone.

Scope. `scope` names modules by the last component of their qualified name
("self_attn" matches model.layers.3.self_attn) or by class name
("LlamaDecoderLayer"); a list of such names matches any of them. None or "*"
means every layer of any model:
  * with an nn.ModuleList: every element of the largest one (the decoder layers
    of Hugging Face models: model.layers, transformer.h), at positions 0..n-1,
    then every module with parameters of its own outside that list
    (embeddings, the final norm, lm_head), outermost, in registration order;
  * without one, the model read as a sequence, in registration order: an
    nn.Sequential's layers are all its children (a ReLU between two Linears is
    a layer too: it saves the tensor the next Linear saves); another module's
    layers are its children that hold parameters (block1, block2, head). A
    layer that is an nn.Sequential gives way to its own layers, and so does a
    lone layer with layers inside (a wrapper such as self.net).
A model with no submodule holding parameters has no layers to offload
(ValueError). A scope module called inside another one belongs to the outer
one's layer.

Eligible tensors: saved while a scope module runs forward, on the target device
(`device`, default the device of the model's first parameter when that is a
CUDA device), storage of at least min_bytes bytes, not the storage of a
parameter or buffer of the model, a plain strided tensor. A CPU model has no
device memory to spare: without device= the context offloads nothing, warns
once (UserWarning) and stats()["inactive"] says why; device="cpu" drives the
whole path through the runtime's fake copy backend (how the tests run it).

Design decisions (see also _eager_store.py):
  * Deduplication by untyped storage. A storage is offloaded once, whole, as a
    flat uint8 tensor; every saved view of it (non-contiguous views, aliases,
    the q/k/v slices of one projection, the rotary tables every layer saves) is
    rebuilt on unpack with its dtype, size, stride and storage offset.
  * Forward release lag. The D2H starts in pack; its wait (which lets the device
    memory go) runs at the end of the scope module `lag` layers later (default
    1: the copy of layer i overlaps the compute of layer i+1).
  * The tail stays resident. At context exit, or when backward starts inside
    the context, the waits still pending (the last `lag` layers, needed first by
    backward) run but their device memory is kept: backward reads them without a
    reload and without a stall. Their host copies exist all the same, so a
    second backward (retain_graph) reloads them. torchtune's OffloadActivations
    does the same for its last stashed activations.
  * Backward prefetch. The first unpack of layer i reloads all of layer i and
    starts the reloads of the `prefetch` layers before it (i-1, ..., i-prefetch,
    of the same forward pass); each unpack waits only for its own storage. A
    device copy is let go once every live handle of its storage was unpacked in
    the current backward; what a backward prefetched and did not use is waited
    for and let go when that backward ends.
  * Version check. Saved-tensor hooks switch autograd's in-place check off; the
    context checks versions itself and raises autograd's own error.
  * Nesting. PyTorch runs only the innermost pair of saved-tensor hooks, so
    contexts cooperate. A context entered inside another spillway context (on
    a different model) packs what is saved in its own layers and hands every
    other saved tensor to the outer context's pack, which applies its own
    scope (so `with offload_activations(a): with offload_activations(b):`
    offloads the layers of both, whichever model calls the other). Each pack
    result remembers the context that made it, and unpack goes to that
    context. Two contexts on one model are an error (its hooks would run
    twice). Foreign hooks win: if another library's saved-tensor hooks are
    innermost when the context is entered (torch.utils.checkpoint's, another
    offloader's), they own the saved tensors; the context stays inactive
    (stats()["inactive"] says why). Inside the context, torch.utils.checkpoint
    regions work as usual (their hooks are innermost there).
  * A full pinned pool is not an error: the tensor stays on the device
    (skipped reason "host_full").

Thread-safety: one context serves one model; its state is guarded by a lock,
so backward may run on autograd's device threads. A nested context never holds
its lock while it calls the outer one.
"""

from __future__ import annotations

import collections
import itertools
import threading
import warnings
import weakref
from typing import Iterable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from spillway import _C, ops
from spillway._device import parse_device, usable_device
from spillway._device import shown as _shown
from spillway.activations._model_weights import ModelWeights
from spillway.activations._module_labels import leaf_name, module_labels
from spillway.activations import _eager_store
from spillway.activations._eager_store import (_Entry, _Handle, _Kept, _Layer, check_version,
                                               version_witness)

__all__ = ["offload_activations", "OffloadActivations"]

_SKIP_REASONS = ("outside_scope", "layer_not_selected", "backward", "unsupported",
                 "other_device", "parameter", "small", "host_full")

# Models with an active context: two contexts on one model would double its hooks.
_active_models: "weakref.WeakKeyDictionary[nn.Module, OffloadActivations]" = (
    weakref.WeakKeyDictionary())


class _DefaultScope(str):
    """The type of scope's default, "self_attn": a memory budget tells it from a passed one."""


_DEFAULT_SCOPE = _DefaultScope("self_attn")

# Note [A leaner host path]: what the contexts read at every step and block call and
# find unchanged is kept instead: the model's weights between steps (Note [Weights
# between calls], _model_weights.py), what a learned table's templates read
# (_eager_budget.py, SaveParts.needs_of), and a planned step's saves skip _head_save
# before the head's layer; each offloaded save's version witness is made in C++
# (_eager_store.version_witness: ~0.3 us against ~2). Results are the same bits either
# way (tests run both). Off until measured on T1: on the 2-core CPU host (2026-12-08,
# host bench) a by-position block's hooks cost ~130 us less with it, 5-9 % of what they
# add to a plain forward.
_LEAN_HOST = False


_FastKept = _C.FastKept


def _unpack_fast_kept(packed) -> torch.Tensor:
    """_Kept.unpack for a save kept in C++ (Note [Kept saves in C++], fast_keep.cc)."""
    t = packed.tensor
    check_version(t.dtype, t.device, t.shape, packed.version, t._version)
    return t


def offload_activations(model: nn.Module, scope: str | Iterable[str] | None = _DEFAULT_SCOPE,
                        min_bytes: int = 1 << 20, prefetch: int = 1,
                        device: torch.device | str | None = None,
                        lag: int = 1,
                        layers: Iterable[int] | None = None, *,
                        memory_budget: int | float | str | None = None,
                        device_profile: str | dict | None = None,
                        profile_steps: int = 2) -> "OffloadActivations":
    """The context manager that offloads the activations saved by `model`'s scope modules.

    Args:
      model: the module whose forward runs under the context.
      scope: which submodules are layers: a module name ("self_attn"), a class
        name ("LlamaDecoderLayer"), a list of names, or None / "*" for every
        layer of the model (its largest nn.ModuleList and the modules with
        parameters outside it; without a ModuleList, the children of an
        nn.Sequential, or the children holding parameters; see the module
        docstring). With memory_budget, an optional restriction: the blocks
        the plan may act on (default: every block, the elements of the
        model's largest nn.ModuleList).
      min_bytes: storages smaller than this stay on the device.
      prefetch: how many layers ahead of need backward reloads (0: on demand).
      device: the device whose tensors are offloaded (cpu or cuda[:N]); default
        the model's device when it is a CUDA device. A CPU model without
        device= offloads nothing and warns; device="cpu" drives the fake
        copy backend (for testing).
      lag: how many layers later the forward wait of a layer runs (0: at the end
        of the layer itself); the last `lag` layers stay resident for backward.
      layers: which scope modules offload, as positions in the scope's module
        order (model.named_modules() order; 0 is the first decoder layer);
        None: all. The others keep their saved tensors on the device but still
        count for `lag` and `prefetch`, so `layers=range(3), lag=8` offloads the
        first three layers and gives each copy eight layers of compute to hide
        behind before its wait.
      memory_budget: peak device bytes a step may use, weights included: an
        int, a string ("12GiB", "800MiB", "1.5e9"), or a float in (0, 1], a
        fraction of the step's peak without spillway. The context then plans
        per block: keep, offload, checkpoint, or checkpoint with the block's
        saved input offloaded (see _eager_budget.py). The first
        `profile_steps` steps under the context run every block checkpointed
        and profile them; the plan applies from the next step on and is
        `ctx.plan`. Not with `layers`. `lag` is then the smallest lag: the plan
        lets each block's offloaded tensors go at the first block end by which
        their copies should have finished.
      device_profile: with memory_budget, the device profile the planner
        simulates on: a path to a device-profile JSON file
        (docs/device-profile.md) or the profile as a dict; None: the shipped
        NVIDIA H200 profile.
      profile_steps: with memory_budget, how many steps profile (>= 1): the
        first counts what each block saves, the later ones only time the blocks
        (without the counting hooks, whose Python work slows the step down).

    Raises ValueError, with a message starting "[eager]" that names the
    argument and the value received, for: a model that is not an nn.Module; a
    scope that is not a str, None or an iterable of non-empty strs (an empty
    list too), or that matches no module; scope "*" on a model with no layers
    to offload; min_bytes, prefetch or lag not an int (bools included) or
    negative; layers not an iterable of ints, or a position out of range; an
    unknown or unusable device; with memory_budget: a budget that is not a
    positive int, a parsable size string or a float in (0, 1], a model on the
    CPU without device=, layers given, a device_profile that is not a
    readable JSON file or a dict, profile_steps not an int >= 1. Entering the context raises RuntimeError
    when another context is active on the same model. With memory_budget, the
    first step after profiling raises the planner's MemoryError when the budget is below the
    smallest peak the plan can reach (the model is left as it was).
    """
    if memory_budget is not None:
        from spillway.activations._eager_budget import BudgetedOffload
        return BudgetedOffload(model, memory_budget,
                               scope=None if scope is _DEFAULT_SCOPE else scope,
                               min_bytes=min_bytes, prefetch=prefetch, device=device, lag=lag,
                               layers=layers, device_profile=device_profile,
                               profile_steps=profile_steps)
    if device_profile is not None:
        raise ValueError("[eager] device_profile is for memory_budget= planning; got "
                         f"{_shown(device_profile)} without a memory_budget")
    if profile_steps != 2:
        raise ValueError("[eager] profile_steps is for memory_budget= planning; got "
                         f"{_shown(profile_steps)} without a memory_budget")
    return OffloadActivations(model, scope=scope, min_bytes=min_bytes, prefetch=prefetch,
                              device=device, lag=lag, layers=layers)


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"[eager] {name} must be an int, got {_shown(value)}")
    if value < 0:
        raise ValueError(f"[eager] {name} must be >= 0, got {value}")
    return value


def _target_device(model: nn.Module, device) -> tuple[torch.device, bool]:
    """The device whose tensors move, and whether offload is enabled for it."""
    if device is None:
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        if first is None:
            raise ValueError("[eager] the model has no parameter or buffer to take the device "
                             "from; pass device=")
        target = first.device
        enabled = target.type == "cuda"  # a CPU model has no device memory to spare
        return usable_device(target, "eager"), enabled
    return parse_device(device, "eager"), True


def _scope_names(scope) -> list[str]:
    """The names a scope other than None or '*' holds; ValueError for anything else."""
    expected = "[eager] scope must be a module name, a class name (non-empty strings), a list " \
               "of them, None or '*'"
    if isinstance(scope, str):
        names = [scope]
    elif isinstance(scope, type):
        raise ValueError(f"{expected}; got the class {scope.__name__} itself: pass "
                         f"scope={scope.__name__!r}")
    else:
        try:
            names = list(scope)
        except TypeError:
            raise ValueError(f"{expected}; got {_shown(scope)}") from None
        if not names:
            raise ValueError(f"{expected}; got an empty list, {_shown(scope)}")
    for name in names:
        if not isinstance(name, str) or not name:
            where = "" if isinstance(scope, str) else f" in {_shown(scope)}"
            raise ValueError(f"{expected}; got {_shown(name)}{where}")
    return names


def _scope_modules(model: nn.Module, scope) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) pairs `scope` selects; ValueError when none."""
    if scope is None or (isinstance(scope, str) and scope == "*"):
        return _every_layer(model)
    names = _scope_names(scope)
    wanted = set(names)
    found = [(name, m) for name, m in model.named_modules()
             if leaf_name(name) in wanted or type(m).__name__ in wanted]
    if not found:
        raise ValueError(f"[eager] scope {scope!r} matches no module of {type(model).__name__}; "
                         f"modules there include: {module_labels(model)}")
    return found


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _every_layer(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Scope '*': the largest nn.ModuleList and what has parameters outside it, or else
    the model read as a sequence (_layer_sequence); ValueError when there is nothing."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    best = max(lists, key=lambda nm: len(nm[1]), default=None)
    if best is not None and len(best[1]) > 0:
        found = [(f"{best[0]}.{i}" if best[0] else str(i), m) for i, m in enumerate(best[1])]
        return found + _modules_outside_list(model, best[0])
    found, seen = [], set()
    for name, m in _layer_sequence("", model):
        if id(m) not in seen:  # a module registered twice is one layer
            seen.add(id(m))
            found.append((name, m))
    if not any(_holds_parameters(m) for _, m in found):
        what = ("no submodules" if next(model.children(), None) is None
                else "no submodule with parameters")
        raise ValueError(f"[eager] scope '*': a model with no layers to offload: "
                         f"{type(model).__name__} has {what}")
    return found


def _layer_sequence(prefix: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of a model without an nn.ModuleList, in registration order.

    An nn.Sequential's layers are all its children (an activation between two
    Linears saves the tensor the next one saves: it must be a layer too, or
    the storage stays on the device); another module's are its children that
    hold parameters. A child that is an nn.Sequential gives way to its own
    layers, and so does a lone layer with layers of its own (a wrapper such as
    self.net), so the sequence is as fine as the model's structure allows.
    """
    if isinstance(module, nn.Sequential):
        children = list(module.named_children())
    else:
        children = [(n, m) for n, m in module.named_children() if _holds_parameters(m)]
    layers: list[tuple[str, nn.Module]] = []
    for name, child in children:
        full = f"{prefix}.{name}" if prefix else name
        layers += _layer_sequence(full, child) if isinstance(child, nn.Sequential) else [
            (full, child)]
    if len(layers) == 1:
        return _layer_sequence(*layers[0]) or layers
    return layers


def _modules_outside_list(model: nn.Module, list_name: str) -> list[tuple[str, nn.Module]]:
    """The modules with parameters of their own outside the layer list, outermost only.

    For "*": what runs before or after the decoder layers (Llama's embed_tokens,
    final norm and lm_head; GPT-2's wte, wpe, ln_f). The final norm's saved
    hidden state sits on the device through the loss's backward, the step's
    peak, unless it moves too (measured on T1: 0.19 GiB). Ancestors of the list
    (the model itself) and modules inside a chosen one are left out.
    """
    if not list_name:
        return []  # the model is the layer list
    picked: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if not name or name == list_name or name.startswith(f"{list_name}."):
            continue
        if list_name.startswith(f"{name}."):
            continue  # an ancestor of the layer list
        if any(name.startswith(f"{outer}.") for outer, _ in picked):
            continue  # inside a module already picked
        if next(m.parameters(recurse=False), None) is not None:
            picked.append((name, m))
    return picked


def _layer_positions(layers) -> list[int] | None:
    """The positions `layers` holds (None: all); ValueError unless an iterable of ints."""
    if layers is None:
        return None
    try:
        chosen = list(layers)
    except TypeError:
        raise ValueError(f"[eager] layers must be an iterable of ints or None, got "
                         f"{_shown(layers)}") from None
    for i in chosen:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"[eager] layers must hold ints, got {_shown(i)} in "
                             f"{_shown(layers)}")
    return chosen


def _selected_layers(chosen: list[int] | None, count: int) -> frozenset | None:
    """The positions as a set (None: all); ValueError when one is out of range."""
    if chosen is None:
        return None
    for i in chosen:
        if not 0 <= i < count:
            raise ValueError(f"[eager] layers={chosen}: layer position {i} is out of range: "
                             f"the scope matches {count} modules (positions 0..{count - 1})")
    return frozenset(chosen)


def _context_of(pack_hook) -> "OffloadActivations | None":
    """The spillway context whose pack hook this is, or None (another library's)."""
    owner = getattr(pack_hook, "__self__", None)
    if isinstance(owner, OffloadActivations) and pack_hook.__func__ is OffloadActivations._pack:
        return owner
    return None


class OffloadActivations:
    """The context of offload_activations(); see the module docstring."""

    def __init__(self, model, scope="self_attn", min_bytes=1 << 20, prefetch=1, device=None,
                 lag=1, layers=None):
        if not isinstance(model, nn.Module):
            raise ValueError(f"[eager] model must be a torch.nn.Module, got {_shown(model)}")
        self._min_bytes = _check_count("min_bytes", min_bytes)
        self._prefetch = _check_count("prefetch", prefetch)
        self._lag = _check_count("lag", lag)
        positions = _layer_positions(layers)
        # The scope first: a model with nothing to offload says so, before it
        # fails to name its device.
        self._scope = _scope_modules(model, scope)
        self._device, self._enabled = _target_device(model, device)
        self._position = {id(m): i for i, (_, m) in enumerate(self._scope)}
        self._selected = _selected_layers(positions, len(self._scope))
        self._model = model

        # Re-entrant on purpose: a handle or entry destructor (it takes the lock)
        # may run from the garbage collector inside a locked region of this thread.
        self._lock = threading.RLock()
        self._active = False
        self._hooks_cm = None
        self._outer: OffloadActivations | None = None  # the spillway context entered before
        self._warned_cpu = False
        self._module_hooks = []
        self._param_storages: frozenset | set = set()
        # The model's weights between steps (Note [Weights between calls]).
        self._weights = ModelWeights(model)
        self._entries: dict = {}  # StorageWeakRef -> weakref(_Entry), storages offloaded
        self._layers: dict[int, _Layer] = {}
        self._pending: collections.deque[_Layer] = collections.deque()  # forward waits due
        self._next_layer = 0
        self._pass_id = 0
        self._depth = 0  # nesting of scope module calls
        self._current: _Layer | None = None
        self._tasks_seen: set = set()
        self._inactive: str | None = None
        self._kept_reason: str | None = None  # why _pack kept its last save
        self._stats = {"tensors_seen": 0, "tensors_offloaded": 0, "storages_offloaded": 0,
                       "bytes_offloaded": 0, "deduplicated": 0,
                       "skipped": dict.fromkeys(_SKIP_REASONS, 0),
                       "reloads_prefetched": 0, "reloads_on_demand": 0, "bytes_reloaded": 0,
                       "kept_resident": 0, "bytes_kept_resident": 0, "layers": 0,
                       "handed_to_outer": 0}

    # ---- context ------------------------------------------------------------

    def __enter__(self) -> "OffloadActivations":
        if self._active:
            raise RuntimeError("[eager] this offload_activations context is already entered")
        if not self._enabled:
            self._inactive = (f"nothing is offloaded: the model is on {self._device} and device= "
                              "was not given (offload is on for CUDA models); device='cpu' "
                              "drives the path through the fake copy backend, for testing")
            if not self._warned_cpu:
                self._warned_cpu = True
                warnings.warn(f"[eager] offload_activations will offload nothing: the model is "
                              f"on the CPU, which has no device memory to spare. Pass "
                              f"device='cpu' to drive the offload path through the fake copy "
                              f"backend anyway (for testing)", UserWarning, stacklevel=2)
            self._active = True
            return self
        if _active_models.get(self._model) is not None:
            raise RuntimeError("[eager] offload_activations is already active on this "
                               f"{type(self._model).__name__}")
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer = None if top is None else _context_of(top[0])
        if top is not None and self._outer is None:
            self._inactive = ("saved-tensor hooks were already active (torch.utils.checkpoint "
                              "or another offloader): they own the saved tensors")
            self._active = True
            return self
        self._inactive = None
        self._weights.reuse = _LEAN_HOST
        _eager_store.LEAN_WITNESS[0] = _C.version_witness if _LEAN_HOST else None
        self._param_storages = self._weights.storages()
        if self._outer is not None:  # weights shared with the outer model stay too
            self._param_storages = self._param_storages | self._outer._param_storages
        self._module_hooks = [self._model.register_forward_pre_hook(self._on_model_call)]
        for _, module in self._scope:
            self._module_hooks.append(module.register_forward_pre_hook(self._on_layer_start))
            self._module_hooks.append(
                module.register_forward_hook(self._on_layer_end, always_call=True))
        self._hooks_cm = torch.autograd.graph.saved_tensors_hooks(self._pack_hook(), self._unpack)
        self._hooks_cm.__enter__()
        _active_models[self._model] = self
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._active = False
        if self._inactive is not None:
            return
        try:
            self._hooks_cm.__exit__(*exc)
        finally:
            # Dropped: a C++ pack hook (Note [Kept saves in C++]) holding this context's
            # methods would keep it alive, unseen by the cycle collector.
            self._hooks_cm = None
            for h in self._module_hooks:
                h.remove()
            self._module_hooks = []
            self._depth = 0
            self._current = None
            _active_models.pop(self._model, None)
            self._param_storages = set()
            self._outer = None
            with self._lock:
                self._finish_forward_waits(keep_resident=True)

    def stats(self) -> dict:
        """Counters since the context was made (copies; safe to keep).

        tensors_seen: saved tensors packed; tensors_offloaded: of them, backed by a
        host copy; storages_offloaded / bytes_offloaded: unique storages moved to
        host; deduplicated: saved tensors that reused another's host copy;
        skipped: {reason: count}; reloads_prefetched / reloads_on_demand /
        bytes_reloaded: storages brought back ahead of need / when needed;
        kept_resident / bytes_kept_resident: tail storages backward read in
        place; layers: scope module calls seen; handed_to_outer: saved tensors
        passed to the outer spillway context (saved outside this context's
        layers; that context's counters have them); inactive: why nothing ran
        (the model is on the CPU and device= was not given, or foreign
        saved-tensor hooks were active), or None.
        """
        with self._lock:
            out = dict(self._stats)
            out["skipped"] = dict(self._stats["skipped"])
            out["inactive"] = self._inactive
            out["device"] = str(self._device)
            return out

    # ---- module hooks -------------------------------------------------------

    @staticmethod
    def _in_backward() -> bool:
        # A checkpoint's recompute runs modules during backward: not a forward.
        return torch._C._current_graph_task_id() != -1

    def _on_model_call(self, module, args):
        if not self._in_backward():
            self._pass_id += 1

    def _on_layer_start(self, module, args):
        if self._in_backward():
            return
        self._depth += 1
        if self._depth > 1:
            return
        with self._lock:
            # Prune before registering: the new layer has no entries yet and
            # would count as dead (it used to be dropped at once, so prefetch
            # never found layer 0, 16, 32, ...).
            if self._next_layer % 16 == 0:
                self._prune_layers()
            layer = _Layer(self._next_layer, self._pass_id, self._select_layer(module, args))
            self._next_layer += 1
            self._layers[layer.index] = layer
            self._current = layer
            self._stats["layers"] += 1

    def _select_layer(self, module, args) -> bool:
        """Whether the saved tensors of this call of a scope module may be offloaded.

        Called under the lock when a scope module starts in forward (outermost
        calls only); the budgeted context decides per call.
        """
        return self._selected is None or self._position.get(id(module)) in self._selected

    def _on_layer_end(self, module, args, output):
        if self._in_backward() or self._depth == 0:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        with self._lock:
            done = self._current
            self._current = None
            if done is None:
                return
            due = [layer for layer in self._pending
                   if layer.index + self._release_lag(layer) <= done.index]
            for layer in due:
                self._pending.remove(layer)
                self._finish_layer(layer, keep_resident=False)

    def _release_lag(self, layer: _Layer) -> int:
        """How many layers after `layer` its forward wait runs (the context's lag; the
        budgeted context's plan sets one per block call)."""
        return self._lag

    def _prune_layers(self) -> None:
        for index in [i for i, layer in self._layers.items() if layer.dead()]:
            del self._layers[index]

    # ---- forward waits ------------------------------------------------------

    def _finish_layer(self, layer: _Layer, keep_resident: bool) -> None:
        pending, layer.pending = layer.pending, []
        failures = 0
        for entry in pending:
            try:
                entry.finish_forward(keep_resident)
            except RuntimeError as e:
                failures += 1
                last = e
            if keep_resident and entry.resident:
                self._stats["kept_resident"] += 1
                self._stats["bytes_kept_resident"] += entry.nbytes
        if failures:
            warnings.warn(f"[eager] {failures} offload(s) of layer {layer.index} failed; their "
                          f"tensors stay on {self._device}: {last}", RuntimeWarning, stacklevel=3)

    def _finish_forward_waits(self, keep_resident: bool) -> None:
        while self._pending:
            self._finish_layer(self._pending.popleft(), keep_resident)

    # ---- pack ---------------------------------------------------------------

    def _skip_reason(self, t: torch.Tensor) -> str | None:
        if self._in_backward():
            return "backward"
        if self._current is None:
            return "outside_scope"
        if not self._current.selected:
            return "layer_not_selected"
        if isinstance(t, nn.Parameter):
            return "parameter"
        if (type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized
                or t.is_nested or t.is_conj() or t.is_neg()):
            return "unsupported"
        if t.device != self._device:
            return "other_device"
        return None

    def _pack(self, t: torch.Tensor):
        outer = self._outer
        if outer is not None and self._current is None:
            # Not saved in one of this context's layers: the outer context's to
            # judge (its scope, its layers). Its lock is not taken under ours.
            with self._lock:
                self._stats["handed_to_outer"] += 1
            return outer._pack(t)
        with self._lock:
            self._stats["tensors_seen"] += 1
            reason = self._skip_reason(t)
            if reason is None:
                storage = t.untyped_storage()
                nbytes = storage.nbytes()
                key = StorageWeakRef(storage)
                if key in self._param_storages:
                    reason = "parameter"
                elif nbytes == 0 or nbytes < self._min_bytes:
                    reason = "small"
            if reason is not None:
                self._stats["skipped"][reason] += 1
                self._kept_reason = reason  # Note [Kept saves in C++] (fast_keep.cc)
                return _Kept(self, t, None if reason == "backward" else self._current)
            return self._pack_offloaded(t, storage, key)

    def _pack_hook(self):
        """The pack hook the context enters (the budgeted context's may be C++)."""
        return self._pack

    def _pack_offloaded(self, t, storage, key):
        layer = self._current
        witness = version_witness(t)
        version = t._version
        ref = self._entries.get(key)
        entry = ref() if ref is not None else None
        if entry is not None and entry.reusable_for(t):
            self._stats["deduplicated"] += 1
        else:
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            try:
                entry = _Entry(self, key, layer, flat, witness, version)
            except torch.OutOfMemoryError:
                self._stats["skipped"]["host_full"] += 1
                return _Kept(self, t, layer)
            self._entries[key] = weakref.ref(entry)
            layer.pending.append(entry)
            if not self._pending or self._pending[-1] is not layer:
                self._pending.append(layer)
            self._stats["storages_offloaded"] += 1
            self._stats["bytes_offloaded"] += entry.nbytes
        layer.add(entry)
        self._stats["tensors_offloaded"] += 1
        return _Handle(entry, layer, t, witness, version)

    def _forget_entry(self, key, entry) -> None:
        """Called by a dying entry (from its __del__, where its weakref may still resolve)."""
        with self._lock:
            ref = self._entries.get(key)
            if ref is not None and ref() in (None, entry):
                del self._entries[key]

    # ---- unpack -------------------------------------------------------------

    def _unpack(self, packed):
        if packed.owner is not self:
            return packed.owner._unpack(packed)  # packed by an outer context (see _pack)
        try:
            kept = isinstance(packed, _Kept)
            if kept or type(packed) is _FastKept:
                out = packed.unpack() if kept else _unpack_fast_kept(packed)
                if packed.layer is not None:
                    self._prefetch_for_kept(packed.layer)
                return out
            packed.check_version()
        except RuntimeError:
            # This backward stops here: what it prefetched is not needed now.
            task = torch._C._current_graph_task_id()
            if task != -1 and task in self._tasks_seen:
                self._end_backward(task)
            raise
        entry = packed.entry
        with self._lock:
            task = torch._C._current_graph_task_id()
            if task != -1 and task not in self._tasks_seen:
                self._start_backward(task)
            if entry.forward_pending:
                # Unpacked before its layer's wait (backward started outside any
                # graph task, or grad_fn._saved_* read by hand): read it in place.
                self._finish_layer_of(entry)
            if task != -1:
                self._prefetch_from(packed.layer, task)
            if entry.device is None:
                self._start_reload(entry, "reloads_on_demand")
            entry.finish_reload()
            flat = entry.device
            entry.mark_unpacked(packed.serial, task)
        return packed.rebuild(flat)

    def _finish_layer_of(self, entry: _Entry) -> None:
        layer = entry.layer
        if layer in self._pending:
            self._pending.remove(layer)
        self._finish_layer(layer, keep_resident=True)

    def _start_backward(self, task) -> None:
        """First unpack of a backward: remaining forward waits run, cleanup is queued."""
        self._tasks_seen.add(task)
        self._finish_forward_waits(keep_resident=True)
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._end_backward(task))

    def _end_backward(self, task) -> None:
        """Reloads this backward started and did not use: wait, then let them go."""
        with self._lock:
            self._tasks_seen.discard(task)
            for layer in list(self._layers.values()):
                if layer.prefetched_task == task:
                    layer.prefetched_task = None
                for entry in layer.live_entries():
                    if entry.reload_pending:
                        entry.finish_reload()
                        entry.device = None

    def _prefetch_from(self, layer: _Layer, task) -> None:
        """Reloads layer `layer` and the `prefetch` layers before it (same pass)."""
        if layer.prefetched_task == task:
            return
        layer.prefetched_task = task
        # The unpacking layer's own storages are needed now: "on demand".
        self._reload_layer(layer, task, "reloads_on_demand")
        self._reload_before(layer.index, layer.pass_id, task)

    def _reload_before(self, index: int, pass_id: int, task) -> None:
        """Starts the reloads of the `prefetch` layers before layer `index` (same pass)."""
        for back in range(1, self._prefetch + 1):
            earlier = self._layers.get(index - back)
            if earlier is None:
                continue  # pruned: nothing of it was offloaded
            if earlier.pass_id != pass_id:
                break
            self._reload_layer(earlier, task, "reloads_prefetched")

    def _prefetch_for_kept(self, layer: _Layer) -> None:
        """A kept tensor of `layer` was unpacked: backward has reached that layer."""
        task = torch._C._current_graph_task_id()
        if task == -1 or layer.prefetched_task == task:
            return
        with self._lock:
            if task not in self._tasks_seen:
                self._start_backward(task)
            self._prefetch_from(layer, task)

    def _reload_layer(self, layer: _Layer, task, counter: str) -> None:
        for entry in layer.live_entries():
            if entry.device is None and entry.host is not None and entry.needed_in(task):
                self._start_reload(entry, counter)

    def _start_reload(self, entry: _Entry, counter: str) -> None:
        entry.start_reload()
        self._stats[counter] += 1
        self._stats["bytes_reloaded"] += entry.nbytes
