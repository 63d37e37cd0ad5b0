"""Offloaded weights in backward, for offload_weights (Note [Weights in backward]).

Note [Weights in backward]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A model call with autograd recording runs inside one saved_tensors_hooks
context (entered by the model's pre-hook, left by its forward hook). What
autograd saves that lies in a streamed group's device buffer (a parameter, or a
view of one such as weight.t()) is packed as a reference: the group, and the
tensor's offset, shape, stride and dtype in the buffer. So saving a weight keeps
no device memory, and the buffer goes when the group's forward ends, as in
inference. Everything else autograd saves is left as it is.

In backward, unpacking a reference brings its group's slab back into a device
buffer of its own (waited for on the compute stream) and starts the copy of
the group that ran before it in forward, so groups come back in reverse order
one ahead. A parameter that requires grad gets a gradient from PyTorch's
AccumulateGrad node, which shapes it after the parameter: a pre-hook on that
node makes the parameter a view of the group's backward buffer, and a post-
accumulate hook (Tensor.register_post_accumulate_grad_hook) makes it a
placeholder again. A group's backward buffer is dropped once its references
are unpacked and its parameters' gradients accumulated, and in any case at the
end of the backward (a callback of the autograd engine), with every copy still
copying ahead waited for. The gradients (`.grad`) are ordinary device tensors
of the parameters' shape; an optimizer step reads the weights, so it runs
inside handle.mutate_weights(), which puts them on the device and takes the
host slabs again afterwards.

Limits: the forward must be a call of the model (a block called on its own
with autograd recording is refused). Another saved_tensors_hooks context
inside the call (spillway.offload_activations, torch's save_on_cpu) hides this
one for what is saved inside it; that is not detected yet, so do not combine
them.
"""
from __future__ import annotations

import typing

import torch

from spillway import ops


class _WeightRef(typing.NamedTuple):
    """A saved tensor that lies in a streamed group's buffer."""
    group: int
    offset: int        # in elements of dtype, from the buffer's start
    shape: tuple
    stride: tuple
    dtype: torch.dtype


class Backward:
    """One handle's weights in backward (Note [Weights in backward])."""

    def __init__(self, handle):
        self.handle = handle
        self.context = None      # the saved_tensors_hooks of the model call in progress
        self.groups_by_storage: dict[int, int] = {}  # live streamed buffer -> its group
        self.order: list[int] = []  # groups in the order their forward recorded
        self.back: dict[int, torch.Tensor] = {}   # group -> its waited buffer in backward
        self.ahead: dict[int, torch.Tensor] = {}  # group -> its buffer copying ahead
        self.refs: dict[int, int] = {}            # group -> references not yet unpacked
        self.pending: dict[int, int] = {}         # group -> gradients not yet accumulated
        self.hooked: dict[int, tuple] = {}        # id(param) -> (its AccumulateGrad, handles)
        self.callback_queued = False

    # ---- forward ----

    def call_starts(self) -> None:
        if torch.is_grad_enabled() and self.context is None:
            self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            self.context.__enter__()
            self.order = []

    def call_ends(self) -> None:
        if self.context is not None:
            context, self.context = self.context, None
            context.__exit__(None, None, None)

    @property
    def recording(self) -> bool:
        return self.context is not None and torch.is_grad_enabled()

    def brought(self, index: int, buffer: torch.Tensor) -> None:
        """The group's weights are views of `buffer` for its forward."""
        self.groups_by_storage[buffer.untyped_storage().data_ptr()] = index
        self.order.append(index)
        self.pending[index] = self.pending.get(index, 0) + self.hook(index)

    def hook(self, index: int) -> int:
        """Hooks the AccumulateGrad node of each of the group's parameters that requires
        grad (once); returns how many there are."""
        trained = 0
        for slot, p in enumerate(self.handle._blocks[index].params):
            if not p.requires_grad:
                continue
            trained += 1
            if id(p) not in self.hooked:
                # The node is made now, while p has its real shape (its input metadata).
                node = p.view_as(p).grad_fn.next_functions[0][0]
                handles = (node.register_prehook(self._before_accumulate(index, slot)),
                           p.register_post_accumulate_grad_hook(self._after_accumulate(index, slot)))
                self.hooked[id(p)] = (node, handles)
        return trained

    def released(self, buffer: torch.Tensor) -> None:
        if self.groups_by_storage:  # empty unless a call records autograd (inference: no cost)
            self.groups_by_storage.pop(buffer.untyped_storage().data_ptr(), None)

    def pack(self, t):
        if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
            try:
                index = self.groups_by_storage.get(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                return t
            if index is not None:
                self.refs[index] = self.refs.get(index, 0) + 1
                return _WeightRef(index, t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                                  t.dtype)
        return t

    def unpack(self, saved):
        if not isinstance(saved, _WeightRef):
            return saved
        buffer = self.buffer(saved.group)
        out = torch.empty(0, dtype=saved.dtype, device=buffer.device)
        out.set_(buffer.untyped_storage(), saved.offset, saved.shape, saved.stride)
        self.refs[saved.group] = self.refs.get(saved.group, 1) - 1
        self.maybe_drop(saved.group)
        return out

    # ---- backward ----

    def buffer(self, index: int) -> torch.Tensor:
        """The group's buffer in backward: reloaded (or taken from the copy started ahead)
        and waited for; the group before it in forward starts copying."""
        buffer = self.back.get(index)
        if buffer is not None:
            return buffer
        resident = self.handle._resident.get(index)
        if resident is not None:  # compiled: a resident group's references
            return resident
        host = self.handle._blocks[index].host
        stats = self.handle._stats
        buffer = self.ahead.pop(index, None)
        if buffer is None:
            buffer = ops.reload(host, self.handle.device)
            stats["backward_reloads"] += 1
            stats["backward_on_demand"] += 1
        buffer = ops.wait_tensor(buffer, keepalive=host)
        self.back[index] = buffer
        self._queue_end()
        before = self._before(index)
        if before is not None and before not in self.back and before not in self.ahead:
            self.ahead[before] = ops.reload(self.handle._blocks[before].host, self.handle.device)
            stats["backward_reloads"] += 1
        return buffer

    def _before(self, index: int) -> int | None:
        """The streamed group that ran before `index`'s last forward run."""
        order = self.order
        for position in range(len(order) - 1, -1, -1):
            if order[position] == index:
                for k in range(position - 1, -1, -1):
                    if self.handle._streamed(order[k]) and order[k] != index:
                        return order[k]
                return None
        return None

    def maybe_drop(self, index: int) -> None:
        if self.refs.get(index, 0) <= 0 and self.pending.get(index, 0) <= 0:
            self.back.pop(index, None)

    def _before_accumulate(self, index: int, slot: int):
        def hook(grad_outputs):
            h = self.handle
            if index in h._live or h._mutating:
                return None  # the parameter holds its weights already
            p = h._blocks[index].params[slot]
            if index in h._resident:
                if h._compiled:  # its parameters hold placeholders between pieces
                    p.data = h._blocks[index].views(h._resident[index])[slot]
                return None
            p.data = h._blocks[index].views(self.buffer(index))[slot]
            return None
        return hook

    def _after_accumulate(self, index: int, slot: int):
        def hook(p):
            h = self.handle
            if index in h._live or h._mutating:
                return
            if index in h._resident:
                if h._compiled:
                    p.data = h._blocks[index].placeholders[slot]
                return
            p.data = h._blocks[index].placeholders[slot]
            self.pending[index] = self.pending.get(index, 1) - 1
            self.maybe_drop(index)
        return hook

    def _queue_end(self) -> None:
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.end)
            self.callback_queued = True

    def end(self) -> None:
        """The end of a backward: every backward buffer dropped, every copy ahead waited
        for, the counts reset."""
        self.callback_queued = False
        for buffer in self.ahead.values():
            ops.wait_tensor(buffer)
        self.ahead.clear()
        self.back.clear()
        self.refs.clear()
        self.pending.clear()

    def remove(self) -> None:
        """Every hook on the parameters' AccumulateGrad nodes removed."""
        self.call_ends()
        for _, handles in self.hooked.values():
            for handle in handles:
                handle.remove()
        self.hooked.clear()
        self.end()
