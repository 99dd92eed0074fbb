"""The GPU catalog against the vendor figures it cites (gpu_catalog.py's sources).

Each row is a figure as the datasheet prints it -- for the system it describes, often "with
sparsity" -- and the test derives the per-GPU, per-direction, dense value the cost model reads.
"""

from __future__ import annotations

import pytest

from opweave.costmodel import default_catalog

T = 1e12  # TFLOPS, TB/s
P = 1e15  # PFLOPS
G = 1e9  # GB, GB/s
GBIT = 1e9 / 8  # Gb/s in bytes/s

# (GPU, catalog field, datasheet figure, GPUs the figure is for, divide by: 2 for a "with
# sparsity" tensor rate or an aggregate both-directions link, else 1), source
DATASHEET = [
    # FP8/FP4 dense rates of the GPUs the catalog already had
    ("h100-sxm", "fp8_flops_per_s", 3958 * T, 1, 2),  # H100 datasheet, SXM, with sparsity
    ("h200-sxm", "fp8_flops_per_s", 3958 * T, 1, 2),  # H200 datasheet
    ("h100-pcie", "fp8_flops_per_s", 3026 * T, 1, 2),  # H100 datasheet, PCIe
    ("l40s", "fp8_flops_per_s", 1466 * T, 1, 2),  # L40S datasheet
    ("l4", "fp8_flops_per_s", 485 * T, 1, 2),  # L4 datasheet
    ("mi300x", "fp8_flops_per_s", 5229.8 * T, 1, 2),  # MI300X data sheet
    ("b200", "dense_flops_per_s", 36 * P, 8, 2),  # HGX/DGX B200, 8 GPUs, with sparsity
    ("b200", "fp8_flops_per_s", 72 * P, 8, 2),
    ("b200", "fp4_flops_per_s", 144 * P, 8, 2),
    ("b200", "mem_bandwidth_bytes_per_s", 64 * T, 8, 1),
    # B300: HGX B300 (8 GPUs); dense FP4 is listed beside the sparse one
    ("b300", "dense_flops_per_s", 36 * P, 8, 2),
    ("b300", "fp8_flops_per_s", 72 * P, 8, 2),
    ("b300", "fp4_flops_per_s", 105 * P, 8, 1),
    ("b300", "mem_bandwidth_bytes_per_s", 8 * T, 1, 1),
    ("b300", "intra_node_bandwidth_bytes_per_s", 1.8 * T, 1, 2),  # NVLink 5, both directions
    ("b300", "network_bandwidth_bytes_per_s", 800 * GBIT, 1, 1),  # ConnectX-8 per GPU
    # GB200 NVL72 (72 GPUs)
    ("gb200", "dense_flops_per_s", 360 * P, 72, 2),
    ("gb200", "fp8_flops_per_s", 720 * P, 72, 2),
    ("gb200", "fp4_flops_per_s", 1440 * P, 72, 2),
    ("gb200", "mem_bandwidth_bytes_per_s", 576 * T, 72, 1),
    ("gb200", "intra_node_bandwidth_bytes_per_s", 1.8 * T, 1, 2),  # NVLink 5 per GPU
    ("gb200", "network_bandwidth_bytes_per_s", 400 * GBIT, 1, 1),  # ConnectX-7 per GPU
    # GB300 NVL72 (72 GPUs); dense FP4 listed beside the sparse one
    ("gb300", "dense_flops_per_s", 360 * P, 72, 2),
    ("gb300", "fp8_flops_per_s", 720 * P, 72, 2),
    ("gb300", "fp4_flops_per_s", 1080 * P, 72, 1),
    ("gb300", "mem_bandwidth_bytes_per_s", 576 * T, 72, 1),
    ("gb300", "intra_node_bandwidth_bytes_per_s", 1.8 * T, 1, 2),
    ("gb300", "network_bandwidth_bytes_per_s", 800 * GBIT, 1, 1),
    # H20 (HGX H20)
    ("h20", "mem_bandwidth_bytes_per_s", 4.0 * T, 1, 1),
    ("h20", "dense_flops_per_s", 148 * T, 1, 1),
    ("h20", "fp8_flops_per_s", 296 * T, 1, 1),
    ("h20", "intra_node_bandwidth_bytes_per_s", 900 * G, 1, 2),
    # RTX PRO 6000 Blackwell Server Edition
    ("rtx-pro-6000", "mem_bandwidth_bytes_per_s", 1597 * G, 1, 1),
    ("rtx-pro-6000", "dense_flops_per_s", 1 * P, 1, 2),
    ("rtx-pro-6000", "fp8_flops_per_s", 2 * P, 1, 2),
    ("rtx-pro-6000", "fp4_flops_per_s", 4 * P, 1, 2),
    ("rtx-pro-6000", "intra_node_bandwidth_bytes_per_s", 128 * G, 1, 2),  # PCIe Gen5 x16
    ("rtx-pro-6000", "network_bandwidth_bytes_per_s", 1600 * GBIT, 8, 1),  # AWS g7e.48xlarge
]


@pytest.mark.parametrize(("gpu", "field", "figure", "gpus", "halve"), DATASHEET)
def test_catalog_matches_the_datasheet(
    gpu: str, field: str, figure: float, gpus: int, halve: int
) -> None:
    assert getattr(default_catalog().get(gpu), field) == pytest.approx(figure / gpus / halve)


MIB = 1 << 20
# (GPU, the memory the device reports -- nvidia-smi's total in MiB, rocm-smi's in bytes for the
# MI300X, as public logs print them (gpu_catalog.py [SMI]) -- and its datasheet's "GB")
DEVICE_MEMORY = [
    ("h100-sxm", 81559 * MIB, 80),
    ("h100-pcie", 81559 * MIB, 80),
    ("h200-sxm", 143771 * MIB, 141),
    ("h20", 97871 * MIB, 96),
    ("a100-sxm-80gb", 81920 * MIB, 80),
    ("a100-sxm-40gb", 40960 * MIB, 40),
    ("l40s", 46068 * MIB, 48),
    ("l4", 23034 * MIB, 24),
    ("rtx-pro-6000", 97887 * MIB, 96),
    ("b200", 183359 * MIB, 1440 / 8),  # HGX B200: 1,440 GB over 8 GPUs
    ("b300", 275040 * MIB, 288),
    ("gb200", 189471 * MIB, 186),
    ("gb300", 284208 * MIB, 288),
    ("mi300x", 206141652992, 192),
]


@pytest.mark.parametrize(("gpu", "reported", "datasheet_gb"), DEVICE_MEMORY)
def test_memory_is_what_the_device_reports(gpu: str, reported: int, datasheet_gb: float) -> None:
    """vLLM sizes its KV cache from the device's own total, not the datasheet's rounded "GB"
    (7% apart on the H100); the two still name the same memory."""
    memory = default_catalog().get(gpu).memory_bytes
    assert memory == reported
    assert memory == pytest.approx(datasheet_gb * G, rel=0.075)


@pytest.mark.parametrize(
    ("gpu", "fp8", "fp4"),
    [
        ("a100-sxm-80gb", False, False),  # Ampere: neither
        ("a100-sxm-40gb", False, False),
        ("h100-sxm", True, False),  # Hopper and Ada: FP8 only
        ("h200-sxm", True, False),
        ("h20", True, False),
        ("h100-pcie", True, False),
        ("l40s", True, False),
        ("l4", True, False),
        ("mi300x", True, False),  # CDNA 3: FP8 only
        ("b200", True, True),  # Blackwell: both
        ("b300", True, True),
        ("gb200", True, True),
        ("gb300", True, True),
        ("rtx-pro-6000", True, True),
    ],
)
def test_a_gpu_without_such_tensor_cores_has_no_rate(gpu: str, fp8: bool, fp4: bool) -> None:
    hw = default_catalog().get(gpu)
    assert (hw.fp8_flops_per_s is not None) is fp8
    assert (hw.fp4_flops_per_s is not None) is fp4
    assert (hw.effective_fp8_flops is not None) is fp8
    assert (hw.effective_fp4_flops is not None) is fp4


# Measured achievable / peak GEMM throughput: stas00/ml-engineering MAMF tables (best shape,
# no sparsity) and Azure's ND GB200 v6 cuBLASLt FP4 GEMMs.
MEASURED = [
    ("h100-sxm", "fp8_compute_efficiency", 1402.6, 1979),
    ("h200-sxm", "fp8_compute_efficiency", 1453.4, 1979),
    ("b200", "fp8_compute_efficiency", 3432.5, 4500),
    ("b300", "fp8_compute_efficiency", 3353.3, 4500),
    ("gb200", "fp8_compute_efficiency", 3615.6, 5000),
    ("gb200", "fp4_compute_efficiency", 7627.6, 10000),
    ("b300", "compute_efficiency", 1769.0, 2250),
    ("gb200", "compute_efficiency", 1822.0, 2500),
    ("b200", "compute_efficiency", 1745.0, 2250),
]


@pytest.mark.parametrize(("gpu", "field", "achieved", "peak"), MEASURED)
def test_efficiencies_are_the_measured_ratios(
    gpu: str, field: str, achieved: float, peak: float
) -> None:
    hw = default_catalog().get(gpu)
    assert getattr(hw, field) == pytest.approx(achieved / peak, abs=0.005)


def test_without_a_measurement_the_fp8_rate_takes_the_bf16_efficiency() -> None:
    cat = default_catalog()
    l40s, b200 = cat.get("l40s"), cat.get("b200")
    assert l40s.fp8_compute_efficiency is None
    assert l40s.effective_fp8_flops == pytest.approx(733e12 * l40s.compute_efficiency)
    assert b200.fp4_compute_efficiency is None
    assert b200.effective_fp4_flops == pytest.approx(9000e12 * b200.compute_efficiency)
    assert b200.effective_fp8_flops == pytest.approx(4500e12 * 0.76)
    # no measured FP8/FP4 efficiency is given where the GPU has no such tensor cores
    for hw in cat:
        assert hw.fp8_compute_efficiency is None or hw.fp8_flops_per_s is not None, hw.id
        assert hw.fp4_compute_efficiency is None or hw.fp4_flops_per_s is not None, hw.id


def test_rack_scale_gpus_are_nodes_of_four_in_one_nvlink_domain_of_72() -> None:
    cat = default_catalog()
    for gpu in ("gb200", "gb300"):
        hw = cat.get(gpu)
        # 18 compute trays of 2 superchips (4 GPUs) behind one NVLink switch domain
        assert (hw.gpus_per_node, hw.nvlink_domain_gpus, hw.scale_up_gpus) == (4, 72, 72)
    for gpu in ("b200", "b300", "h20", "h100-sxm"):
        hw = cat.get(gpu)
        assert (hw.gpus_per_node, hw.nvlink_domain_gpus, hw.scale_up_gpus) == (8, None, 8)
    rtx = cat.get("rtx-pro-6000")  # PCIe only: no NVLink at all
    assert "PCIe" in rtx.intra_node_link and rtx.nvlink_domain_gpus is None
    assert rtx.allreduce_bandwidth_bytes_per_s is None  # collectives at the PCIe link's rate
