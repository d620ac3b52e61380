"""The CUDA driver's allocation properties: what chunks are created with (a mixin of
:class:`jaxbuf.drivers.cuda.CudaVmmDriver`).

One ``CUmemAllocationProp`` per device, built once: pinned device memory, the best handle type
of the shareable chain (fabric -> POSIX descriptor -> none, from the driver's ``shareable``
down, skipping what the device does not report) and the ``gpuDirectRDMACapable`` flag where
``rdma`` asks for it and the device reports it. When ``cuMemCreate`` refuses a handle type or
the flag, the property steps down for good, and the reason is kept as a note that
:meth:`CudaAllocation.allocation_options` reports. The methods use the driver's binding
(``self._cu``), ``_check``, ``_error_name``, ``ensure_context``, ``create`` and
``release``.
"""

from __future__ import annotations

from typing import Any

from jaxbuf.drivers.base import DriverError

__all__ = ["SHAREABLE", "CudaAllocation"]

#: The ``shareable`` choices of :class:`~jaxbuf.drivers.cuda.CudaVmmDriver`: the handle-type
#: chain, best first.
SHAREABLE = ("fabric", "posix", "none")


class CudaAllocation:
    """Allocation properties, granularity and ``cuMemCreate`` for
    :class:`~jaxbuf.drivers.cuda.CudaVmmDriver`.

    Invariants: a device's property, handle-type chain and position in it are built together
    on first use; the position only moves down the chain (and the RDMA flag, once dropped,
    stays dropped); every handle type from ``shareable`` down that is skipped or refused,
    and a wanted RDMA flag that is not set, leaves a note saying why.
    """

    _cu: Any

    def _init_allocation(self, cu: Any, shareable: str, rdma: str | bool) -> None:
        """Check ``shareable`` and ``rdma`` (a ValueError naming the bad one, before any state
        is set), then set up the per-device caches, empty."""
        if shareable not in SHAREABLE:
            raise ValueError(f"shareable must be one of {SHAREABLE}, got {shareable!r}")
        if rdma not in ("auto", True, False):
            raise ValueError(f"rdma must be 'auto', True or False, got {rdma!r}")
        self._shareable, self._rdma = shareable, rdma
        # device index -> sentences saying why a handle type or RDMA was not used.
        self._allocation_notes: dict[int, list[str]] = {}
        if cu is not None:
            # What cuMemCreate answers for a handle type or flag it will not give (fabric
            # handles without an IMEX channel: NOT_PERMITTED); never out of memory.
            self._refusals = tuple(
                getattr(cu.CUresult, name)
                for name in ("CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_NOT_PERMITTED")
                if hasattr(cu.CUresult, name)
            )
        self._granularities: dict[int, int] = {}
        # device index -> CUmemAllocationProp used by create (and granularity).
        self._allocation_props: dict[int, Any] = {}
        # device index -> the handle-type chain create() walks down (see shareable).
        self._handle_chains: dict[int, list[tuple[str, Any]]] = {}
        self._handle_steps: dict[int, int] = {}

    def _attribute(self, name: str, device_index: int) -> int:
        """``cuDeviceGetAttribute`` by name; 0 when this binding does not know the name."""
        attribute = getattr(self._cu.CUdevice_attribute, name, None)
        if attribute is None:
            return 0
        return int(
            self._check(
                self._cu.cuDeviceGetAttribute(attribute, device_index),
                "cuDeviceGetAttribute",
                device=device_index,
            )
        )

    def _handle_type_chain(self, device_index: int) -> list[tuple[str, Any]]:
        """``(name, requestedHandleTypes)`` to try, best first, that the device reports;
        the reasons for the skipped ones go to the allocation notes."""
        types = self._cu.CUmemAllocationHandleType
        notes = self._allocation_notes.setdefault(device_index, [])
        posix = self._attribute(
            "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", device_index
        )
        chain: list[tuple[str, Any]] = []
        start = SHAREABLE.index(self._shareable)
        fabric_type = getattr(types, "CU_MEM_HANDLE_TYPE_FABRIC", None)
        if start == 0:
            if fabric_type is None:
                notes.append("fabric handles: this cuda.bindings has no CU_MEM_HANDLE_TYPE_FABRIC")
            elif not self._attribute(
                "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED", device_index
            ):
                notes.append("fabric handles: the device reports no fabric handle support")
            else:
                both = (
                    fabric_type | types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                    if posix
                    else fabric_type
                )
                chain.append(("fabric", both))
        if start <= 1:
            if posix:
                chain.append(("posix", types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
            else:
                notes.append("POSIX descriptors: the device reports no POSIX handle support")
        chain.append(("none", types.CU_MEM_HANDLE_TYPE_NONE))
        return chain

    def _allocation_prop(self, device_index: int) -> Any:
        """The pinned-device ``CUmemAllocationProp`` for ``device_index`` (cached): the best
        handle type of the chain (see ``shareable``) and the RDMA flag (see ``rdma``)."""
        prop = self._allocation_props.get(device_index)
        if prop is None:
            prop = self._cu.CUmemAllocationProp()
            prop.type = self._cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = self._cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = device_index
            # Ask for an exportable handle now so chunks can be shared across processes
            # (and hosts) later; create() steps down the chain when the driver refuses one.
            chain = self._handle_type_chain(device_index)
            self._handle_chains[device_index] = chain
            self._handle_steps[device_index] = 0
            prop.requestedHandleTypes = chain[0][1]
            if self._rdma is not False:
                supported = self._attribute(
                    "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED", device_index
                )
                if supported:
                    prop.allocFlags.gpuDirectRDMACapable = 1
                elif self._rdma is True:
                    raise DriverError(
                        "cuDeviceGetAttribute",
                        "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED is 0 (rdma=True needs it)",
                        device=device_index,
                    )
                else:
                    self._allocation_notes.setdefault(device_index, []).append(
                        "GPUDirect RDMA: the device reports no RDMA support for VMM allocations"
                    )
            self._allocation_props[device_index] = prop
        return prop

    def allocation_options(self, device_index: int, probe: bool = False) -> dict[str, Any]:
        """What chunks on ``device_index`` are created with now: ``handle_type``
        (``"fabric"``, ``"posix"`` or ``"none"``), ``rdma`` (``gpuDirectRDMACapable``), and
        ``notes``: why not more (what the device does not report, what ``cuMemCreate``
        refused). A refusal is known once a chunk was created: ``probe`` creates and
        releases one granule first."""
        self.ensure_context(device_index)
        prop = self._allocation_prop(device_index)
        if probe:
            self.release(self.create(self.granularity(device_index), device_index))
        chain = self._handle_chains[device_index]
        return {
            "handle_type": chain[self._handle_steps[device_index]][0],
            "rdma": bool(prop.allocFlags.gpuDirectRDMACapable),
            "notes": list(self._allocation_notes.get(device_index, [])),
        }

    def granularity(self, device_index: int) -> int:
        """``cuMemGetAllocationGranularity`` (minimum) of :meth:`create`'s chunks. Cached."""
        granularity = self._granularities.get(device_index)
        if granularity is None:
            self.ensure_context(device_index)
            granularity = int(
                self._check(
                    self._cu.cuMemGetAllocationGranularity(
                        self._allocation_prop(device_index),
                        self._cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                    ),
                    "cuMemGetAllocationGranularity",
                    device=device_index,
                )
            )
            self._granularities[device_index] = granularity
        return granularity

    def _create(self, size: int, device_index: int) -> Any:
        prop = self._allocation_prop(device_index)
        error, handle = self._cu.cuMemCreate(size, prop, 0)
        while error in self._refusals and self._step_down(prop, device_index, error):
            error, handle = self._cu.cuMemCreate(size, prop, 0)
        return self._check((error, handle), "cuMemCreate", size=size, device=device_index)

    def _step_down(self, prop: Any, device_index: int, error: Any) -> bool:
        """After ``cuMemCreate`` refused ``prop``: ask for less, for good (the next handle
        type of the chain, then no RDMA flag where it was only wanted). False when
        nothing is left to drop."""
        # The chain's position is kept apart: a fabric | POSIX mask reads back as no enum.
        chain, step = self._handle_chains[device_index], self._handle_steps[device_index]
        notes = self._allocation_notes.setdefault(device_index, [])
        name = self._error_name(error)
        if step + 1 < len(chain):
            refused, (next_name, next_value) = chain[step][0], chain[step + 1]
            notes.append(f"{refused} handles: cuMemCreate refused them ({name}); using {next_name}")
            prop.requestedHandleTypes = next_value
            self._handle_steps[device_index] = step + 1
            return True
        if self._rdma == "auto" and prop.allocFlags.gpuDirectRDMACapable:
            notes.append(f"GPUDirect RDMA: cuMemCreate refused gpuDirectRDMACapable ({name})")
            prop.allocFlags.gpuDirectRDMACapable = 0
            return True
        return False
