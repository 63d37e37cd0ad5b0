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

Note [Recipes by position]. A call that rebuilds its cheap or linear part
ran under the Recorder at every call (v16, H100 machine's host: +6.1 ms of
host time per T1 block, against 5.1 ms of its kernels: such plans were
bound by the launching thread). Its recipes are the same at every call, so
the call under the Recorder learns each one as a template
(RecipeScope.template): its nodes with their inputs named, not held — an
earlier save of the call by position (_SaveRef), a parameter by data
pointer (_ParamRef), an extra input by the call of the function that took
it (_ExtraRef: the ordinal-th call of T.to, argument 0) — and, per input,
the path through the saved tensor's autograd history that reaches it:
(edge index, node type) per step from t.grad_fn to that save's grad_fn and
output number, the extra's, or the parameter's AccumulateGrad. At later
calls under the same policy, SaveParts binds each template to the call's
own tensors (packed objects by position, the extra inputs that a narrow
TorchFunctionMode, _Catcher, caught, acting on those functions only) after
checking every path on this call's t. Layouts alone would not do: a wrong
part costs memory, a wrong recipe costs wrong gradients (a block that takes
sigmoid of sin(x) or of cos(x), both saved, by a flag has the same saves in
the same layouts either way; the test with it fails without the check).
Where a check fails, or an extra input was not caught as learned or was
written since, t goes as the rest, the call departs (its remaining saves
go as the rest) and its next call learns again. A recipe whose input has no
autograd history to check it by (a frozen parameter, a tensor that does not
require grad) is not learned: its call keeps the Recorder. The values
rebuilt are those the Recorder's recipes rebuild: the same functions on
the same inputs. On a tiny T1-shaped bf16 Llama on the 2-core CPU host, a
block rebuilding C_k and L_k costs +2.2-2.4 ms of host time by position,
against +3.1-3.6 ms under the Recorder (bench/torch/eager_host_overhead.py
--dtype bfloat16).

Note [Catching in a window]. A _Catcher across the whole block call makes every
torch call of the block go through Python (T1's bf16 blocks: 66 calls, for the
two norms' T.to). With _eager_budget._CATCH_IN_WINDOWS the call that learns
watches the block's submodules (Recorder.watch) and notes, per recorded call,
the innermost submodule call running it and the function's calls so far in
that submodule call (nested ones counted too, as a mode there sees them).
An extra input taken there is caught there: SaveParts.watch hooks that
submodule, entering a _Catcher for its learned call only (a Llama block's
catchers then see 18 calls). One taken by the block's own forward has no
window and is caught across the call as before. The catchers of a call share
one table, so binding and its checks are unchanged. On the 2-core CPU host
a bf16 block rebuilding its parts costs ~90 us less host time this way (2.14
against 2.06 ms over a plain forward); on the H100 machine's host the same
rebuild cost +3.96 ms against +1.90 for keeping the parts (2026-12-07), and
what of that the catcher was is what a run with the flag on will tell.

Thread-safety: a Recorder and its RecipeScope belong to one block call on
one thread; a Recipe is unpacked by autograd on its thread.
"""

from __future__ import annotations

import dataclasses
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
_RECORDED = _ELEMENTWISE | _LINEAR
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
    """One block call's saves by position, as its last call under the Recorder found them
    (Note [Parts by position]): each save's part ("cheap", "linear", None: the rest) and,
    where that call rebuilt it, its recipe's template (Note [Recipes by position]).

    table: per save in order, (save_layout, its grad_fn's type, part, _Template or None).
    params: the model's parameters and buffers by data pointer (a template's _ParamRef);
    pack_extra: as RecipeScope's. One block call on one thread.
    """

    __slots__ = ("table", "at", "departed", "params", "pack_extra", "results", "bound",
                 "packed", "targets", "needed", "catcher", "extras_packed", "slots",
                 "nodes", "checked", "chains", "caught", "windows")

    def __init__(self, table: list[tuple], params: dict | None = None, pack_extra=None,
                 by_window: bool = False, needs: tuple | None = None):
        self.table = table
        self.at = 0  # saves matched so far
        self.departed = False
        self.params = params
        self.pack_extra = pack_extra
        self.results = _Results()  # as RecipeScope.results
        self.bound = 0  # recipes bound so far
        # What the table's templates read (needs_of): the same at every call of one table,
        # so the caller may pass what an earlier call of it was given.
        self.needed, wanted, self.windows = needs or SaveParts.needs_of(table, by_window)
        self.packed: dict[int, object] = {}
        self.targets: dict[int, tuple] = {}
        self.extras_packed: dict[int, object] = {}
        self.slots: dict[int, _Slot] = {}  # a template node's slot -> this call's key
        self.nodes: dict[int, _Node] = {}  # a template node (id) -> bound in this call
        self.checked: dict[tuple, object] = {}  # (template, grad_fn, output_nr) that passed
        self.chains: dict[int, list] = {}  # a bound root (id, in nodes) -> its chain
        # The extra inputs caught so far: _ExtraRef -> (tensor, version, grad_fn, nr).
        self.caught: dict = {}
        self.catcher = _Catcher(wanted, self.caught) if wanted else None

    @staticmethod
    def needs_of(table: list[tuple], by_window: bool = False) -> tuple:
        """(the positions a template reads or checks: their packed objects and grad_fns;
        what the catchers want, func -> ordinal -> [_ExtraRef]: the block call's; with
        by_window each submodule call's (Note [Catching in a window]), by module (id) ->
        (module, {its call number: wanted})). Read only: shared by the calls of a table."""
        templates = [entry[3] for entry in table if entry[3] is not None]
        needed = frozenset(ref.position for tp in templates for ref in tp.reads
                           if isinstance(ref, _SaveRef))
        wanted: dict = {}
        windows: dict[int, tuple] = {}
        for tp in templates:
            for ref in tp.reads:
                if isinstance(ref, _ExtraRef):
                    spec = ref.spec
                    if by_window and spec.window is not None:
                        module, entry, ordinal = spec.window
                        calls = windows.setdefault(id(module), (module, {}))[1]
                        at = calls.setdefault(entry, {}).setdefault(spec.func, {})
                        at = at.setdefault(ordinal, [])
                    else:
                        at = wanted.setdefault(spec.func, {}).setdefault(spec.ordinal, [])
                    if ref not in at:
                        at.append(ref)
        return needed, wanted, windows

    def watch(self) -> list:
        """Note [Catching in a window]: hooks on the submodules whose calls made the
        extra inputs, each entering a _Catcher for the learned call only; the handles."""
        handles = []
        for module, calls in self.windows.values():
            state = {"n": 0, "open": []}

            def pre(m, args, calls=calls, state=state):
                n = state["n"]
                state["n"] = n + 1
                wanted = calls.get(n)
                catcher = _Catcher(wanted, self.caught) if wanted is not None else None
                if catcher is not None:
                    catcher.__enter__()
                state["open"].append(catcher)

            def post(m, args, output, state=state):
                catcher = state["open"].pop() if state["open"] else None
                if catcher is not None:
                    catcher.__exit__(None, None, None)

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, always_call=True))
        return handles

    def next(self, t: torch.Tensor) -> tuple[str | None, "_Template | None"]:
        """The part of the call's next save, t, and its template; (None, None) (the rest)
        once a save departs."""
        if not self.departed and self.at < len(self.table):
            layout, maker, part, template = self.table[self.at]
            if type(t.grad_fn) is maker and layout == save_layout(t):
                self.at += 1
                return part, template
        self.departed = True
        return None, None

    def depart(self) -> None:
        """The call's remaining saves go as the rest (a template's check failed)."""
        self.departed = True

    def saved(self, t: torch.Tensor, packed) -> None:
        """The save next() matched last was packed to `packed`."""
        position = self.at - 1
        if position in self.needed and not self.departed:
            self.packed[position] = packed
            self.targets[position] = (t.grad_fn, t.output_nr)

    def bind(self, template: "_Template", t: torch.Tensor) -> _Node | None:
        """The recipe rebuilding t, this call's tensors in the template's places; None
        where t's autograd history does not reach them as the learned call's did."""
        fn = t.grad_fn
        checked = (id(template), id(fn), t.output_nr)
        if checked not in self.checked:  # (q, k and v save one tensor: checked once)
            if not self._reaches(template, fn):
                return None
            self.checked[checked] = fn  # held: its id names it while the call lasts
        try:
            root = self._node(template.root, self.nodes)
        except _Unbound:
            return None
        self.bound += 1
        return root

    def chain(self, root: _Node) -> list:
        """Recipe.chain for a recipe of this call rebuilding with `root` (once a root)."""
        chain = self.chains.get(id(root))
        if chain is None:
            chain = self.chains[id(root)] = chain_of(root, self.results)
        return chain

    def _reaches(self, template: "_Template", fn) -> bool:
        """t's autograd history (from fn) reaches the template's inputs by its paths."""
        for ref, path in template.checks:
            node, nr = fn, 0
            for index, kind in path:
                edges = node.next_functions
                if index >= len(edges):
                    return False
                node, nr = edges[index]
                if type(node) is not kind:
                    return False
            if not self._is(ref, node, nr):
                return False
        return True

    def _is(self, ref, node, nr: int) -> bool:
        if isinstance(ref, _SaveRef):
            target = self.targets.get(ref.position)
        elif isinstance(ref, _ExtraRef):
            caught = self.caught.get(ref)
            target = caught[2:] if caught is not None else None
        else:
            return _accumulates_into(node, ref.ptr)
        return target is not None and target[0] is node and target[1] == nr

    def _node(self, tn: "_TNode", memo: dict) -> _Node:
        node = memo.get(id(tn))
        if node is None:
            slot = self.slots.get(tn.slot)
            if slot is None:
                slot = self.slots[tn.slot] = _Slot(tn.linear)
            node = memo[id(tn)] = _Node(
                tn.func, tuple(self._leaf(a, memo) for a in tn.args),
                {k: self._leaf(v, memo) for k, v in tn.kwargs.items()}, tn.layout, slot)
        return node

    def _leaf(self, a, memo: dict):
        if isinstance(a, _SaveRef):
            return _input(self.packed[a.position])
        if isinstance(a, _ExtraRef):
            return _input(self._extra(a))
        if isinstance(a, _ParamRef):
            p = self.params.get(a.ptr) if self.params is not None else None
            if p is None:
                raise _Unbound
            return _Param(p, a.layout, p._version)
        if isinstance(a, _View):  # a template's: its node a _TNode
            return _View(self._node(a.node, memo), a.layout)
        return a

    def _extra(self, ref: "_ExtraRef"):
        """The extra input `ref` as this call packed it (packed at its first recipe, as
        RecipeScope.pack_extras does), caught by the call's _Catcher."""
        packed = self.extras_packed.get(ref.spec.index)
        if packed is None:
            caught = self.caught.get(ref)
            if caught is None or caught[0]._version != caught[1] or self.pack_extra is None:
                raise _Unbound  # not made as learned, or written since
            packed = self.extras_packed[ref.spec.index] = self.pack_extra(caught[0])
        return packed


class _Unbound(Exception):
    """A template's input is not in this call (SaveParts.bind answers None)."""


class _Slot:
    """A bound node's `made`: the key its rebuilt value is shared under in the call's
    _Results (as a recorded node's storage), and whether F.linear makes it."""

    __slots__ = ("storage", "linear")

    def __init__(self, linear: bool):
        self.storage = object()
        self.linear = linear


@dataclasses.dataclass(frozen=True, eq=False)
class _SaveRef:
    """A template's input: the call's save at `position` (its packed object)."""
    position: int


@dataclasses.dataclass(frozen=True)
class _ExtraSpec:
    """Where an extra input is caught: argument `key` of the `ordinal`-th call of `func`
    in the block call, of layout `layout`; `index`: the call's extra number; `window`:
    where a windowed _Catcher catches it, or None (Note [Catching in a window])."""
    func: object
    ordinal: int
    key: object
    layout: tuple
    index: int
    window: tuple | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class _ExtraRef:
    """A template's input that the block does not save (RecipeScope's _Extra)."""
    spec: _ExtraSpec


@dataclasses.dataclass(frozen=True, eq=False)
class _ParamRef:
    """A template's parameter (or buffer) input: the model's tensor at data pointer
    `ptr`, read through `layout`."""
    ptr: int
    layout: tuple


def _accumulates_into(node, ptr: int) -> bool:
    """Whether autograd node `node` is the AccumulateGrad of the parameter whose storage
    is at data pointer `ptr` (a _ParamRef's check, at learning and at binding)."""
    tensor = getattr(node, "variable", None)
    return tensor is not None and tensor.untyped_storage().data_ptr() == ptr


class _TNode:
    """A recipe node with its inputs as references (_SaveRef, _ExtraRef, _ParamRef, a
    _View of a _TNode); slot: the learned call's storage it rebuilds, numbered (shared values)."""

    __slots__ = ("func", "args", "kwargs", "layout", "slot", "linear")

    def __init__(self, func, args, kwargs, layout, slot: int, linear: bool):
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.layout = layout
        self.slot = slot
        self.linear = linear


@dataclasses.dataclass(frozen=True, eq=False)
class _Template:
    """How a save was rebuilt (Note [Recipes by position]): the root node; `reads`, the
    references it reads; `checks`, per reference, the path through the saved tensor's
    autograd history to it, (edge index, node type) per step."""
    root: _TNode
    reads: tuple
    checks: tuple


class _Catcher(TorchFunctionMode):
    """Catches a block call's extra inputs (Note [Recipes by position]): counts the calls
    of the functions that took them, as the Recorder counted, and at the learned call
    notes the argument (tensor, version, grad_fn, output_nr) where its layout is the
    learned one. Acts on nothing else."""

    def __init__(self, wanted: dict, caught: dict | None = None):
        super().__init__()
        self.wanted = wanted  # func -> ordinal -> [_ExtraRef]
        self.calls: dict = {}
        self.caught: dict = {} if caught is None else caught  # shared by a call's catchers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            at = self.wanted.get(func)
        except TypeError:
            at = None
        if at is not None:
            n = self.calls.get(func, 0)
            self.calls[func] = n + 1
            for ref in at.get(n, ()):
                key = ref.spec.key
                a = (args[key] if key < len(args) else None) if isinstance(key, int) else (
                    kwargs.get(key))
                if (isinstance(a, torch.Tensor) and _plain_tensor(a)
                        and _layout(a) == ref.spec.layout):
                    self.caught[ref] = (a, a._version, a.grad_fn, a.output_nr)
        return func(*args, **kwargs)


def _interned(leaf):
    """What tells a template node's input apart (RecipeScope._template_node)."""
    if isinstance(leaf, (_SaveRef, _ExtraRef, _TNode)):
        return id(leaf)
    if isinstance(leaf, _View):
        return ("view", id(leaf.node), leaf.layout)
    if isinstance(leaf, _ParamRef):
        return ("param", leaf.ptr, leaf.layout)
    return (type(leaf), repr(leaf))


def _input(packed, share_handles: bool = True) -> "_Packed":
    """A recipe's leaf for an input the block packed: for a recipe that will be packed,
    its own share of an offloaded entry (_Handle.sibling); the profiling step only
    classifies (share_handles=False)."""
    if share_handles and isinstance(packed, _Handle):
        packed = packed.sibling()
    return _Packed(packed)


def _path_to(root, targets: dict, depth: int = 16) -> dict:
    """Per target, the first path found breadth-first from autograd node `root` to it:
    (edge index, node type) per step. targets: key -> match(node, input_nr)."""
    found: dict = {}
    # By id, holding each node: a C++ node's Python object lives only while referenced,
    # and a new one for another node may take a freed one's id.
    frontier, seen = [(root, ())], {id(root): root}
    for _ in range(depth):
        following = []
        for node, path in frontier:
            for index, (nxt, nr) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                step = (*path, (index, type(nxt)))
                for key, match in targets.items():
                    if key not in found and match(nxt, nr):
                        found[key] = step
                if id(nxt) not in seen:
                    seen[id(nxt)] = nxt
                    following.append((nxt, step))
        if len(found) == len(targets) or not following:
            break
        frontier = following
    return found


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
                 "linear", "ordinal", "window")

    def __init__(self, func, args, kwargs, out: torch.Tensor, storage, traffic: int,
                 ordinal: int, window: tuple | None = None):
        self.linear = func in _LINEAR
        self.ordinal = ordinal  # calls of func before this one in the block call (_Catcher)
        # (submodule, its call in the block call, calls of func before this one in that
        # call): where a windowed _Catcher catches it (Note [Catching in a window]).
        self.window = window
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
        self.calls: dict = {}  # func -> its calls so far (_counted; _Catcher counts alike)
        # Note [Catching in a window]: the block's submodule calls running now, outermost
        # first, each [module, its call number in the block call, its own calls dict];
        # per module, its calls so far. Kept by watch()'s hooks.
        self.windows: list[list] = []
        self.entries: dict[int, int] = {}

    def watch(self, block: torch.nn.Module) -> list:
        """Hooks on the block's submodules that keep `windows` while the block runs (Note
        [Catching in a window]); the handles, to remove."""
        def pre(module, args):
            n = self.entries.get(id(module), 0)
            self.entries[id(module)] = n + 1
            self.windows.append([module, n, {}])

        def post(module, args, output):
            if self.windows and self.windows[-1][0] is module:
                self.windows.pop()

        handles = []
        for module in block.modules():
            if module is not block:
                handles.append(module.register_forward_pre_hook(pre))
                handles.append(module.register_forward_hook(post, always_call=True))
        return handles

    def _arg(self, t: torch.Tensor) -> _Arg:
        storage = storage_key(t)
        param = self.params.get(t.untyped_storage().data_ptr()) if storage is not None else None
        return _Arg(t, storage, param)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ordinal = _counted(self.calls, func)
        window = None
        if ordinal is not None and self.windows:  # counted in every enclosing call
            for module, entry, calls in self.windows:
                window = (module, entry, _counted(calls, func))
        if ordinal is None or not recomputable_op(func, args, kwargs, linear=True):
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
        self.made[storage] = _Made(func, recorded_args, recorded_kwargs, out, storage, traffic,
                                   ordinal, window)
        return out


def _counted(calls: dict, func) -> int | None:
    """func's calls before this one, counted in `calls`; None (not counted) for a function
    no recipe runs (_ELEMENTWISE, _LINEAR)."""
    try:
        if func not in _RECORDED:
            return None
    except TypeError:  # unhashable callable
        return None
    n = calls.get(func, 0)
    calls[func] = n + 1
    return n


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
    """A nested recipe's output read through a view (its layout): node a _Node, or in a
    template (Note [Recipes by position]) a _TNode."""

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

    def __init__(self, owner, node: _Node, t: torch.Tensor, results: "_Results",
                 chain: list | None = None):
        self.owner = owner  # the OffloadActivations that packed it (it unpacks it)
        self.node = node
        self.results = results  # RecipeScope.results of its block call
        self.chain = chain_of(node, results) if chain is None else chain
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


def chain_of(node: _Node, results: "_Results") -> list:
    """Recipe.chain of a recipe rebuilding with `node` (see there)."""
    chain: dict = {}
    for n in nodes_of(node):
        chain[n.made.storage] = None
        for leaf in (*n.args, *n.kwargs.values()):
            if isinstance(leaf, _Packed) and _shares(leaf.packed, results):
                chain.update(dict.fromkeys(leaf.packed.chain))
    return list(chain)


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

    def __init__(self, recorder: Recorder, share_handles: bool = True, pack_extra=None,
                 learn: bool = False):
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
        # Note [Recipes by position]: with `learn`, what template() needs: per key of
        # packed and cheap_packed, the reference it stands for (the save's position, or an
        # extra input); per position, the saved tensor's (grad_fn, output_nr); the extra
        # inputs by key; the recorded storages numbered (a template node's slot).
        self.learning = learn
        self.refs: dict[tuple, object] = {}
        self.cheap_refs: dict[tuple, object] = {}
        self.targets: dict[int, tuple] = {}
        self.extra_refs: dict[tuple, _ExtraRef] = {}
        self.slots: dict = {}
        self.tnodes: dict[tuple, _TNode] = {}

    def release(self) -> None:
        """Lets go of every tensor the scope holds (a scope only used to classify)."""
        self.packed.clear()
        self.cheap_packed.clear()
        self.results = _Results()
        self.recorder.made.clear()

    def note_packed(self, t: torch.Tensor, packed, cheap: bool = False,
                    position: int | None = None) -> None:
        """t was packed to `packed`; cheap: t is of the cheap set (read by linear recipes
        only, Note [Linear recipes]); position: t is the block call's save at this
        position (learning: Note [Recipes by position])."""
        storage = storage_key(t)
        if storage is not None:
            key = (storage, _layout(t))
            (self.cheap_packed if cheap else self.packed)[key] = (packed, t._version)
            if self.learning:
                ref = _SaveRef(position) if position is not None else None
                (self.cheap_refs if cheap else self.refs)[key] = ref
                if ref is not None and t.grad_fn is not None:
                    self.targets[position] = (t.grad_fn, t.output_nr)

    def template(self, root: _Node, t: torch.Tensor, linear: bool) -> _Template | None:
        """Note [Recipes by position]: node_for(t, linear)'s recipe `root` with its inputs
        as references, and the paths through t's autograd history that a later call's t
        must reach them by; None where an input cannot be named or reached so (the call
        keeps the Recorder). Call it before pack_extras(root)."""
        if not self.learning or t.grad_fn is None:
            return None
        reads: dict[int, object] = {}  # id -> reference, each once
        try:
            troot = self._template_node(root, linear, {}, reads)
        except _Unbound:
            return None
        targets = {}
        for ref in reads.values():
            if isinstance(ref, _ParamRef):
                targets[ref] = (lambda ptr: lambda node, nr: _accumulates_into(node, ptr))(
                    ref.ptr)
                continue
            target = self.targets.get(ref.position if isinstance(ref, _SaveRef) else ref)
            if target is None or target[0] is None:
                return None  # no autograd history to check it by
            targets[ref] = (lambda fn, n: lambda node, nr: node is fn and nr == n)(*target)
        paths = _path_to(t.grad_fn, targets)
        if len(paths) < len(targets):
            return None
        return _Template(troot, tuple(reads.values()),
                         tuple((ref, paths[ref]) for ref in reads.values()))

    def _template_node(self, node: _Node, linear: bool, memo: dict, reads: dict) -> _TNode:
        tn = memo.get(id(node))
        if tn is not None:
            return tn
        made = node.made

        def ref(key, leaf):
            a = made.args[key] if isinstance(key, int) else made.kwargs[key]
            if isinstance(leaf, _Packed):  # as _leaf found it: packed first, then cheap
                k = (a.storage, a.layout)
                r = self.refs.get(k) if k in self.packed else self.cheap_refs.get(k)
            elif isinstance(leaf, _Param):
                r = _ParamRef(leaf.tensor.untyped_storage().data_ptr(), leaf.layout)
            elif isinstance(leaf, _View):
                return _View(self._template_node(leaf.node, linear, memo, reads), leaf.layout)
            elif isinstance(leaf, _Extra):
                k = (a.storage, a.layout)
                r = self.extra_refs.get(k)
                if r is None:
                    spec = _ExtraSpec(made.func, made.ordinal, key, a.layout,
                                      len(self.extra_refs), made.window)
                    r = self.extra_refs[k] = _ExtraRef(spec)
                    self.targets[r] = (leaf.tensor.grad_fn, leaf.tensor.output_nr)
            else:
                return leaf
            if r is None:
                raise _Unbound  # packed outside the call's saves
            reads.setdefault(id(r), r)
            return r

        args = tuple(ref(i, a) for i, a in enumerate(node.args))
        kwargs = {k: ref(k, v) for k, v in node.kwargs.items()}
        slot = self.slots.setdefault(made.storage, len(self.slots))
        # One node for one op on the same inputs across the call's recipes (q, k and v's
        # normalised input): a later call binds it once (SaveParts.nodes).
        key = (slot, node.func, node.layout, tuple(map(_interned, args)),
               tuple((k, _interned(v)) for k, v in kwargs.items()))
        tn = self.tnodes.get(key)
        if tn is None:
            tn = self.tnodes[key] = _TNode(node.func, args, kwargs, node.layout, slot,
                                           made.linear)
        memo[id(node)] = tn
        return tn

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
                    if self.learning:  # what template() named it
                        self.refs[key] = self.extra_refs.get(key)
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
        return _input(packed, self.share_handles)

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
