"""Layer-wise weight offload (seed 002's behaviour): offload_weights().

    handle = spillway.offload_weights(model)          # blocks: the largest nn.ModuleList
    with torch.inference_mode():
        out = model(x)                                # each block's weights come and go
    with handle.mutate_weights():                     # every weight on the device, editable
        merge_lora(model)
    handle.detach()                                   # an ordinary resident model again

Note [Layer-wise weights]
~~~~~~~~~~~~~~~~~~~~~~~~~
Each block (an entry of the model's largest nn.ModuleList, or of the one named
by `blocks`) gets one host slab: its parameters laid end to end, each at a
256-byte aligned offset, copied to pinned host memory once by
spillway::offload (the runtime's copy engine and pinned pool). On the device
each of those parameters is a placeholder of its dtype and rank with no
elements, so module code, named_parameters() and state_dict keys keep working.
Everything outside the blocks (embeddings, head, norms, the blocks' buffers, a
parameter two blocks share) moves to the device and stays.

Before a block runs (a forward pre-hook) the compute stream waits for that
block's slab, reloaded by spillway::reload into one device buffer (one H2D per
block, on the runtime's copy stream, after the compute stream's current
point), and its parameters become views of the buffer. At most `slots`
(prefetch + 1) such buffers are allocated at once: before the block runs, the
next slots - 1 blocks start their reloads; after it ran (a forward hook) its
parameters are placeholders again, its buffer goes back to PyTorch's caching
allocator on the compute stream, on which it was allocated (the copy that
wrote it finished before the compute stream read it, so no record_stream is
needed), and one more block starts its reload. Copies started by a call's
last blocks are the next call's first (the ring's handover); they stay
pending between calls, so the link never idles at the boundary, and are
waited for by the block that uses them (or by detach(), mutate_weights() and
a dropped handle's finalizer). These are the rules the weight-stream
simulator replays (Note [Weight stream] in src/sim/weight_stream.cc).

The order prefetched is the one observed: each call of the model records the
blocks in the order they ran, and the next call prefetches along it, as a
ring (the last block prefetches the first for the next call). Before any call
completed it is the ModuleList's order. A block that runs out of the predicted
order, twice, or not at all still reads exactly its own weights (a block
whose reload was not started loads on demand); a misprediction costs time and
at most `slots` buffers, which wait for their copies before being dropped.

With granularity='children' the unit is finer: each direct child of a block
that holds parameters (attention, MLP) is a group with its own slab, copy and
hooks, and the block's own parameters another; everything above then holds
for groups. Smaller buffers let a tight budget stream through two slots
where whole blocks fit only one.

With a gpu_budget, some blocks stay resident: their weights live in a device
buffer of their own for good, and the stream skips them. The resident-set
scheduler (include/spillway/weights.h, in C++) chooses them and the slot
count: the least simulated call time whose simulated weights on the device
(the weights outside the blocks, the resident blocks, the streamed buffers)
fit the budget. It first plans with no compute time known (every block as if
the link were the bottleneck); the model's second call is profiled (each
block's compute time and the compute between blocks, from CUDA events on the
compute stream, taken after the block's wait), and the plan is made again
from those times before the third call. forecast() shows the plan.

Training: a call of the model with autograd recording saves references to the
streamed weights instead of the weights, and backward brings them back, group
by group in reverse order (Note [Weights in backward] in _training.py); the
gradients are those of the resident model, bit for bit. The optimizer step
runs inside mutate_weights().
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import weakref

import torch
from torch import nn

from spillway import _budget, ops
from spillway._device import allocation_rounded as _rounded
from spillway._device import parse_device
from spillway._device import shown as _shown
from spillway.weights._training import Backward

_ALIGN = 256  # bytes; every parameter's offset in its slab is a multiple of this


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one parameter of a block lives in the block's slab."""
    name: str            # the parameter's name inside the block (module path + attribute)
    offset: int          # bytes from the slab's start, a multiple of _ALIGN
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


# The attached handles an optimizer's step asks first (LayerwiseWeights._check_step),
# through one pre-hook on every optimizer's step (torch's global one), registered once:
# a hook per handle removed as its handle dies could change torch's hook dict while a
# step iterates over it.
_STEP_GUARDED: "weakref.WeakSet[LayerwiseWeights]" = weakref.WeakSet()
_step_guard = None


def _guard_steps(handle: "LayerwiseWeights") -> None:
    global _step_guard
    if _step_guard is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def pre_hook(optimizer, args, kwargs):
            for live in list(_STEP_GUARDED):
                live._check_step(optimizer)
            return None

        _step_guard = register_optimizer_step_pre_hook(pre_hook)
    _STEP_GUARDED.add(handle)


def _placeholder(dtype: torch.dtype, ndim: int, device: torch.device) -> torch.Tensor:
    """An empty tensor of the parameter's dtype and rank (rank 1 for a scalar)."""
    return torch.empty((0,) * max(ndim, 1), dtype=dtype, device=device)


def _shaped_placeholder(slot: "_Slot", device: torch.device) -> torch.Tensor:
    """A tensor of the parameter's dtype and shape that holds one element, expanded (all
    strides 0): NaN for a floating dtype, else 0. What torch.compile traces in place of an
    offloaded weight (Note [Piecewise executor] in compiled.py): it has the weight's
    shape, reading it is safe (a copy, print or deepcopy of the model works), and a model
    run on it gives NaN, never a plausible value; the executor hands its pieces the
    weight's device copy instead, and the blocks refuse a call outside it."""
    fill = float("nan") if slot.dtype.is_floating_point or slot.dtype.is_complex else 0
    return torch.full((), fill, dtype=slot.dtype, device=device).expand(slot.shape)


def _owner(block: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (block.get_submodule(path) if path else block), attr


class _Block:
    """One block's host slab and layout; its device buffer while it runs."""

    def __init__(self, index: int, path: str, module: nn.Module, slots: list[_Slot],
                 host: torch.Tensor, device: torch.device, shaped: bool = False):
        self.index, self.path, self.module = index, path, module
        self.slots, self.host = slots, host
        self.params: list[nn.Parameter] = [self.parameter(s.name) for s in slots]
        # What each parameter holds while the block is not running (shaped: for the
        # compiled executor, whose traced graphs need the weights' shapes).
        self.placeholders = [_shaped_placeholder(s, device) if shaped
                             else _placeholder(s.dtype, len(s.shape), device) for s in slots]

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    def qualified(self, slot: _Slot) -> str:
        """The parameter's name in the model (its state_dict key)."""
        return f"{self.path}.{slot.name}"

    def parameter(self, name: str) -> nn.Parameter:
        owner, attr = _owner(self.module, name)
        return owner._parameters[attr]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [buffer[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape)
                for s in self.slots]


class LayerwiseWeights:
    """The handle offload_weights() returns (Note [Layer-wise weights]).

    blocks: the offloaded blocks' module paths, in ModuleList order. device: where
    the weights run. stats(): bytes on the host, reloads, on-demand loads.
    mutate_weights(): a context with every weight on the device; on leaving it the
    host slabs are taken again from the parameters as they are then. detach():
    every weight back on the device as an ordinary parameter, the hooks removed.

    Not thread-safe: one model call at a time, as PyTorch modules themselves.
    """

    def __init__(self, model: nn.Module, blocks, prefetch: int | None, device: torch.device,
                 budget: tuple[str, float] | None = None, device_profile=None,
                 granularity: str = "block", compiled: bool = False):
        self.model, self.device, self.granularity = model, device, granularity
        # compiled: driven by the piecewise executor (compiled.py), which hands each piece
        # its weights' device copies: the parameters keep their shaped placeholders, and
        # the blocks' only hook refuses a run outside the executor.
        self._compiled = compiled
        self.prefetch = 1 if prefetch is None else prefetch
        self._slots = self.prefetch + 1  # streamed buffers allocated at once
        self._list_path, modules = _find_blocks(model, blocks)
        self.blocks: list[str] = [f"{self._list_path}.{i}" if self._list_path else str(i)
                                  for i in range(len(modules))]
        self._modules = modules
        self._blocks: list[_Block] = []
        self._live: dict[int, torch.Tensor] = {}        # block -> its waited device buffer
        self._resident: dict[int, torch.Tensor] = {}    # block -> its buffer for good
        # block -> (its reloaded buffer, whether the compute stream waited for the copy)
        self._prefetched: dict[int, tuple[torch.Tensor, bool]] = {}
        self._order: list[int] = []      # the block order of the last completed call
        self._following: dict[int, int] = {}  # block -> the block after it in that order
        self._observed: list[int] = []   # this call's so far
        self._held: set[int] = set()     # compiled: live past their graph (_end_of_graph)
        self._bound: set[int] = set()    # compiled: run eagerly by Dynamo (_eager_start)
        self._depth = 0                  # model calls in progress (re-entrant calls)
        self._hooks: list = []
        self._mutating = False
        self._detached = False
        self._stats = {"reloads": 0, "prefetched": 0, "on_demand": 0, "dropped_prefetches": 0,
                       "calls": 0, "backward_reloads": 0, "backward_on_demand": 0}
        self._backward = Backward(self)  # Note [Weights in backward]
        # The budget's planning (None without a gpu_budget): see _Planner.
        self._planner = None if budget is None else _Planner(
            self, budget, device_profile, fixed_slots=prefetch is not None)
        # Planned before anything moves: a budget no plan fits leaves the model unchanged.
        first = None if self._planner is None else self._planner.plan(steps=None)
        self._snapshot(initial=True)
        self._follow([b.index for b in self._blocks])  # until a call has run
        if first is not None:
            self._apply(first)
        self._install_hooks()
        # A handle dropped without detach() leaves no copy unwaited in the runtime.
        self._finalizer = weakref.finalize(self, _wait_dropped, self._prefetched)
        self._finalizer.atexit = False

    # ---- the host slabs ------------------------------------------------------

    def _offloadable(self) -> list[list[tuple[str, nn.Parameter]]]:
        """Per block, the parameters that go to its slab: not empty, and used by no other
        block and by nothing outside the blocks (those stay resident)."""
        in_blocks = [list(m.named_parameters()) for m in self._modules]
        uses: dict[int, int] = {}
        for params in in_blocks:
            for _, p in params:
                uses[id(p)] = uses.get(id(p), 0) + 1
        inner = {id(m) for b in self._modules for m in b.modules()}
        for m in self.model.modules():
            if id(m) not in inner:
                for p in m.parameters(recurse=False):
                    uses[id(p)] = uses.get(id(p), 0) + 1
        return [[(n, p) for n, p in params if p.numel() > 0 and uses[id(p)] == 1]
                for params in in_blocks]

    def _grouped(self) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
        """The groups, in block order: (path, the module whose forward hooks bring the
        group's weights, its parameters named inside that module). granularity 'block':
        one group per block. 'children': per block, its own parameters (the block's hooks)
        and each direct child's (the child's hooks); a block whose children share a
        parameter stays one group."""
        out = []
        for path, module, params in zip(self.blocks, self._modules, self._offloadable()):
            ids = [id(p) for _, p in module.named_parameters(remove_duplicate=False)]
            if self.granularity == "block" or len(ids) != len(set(ids)):
                out.append((path, module, params))
                continue
            by_child: dict[str, list[tuple[str, nn.Parameter]]] = {}
            for name, p in params:
                child, dot, rest = name.partition(".")
                by_child.setdefault(child if dot else "", []).append((rest if dot else name, p))
            children = dict(module.named_children())
            if "" in by_child:
                out.append((path, module, by_child.pop("")))
            out += [(f"{path}.{child}", children[child], ps) for child, ps in by_child.items()]
        return out

    def _snapshot(self, initial: bool) -> None:
        """Builds every group's host slab from its parameters as they are, then (all
        slabs made) makes the parameters placeholders. Nothing changes when a slab cannot
        be made (pinned memory exhausted): the error names the group."""
        groups = self._grouped()
        if initial and not any(params for _, _, params in groups):
            raise ValueError(f"[weights] the blocks of {self._list_path or 'the model'} "
                             f"({len(self._modules)} modules) have no parameters of their own "
                             f"to offload")
        made: list[_Block] = []
        for index, (path, module, params) in enumerate(groups):
            slots, offset = [], 0
            for name, p in params:
                offset = -(-offset // _ALIGN) * _ALIGN
                nbytes = p.numel() * p.element_size()
                slots.append(_Slot(name, offset, nbytes, p.dtype, tuple(p.shape)))
                offset += nbytes
            if not slots:
                made.append(_Block(index, path, module, [],
                                   torch.empty(0, dtype=torch.uint8), self.device,
                                   self._compiled))
                continue
            try:
                staging = torch.empty(offset, dtype=torch.uint8, device=self.device)
                with torch.no_grad():
                    for s, (_, p) in zip(slots, params):
                        staging[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) \
                            .copy_(p.detach())
                host = ops.offload(staging, exact=True)
                host = ops.wait_tensor(host, keepalive=staging)
                del staging
            except torch.OutOfMemoryError as e:
                raise torch.OutOfMemoryError(
                    f"[weights] {'block' if self.granularity == 'block' else 'group'} {path} "
                    f"({offset / 2**20:.1f} MiB): no memory "
                    f"for its host slab or its staging copy ({e}); the model is unchanged") \
                    from None
            made.append(_Block(index, path, module, slots, host, self.device, self._compiled))
        ops.synchronize()  # the slabs are complete before the parameters let go
        self._blocks = made
        for block in made:
            for p, placeholder in zip(block.params, block.placeholders):
                p.data = placeholder
        if initial:
            self._move_the_rest()

    def _move_the_rest(self) -> None:
        """Everything the slabs do not hold moves to the device once."""
        offloaded = {id(p) for b in self._blocks for p in b.params}
        with torch.no_grad():
            for p in self.model.parameters():
                if id(p) not in offloaded and p.device != self.device:
                    p.data = p.data.to(self.device)
            for module in self.model.modules():
                for name, buf in module._buffers.items():
                    if buf is not None and buf.device != self.device:
                        module._buffers[name] = buf.to(self.device)

    # ---- hooks ------------------------------------------------------------------

    def _install_hooks(self) -> None:
        _guard_steps(self)
        if self._compiled:
            for module, path in zip(self._modules, self.blocks):
                self._hooks.append(module.register_forward_pre_hook(self._outside(path)))
            for block in self._blocks:
                if block.slots:
                    self._hooks.append(block.module.register_forward_pre_hook(
                        self._eager_start(block.index)))
                    self._hooks.append(block.module.register_forward_hook(
                        self._eager_end(block.index), always_call=True))
            return
        self._hooks.append(self.model.register_forward_pre_hook(self._on_model_start))
        self._hooks.append(self.model.register_forward_hook(self._on_model_end,
                                                            always_call=True))
        for block in self._blocks:
            if not block.slots:
                continue
            self._hooks.append(block.module.register_forward_pre_hook(
                self._pre_hook(block.index)))
            self._hooks.append(block.module.register_forward_hook(
                self._post_hook(block.index), always_call=True))

    @torch.compiler.disable
    def _on_model_start(self, module, args):
        self._call_starts()

    @torch.compiler.disable
    def _on_model_end(self, module, args, output):
        self._call_ends()

    def _call_starts(self) -> None:
        """A call of the model begins (the model's pre-hook, or the compiled executor)."""
        if self._depth == 0:
            self._observed = []
            if self._planner is not None:
                self._planner.call_starts()
            if not self._mutating:
                self._backward.call_starts()
        self._depth += 1

    def _call_ends(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._let_go(keep=None)
            self._backward.call_ends()
            self._stats["calls"] += 1
            if self._observed:
                self._order = self._observed
                self._follow(self._observed)
            # The copies started for the next call's first blocks stay pending: the
            # blocks that use them wait for them (Note [Layer-wise weights]).
            if self._planner is not None and not self._live:
                plan = self._planner.call_ends()
                if plan is not None:
                    self._apply(plan, prime=True)

    def _check_step(self, optimizer) -> None:
        """Before any optimizer's step: one that would update offloaded weights outside
        mutate_weights() is refused before it changes anything. Their parameters hold
        placeholders between calls (or a resident group's device buffer, whose host slab
        would go stale), so the update would fail half done or be lost."""
        if self._mutating or self._detached:
            return
        mine = {id(param): block.qualified(slot) for block in self._blocks
                for slot, param in zip(block.slots, block.params)}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in mine:
                    raise RuntimeError(
                        f"[weights] {type(optimizer).__name__}.step() would update "
                        f"{mine[id(param)]}, whose weights are offloaded to the host, outside "
                        f"mutate_weights(): step inside `with handle.mutate_weights(): "
                        f"optimizer.step()` (for spillway.compile, its spillway_weights). "
                        f"Nothing was changed")

    def _outside(self, path: str):
        """Compiled: a block run outside a call of the compiled model (the model called
        without its compiled wrapper) would compute on placeholders. Dynamo traces the
        hook as nothing (is_compiling() is constant there)."""
        def hook(module, args):
            if (torch.compiler.is_compiling() or self._mutating or self._detached
                    or self._depth > 0):
                return
            raise RuntimeError(
                f"[weights] {path} was called outside the compiled model: its weights are "
                f"on the host for spillway.compile(weights='offload'), and its parameters "
                f"hold placeholders. Call the module spillway.compile returned, or put the "
                f"weights on the device with its spillway_weights.mutate_weights() or "
                f"detach()")
        return hook

    def _eager_start(self, index: int):
        """Compiled: Dynamo runs the group's module eagerly inside a call of the compiled
        model (its frame skipped: the recompile limit reached, or code Dynamo does not
        trace). It runs as offload_weights() runs it: its weights come to the device and
        its parameters hold their views until it ends; a piece that reads them meanwhile
        finds them live. Traced, the hook is nothing."""
        def hook(module, args):
            if (torch.compiler.is_compiling() or self._mutating or self._detached
                    or index in self._bound):
                return
            block = self._blocks[index]
            if self._depth == 0:
                raise RuntimeError(
                    f"[weights] {block.path} was called outside the compiled model: its "
                    f"weights are on the host for spillway.compile(weights='offload'), and "
                    f"its parameters hold placeholders. Call the module spillway.compile "
                    f"returned, or put the weights on the device with its "
                    f"spillway_weights.mutate_weights() or detach()")
            self._bring(index)
            self._bound.add(index)
            self._bind(block, block.views(self._device_copy(index)), force=True)
        return hook

    def _eager_end(self, index: int):
        def hook(module, args, output):
            if torch.compiler.is_compiling() or index not in self._bound:
                return
            self._bound.discard(index)
            block = self._blocks[index]
            self._bind(block, block.placeholders, force=True)
            self._release(index)
        return hook

    def _pre_hook(self, index: int):
        @torch.compiler.disable
        def hook(module, args):
            if not self._mutating:
                self._bring(index)
        return hook

    def _post_hook(self, index: int):
        @torch.compiler.disable
        def hook(module, args, output):
            if not self._mutating:
                streamed = index in self._live
                self._release(index)
                if (streamed and torch.is_grad_enabled() and not self._backward.recording
                        and _records_grad(output)):
                    raise RuntimeError(
                        f"[weights] {self._blocks[index].path} ran with autograd recording "
                        f"outside a call of the model: its backward would need the offloaded "
                        f"weights again, which only a call of the model arranges (Note "
                        f"[Weights in backward]). Call the model, or run the block under "
                        f"torch.no_grad()")
        return hook

    def _end_of_graph(self, index: int) -> None:
        """Compiled: a graph's last piece that reads the group ended. When the last call's
        order brings the same group next (a graph break inside it), its weights stay on
        the device until then instead of being copied again; a wrong guess costs only
        the time they are held (released at the next bring of another group)."""
        k = len(self._observed)
        if index in self._bound:  # its eager run releases it
            return
        if index in self._live and k < len(self._order) and self._order[k] == index:
            self._held.add(index)
        else:
            self._release(index)

    def _let_go(self, keep: int | None) -> None:
        """Releases the groups held past their graph, but `keep`."""
        for k in sorted(self._held - {keep}):
            self._held.discard(k)
            self._release(k)
        self._held.discard(keep)

    def _bring(self, index: int) -> None:
        if self._held:
            self._let_go(keep=index)
        block = self._blocks[index]
        self._observed.append(index)
        profiling = self._planner is not None and self._planner.profiling
        if profiling:
            self._planner.mark("before", index)
        if index in self._resident:
            if profiling:
                self._planner.mark("start", index)
            return
        if (torch.is_grad_enabled() and not self._backward.recording
                and any(p.requires_grad for p in block.params)):
            self._observed.pop()
            raise RuntimeError(
                f"[weights] {block.path} runs with gradients enabled outside a call of the "
                f"model, and its offloaded parameters require grad: only a call of the model "
                f"brings them back for backward (Note [Weights in backward]). Call the model, "
                f"or run the block under torch.no_grad()")
        if index in self._live:  # a re-entrant call of the same block: its weights are here
            return
        buffer, waited = self._prefetched.pop(index, (None, False))
        if buffer is None:
            buffer = ops.reload(block.host, self.device)
            self._stats["reloads"] += 1
            self._stats["on_demand"] += 1
        if not waited:
            buffer = ops.wait_tensor(buffer, keepalive=block.host)
        self._live[index] = buffer
        self._bind(block, block.views(buffer))
        if self._backward.recording:
            self._backward.brought(index, buffer)
        if profiling:
            self._planner.mark("start", index)
        self._fill(index)

    def _release(self, index: int) -> None:
        if index in self._bound:  # compiled: its eager run (_eager_start) ends it
            return
        if self._planner is not None and self._planner.profiling:
            self._planner.mark("end", index)
        buffer = self._live.pop(index, None)
        if buffer is None:
            return
        block = self._blocks[index]
        self._bind(block, block.placeholders)
        self._backward.released(buffer)
        del buffer  # back to the caching allocator, in the compute stream's order
        self._fill(index)

    def _bind(self, block: _Block, tensors: list[torch.Tensor], force: bool = False) -> None:
        """The block's parameters hold `tensors` (its weights' device views, or its
        placeholders). The compiled executor passes the views to its pieces and leaves
        the parameters as they are, unless it binds them (force: a piece that trains, a
        group Dynamo runs eagerly)."""
        if force or not self._compiled:
            for p, t in zip(block.params, tensors):
                p.data = t

    def _train_through(self, index: int) -> None:
        """Compiled, a piece that trains: the group's parameters hold its device views
        for the piece, so autograd records them and their gradients reach them (Note
        [Weights in backward]); a resident group's buffer is known to the packing too,
        since its parameters hold placeholders again after the piece."""
        block = self._blocks[index]
        if index in self._resident:
            buffer = self._resident[index]
            self._backward.groups_by_storage[buffer.untyped_storage().data_ptr()] = index
            self._backward.hook(index)
        if index not in self._bound:
            self._bind(block, block.views(self._device_copy(index)), force=True)

    def _untrain(self, index: int) -> None:
        """After the piece: the placeholders again; what the piece saved is packed."""
        if index in self._resident:
            buffer = self._resident[index]
            self._backward.groups_by_storage.pop(buffer.untyped_storage().data_ptr(), None)
        if index not in self._bound:
            self._bind(self._blocks[index], self._blocks[index].placeholders, force=True)

    def _where_of_params(self) -> dict[int, tuple[int, int]]:
        """id(parameter) -> (its group, its slot), for every offloaded parameter."""
        return {id(p): (b.index, k) for b in self._blocks for k, p in enumerate(b.params)}

    def _device_copy(self, index: int) -> torch.Tensor | None:
        """The group's device buffer while it runs, or for good when resident."""
        buffer = self._live.get(index)
        return self._resident.get(index) if buffer is None else buffer

    def _streamed(self, index: int) -> bool:
        return bool(self._blocks[index].slots) and index not in self._resident

    def _follow(self, order: list[int]) -> None:
        """The ring the next call prefetches along: the streamed blocks of `order`, each
        followed by the next streamed block after its last occurrence."""
        ring = [k for k in order if self._streamed(k)]
        self._following = {k: ring[(position + 1) % len(ring)]
                           for position, k in enumerate(ring)}

    def _wanted(self, index: int) -> list[int]:
        """The blocks after `index` along the ring whose copies should be running: as many
        as the slots the live blocks leave, nearest first (Note [Weight stream])."""
        following, out, k = self._following, [], index
        room = self._slots - len(self._live)
        for _ in range(len(following)):
            if len(out) >= room or k not in following:
                break
            k = following[k]
            if k in out:
                break
            if k in self._live:
                if k == index:
                    break
                continue
            out.append(k)
        return out

    def _fill(self, index: int) -> None:
        wanted = self._wanted(index)
        for k in list(self._prefetched):  # mispredicted: wait for the copy, then drop
            if k not in wanted:
                buffer, waited = self._prefetched.pop(k)
                if not waited:
                    ops.wait_tensor(buffer, keepalive=self._blocks[k].host)
                self._stats["dropped_prefetches"] += 1
        for k in wanted:
            if k in self._prefetched:
                continue
            self._prefetched[k] = (ops.reload(self._blocks[k].host, self.device), False)
            self._stats["reloads"] += 1
            self._stats["prefetched"] += 1

    def _apply(self, plan: dict, prime: bool = False) -> None:
        """Makes `plan`'s blocks resident (their own device buffer, waited for) and
        streams the others through plan['slots'] buffers. Between calls only. prime: start
        the next call's first copies, as the last streamed block would have."""
        self._drain()
        for block in self._blocks:
            keep = bool(plan["resident"][block.index]) and bool(block.slots)
            if keep and block.index not in self._resident:
                buffer = ops.wait_tensor(ops.reload(block.host, self.device), keepalive=block.host)
                self._stats["reloads"] += 1
                self._resident[block.index] = buffer
                self._bind(block, block.views(buffer))
            elif not keep and block.index in self._resident:
                del self._resident[block.index]
                self._bind(block, block.placeholders)
        self._slots = int(plan["slots"])
        order = self._order or [b.index for b in self._blocks]
        self._follow(order)
        last = next((k for k in reversed(order) if self._streamed(k)), None)
        if prime and last is not None:
            self._fill(last)

    def _drain(self) -> None:
        """Waits for and drops every prefetched buffer."""
        _wait_all(self._prefetched)

    # ---- the user's scopes ----------------------------------------------------------

    def _check_attached(self, what: str) -> None:
        if self._detached:
            raise RuntimeError(f"[weights] {what} after detach(): the model is an ordinary "
                               f"resident model again")

    @contextlib.contextmanager
    def mutate_weights(self):
        """Every offloaded weight on the device, each an ordinary tensor of its own, for
        the body to read or change (in place, or by assigning new parameters of any shape
        and dtype); the blocks run without moving anything. On leaving, the host slabs are
        made again from the parameters as they are then."""
        self._check_attached("mutate_weights()")
        if self._mutating:
            raise RuntimeError("[weights] mutate_weights() is already active")
        if self._live:
            raise RuntimeError("[weights] mutate_weights() inside a model call")
        self._drain()
        self._restore_all()
        self._mutating = True
        try:
            yield self
        finally:
            self._mutating = False
            try:
                self._snapshot(initial=False)
                if self._planner is not None:  # the blocks' sizes may have changed
                    self._apply(self._planner.plan(steps=self._planner.steps))
            except BaseException:
                # The weights stay where the body left them, on the device; without
                # slabs the hooks have nothing to do.
                self._remove_hooks()
                raise

    def detach(self) -> nn.Module:
        """Every offloaded weight back on the device as an ordinary parameter, the hooks
        removed, the host slabs freed. Returns the model."""
        self._check_attached("detach()")
        if self._live:
            raise RuntimeError("[weights] detach() inside a model call")
        self._drain()
        self._restore_all()
        self._remove_hooks()
        return self.model

    def _remove_hooks(self) -> None:
        self._backward.remove()
        for hook in self._hooks:
            hook.remove()
        _STEP_GUARDED.discard(self)
        self._hooks, self._blocks, self._detached = [], [], True
        _HANDLES.pop(self.model, None)

    def _restore_all(self) -> None:
        """Each offloaded parameter gets a device tensor of its own with its value (the
        resident blocks' buffers are let go)."""
        self._resident.clear()
        for block in self._blocks:
            if not block.slots:
                continue
            buffer = ops.wait_tensor(ops.reload(block.host, self.device), keepalive=block.host)
            self._stats["reloads"] += 1
            for p, view in zip(block.params, block.views(buffer)):
                p.data = view.clone()
            del buffer

    def state_dict(self) -> dict:
        """The model's state_dict with every offloaded parameter's value read from its
        host slab (a CPU tensor of its own) instead of its placeholder."""
        self._check_attached("state_dict()")
        out = self.model.state_dict()
        if self._mutating:  # the parameters themselves hold the values
            return out
        for block in self._blocks:
            for slot, view in zip(block.slots, block.views(block.host)):
                out[block.qualified(slot)] = view.clone()
        return out

    def stats(self) -> dict:
        """calls: model calls completed; reloads: H2D copies of a block's slab (prefetched:
        started ahead, on_demand: at the block's start, dropped_prefetches: never used);
        bytes_offloaded: the offloaded parameters' bytes; bytes_host: their slabs' (with
        alignment); bytes_pinned: the pinned memory those slabs hold (pages); order: the
        block order of the last call, which the next one prefetches along; in_flight: the
        blocks whose weights are prefetched and not yet used (after a call: the ring's
        handover to the next one, pending); resident: the blocks whose weights stay on the
        device (gpu_budget); slots: the streamed buffers allocated at once at most."""
        slabs = [b.nbytes for b in self._blocks if b.slots]
        return {**self._stats, "blocks": len(self.blocks), "groups": len(self._blocks),
                "resident": sorted(self._resident), "slots": self._slots,
                "bytes_offloaded": sum(s.nbytes for b in self._blocks for s in b.slots),
                "bytes_host": sum(slabs),
                "bytes_pinned": sum(-(-n // 4096) * 4096 for n in slabs),
                "order": list(self._order), "in_flight": sorted(self._prefetched)}

    @property
    def groups(self) -> list[str]:
        """The module paths of the groups, each with one slab and one copy: the blocks
        (granularity 'block'), or their children and the blocks' own parameters."""
        return [b.path for b in self._blocks]

    def forecast(self) -> dict | None:
        """The gpu_budget plan and what the simulator forecasts for it (None without a
        gpu_budget): budget_bytes, resident (indices into groups), slots, strategy, profiled
        (whether the compute times are measured: from the second call on), call_ms,
        compute_ms, stall_ms, link_ms, bytes_moved, peak_bytes (the weights on the device
        at most), resident_bytes, and candidates (each strategy's forecast)."""
        return None if self._planner is None else self._planner.forecast()

    def __repr__(self) -> str:
        s = self.stats()
        return (f"LayerwiseWeights({len(self.blocks)} blocks of {self._list_path or 'the model'}, "
                f"{s['bytes_offloaded'] / 2**20:.1f} MiB on the host, {self._slots} slots, "
                f"{len(self._resident)} resident, "
                f"device {self.device}{', detached' if self._detached else ''})")


class _Planner:
    """A handle's gpu_budget plans (Note [Layer-wise weights]): the resident-set scheduler
    (spillway._C.plan_resident_set) run on the blocks' slab sizes, the weights outside the
    blocks, and the call's steps: none before the second call, measured by it after."""

    PROFILED_CALL = 2

    def __init__(self, handle: "LayerwiseWeights", budget: tuple[str, float], device_profile,
                 fixed_slots: bool):
        self.handle, self.spec = handle, budget
        self.profile_json = _budget.device_profile_json(device_profile, "weights")
        # Slot counts tried: up to 4 blocks, or 8 children (a block's small groups, its
        # norms, take slots of their own).
        most = 8 if handle.granularity == "children" else 4
        self.slots = (handle._slots, handle._slots) if fixed_slots else (1, most)
        self.steps: list[tuple[int, float]] | None = None  # measured by the profiled call
        self.result: dict | None = None
        self.budget_bytes = 0
        self.profiling = False
        self._calls = 0
        self._marks: list[tuple[str, int, object]] = []

    # ---- sizes ----

    def _sizes(self) -> tuple[list[int], int, int]:
        """(each block's slab bytes, the device bytes of what stays there, the device bytes
        of everything: what a budget fraction is of), from the slabs once made, from the
        parameters before; each tensor rounded as the caching allocator rounds it."""
        h = self.handle
        if h._blocks:
            block_bytes = [b.nbytes if b.slots else 0 for b in h._blocks]
            offloaded = {id(p) for b in h._blocks for p in b.params}
        else:
            block_bytes, offloaded = [], set()
            for _, _, params in h._grouped():
                offset = 0
                for _, p in params:
                    offset = -(-offset // _ALIGN) * _ALIGN + p.numel() * p.element_size()
                    offloaded.add(id(p))
                block_bytes.append(offset)
        rest = [p for p in h.model.parameters() if id(p) not in offloaded]
        fixed = sum(_rounded(p.numel() * p.element_size()) for p in rest)
        fixed += sum(_rounded(b.numel() * b.element_size()) for b in h.model.buffers())
        return block_bytes, fixed, fixed + sum(_rounded(n) for n in block_bytes)

    # ---- planning ----

    def plan(self, steps: list[tuple[int, float]] | None) -> dict:
        from spillway import _C
        block_bytes, fixed, total = self._sizes()
        self.budget_bytes = _budget.budget_bytes(self.spec, total)
        if steps is None:  # no time known: every block as if the link were the bottleneck
            steps = [(b, 0.0) for b in range(len(block_bytes))]
        try:
            result = json.loads(_C.plan_resident_set(
                block_bytes, steps, fixed, self.budget_bytes, min_slots=self.slots[0],
                max_slots=self.slots[1], device_profile_json=self.profile_json))
        except ValueError as e:
            shown = (f"{self.spec[1]:g} of {total} weight bytes" if self.spec[0] == "fraction"
                     else f"{self.budget_bytes} bytes")
            raise ValueError(f"[weights] gpu_budget ({shown}): {e}; the model is unchanged"
                             if not self.handle._blocks else
                             f"[weights] gpu_budget ({shown}): {e}") from None
        self.result = result
        return result

    def forecast(self) -> dict | None:
        if self.result is None:
            return None
        r = self.result
        return {"budget_bytes": self.budget_bytes,
                "resident": [i for i, keep in enumerate(r["resident"]) if keep],
                "slots": r["slots"], "strategy": r["strategy"],
                "profiled": self.steps is not None, **r["forecast"],
                "candidates": r["candidates"]}

    # ---- the profiled call ----

    def call_starts(self) -> None:
        self._calls += 1
        self.profiling = self._calls == self.PROFILED_CALL and self.steps is None
        if self.profiling:
            self._marks = [("model", -1, self._clock())]

    def mark(self, kind: str, index: int) -> None:
        self._marks.append((kind, index, self._clock()))

    def call_ends(self) -> dict | None:
        """The plan from the profiled call's times, when this call was it."""
        if not self.profiling:
            return None
        self.profiling = False
        self._marks.append(("model", -1, self._clock()))
        self.steps = self._steps(self._marks)
        self._marks = []
        return self.plan(self.steps)

    def _clock(self):
        if self.handle.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed(self, a, b) -> float:
        if isinstance(a, float):
            return max(0.0, (b - a) * 1e3)
        return max(0.0, a.elapsed_time(b))

    def _steps(self, marks) -> list[tuple[int, float]]:
        """(block, ms) of each block between its start (after its wait) and its end, and
        (-1, ms) for the compute between blocks, before the first and after the last."""
        if not isinstance(marks[-1][2], float):
            marks[-1][2].synchronize()
        steps, previous, started = [], marks[0][2], {}
        for kind, index, clock in marks[1:]:
            if kind in ("before", "model"):
                gap = self._elapsed(previous, clock)
                if gap > 0:
                    steps.append((-1, gap))
                previous = clock
            elif kind == "start":
                started[index] = clock
            elif kind == "end" and index in started:
                steps.append((index, self._elapsed(started.pop(index), clock)))
                previous = clock
        return steps



def _records_grad(output) -> bool:
    """Whether autograd recorded the op that made any tensor of `output`."""
    from torch.utils._pytree import tree_leaves
    return any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in tree_leaves(output))


def _wait_dropped(prefetched: dict) -> None:
    """_wait_all for a handle the garbage collector drops: it may run while a dispatch
    mode is active (a FakeTensorMode while Dynamo traces, a recorder), which must not see
    the waits."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        _wait_all(prefetched)


def _wait_all(prefetched: dict) -> None:
    """Waits for every prefetched copy not yet waited for, and drops them all."""
    for buffer, waited in prefetched.values():
        if not waited:
            ops.wait_tensor(buffer)
    prefetched.clear()


def _find_blocks(model: nn.Module, blocks) -> tuple[str, list[nn.Module]]:
    """(path, modules): the ModuleList named by `blocks`, or the model's largest by
    parameter count (ties: the first in module order)."""
    if blocks is not None:
        if not isinstance(blocks, str) or not blocks:
            raise ValueError(f"[weights] blocks must be the path of an nn.ModuleList or "
                             f"nn.Sequential inside the model (a non-empty str), or None, got "
                             f"{_shown(blocks)}")
        try:
            found = model.get_submodule(blocks)
        except AttributeError:
            raise ValueError(f"[weights] blocks={blocks!r}: the model has no submodule of "
                             f"that path") from None
        if not isinstance(found, (nn.ModuleList, nn.Sequential)) or len(found) == 0:
            raise ValueError(f"[weights] blocks={blocks!r} is a {type(found).__name__}"
                             f"{' with no entries' if len(list(found.children())) == 0 else ''}"
                             f": it must be a non-empty nn.ModuleList or nn.Sequential of "
                             f"blocks")
        return blocks, list(found)
    best = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, path, module)
    if best is None:
        raise ValueError(f"[weights] {type(model).__name__} has no nn.ModuleList of blocks to "
                         f"offload; pass blocks='path.to.blocks' (an nn.ModuleList or "
                         f"nn.Sequential)")
    return best[1], list(best[2])


def _target_device(device) -> torch.device:
    if device is None:
        if not torch.cuda.is_available():
            raise ValueError("[weights] torch has no usable CUDA here: pass device='cpu' to run "
                             "the offload through the runtime's fake copy backend (for testing)")
        device = "cuda"
    return parse_device(device, "weights")


def offload_weights(model: nn.Module, blocks: str | None = None, prefetch: int | None = None,
                    gpu_budget=None, device=None, device_profile=None,
                    granularity: str = "block") -> LayerwiseWeights:
    """Keeps each block's weights in pinned host memory, bringing them to the device for
    the block's forward only (Note [Layer-wise weights]). Training: gradients come back
    through backward (Note [Weights in backward]); step the optimizer inside mutate_weights().

    model: an nn.Module on any device (its weights may not fit the GPU: a CPU model is
    never moved whole). blocks: the path of the nn.ModuleList (or nn.Sequential) whose
    entries are the blocks; None = the model's largest nn.ModuleList. prefetch: how many
    blocks' copies run ahead of the running block (>= 0; streamed buffers allocated at once
    = prefetch + 1); None = 1, or with a gpu_budget the scheduler's choice (1 to 3 ahead).
    gpu_budget: the model's weights on the device at most (the weights outside the blocks,
    the resident blocks, the streamed buffers; activations not counted): bytes (int, or a
    string such as '2GiB') or a fraction of the model's weights (parameters and buffers, as
    the caching allocator rounds them: 1.0 keeps every block; 0.5, '50%'); the
    resident-set scheduler keeps the blocks it chooses on the device (forecast()). None:
    every block streams. device: where the model runs; None = the current CUDA device;
    'cpu' drives the runtime's fake copy backend (tests). device_profile: the device
    profile the scheduler plans with (a JSON path or dict, as `spillway calibrate` writes
    it); None = the shipped H200 profile. granularity: 'block' (one slab and one copy per
    block) or 'children' (one per direct child of a block with parameters, and one for
    the block's own: smaller buffers, so a tight budget streams through more slots; only
    for blocks that use a child's parameters inside that child's forward, as Hugging Face
    and most transformer blocks do). prefetch, resident sets and stats then count groups.

    Raises ValueError (no blocks, bad arguments, a gpu_budget below the smallest that fits:
    the message names it), torch.OutOfMemoryError (pinned or device memory for a slab); the
    model is then unchanged.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"[weights] model must be an nn.Module, got {type(model).__name__}")
    return _attach(model, blocks, prefetch, gpu_budget, device, device_profile, granularity,
                   compiled=False)


def _attach(model: nn.Module, blocks, prefetch, gpu_budget, device, device_profile,
            granularity: str, compiled: bool) -> LayerwiseWeights:
    """The handle of offload_weights() (compiled=False) or of the compiled executor
    (compiled=True, Note [Piecewise executor] in compiled.py), after checking the
    arguments they share."""
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                 or prefetch < 0):
        raise ValueError(f"[weights] prefetch must be an int >= 0 (blocks copied ahead) or "
                         f"None, got {_shown(prefetch)}")
    if granularity not in ("block", "children"):
        raise ValueError(f"[weights] granularity must be 'block' or 'children', got "
                         f"{_shown(granularity)}")
    budget = None
    if gpu_budget is not None:
        budget = _budget.parse_memory_budget(gpu_budget, "weights", "gpu_budget",
                                             "the model's weight bytes")
    elif device_profile is not None:
        raise ValueError("[weights] device_profile is for the gpu_budget's scheduler; pass a "
                         "gpu_budget too, or leave device_profile=None")
    target = _target_device(device)
    attached = _HANDLES.get(model)
    if attached is not None and attached() is not None:
        raise ValueError(f"[weights] the model's weights are offloaded already ({attached()!r}); "
                         f"detach() that handle first")
    handle = LayerwiseWeights(model, blocks, prefetch, target, budget, device_profile,
                              granularity, compiled)
    _HANDLES[model] = weakref.ref(handle)
    return handle


# The attached handle of each model, weakly (the model's hooks hold the handle).
_HANDLES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


__all__ = ["offload_weights", "LayerwiseWeights"]
