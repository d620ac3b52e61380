"""``jaxbuf info``: platform, which drivers work here (and why not), versions, granules."""

from __future__ import annotations

import argparse
import sys

from ._shared import CliError, Printer, machine, one_line, resolve_device, versions


def run(args: argparse.Namespace) -> int:
    from jaxbuf.drivers import HostVmmDriver, cuda_unavailable_reason, get_vmm_driver
    from jaxbuf.extensible import granule_size

    out = Printer()
    described = machine()
    out.table(
        "jaxbuf info",
        ["", ""],
        [
            ["platform", described["platform"]],
            ["python", f"{described['python']} ({sys.executable})"],
            ["machine", f"{described['node']}: {described['cpu']}, {described['cpu_count']} CPUs"],
            ["GPUs", ", ".join(described["gpus"]) or "none"],
        ],
    )

    driver_rows = []
    granule_rows = []
    reasons = {"cpu": HostVmmDriver().unavailable_reason(), "cuda": cuda_unavailable_reason()}
    for name, reason in reasons.items():
        if reason is not None:
            driver_rows.append([name, "unavailable", one_line(reason)])
            continue
        driver = get_vmm_driver(name)
        count = driver.device_count()
        details = f"{count} device(s)"
        if name == "cuda":  # how the staged apply's driver calls are made
            reason = getattr(driver, "c_calls_reason", None)
            details += (
                "; hot calls from C"
                if reason is None
                else f"; hot calls via cuda.bindings: {reason}"
            )
        driver_rows.append([name, "works", details])
        for index in range(count):
            device = name if name == "cpu" else f"cuda:{index}"
            commit_kib = granule_size(device) // 1024
            driver_kib = driver.granularity(index) // 1024
            granule_rows.append([device, f"{commit_kib:,} KiB", f"{driver_kib:,} KiB"])
    out.table("drivers", ["driver", "status", "details"], driver_rows)
    out.table("granules", ["device", "commit granule", "driver granularity"], granule_rows)
    if reasons["cuda"] is None:
        out.table("CUDA allocations", ["device", "chunks get", "why not more"], _allocations())
    out.table("transfer engines", ["engine", "status"], [["NIXL", _nixl_status()]])
    from jaxbuf.transfer._report import transport_rows

    out.table(
        "KV transfers (transport='auto')",
        ["memory", "to a process on this host, same user", "to another host"],
        transport_rows(),
    )
    out.table("versions", ["package", "version"], [[k, v] for k, v in versions().items()])
    try:
        default = resolve_device(None)
    except CliError as error:
        default = f"none ({error})"
    out.line(f"default device: {default}")
    return 0


def _allocations() -> list[list[str]]:
    """Per CUDA device: the best handle type (the chain from fabric, probed with one
    granule) and GPUDirect RDMA, and why not more (what NIXL over InfiniBand and
    multi-node NVLink need)."""
    from jaxbuf.drivers import get_vmm_driver
    from jaxbuf.drivers.cuda import CudaVmmDriver

    rows = []
    for index in range(get_vmm_driver("cuda").device_count()):
        try:
            options = CudaVmmDriver(shareable="fabric", rdma="auto").allocation_options(
                index, probe=True
            )
        except Exception as error:  # noqa: BLE001 - reported in the table
            rows.append([f"cuda:{index}", "unknown", one_line(str(error))])
            continue
        rdma = "GPUDirect RDMA" if options["rdma"] else "no RDMA flag"
        rows.append(
            [
                f"cuda:{index}",
                f"{options['handle_type']} handles, {rdma}",
                "; ".join(options["notes"]) or "-",
            ]
        )
    return rows


def _nixl_status() -> str:
    """Which NIXL module jaxbuf.transfer would use, or why none (without making an agent)."""
    from jaxbuf.transfer import NixlUnavailable, load_nixl

    try:
        module = load_nixl()
    except NixlUnavailable as error:
        return one_line(str(error))
    return f"{module.__name__} (jaxbuf.transfer works)"
