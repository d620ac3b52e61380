"""Which transport a transfer of a device's memory would take here, and why:
what ``jaxbuf info`` prints. Probes with one granule; makes no NIXL agent."""

from __future__ import annotations

from typing import Any

__all__ = ["transport_rows"]


def _same_host(device: str) -> str:
    """Whether this device's chunks can be served to a same-host peer (exported as
    descriptors), probed with one chunk."""
    from jaxbuf.extensible import ExtensibleTensor, granule_size
    from jaxbuf.sharing import export_layout
    from jaxbuf.sharing._wire import _close_all

    try:
        tensor = ExtensibleTensor(granule_size(device), device)
    except Exception as error:  # noqa: BLE001 - the reason is the answer
        return f"no: cannot reserve memory here ({error})"
    try:
        tensor.resize_per_segment_(granule_size(device))
        _, fds = export_layout(tensor)
        _close_all(fds)
    except Exception as error:  # noqa: BLE001 - as above
        return f"NIXL instead: this buffer's chunks cannot be exported as descriptors ({error})"
    finally:
        tensor.free()
    return (
        "same-host transport: chunks imported as POSIX descriptors, one driver copy per block list"
    )


def _nixl_between_processes(device: str, options: dict[str, Any] | None) -> str:
    if device == "cpu":
        return "NIXL over UCX (shared memory or TCP between processes, RDMA between hosts)"
    if options is not None and options.get("handle_type") == "fabric":
        return "NIXL over UCX cuda_ipc with fabric handles (create buffers with shareable='fabric')"
    return (
        "NIXL over UCX through the host: the UCX bundled with NIXL opens another process's "
        "VMM memory only with fabric handles, which this machine does not give (see CUDA "
        "allocations); UCX 1.22's POSIX-descriptor cuda_ipc handles are not yet tried by "
        "jaxbuf on a GPU, so on one host the same-host transport moves VMM memory"
    )


def transport_rows() -> list[list[str]]:
    """``[device, to a peer on this host (same user), to a peer on another host]`` rows."""
    from jaxbuf.drivers import HostVmmDriver, cuda_unavailable_reason, get_vmm_driver

    devices: list[tuple[str, dict | None]] = []
    if HostVmmDriver().unavailable_reason() is None:
        devices.append(("cpu", None))
    if cuda_unavailable_reason() is None:
        from jaxbuf.drivers.cuda import CudaVmmDriver

        for index in range(get_vmm_driver("cuda").device_count()):
            try:
                options = CudaVmmDriver(shareable="fabric", rdma="auto").allocation_options(
                    index, probe=True
                )
            except Exception:  # noqa: BLE001 - reported as unknown below
                options = None
            devices.append((f"cuda:{index}", options))
    rows = []
    for device, options in devices:
        between_hosts = _nixl_between_processes(device, options)
        if device != "cpu" and not (options or {}).get("rdma"):
            between_hosts += "; no GPUDirect RDMA flag: UCX stages through host memory"
        rows.append([device, _same_host(device), between_hosts])
    return rows
