"""A model's parameters and buffers, remembered between steps (Note [Weights between calls]).

Note [Weights between calls]. The eager contexts read the model's weights at every
step: the storages the store must not move (eager.py, at each __enter__) and the tensors
a recipe reads by data pointer (_eager_budget.py, at each model call). Walking the
module tree for them (model.parameters() and model.buffers(), nested generators) took
~0.35 ms a walk on the host bench's 16-layer Llama (2 CPU cores, 2026-12), ~0.9 ms a step
with the sets built from it; telling that nothing changed takes ~0.1 ms. What the last
walk found is reused while:
  1. every module reachable through _modules holds the same objects in its _modules,
     _parameters and _buffers, in order (a weight or submodule added, removed or
     replaced, by setattr, register_* or by writing those dicts, model.to() with
     overwritten parameters): compared by id; and no object the walk saw has died
     (a weakref callback), so an id seen again is the same object;
  2. every weight has the same storage (UntypedStorage._cdata) at the same data
     pointer (.data reassigned, model.to() in place or by swap_tensors, a storage
     resized): the walk's StorageWeakRefs keep those storage objects allocated, so a
     _cdata seen again is the same storage (storage_key's argument, _recipes.py).
Anything else walks again. Nothing is held strongly but the detached tensors by_ptr()
hands out, which the budgeted context held between steps before this cache too. Kept only
where eager._LEAN_HOST is on (Note [A leaner host path], eager.py); otherwise every call
walks, as before.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef


class _Deaths:
    """Set by a weakref callback when an object the last walk saw dies (no strong
    reference to the owner: the callbacks' weakrefs are the owner's)."""

    __slots__ = ("seen",)

    def __init__(self):
        self.seen = False

    def died(self, _ref) -> None:
        self.seen = True


class ModelWeights:
    """model.parameters() then model.buffers(), walked again only when the check of Note
    [Weights between calls] finds a change. One model; not thread-safe (the contexts
    call it from the thread that runs forward)."""

    def __init__(self, model: nn.Module):
        self._model = model
        self._seen: tuple | None = None  # the check's fingerprint of the last walk
        self._deaths = _Deaths()
        self._refs: list = []  # weakrefs to what the fingerprint names by id
        self._tensors: tuple = ()
        self._storages: frozenset = frozenset()
        self._by_ptr: dict | None = None
        self._limit = 0  # modules _fingerprint reads at most (a cycle would never end)
        self.walks = 0  # full walks so far (tests)
        # False: every call walks, and nothing is kept (the eager contexts' _LEAN_HOST).
        self.reuse = True

    def storages(self) -> frozenset:
        """StorageWeakRefs of every parameter's and buffer's storage."""
        if not self.reuse:
            return frozenset(StorageWeakRef(t.untyped_storage()) for t in self._all())
        self._refresh()
        return self._storages

    def by_ptr(self) -> dict[int, torch.Tensor]:
        """Every parameter and buffer, detached, by its storage's data pointer (a later
        one of a storage wins). Shared: read it, do not change it."""
        if not self.reuse:
            return {t.untyped_storage().data_ptr(): t.detach() for t in self._all()}
        self._refresh()
        if self._by_ptr is None:
            self._by_ptr = {t.untyped_storage().data_ptr(): t.detach() for t in self._tensors}
        return self._by_ptr

    def _objects(self) -> tuple[list, list] | None:
        """Each module reachable through _modules (breadth first) followed by its
        parameters and buffers (Nones too), and those parameters and buffers (no Nones):
        read without nn.Module's generators, in a quarter of their time. None where the
        tree looks cyclic."""
        modules, objects, tensors = [self._model], [], []
        for m in modules:  # grows while read
            objects.append(m)
            children = m._modules
            if children:
                modules += [c for c in children.values() if c is not None]
                if len(modules) > self._limit:
                    return None
            weights = (*m._parameters.values(), *m._buffers.values())
            objects += weights
            tensors += weights
        return objects, [t for t in tensors if t is not None]

    def _fingerprint(self, found: tuple[list, list] | None = None) -> tuple | None:
        """Point 1's ids and point 2's (storage, data pointer) pairs, of `found` (default:
        _objects() now); None: walk."""
        found = self._objects() if found is None else found
        if found is None:
            return None
        objects, tensors = found
        storages = [t.untyped_storage() for t in tensors]
        return list(map(id, objects)), [(s._cdata, s.data_ptr()) for s in storages]

    def _refresh(self) -> None:
        if self._seen is not None and not self._deaths.seen:
            seen = self._fingerprint()
            if seen is not None and seen == self._seen:
                return
        self._walk()

    def _all(self):
        return itertools.chain(self._model.parameters(), self._model.buffers())

    def _walk(self) -> None:
        self.walks += 1
        self._tensors = tuple(self._all())
        self._storages = frozenset(StorageWeakRef(t.untyped_storage()) for t in self._tensors)
        self._by_ptr = None
        self._deaths = deaths = _Deaths()
        self._refs = []
        self._seen = None
        # nn.Module.modules() counts a module registered twice once, _fingerprint twice.
        self._limit = 4 * sum(1 for _ in self._model.modules()) + 64
        found = self._objects()
        if found is None:
            return  # never reused: every call walks
        self._refs = [weakref.ref(obj, deaths.died) for obj in found[0] if obj is not None]
        self._seen = self._fingerprint(found)
