"""The device being profiled: checking it exists, naming it, and describing it as a HardwareSpec.

A profile carries its device as the cost model's :class:`HardwareSpec`, so the planner can price
it and fall back to its roofline for anything the profile lacks (collectives, other models).
A GPU the catalog knows keeps its datasheet figures. A CPU (or an unknown GPU) has no datasheet,
so its "peak" bandwidth and FLOPs are measured quickly here (a large copy and a matmul in the
profile's dtype); the efficiencies fitted to the profile are then relative to those.
"""

from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from opweave.costmodel import HardwareSpec, default_catalog

from ..errors import DeviceUnavailableError, ProfilerError

# ASSUMED price of CPU time when --usd-per-hour is not given: AWS c5.large (2 vCPU) on demand at
# $0.085/h in us-east-1, i.e. $0.0425 per vCPU-hour (the AWS EC2 Auto Scaling user guide's
# on-demand example table lists c5.2xlarge, 8 vCPU, at $0.34/h; example pricing, not a quote).
CPU_USD_PER_VCPU_HOUR = 0.0425
CPU_PRICE_SOURCE = (
    "ASSUMED $0.0425 per vCPU-hour = AWS c5.large (2 vCPU) on-demand $0.085/h, us-east-1 "
    "(AWS EC2 Auto Scaling user guide, on-demand example table); set --usd-per-hour"
)
# ASSUMED for a CPU host: 10 Gb/s Ethernet between hosts, 50 us one-way through the stack.
_CPU_NETWORK_BYTES_PER_S = 1.25e9
_CPU_NETWORK_LATENCY_S = 50e-6
# Catalog ids by a substring of torch.cuda.get_device_name (most specific first).
_GPU_NAMES = (
    ("H200", "h200-sxm"),
    ("H100 PCIe", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("B200", "b200"),
    ("L40S", "l40s"),
    ("L4", "l4"),
    ("MI300X", "mi300x"),
    ("A100", "a100"),
)


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, checked to exist on this machine."""
    key = name.strip().lower()
    if key == "cpu":
        return torch.device("cpu")
    if key == "cuda" or re.fullmatch(r"cuda:\d+", key):
        if not torch.cuda.is_available():
            built = torch.version.cuda or "no CUDA support"
            raise DeviceUnavailableError(
                f"--device {name}: no CUDA device is visible on this machine (torch "
                f"{torch.__version__}, built with {built}); use --device cpu"
            )
        index = int(key.split(":")[1]) if ":" in key else 0
        if index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device("cuda", index)
    raise ProfilerError(f"unknown device {name!r}; use cpu or cuda")


def cpu_model_name() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model_name()


def _meminfo(field: str) -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    total = _meminfo("MemTotal")
    if total is None:
        total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return total


def cache_bytes(device: torch.device) -> int | None:
    """The largest cache in front of ``device``'s memory: the GPU's L2, or the CPU's last level
    (the largest ``/sys/devices/system/cpu/cpu0/cache/index*/size``); None when not reported."""
    if device.type == "cuda":
        size = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
        return size or None
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        match = re.fullmatch(r"(\d+)([KMG]?)", entry.read_text().strip())
        if match:
            sizes.append(int(match[1]) * 1024 ** " KMG".index(match[2] or " "))
    if not sizes and hasattr(os, "sysconf_names") and "SC_LEVEL3_CACHE_SIZE" in os.sysconf_names:
        sizes.append(max(os.sysconf("SC_LEVEL3_CACHE_SIZE"), 0))
    return max(sizes, default=0) or None


def state_budget_bytes(device: torch.device) -> float:
    """Memory the profiler may fill with synthetic KV state for one cell."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return 0.5 * free
    available = _meminfo("MemAvailable") or 0.5 * memory_bytes(device)
    return min(0.25 * available, 4 * 2**30)


@dataclass(frozen=True)
class Peaks:
    """Quickly measured achievable peaks, standing in for a datasheet."""

    bandwidth_bytes_per_s: float
    flops_per_s: float


def _best_time(fn, device: torch.device, tries: int = 5) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(tries + 1):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _copy_time(n_bytes: int, device: torch.device) -> float:
    src = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return _best_time(lambda: dst.copy_(src), device)


@torch.inference_mode()
def measure_peaks(device: torch.device, dtype: torch.dtype) -> Peaks:
    """Copy bandwidth (read + write) and matmul FLOPs in ``dtype``, best of five."""
    cuda = device.type == "cuda"
    n_bytes = (2 if cuda else 0.25) * 2**30
    bandwidth = 2 * n_bytes / _copy_time(int(n_bytes), device)
    n = 8192 if cuda else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    flops = 2.0 * n**3 / _best_time(lambda: a @ b, device)
    return Peaks(bandwidth_bytes_per_s=bandwidth, flops_per_s=flops)


def _catalog_gpu(name: str, memory: float) -> HardwareSpec | None:
    for needle, gpu_id in _GPU_NAMES:
        if needle.lower() in name.lower():
            if gpu_id == "a100":
                gpu_id = "a100-sxm-40gb" if memory < 60e9 else "a100-sxm-80gb"
            return default_catalog().get(gpu_id)
    return None


def describe_device(
    device: torch.device,
    dtype: torch.dtype,
    *,
    threads: int,
    usd_per_hour: float | None,
    link: tuple[float, float] | None,
) -> tuple[HardwareSpec, bool]:
    """The profiled device, and whether its peaks were measured here (not from a datasheet).

    ``link`` is the measured point-to-point (latency, bandwidth), if any.
    """
    name = device_name(device)
    memory = memory_bytes(device)
    if device.type == "cuda":
        known = _catalog_gpu(name, memory)
        if known is not None:
            if usd_per_hour is None:
                return known, False
            return known.model_copy(
                update={"usd_per_hour": usd_per_hour, "price_source": "--usd-per-hour"}
            ), False
    peaks = measure_peaks(device, dtype)
    latency, bandwidth = link or (
        (_CPU_NETWORK_LATENCY_S, peaks.bandwidth_bytes_per_s / 2)
        if device.type == "cpu"
        else (10e-6, 32e9)  # ASSUMED PCIe Gen4 x16 between unknown GPUs
    )
    if device.type == "cpu":
        gpu_id, label = "cpu", f"{name} ({threads} threads)"
        price = usd_per_hour if usd_per_hour is not None else CPU_USD_PER_VCPU_HOUR * threads
        source = "--usd-per-hour" if usd_per_hour is not None else CPU_PRICE_SOURCE
        link_name = "loopback (torch.distributed gloo)"
    else:
        gpu_id = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"
        label, price = name, usd_per_hour
        source = "--usd-per-hour" if usd_per_hour is not None else "unknown; set --usd-per-hour"
        link_name = "measured (torch.distributed nccl)" if link else "ASSUMED PCIe"
    spec = HardwareSpec(
        id=gpu_id,
        name=label,
        memory_bytes=memory,
        mem_bandwidth_bytes_per_s=peaks.bandwidth_bytes_per_s,
        dense_flops_per_s=peaks.flops_per_s,
        intra_node_link=link_name,
        intra_node_bandwidth_bytes_per_s=bandwidth,
        intra_node_latency_s=latency,
        network_bandwidth_bytes_per_s=_CPU_NETWORK_BYTES_PER_S,
        network_latency_s=_CPU_NETWORK_LATENCY_S,
        # A CPU "device" is one rank of ``threads`` cores: this host holds that many side by
        # side, linked by the loopback transfers measured above (not the network).
        gpus_per_node=torch.cuda.device_count()
        if device.type == "cuda"
        else max(1, (os.cpu_count() or 1) // max(threads, 1)),
        usd_per_hour=price,
        price_source=source,
        link_efficiency=1.0,
        # engines overlap shared experts on a second CUDA stream; not on CPU or ROCm
        side_streams=device.type == "cuda" and torch.version.hip is None,
        # a GPU engine's fused-MoE and attention kernels; a CPU rank runs plain matmuls
        engine_kernels=device.type == "cuda",
    )
    if device.type == "cpu":
        # A CPU rank's host work per step is the runtime loop's, which the profile's
        # orchestration measures; the catalog's default is a GPU engine's launch gap.
        spec = spec.model_copy(update={"step_overhead_s": 0.0})
    return spec, True
