"""What eager.py keeps for each saved tensor: handles, offloaded storages, layers.

Three objects, owned in one direction only (autograd -> handle -> entry -> host copy):

  _Kept     the pack result of a tensor that stays where it is (the tensor itself).
  _Handle   the pack result of an offloaded tensor: how to rebuild it (dtype, size,
            stride, storage offset) from its storage, and the entry of that storage.
  _Entry    one offloaded untyped storage: its host copy (owned, freed with the
            entry) and, at times, a device copy: the source until the forward wait,
            a resident tail copy, or a reloaded copy during backward.
  _Layer    the offloads made while one scope module ran: the unit of the forward
            release lag and of backward prefetch. Holds entries weakly once their
            forward wait ran.

Autograd frees a handle when it frees the saved tensor (after backward, or when
the graph is dropped); the last handle of an entry frees the entry, which frees
the host copy (its pinned block goes back to the pool).

Invariants of an _Entry:
  1. host is the host copy made by spillway::offload; it lives as long as the entry.
  2. forward_pending: the offload's wait has not run; device is the source storage
     (as a flat uint8 tensor) and the entry is in its layer's pending list.
  3. reload_pending: a reload into device was started and its wait has not run.
  4. device is None only when neither wait is pending.
All fields are changed under the owning context's lock (OffloadActivations._lock).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from spillway import ops

_serials = itertools.count()


def _legacy_type_name(dtype: torch.dtype, device: torch.device) -> str:
    return torch.empty(0, dtype=dtype, device=device).type()


def check_version(dtype, device, size, saved: int, current: int) -> None:
    """Raises PyTorch's own error for a saved tensor modified in place after saving.

    Saved-tensor hooks switch off autograd's version check (it cannot see
    through the packed object), so the context checks it itself, with the
    message autograd would have given (code that matches on it keeps working).
    """
    if saved == current:
        return
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{_legacy_type_name(dtype, device)} {list(size)}] is at version "
        f"{current}; expected version {saved} instead. Hint: enable anomaly detection to find "
        "the operation that failed to compute its gradient, with "
        "torch.autograd.set_detect_anomaly(True).")


def version_witness(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing t's version counter but not its storage (it holds no memory).

    An alias made by _make_subclass shares the version counter (like detach());
    set_ then points it at an empty storage. set_ bumps the shared counter, so
    the counter is put back. With eager._LEAN_HOST (Note [A leaner host path]) the
    extension makes it in one call (spillway._C.version_witness: ~0.3 us against ~2).
    """
    fast = LEAN_WITNESS[0]
    if fast is not None:
        witness = fast(t)
        if witness is not None:
            return witness
    witness = torch.Tensor._make_subclass(torch.Tensor, t, False)
    version = witness._version
    witness.set_(_empty(t.dtype, t.device))
    _set_version(witness, version)
    return witness


_EMPTY: dict = {}
# spillway._C.version_witness while eager._LEAN_HOST is on, else None: set by
# eager.OffloadActivations.__enter__ (one cell the contexts write, version_witness reads).
LEAN_WITNESS: list = [None]


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-element tensor per dtype and device, shared by every witness (set_ onto it)."""
    key = (dtype, device)
    e = _EMPTY.get(key)
    if e is None:
        e = _EMPTY[key] = torch.empty(0, dtype=dtype, device=device)
    return e


def _set_version(t: torch.Tensor, version: int) -> None:
    try:
        torch._C._autograd._unsafe_set_version_counter((t,), (version,))
    except TypeError:  # torch < 2.5 takes one tensor
        torch._C._autograd._unsafe_set_version_counter(t, version)


class _Kept:
    """A saved tensor left in place: the tensor and its version when saved."""

    __slots__ = ("owner", "tensor", "version", "layer")

    def __init__(self, owner, tensor: torch.Tensor, layer: "_Layer | None" = None):
        self.owner = owner  # the OffloadActivations that packed it (it unpacks it)
        # Detached: pack receives the saved tensor itself, whose grad_fn may be
        # the node saving it; holding that would make a cycle through C++ that
        # Python's collector cannot see. detach() shares the version counter.
        self.tensor = tensor.detach()
        self.version = tensor._version
        # The layer it was saved in, if any: its unpack still drives prefetch.
        self.layer = layer

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        check_version(t.dtype, t.device, t.shape, self.version, t._version)
        return t


class _Layer:
    """The offloads made during one call of a scope module (one 'layer').

    index orders layers of a context (forward order); pass_id is the forward
    pass of the model (root module call) it belongs to: prefetch stays inside
    one pass.
    """

    __slots__ = ("index", "pass_id", "selected", "pending", "entries", "prefetched_task",
                 "__weakref__")

    def __init__(self, index: int, pass_id: int, selected: bool = True):
        self.index = index
        self.pass_id = pass_id
        self.selected = selected  # whether its saved tensors may be offloaded
        self.pending: list[_Entry] = []  # entries whose forward wait has not run
        self.entries: list[weakref.ref] = []  # every entry a handle of this layer uses
        self.prefetched_task = None  # graph task whose prefetch already covered this layer

    def add(self, entry: "_Entry") -> None:
        if not self.entries or self.entries[-1]() is not entry:
            self.entries.append(weakref.ref(entry))

    def live_entries(self):
        for ref in self.entries:
            entry = ref()
            if entry is not None:
                yield entry

    def dead(self) -> bool:
        return not self.pending and all(ref() is None for ref in self.entries)


class _Entry:
    """One offloaded untyped storage (see the module docstring for invariants)."""

    __slots__ = ("owner", "key", "layer", "host", "device", "target", "nbytes",
                 "witness", "version", "forward_pending", "reload_pending", "resident",
                 "live", "unpacked", "round_task", "__weakref__")

    def __init__(self, owner, key, layer: _Layer, flat: torch.Tensor, witness, version: int):
        self.owner = owner  # the OffloadActivations that made it (its lock guards this entry)
        self.key = key  # StorageWeakRef of the source storage, for deduplication
        self.layer = layer
        self.target = flat.device
        self.nbytes = flat.nbytes
        self.host = ops.offload(flat)  # D2H starts now, after the compute stream's current point
        self.device = flat
        self.forward_pending = True
        self.reload_pending = False
        self.resident = False  # device is the source, kept past the forward (the tail)
        self.witness = witness  # version counter of the tensor that made the entry
        self.version = version
        self.live = 0  # live handles
        self.unpacked: set[int] = set()  # serials of handles unpacked in round_task
        self.round_task = None

    def reusable_for(self, t: torch.Tensor) -> bool:
        """Whether the host copy still holds t's bytes (nothing wrote the storage since)."""
        return self.witness._version == self.version and t._version == self.version

    def finish_forward(self, keep_resident: bool) -> None:
        """Runs the offload's wait; drops the source unless keep_resident."""
        if not self.forward_pending:
            return
        try:
            ops.wait_tensor(self.host, keepalive=self.device)
        except RuntimeError:
            # The D2H failed: the source is all there is. Keep it for good.
            self.host = None
            self.forward_pending = False
            self.resident = True
            raise
        self.forward_pending = False
        if keep_resident:
            self.resident = True
        else:
            self.device = None

    def start_reload(self) -> None:
        self.device = ops.reload(self.host, self.target)
        self.reload_pending = True

    def finish_reload(self) -> None:
        if self.reload_pending:
            ops.wait_tensor(self.device, keepalive=self.host)
            self.reload_pending = False

    def needed_in(self, task) -> bool:
        """Whether some live handle has not been unpacked in graph task `task`."""
        if self.live == 0:
            return False
        return self.round_task != task or len(self.unpacked) < self.live

    def mark_unpacked(self, serial: int, task) -> None:
        if self.round_task != task:
            self.round_task = task
            self.unpacked = set()
        self.unpacked.add(serial)
        self.maybe_drop_device()

    def maybe_drop_device(self) -> None:
        """Lets go of the device copy once every live handle has been unpacked.

        The unpacked tensors hold the memory while autograd needs them; a later
        unpack (retain_graph, double backward) reloads from the host copy.
        """
        if self.device is None or self.forward_pending or self.host is None:
            return
        if len(self.unpacked) < self.live:
            return
        self.finish_reload()
        self.device = None
        self.resident = False

    def handle_died(self, serial: int) -> None:
        self.live -= 1
        self.unpacked.discard(serial)
        if self.live > 0:
            self.maybe_drop_device()

    def __del__(self):
        # Never leave a wait pending: the runtime would hold the storage forever.
        try:
            if self.reload_pending:
                ops.wait_tensor(self.device, keepalive=self.host)
            if self.forward_pending:
                ops.wait_tensor(self.host, keepalive=self.device)
        except Exception:  # noqa: BLE001 - a destructor must not raise
            pass
        owner = self.owner
        if owner is not None:
            owner._forget_entry(self.key, self)


class _Handle:
    """The pack result of an offloaded tensor; owns a share of its entry."""

    __slots__ = ("entry", "layer", "serial", "dtype", "size", "stride", "offset",
                 "witness", "version", "__weakref__")

    def __init__(self, entry: _Entry, layer: _Layer, t: torch.Tensor, witness, version: int):
        self.entry = entry
        self.layer = layer
        self.serial = next(_serials)
        self.dtype = t.dtype
        self.size = t.shape
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.witness = witness
        self.version = version
        entry.live += 1

    @property
    def owner(self):
        """The OffloadActivations that packed it (it unpacks it)."""
        return self.entry.owner

    def sibling(self) -> "_Handle":
        """A second handle on the same entry and view (a selective recompute reading this
        tensor, _recipes.py): the entry keeps its device copy until both were unpacked."""
        other = _Handle.__new__(_Handle)
        for name in ("entry", "layer", "dtype", "size", "stride", "offset", "witness",
                     "version"):
            setattr(other, name, getattr(self, name))
        other.serial = next(_serials)
        self.entry.live += 1
        return other

    def check_version(self) -> None:
        check_version(self.dtype, self.entry.target, self.size, self.version,
                      self.witness._version)

    def rebuild(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved tensor over `flat`'s storage (same dtype, size, stride, offset)."""
        with torch.no_grad():
            return torch.empty(0, dtype=self.dtype, device=flat.device).set_(
                flat.untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self):
        entry = self.entry
        owner = entry.owner
        try:
            if owner is None:
                entry.handle_died(self.serial)
            else:
                with owner._lock:
                    entry.handle_died(self.serial)
        except Exception:  # noqa: BLE001 - a destructor must not raise
            pass
