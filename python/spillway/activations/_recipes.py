"""Selective recompute in eager: rebuild a block's cheap saved tensors from what it saves anyway.

A Llama layer saves, besides its matmul inputs and attention outputs, values
that pointwise ops made from other saved values: SiLU(gate) and SiLU(gate) *
up (read by the MLP's multiply and down projection), the normalised input
and its product with the norm weight (read by the projections). Each is as
large as a hidden state or an MLP activation and costs a fraction of a
millisecond to make again from the gate, the up projection, the float copy
and the reciprocal norm that the block saves in any case. The budget planner
(_eager_budget.py) may choose, per block, to rebuild them in backward
instead of holding them (or to offload them apart from the rest).

How (one block call at a time):

  1. Recorder, a TorchFunctionMode active while the block runs forward,
     notes for each output of a recomputable function (elementwise or a
     dtype conversion, called out of place: _ELEMENTWISE) the function, its
     arguments (tensors by weak reference, with their layout and version)
     and its output's layout.
  2. RecipeScope.node_for(t), called from the saved-tensor pack hook, tells
     whether a saved tensor t can be rebuilt: t's storage was made by a
     recorded function and t reads it as it was made (same version), and each
     tensor argument is a tensor the block already packed (same storage,
     layout and version: autograd holds it anyway), a parameter, itself
     rebuildable, or, when smaller than what it rebuilds, held for the recipe
     and saved like the rest (the bf16 hidden state an RMSNorm's float copy is
     made from) once the caller decides to rebuild t (pack_extras: a plan that
     keeps or offloads t never runs the recipe, and moving its extra inputs
     would move bytes for nothing). The answer is a Recipe, which holds the packed objects of its
     inputs (never the rebuilt tensors themselves) and a version witness of t.
  3. Unpacking a Recipe (in backward) unpacks its inputs through the
     context's own unpack (a reload where they were offloaded), runs the
     functions again under no_grad, checks the layout, and returns t's view of
     the result. Same kernels, same inputs: the values are bitwise those
     saved. What a block's recipes rebuilt is shared until its last reader
     unpacked (_Results): a Llama layer's rebuild is 10 elementwise ops.

An input the store offloaded is read through a sibling handle
(_eager_store._Handle.sibling): the entry keeps its device copy until every
handle was unpacked or died. Modifying a saved tensor in place after it was
saved raises autograd's own error at unpack, as for every saved tensor.

Note [Linear recipes]. A saved tensor that only a matmul makes from what
the block holds (a Llama MLP's gate and up projections, read by SiLU's and
the product's backward, made by F.linear from the normalised input) can be
rebuilt the same way: the same GEMM on the same input and weight gives the
same bits, as torch.utils.checkpoint relies on. It costs a matmul, not an
elementwise pass: on T1 a block's gate and up (352 MiB) take ~1.2-1.9 ms
to rebuild by their FLOPs on an H100 (timed: 1.27-1.43 ms, v15), against the ~5.9 ms
of the block's whole forward (v14, H100) that a checkpoint runs to free
its 1.5 GiB. So such tensors are a set of their own, L_k,
which the planner treats apart from the cheap set C_k: node_for(t,
linear=True) resolves through F.linear too, and reads C_k's tensors as
inputs (kept, offloaded, or rebuilt by their own recipes: note_packed(...,
cheap=True)), never through C_k's ops, so L_k's rebuild costs its matmuls.
Without linear=True the answer for every tensor is what it was before: a
cheap tensor stays cheap.

Autocast: an op recorded under autocast would run again outside it in
backward, in another dtype. The Recorder records nothing while autocast is
on for the output's device (those tensors are saved as the rest).

Note [Parts by position]. A plan that keeps or offloads a block's cheap and
linear parts apart, rebuilding neither, needs only to know which saves are
which, not how they were made. A block call run under the Recorder learns
that, save by save in order: each save's layout and the part the Recorder
found (BudgetedOffload._pack_part notes it). At its next call under the same policy the
same function on inputs of the same layouts saves the same tensors in the same
order, and SaveParts hands the parts out by position, checking each save's
layout against the learned one; at the first that differs it answers "the
rest" for the call's remaining saves (counted), and the call runs under the
Recorder again at its next call. (Not the profiling step's recompute: with a
KV cache, use_cache=True, the recompute saves other shapes than the forward.)
So such a call runs no Recorder and resolves no recipe: on a tiny T1-shaped
Llama on a 2-core CPU host a block costs +1.38 ms of host time over a plain
forward by position against +2.60 ms under the Recorder (the eager store
alone: +0.81 ms; bench/torch/eager_host_overhead.py).

Thread-safety: a Recorder and its RecipeScope belong to one block call on
one thread; a Recipe is unpacked by autograd on its thread.
"""

from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from spillway.activations._eager_store import _Handle, check_version, version_witness

__all__ = ["Recorder", "RecipeScope", "Recipe", "RebuildProbe", "SaveParts", "recomputable_op",
           "save_layout"]

F = torch.nn.functional
T = torch.Tensor
# The functions a recipe may run again: elementwise (or a dtype conversion), the same
# kernel on the same inputs giving the same bits, never random, never in place (the
# *_ methods and inplace=True are not here or refused), never a view of an input.
_ELEMENTWISE = frozenset({
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.pow, torch.rsqrt,
    torch.sqrt, torch.exp, torch.log, torch.sigmoid, torch.tanh, torch.square, torch.abs,
    torch.reciprocal, torch.where,
    T.add, T.sub, T.mul, T.div, T.neg, T.pow, T.rsqrt, T.sqrt, T.exp, T.log, T.sigmoid,
    T.tanh, T.square, T.abs, T.reciprocal, T.float, T.half, T.bfloat16, T.double, T.to,
    T.type_as,
    T.__add__, T.__radd__, T.__sub__, T.__rsub__, T.__mul__, T.__rmul__, T.__truediv__,
    T.__rtruediv__, T.__neg__, T.__pow__, T.__rpow__,
    F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, F.softplus, F.mish, F.leaky_relu, F.elu,
})
# The functions a linear recipe may run again besides (Note [Linear recipes]).
_LINEAR = frozenset({F.linear})
# Nested recipes deeper than this are not followed (a guard; a Llama norm is 3 deep).
_MAX_DEPTH = 8


def recomputable_op(func, args, kwargs, linear: bool = False) -> bool:
    """An elementwise function called out of place (see _ELEMENTWISE); with `linear`, also
    F.linear (Note [Linear recipes])."""
    try:
        if func not in _ELEMENTWISE and not (linear and func in _LINEAR):
            return False
    except TypeError:  # unhashable callable
        return False
    return not (kwargs.get("inplace") or "out" in kwargs
                or (func in (F.relu, F.leaky_relu, F.elu) and any(a is True for a in args[1:])))


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


def storage_key(t: torch.Tensor) -> StorageWeakRef | None:
    """t's storage, weakly: equal for tensors on one storage. While such a reference
    exists the storage object's address is not reused (its data may be freed), so it
    names one storage even after that storage is gone. None for a tensor without a
    storage (sparse, nested, a subclass without one) or with no bytes."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return StorageWeakRef(storage) if storage.data_ptr() else None


def save_layout(t: torch.Tensor) -> tuple:
    """What SaveParts compares of a save (Note [Parts by position])."""
    return (t.device, *_layout(t))


class SaveParts:
    """One block call's saves' parts ("cheap", "linear", None: the rest) by position, as
    its last call under the Recorder found them (Note [Parts by position])."""

    __slots__ = ("table", "at", "departed")

    def __init__(self, table: list[tuple]):
        self.table = table  # (save_layout, part) per save, in order
        self.at = 0  # saves matched so far
        self.departed = False

    def next(self, t: torch.Tensor) -> str | None:
        """The part of the call's next save, t; None (the rest) once a save departs."""
        if not self.departed and self.at < len(self.table):
            layout, part = self.table[self.at]
            if layout == save_layout(t):
                self.at += 1
                return part
        self.departed = True
        return None


class _Arg:
    """A tensor argument of a recorded op: its storage and the tensor (weakly), layout
    and version; for a view of a parameter or buffer, that module tensor.

    Nothing here holds the argument itself: in the profiling step's recompute it has a
    grad_fn whose saved variables hold the pack hook, which would hold this (a cycle
    through C++ that Python's collector cannot see).
    """

    __slots__ = ("storage", "ref", "layout", "version", "param")

    def __init__(self, t: torch.Tensor, storage: StorageWeakRef | None, param):
        self.storage = storage
        self.ref = weakref.ref(t)
        self.layout = _layout(t)
        self.version = t._version
        self.param = param


class _Made:
    """A recorded op output: how it was made, and its version then; traffic: the bytes
    the op reads and writes (its time as the simulator would estimate it); linear: made
    by F.linear (Note [Linear recipes])."""

    __slots__ = ("func", "args", "kwargs", "storage", "nbytes", "layout", "version", "traffic",
                 "linear")

    def __init__(self, func, args, kwargs, out: torch.Tensor, storage, traffic: int):
        self.linear = func in _LINEAR
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.storage = storage
        self.nbytes = out.untyped_storage().nbytes()
        self.layout = _layout(out)
        self.version = out._version
        self.traffic = traffic


def _plain_tensor(t) -> bool:
    return type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)


class Recorder(TorchFunctionMode):
    """Notes how each recomputable function output of a block call was made (point 1).

    A TorchFunctionMode, not a TorchDispatchMode: it sees the block's torch calls
    (F.silu, x * y, x.to(dtype)), about a third of the cost per call of seeing every
    aten op (a dispatch mode cost T1's layers ~2.5 ms each on a 2-core host).
    params: the model's parameters and buffers by data pointer.
    """

    def __init__(self, params: dict[int, torch.Tensor]):
        super().__init__()
        self.made: dict[StorageWeakRef, _Made] = {}  # storage -> its latest maker
        self.params = params

    def _arg(self, t: torch.Tensor) -> _Arg:
        storage = storage_key(t)
        param = self.params.get(t.untyped_storage().data_ptr()) if storage is not None else None
        return _Arg(t, storage, param)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not recomputable_op(func, args, kwargs, linear=True):
            return func(*args, **kwargs)
        tensors = []
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                if not _plain_tensor(value) or value.layout != torch.strided:
                    return func(*args, **kwargs)
                tensors.append(value)
            elif isinstance(value, (list, tuple)) and any(
                    isinstance(v, torch.Tensor) for v in value):
                return func(*args, **kwargs)  # tensor lists: not followed
        out = func(*args, **kwargs)
        if type(out) is not torch.Tensor or out.layout != torch.strided:
            return out
        storage = storage_key(out)
        if storage is None or torch.is_autocast_enabled(out.device.type):
            return out  # autocast: see the module docstring
        ptr = out.untyped_storage().data_ptr()
        # x.to(its own dtype) returns x; x.to("cpu") moves it: neither is a recipe.
        if any(t.device != out.device or t.untyped_storage().data_ptr() == ptr for t in tensors):
            return out
        recorded_args = tuple(self._arg(a) if isinstance(a, torch.Tensor) else a for a in args)
        recorded_kwargs = {k: self._arg(v) if isinstance(v, torch.Tensor) else v
                           for k, v in kwargs.items()}
        traffic = out.numel() * out.element_size() + sum(
            t.numel() * t.element_size() for t in tensors)
        self.made[storage] = _Made(func, recorded_args, recorded_kwargs, out, storage, traffic)
        return out


class _Node:
    """One op to run again: its function, arguments (leaves resolved) and output layout."""

    __slots__ = ("func", "args", "kwargs", "layout", "made")

    def __init__(self, func, args, kwargs, layout, made):
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.layout = layout
        self.made = made  # the _Made it came from (its storage, its traffic)


class _Packed:
    """An input the block packed (the recipe's own handle): unpacked through the context."""

    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


class _Param:
    """A parameter (or buffer) input, read through its layout (W.t()): held (it lives as
    long as the module), version checked."""

    __slots__ = ("tensor", "layout", "version")

    def __init__(self, tensor: torch.Tensor, layout: tuple, version: int):
        self.tensor = tensor
        self.layout = layout
        self.version = version


class _Extra:
    """An input held for a recipe though the block does not save it (resolution only:
    RecipeScope.pack_extras packs it once the caller rebuilds with the recipe)."""

    __slots__ = ("tensor", "layout", "version")

    def __init__(self, tensor: torch.Tensor, layout: tuple, version: int):
        self.tensor = tensor
        self.layout = layout
        self.version = version


class _View:
    """A nested recipe's output read through a view (its layout)."""

    __slots__ = ("node", "layout")

    def __init__(self, node: _Node, layout: tuple):
        self.node = node
        self.layout = layout


def _as_layout(base: torch.Tensor, layout: tuple) -> torch.Tensor:
    dtype, size, stride, offset = layout
    if (dtype, size, stride, offset) == _layout(base):
        return base
    with torch.no_grad():
        return torch.empty(0, dtype=dtype, device=base.device).set_(
            base.untyped_storage(), offset, size, stride)


class Recipe:
    """The pack result of a saved tensor rebuilt in backward (point 3).

    chain: the storages its unpack may rebuild: its nodes', and those of the recipes it
    reads as packed inputs (a cheap tensor made from a linear recipe's output, Note
    [Linear recipes]). A recipe read that way is evaluated in place, not unpacked, and
    what it rebuilds is shared as the chain's own: SiLU(gate) * up rebuilt for down_proj's
    backward leaves gate and up for the product's and SiLU's backward, one matmul each
    (unpacked apart, each projection ran twice a step: v15 on T1, 60 extra GEMMs).
    """

    __slots__ = ("owner", "node", "results", "chain", "layout", "witness", "version",
                 "__weakref__")

    def __init__(self, owner, node: _Node, t: torch.Tensor, results: "_Results"):
        self.owner = owner  # the OffloadActivations that packed it (it unpacks it)
        self.node = node
        self.results = results  # RecipeScope.results of its block call
        chain: dict = {}
        for n in nodes_of(node):
            chain[n.made.storage] = None
            for leaf in (*n.args, *n.kwargs.values()):
                if isinstance(leaf, _Packed) and _shares(leaf.packed, results):
                    chain.update(dict.fromkeys(leaf.packed.chain))
        self.chain = list(chain)
        results.add_uses(self.chain)
        self.layout = _layout(t)
        self.witness = version_witness(t)
        self.version = t._version

    def unpack(self, unpack_packed) -> torch.Tensor:
        try:
            return self.value(unpack_packed, {})
        finally:
            self.results.done(self.chain)

    def value(self, unpack_packed, memo: dict) -> torch.Tensor:
        """The rebuilt tensor, without counting this read (unpack counts it; a recipe
        reading this one as an input counts it in its own chain)."""
        dtype, size, _, _ = self.layout
        check_version(dtype, self.witness.device, size, self.version, self.witness._version)
        return _as_layout(_evaluate(self.node, unpack_packed, memo, self.results), self.layout)


def _shares(packed, results) -> bool:
    """packed is a recipe of the same block call's scope (its rebuilds shared)."""
    return isinstance(packed, Recipe) and packed.results is results


def _evaluate(node: _Node, unpack_packed, memo: dict, results: dict) -> torch.Tensor:
    # By storage: recipes resolved apart hold nodes of their own for one made tensor.
    key = node.made.storage
    if key in memo:
        return memo[key]
    known = results.get(node.made.storage)
    if known is not None:
        memo[key] = known
        return known

    def value(leaf):
        if isinstance(leaf, _Packed):
            if _shares(leaf.packed, results):
                return leaf.packed.value(unpack_packed, memo)
            return unpack_packed(leaf.packed)
        if isinstance(leaf, _Param):
            t = leaf.tensor
            check_version(t.dtype, t.device, t.shape, leaf.version, t._version)
            return _as_layout(t, leaf.layout)
        if isinstance(leaf, _View):
            return _as_layout(_evaluate(leaf.node, unpack_packed, memo, results), leaf.layout)
        return leaf

    args = tuple(value(a) for a in node.args)
    kwargs = {k: value(v) for k, v in node.kwargs.items()}
    with torch.no_grad():
        out = node.func(*args, **kwargs)
    if _layout(out)[:3] != node.layout[:3] or out.storage_offset() != node.layout[3]:
        raise RuntimeError(
            f"[eager] selective recompute: {node.func} rebuilt a tensor of layout "
            f"{_layout(out)}, not the {node.layout} it made in forward; this op cannot be "
            "rebuilt in place of its saved output (please report it)")
    memo[key] = out
    results.put(node.made.storage, out)
    return out


class _Results:
    """RecipeScope.results: rebuilt values shared by a block's recipes (see there)."""

    __slots__ = ("values", "uses")

    def __init__(self):
        self.values: dict[StorageWeakRef, tuple] = {}
        self.uses: dict[StorageWeakRef, int] = {}

    def get(self, storage):
        known = self.values.get(storage)
        if known is not None and known[0]._version == known[1]:
            return known[0]
        return None

    def put(self, storage, t: torch.Tensor) -> None:
        if self.uses.get(storage, 0) > 1:  # someone else will read it
            self.values[storage] = (t, t._version)

    def add_uses(self, storages) -> None:
        for storage in storages:
            self.uses[storage] = self.uses.get(storage, 0) + 1

    def done(self, storages) -> None:
        for storage in storages:
            left = self.uses.get(storage, 0) - 1
            self.uses[storage] = left
            if left <= 0:
                self.values.pop(storage, None)


class RecipeScope:
    """The recipes of one block call (point 2): what it packed, what can be rebuilt."""

    def __init__(self, recorder: Recorder, share_handles: bool = True, pack_extra=None):
        self.recorder = recorder
        self.share_handles = share_handles  # False: classify only (the profiling step)
        # pack_extra(t) -> packed object: saves an input a recipe holds that the block does
        # not save (the block's input for its float copy); None: no such inputs.
        self.pack_extra = pack_extra
        # (storage, layout) -> (packed object, version when packed); the key's reference
        # keeps the storage's address from being reused while the scope lives.
        self.packed: dict[tuple, tuple] = {}
        # The same for the cheap set's tensors where packed apart (their recipes among
        # them): inputs of linear recipes only (Note [Linear recipes]).
        self.cheap_packed: dict[tuple, tuple] = {}
        # What the block's recipes rebuilt, by storage (a tensor on it, its version), kept
        # until every recipe whose chain runs it was unpacked (uses): the normalised input
        # rebuilt for q_proj's backward is read again by k_proj's and v_proj's, the float
        # copy by the norm's multiply and its square.
        self.results = _Results()

    def release(self) -> None:
        """Lets go of every tensor the scope holds (a scope only used to classify)."""
        self.packed.clear()
        self.cheap_packed.clear()
        self.results = _Results()
        self.recorder.made.clear()

    def note_packed(self, t: torch.Tensor, packed, cheap: bool = False) -> None:
        """t was packed to `packed`; cheap: t is of the cheap set (read by linear recipes
        only, Note [Linear recipes])."""
        storage = storage_key(t)
        if storage is not None:
            (self.cheap_packed if cheap else self.packed)[(storage, _layout(t))] = (
                packed, t._version)

    def node_for(self, t: torch.Tensor, linear: bool = False) -> _Node | None:
        """The recipe that rebuilds t's storage, or None (t is then saved as usual).
        linear: through F.linear too, from the cheap set's packed tensors (Note [Linear
        recipes]); a tensor the elementwise ops rebuild is no linear recipe."""
        storage = storage_key(t)
        if storage is None:
            return None
        node = self._node(storage, t._version, {}, 0, linear)
        if node is not None and linear and not any(n.made.linear for n in nodes_of(node)):
            return None
        return node

    def pack_extras(self, root: _Node) -> None:
        """Saves the inputs node_for's recipe holds that nothing saved yet (once each):
        called where the recipe will rebuild its tensor, never where t is kept or offloaded
        as the rest (then nothing reads them)."""
        for node in nodes_of(root):
            if not any(isinstance(a, _Extra) for a in (*node.args, *node.kwargs.values())):
                continue

            def packed(leaf):
                if not isinstance(leaf, _Extra):
                    return leaf
                t = leaf.tensor
                key = (storage_key(t), leaf.layout)
                known = self.packed.get(key)
                if known is None or known[1] != leaf.version:
                    self.note_packed(t, self.pack_extra(t))
                    known = self.packed[key]
                return self._input(known[0])

            node.args = tuple(packed(a) for a in node.args)
            node.kwargs = {k: packed(v) for k, v in node.kwargs.items()}

    def _node(self, storage: StorageWeakRef, version: int, memo: dict,
              depth: int, linear: bool) -> _Node | None:
        if storage in memo:
            return memo[storage]
        memo[storage] = None  # a cycle (never in practice) resolves to "no"
        made = self.recorder.made.get(storage)
        # An intermediate may be gone by now (SiLU(gate) once the product is made): it is
        # made again, not read, and the reference in `made` keeps its address unique.
        if made is None or depth > _MAX_DEPTH or (made.linear and not linear):
            return None
        # Read as it was made. (A later write does not matter: the value is made again
        # from the inputs, which are checked as saved tensors are.)
        if version != made.version:
            return None
        leaves = {}  # position or keyword -> resolved leaf, for the tensor arguments
        for key, a in (*enumerate(made.args), *made.kwargs.items()):
            if isinstance(a, _Arg):
                leaves[key] = self._leaf(a, made, memo, depth, linear)
                if leaves[key] is None:
                    return None
        args = tuple(leaves.get(i, a) for i, a in enumerate(made.args))
        kwargs = {k: leaves.get(k, a) for k, a in made.kwargs.items()}
        node = _Node(made.func, args, kwargs, made.layout, made)
        memo[storage] = node
        return node

    def _input(self, packed) -> _Packed:
        """A recipe's leaf for an input the block packed: for a recipe that will be packed,
        its own share of an offloaded entry (_Handle.sibling); the profiling step only
        classifies."""
        if self.share_handles and isinstance(packed, _Handle):
            packed = packed.sibling()
        return _Packed(packed)

    def _leaf(self, a: _Arg, made: _Made, memo: dict, depth: int, linear: bool):
        if a.storage is None:
            return None
        key = (a.storage, a.layout)
        packed = self.packed.get(key) or (self.cheap_packed.get(key) if linear else None)
        if packed is not None and packed[1] == a.version:
            return self._input(packed[0])
        if a.param is not None:  # a view of it shares its version counter
            return _Param(a.param, a.layout, a.version) if a.param._version == a.version else None
        node = self._node(a.storage, a.version, memo, depth + 1, linear)
        if node is not None:
            return _View(node, a.layout)
        # Not saved, not rebuildable: worth holding when smaller than what it rebuilds
        # (a bf16 hidden state for its float copy), if it is still here as it was. Linear
        # recipes hold no such input (they would hold it beside the cheap set's).
        t = a.ref()
        if (self.pack_extra is None or linear or t is None or t._version != a.version
                or t.untyped_storage().nbytes() >= made.nbytes):
            return None
        return _Extra(t, a.layout, a.version)


def nodes_of(node: _Node) -> list[_Node]:
    """node and every nested node it runs, each once."""
    out, seen, todo = [], set(), [node]
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        for leaf in (*n.args, *n.kwargs.values()):
            if isinstance(leaf, _View):
                todo.append(leaf.node)
    return out


class _StandIn:
    """A packed input of a RebuildProbe: its storage (an index: inputs on one storage
    share a stand-in), that storage's bytes, and the input's layout there."""

    __slots__ = ("storage", "nbytes", "layout")

    def __init__(self, storage: int, nbytes: int, layout: tuple):
        self.storage = storage
        self.nbytes = nbytes
        self.layout = layout


class _Shared:
    """A RebuildProbe run's results (what _evaluate takes as `results`): every value is
    kept, so each op runs once, as a backward shares what a block's recipes rebuilt."""

    def __init__(self):
        self.values: dict = {}

    def get(self, storage):
        return self.values.get(storage)

    def put(self, storage, t: torch.Tensor) -> None:
        self.values[storage] = t


class RebuildProbe:
    """One block call's selective recompute apart from its tensors: the recipes' nodes
    with each packed input replaced by its storage's size and its layout there, run on
    stand-ins of those layouts. The profiling step builds one per block call from the
    roots RecipeScope.node_for gave (share_handles=False: a packed input is the tensor
    itself) and keeps nothing of the step; the planner times it (_eager_budget.py)
    instead of estimating the ops from their bytes. signature: equal for calls whose
    rebuilds run the same functions on the same layouts (one timing serves them)."""

    _FILL = 0x3C  # every stand-in byte: finite, non-zero values in every float dtype

    def __init__(self, roots: list[_Node]):
        storages: dict = {}
        self._nbytes: list[int] = []  # per stand-in (a _StandIn's storage index)
        copies: dict[int, _Node] = {}

        def stand_in(t: torch.Tensor, layout: tuple) -> _Packed:
            index = storages.setdefault(storage_key(t), len(storages))
            if index == len(self._nbytes):
                self._nbytes.append(t.untyped_storage().nbytes())
            return _Packed(_StandIn(index, self._nbytes[index], layout))

        def leaf(a):
            if isinstance(a, _Packed):
                t = a.packed
                if not isinstance(t, torch.Tensor):
                    raise TypeError("RebuildProbe takes the profiling step's recipes, whose "
                                    f"packed inputs are tensors, not {type(t).__name__}")
                return stand_in(t, _layout(t))
            if isinstance(a, _Param):  # its layout only: an optimizer step changes it
                return stand_in(a.tensor, a.layout)
            if isinstance(a, _View):
                return _View(copy(a.node), a.layout)
            return a

        def copy(node: _Node) -> _Node:
            if id(node) not in copies:
                copies[id(node)] = _Node(node.func, tuple(leaf(a) for a in node.args),
                                         {k: leaf(v) for k, v in node.kwargs.items()},
                                         node.layout, node.made)
            return copies[id(node)]

        self.roots = [copy(r) for r in roots]
        self.signature = tuple(_describe(n) for r in self.roots for n in nodes_of(r))

    def stand_ins(self, device: torch.device) -> list[torch.Tensor]:
        """One byte buffer per packed input storage, filled (see _FILL)."""
        return [torch.full((n,), self._FILL, dtype=torch.uint8, device=device)
                for n in self._nbytes]

    def run(self, stand_ins: list[torch.Tensor]) -> None:
        """Rebuilds every root once, on `stand_ins` (from stand_ins())."""
        def unpack(s: _StandIn) -> torch.Tensor:
            return _as_layout(stand_ins[s.storage], s.layout)

        results, memo = _Shared(), {}
        for root in self.roots:
            _evaluate(root, unpack, memo, results)


def _describe(node: _Node) -> tuple:
    """What RebuildProbe.signature holds of a node: its function and layouts."""
    def one(a):
        if isinstance(a, _Packed):
            return ("in", a.packed.storage, a.packed.nbytes, a.packed.layout)
        if isinstance(a, _View):
            return ("view", a.node.layout, a.layout)
        return ("value", repr(a))
    return (repr(node.func), node.layout, tuple(one(a) for a in node.args),
            tuple((k, one(v)) for k, v in sorted(node.kwargs.items())))
