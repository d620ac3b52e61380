"""Packed writes read in place from pinned memory: :class:`PackRing`, the JAX fast path.

A :class:`~jaxbuf.jax_ops.PackedWrites` over a numpy buffer costs a host-to-device
transfer on every jitted call (110-180 µs fixed on an H200, whatever its size). A
:class:`PackRing` packs instead into one of ``max_concurrency`` pinned slots
(:class:`~jaxbuf.uva.UvaBuffer`, which the device reads over the bus) whose device memory was
imported into JAX once (zero-copy, cached per packed length), and hands that JAX array to
``jit`` as the PackedWrites' leaf: the kernel reads the writes where the host put them.

Safety: a slot is rewritten only once nothing that may read it can still run. The ring
remembers, per slot, a *guard*: an output of the computation that read it (:meth:`apply`
records its own; :meth:`consumed_by` records one of the caller's step). Before a slot comes
round again the ring waits for its guard (``block_until_ready``, usually done already); a slot
whose reader was not recorded, or whose guard was donated meanwhile, costs a full wait
instead: every framework's pending work on the device (:func:`jaxbuf.interop.quiesce`) and
then the device itself (the driver's ``synchronize``, which on CUDA also waits for JAX's
streams). So the default is safe, and the recorded guard is the fast path.

The cached JAX arrays are jit inputs only: JAX caches an array's host value on
``np.asarray``, so reading a ring PackedWrites' leaf on the host would return a stale slot
later. Inspect a pack with :meth:`~jaxbuf.jax_ops.StagedWrites.pack` without a
ring instead.
"""

from __future__ import annotations

import functools
from typing import Any

from .. import interop
from .._checks import as_count, as_max_concurrency, as_optional_bool
from .._resolve import resolve
from ..uva import UvaBuffer
from ..uva._slots import UNRECORDED, PinnedSlot, PinnedSlotRing
from ._jax_apply import METHODS, apply_staged_writes, check_array
from ._jax_pack import Packer
from ._jax_packed import PackedWrites, bucket_size
from ._jax_staging import StagedWrites, new_staged_writes

__all__ = ["PackRing"]

#: Packed lengths whose JAX import one slot keeps; past it the slot's cache starts over (a
#: steady loop packs a handful of bucketed lengths).
MAX_CACHED_LENGTHS = 16
_DEFAULT_MIN_WORDS = 4096  # 16 KiB: four pages, a 256-write step of 16 int32 fits twice


class _Slot(PinnedSlot):
    """One slot of the ring's :class:`~jaxbuf.uva._slots.PinnedSlotRing`: a pinned int32
    buffer of ``capacity`` words, and what the ring knows about its last pack: ``arrays``
    (packed length in words -> the JAX array over them) and ``leaf`` (the last pack's).
    Its ``guard`` is UNRECORDED from the pack until a reader is recorded, then an
    :class:`_OutputGuard`; None once nothing may read it."""

    __slots__ = ("arrays", "leaf")

    def __init__(self) -> None:
        super().__init__()
        self.arrays: dict[int, Any] = {}
        self.leaf: Any = None

    def refresh(self) -> None:
        self.arrays, self.leaf = {}, None


class _OutputGuard:
    """A slot's guard in the JAX wing: ``output`` (a pytree of JAX arrays) of the step that
    read the slot; ready once all of it is. It cannot tell once any of it was donated or
    its step failed (``wait`` returns False): the ring then waits device-wide."""

    __slots__ = ("output",)

    def __init__(self, output: Any) -> None:
        self.output = output

    def ready(self) -> bool:
        import jax

        leaves = jax.tree_util.tree_leaves(self.output)
        return not _any_deleted(self.output) and all(leaf.is_ready() for leaf in leaves)

    def wait(self) -> bool:
        if _any_deleted(self.output):
            return False
        import jax

        try:
            jax.block_until_ready(self.output)
        except RuntimeError:  # donated meanwhile, or the step failed: wait for all
            return False
        return True


def _new_slot_buffer(device: Any, driver: Any, words: int) -> UvaBuffer:
    return UvaBuffer(words, "int32", device, driver=driver)


def _free_buffer(buffer: UvaBuffer) -> None:
    buffer.free()  # its memory stays while an array over it (a user's PackedWrites) does


def _wait_device_wide(device: Any, driver: Any) -> None:
    """What makes a slot with no usable guard safe: JAX's pending work, dispatched or not
    yet, then the device's streams."""
    interop.quiesce(device)
    driver.synchronize(device.index)


# One jitted, donated apply per method, shared by every ring: the array with the writes
# applied, and a one-element token read from it. The token is never handed out, so never
# donated: it stays waitable, and it is ready only once the apply (which read the slot) is.
_JITTED: dict[str | None, Any] = {}


def _jitted_apply(method: str | None) -> Any:
    step = _JITTED.get(method)
    if step is None:
        import jax

        def apply_with_token(array: Any, packed: PackedWrites) -> tuple[Any, Any]:
            out = apply_staged_writes(array, packed, method=method)
            return out, out.reshape(-1)[:1]

        step = _JITTED[method] = jax.jit(apply_with_token, donate_argnums=0)
    return step


class PackRing(Packer):
    """``max_concurrency`` pinned slots that :class:`StagedWrites` pack into, read in place by
    the jitted apply (see the module docstring).

    Each :meth:`pack` takes the next slot round-robin: it first waits until the slot's last
    reader is done (its recorded guard, else a device-wide wait), grows the slot to the next
    power of two of int32 words if the pack does not fit, writes the PackedWrites there with
    the same layout and padding as a fresh pack, and returns a PackedWrites whose leaf is the
    slot's cached JAX array. :meth:`apply` packs (or takes a ring PackedWrites), applies it
    with a cached jitted, donated apply and records the guard; with a jitted step of your
    own, pass any output of it that you will not donate (all outputs of one call are ready
    together) to :meth:`consumed_by` after the call.

    Invariants: a slot is never rewritten while a recorded or unrecorded reader may run; a
    failed pack (closed ring, driver error, bad input) leaves the staged writes staged. The
    slots' memory follows the owner contract of :class:`~jaxbuf.uva.UvaBuffer`: it lives as
    long as any array over it. Not thread-safe; not picklable or copyable.

    Parameters
    ----------
    max_concurrency : int, optional
        Slots (default 2: the step the device reads and the one the host writes).
    device : device spec, optional
        Where the packed writes are read (default :func:`jaxbuf.default_device`); the arrays
        applied to must live there.
    driver : VmmDriver, optional
        Default: the device's driver (tests pass a fault-injecting one).
    min_words : int
        Each slot's first capacity, in int32 words (default 4096, 16 KiB).
    expand : bool, optional
        Whether packs carry every value's row and column (:attr:`PackedWrites.expanded`).
        Default: not on a GPU, where the scatter computes them in a few µs of device time
        and the host writes (and the device reads across the bus) less than half the bytes;
        yes on the CPU, where XLA's scatter runs faster from host-written indices.

    Examples
    --------
    >>> import jax.numpy as jnp, numpy as np
    >>> from jaxbuf.jax_ops import PackRing, StagedWrites
    >>> staged = StagedWrites(4, 8, "int32")
    >>> with PackRing(device="cpu") as ring:
    ...     array = jnp.zeros((4, 8), jnp.int32)
    ...     staged.stage_write(1, 2, np.arange(3, dtype=np.int32))
    ...     array = ring.apply(array, staged)
    ...     print(np.asarray(array)[1].tolist())
    [0, 0, 0, 1, 2, 0, 0, 0]
    """

    __slots__ = (
        "_device",
        "_driver",
        "_ring",
        "_slots",
        "_next",
        "_last",
        "_min_words",
        "_expand",
        "_closed",
        "_scratch_key",
        "_scratch_staged",
    )

    def __init__(
        self,
        max_concurrency: int | None = None,
        device: Any = None,
        *,
        driver: Any = None,
        min_words: int = _DEFAULT_MIN_WORDS,
        expand: bool | None = None,
    ) -> None:
        count = as_max_concurrency(max_concurrency)
        self._min_words = as_count(min_words, "min_words")
        expand = as_optional_bool(expand, "expand")
        self._device, self._driver = resolve(device, driver)
        self._expand = (not self._device.is_cuda) if expand is None else expand
        device, driver = self._device, self._driver
        self._ring = PinnedSlotRing(
            count,
            functools.partial(_new_slot_buffer, device, driver),
            _free_buffer,
            functools.partial(_wait_device_wide, device, driver),
            mode="wait",
            slot_type=_Slot,
            name="PackRing",
        )
        self._slots = self._ring.slots
        self._next = 0
        self._last: _Slot | None = None
        self._closed = False
        # The StagedWrites pack_writes(..., ring=self) stages into, and its arguments.
        self._scratch_key: Any = None
        self._scratch_staged: StagedWrites | None = None

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ""
        return (
            f"PackRing(max_concurrency={len(self._slots)}, device={self._device}, "
            f"expand={self._expand}, capacities={self.capacities}{state})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a PackRing owns pinned memory and cannot be pickled or copied")

    def __enter__(self) -> PackRing:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- state -------------------------------------------------------------------------------
    @property
    def max_concurrency(self) -> int:
        return len(self._slots)

    @property
    def device(self) -> Any:
        return self._device

    @property
    def driver(self) -> Any:
        return self._driver

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capacities(self) -> list[int]:
        """Each slot's capacity in int32 words (0 before its first pack)."""
        return [max(slot.capacity, 0) for slot in self._slots]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed: make a new PackRing to pack again")

    # -- packing -----------------------------------------------------------------------------
    def pack(
        self, staged: StagedWrites, *, clear: bool = True, expand: bool | None = None
    ) -> PackedWrites:
        """``staged``'s writes packed (as :meth:`StagedWrites.pack`) into the next slot; the
        result's leaf is the slot's JAX array, for ``jit`` only (never ``np.asarray`` it).

        The result is valid until the slot comes round again, ``max_concurrency`` packs
        later (the slot then holds that pack): apply it before then. RuntimeError once the
        ring is closed; a failure leaves ``staged`` as it was. ``expand``: as in
        :meth:`StagedWrites.pack`; default: the ring's (see the class docstring)."""
        self._check_open()
        if not isinstance(staged, StagedWrites):
            raise TypeError(f"staged must be a StagedWrites, got {staged!r}")
        if as_optional_bool(expand, "expand") is None:
            expand = self._expand
        plan = staged.plan_pack()  # sizes the pack; a failure below leaves it all staged
        words = plan.words(expand)
        slot = self._slots[self._next]
        if slot.guard is not None:
            self._ring.wait(slot)
        if slot.capacity < words:
            # The new buffer first: a failed allocation leaves the slot as it was.
            self._ring.grow(slot, bucket_size(words, self._min_words))
        leaf = self._leaf(slot, words)
        host = staged.pack_into(plan, slot.buffer.np[:words], clear, expand)
        slot.leaf, slot.guard = leaf, UNRECORDED
        self._last = slot
        self._next = (self._next + 1) % len(self._slots)
        return PackedWrites.from_buffer(
            leaf, host.num_writes, host.num_values, host.dtype, expand, host.uniform, host.shape
        )

    def scratch_writes(self, arguments: tuple) -> StagedWrites:
        """The StagedWrites that :func:`~jaxbuf.jax_ops.pack_writes` (``ring=self``) stages a
        batch into before packing it here, ``arguments`` its constructor's: kept from call to
        call while they stay the same, so its stager's buffers stay allocated (and their pages
        mapped), which a fresh one pays for every time (H200 host, 4,096 writes: 503 -> 375
        µs). Empty between calls."""
        self._check_open()
        try:
            same = arguments == self._scratch_key
        except TypeError:  # a dtype spec whose comparison raises: no reuse
            same = False
        if not same or self._scratch_staged is None:
            staged = new_staged_writes(*arguments)  # validates: a bad argument keeps the old
            self._scratch_key, self._scratch_staged = arguments, staged
        return self._scratch_staged

    def _leaf(self, slot: _Slot, words: int) -> Any:
        array = slot.arrays.get(words)
        if array is None or array.is_deleted():  # deleted: a caller's jit donated it
            if len(slot.arrays) >= MAX_CACHED_LENGTHS:
                slot.arrays.clear()
            array = slot.buffer.view.view(shape=(words,)).to_jax()
            slot.arrays[words] = array
        return array

    # -- applying and guards -----------------------------------------------------------------
    def apply(self, array: Any, writes: StagedWrites | PackedWrites, *, method: str | None = None):
        """``array`` (donated) with ``writes`` applied: a :class:`StagedWrites` is packed into
        the ring first; a PackedWrites (from this ring or not) is applied as it is. Runs a
        cached jitted apply (:func:`~jaxbuf.jax_ops.apply_staged_writes`, ``method``
        as there) and records its completion as the slot's guard. Returns the new array."""
        self._check_open()
        if method is not None and method not in METHODS:
            raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
        if method == "triton" and not self._device.is_cuda:  # refused before packing
            raise ValueError(
                f"method='triton' runs on a GPU, but the ring is on {self._device}; "
                "use method='scatter' (the default there)"
            )
        # The array is checked before packing: a refused one leaves the writes staged.
        if isinstance(writes, StagedWrites):
            check_array(array, writes.dtype.numpy, writes.packed_shape)
            packed = self.pack(writes)
        elif isinstance(writes, PackedWrites):
            check_array(array, writes.dtype, writes.shape)
            packed = writes
        else:
            raise TypeError(f"writes must be a StagedWrites or a PackedWrites, got {writes!r}")
        out, token = _jitted_apply(method)(array, packed)
        slot = self._slot_of(packed)
        if slot is not None:
            slot.guard = _OutputGuard(token)
        return out

    def consumed_by(self, output: Any) -> Any:
        """Record ``output`` (a JAX array or pytree of them, from the step that read the last
        pack) as that slot's guard; returns ``output``. Pass an output you will not donate
        before the slot comes round again: a donated guard costs a device-wide wait."""
        self._check_open()
        if self._last is None or self._last.guard is None:
            raise RuntimeError(f"{self!r} has no pack in flight to record a consumer for")
        self._last.guard = _OutputGuard(output)
        return output

    def _slot_of(self, packed: PackedWrites) -> _Slot | None:
        leaf = packed.buffer
        for slot in self._slots:
            if slot.guard is not None and slot.leaf is leaf:
                return slot
        return None

    # -- closing -----------------------------------------------------------------------------
    def close(self) -> None:
        """Done with the ring: later packs raise RuntimeError; each slot's pinned memory goes
        now (after JAX's pending work, as ``UvaBuffer.free``) or with the last array over it.
        Idempotent; after a driver failure, calling it again frees the rest."""
        self._closed = True
        self._last = None
        self._scratch_key = self._scratch_staged = None
        if any(slot.buffer is not None for slot in self._slots):
            # Pending readers first: an import dropped while a computation still reads it
            # would release its export (and so the memory) only later, on JAX's thread.
            interop.quiesce(self._device)
        for slot in self._slots:
            slot.arrays, slot.leaf = {}, None
        # Recorded readers are done (the quiesce); unrecorded ones too: no device-wide wait.
        self._ring.close(settle_unrecorded=False)

    def free(self) -> None:
        """Same as :meth:`close`."""
        self.close()


def _any_deleted(guard: Any) -> bool:
    """Whether any array in the pytree ``guard`` was deleted (donated): not waitable."""
    import jax

    return any(
        getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree_util.tree_leaves(guard)
    )
