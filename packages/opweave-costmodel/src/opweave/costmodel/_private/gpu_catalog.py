"""The built-in GPUs: datasheet figures, measured efficiency factors and dated prices.

Per GPU, as the cost model sees it (per device; one direction for links). Dense tensor rates
are the datasheet's; where a datasheet lists only "with sparsity" figures, dense = sparse / 2
(Blackwell Ultra's FP4 is the exception: NVIDIA lists its dense figure separately). Where a
datasheet gives a system's totals, per GPU = total / GPUs in the system.

Sources, cited once here and by key below:
  [DS-H100] NVIDIA H100 Tensor Core GPU Datasheet (SXM and PCIe columns): BF16 1,979 / FP8 3,958
  TFLOPS (SXM) and 1,513 / 3,026 (PCIe), with sparsity; [DS-H200] NVIDIA H200 datasheet (same
  tensor rates as H100 SXM); [DS-A100] NVIDIA A100 datasheet (no FP8 tensor cores); [DS-L40S]
  NVIDIA L40S datasheet (BF16 362.05 dense, FP8 1,466 with sparsity); [DS-L4] NVIDIA L4 datasheet
  (FP8 485 with sparsity); [DS-B200] NVIDIA DGX/HGX B200 datasheet, 8-GPU totals (1,440 GB, 64
  TB/s; FP4 144, FP8 72, BF16 36 PFLOPS with sparsity); [DS-MI300X] AMD Instinct MI300X data
  sheet (FP8 5,229.8 TFLOPS with sparsity, no FP4).
  [DS-B300] NVIDIA HGX B300 specifications, 8-GPU totals (FP4 144 | 105 PFLOPS with | without
  sparsity, FP8 72 and BF16 36 PFLOPS with sparsity, up to 2.3 TB HBM3e, NVLink 1.8 TB/s per GPU,
  networking 1.6 TB/s = 8x ConnectX-8 800 Gb/s), as copied by glennklockwood.com/garden/
  processors/B300 (dense FP4 13,125 TFLOPS per GPU) and fibermall.com's HGX B300 table; NVIDIA
  Technical Blog "Inside NVIDIA Blackwell Ultra" (288 GB HBM3e and 8 TB/s per GPU).
  [DS-GB200] NVIDIA GB200 NVL72 specifications, 72-GPU totals: FP4 1,440, FP8 720, BF16 360
  PFLOPS with sparsity, up to 13.4 TB HBM3e at 576 TB/s, NVLink 130 TB/s (1.8 TB/s per GPU);
  glennklockwood.com/garden/processors/B200 (GB200 at 1,200 W: BF16 2,500 / FP8 5,000 / FP4
  10,000 dense TFLOPS); NVIDIA MIG user guide, supported GPUs (GB200 186 GB).
  [DS-GB300] NVIDIA GB300 NVL72 specifications, 72-GPU totals: FP4 1,440 | 1,080 PFLOPS with |
  without sparsity, FP8 720 and BF16 360 PFLOPS with sparsity, up to 20 TB HBM3e at 576 TB/s,
  NVLink 130 TB/s, one ConnectX-8 800 Gb/s per GPU (72 per rack); "Inside NVIDIA Blackwell
  Ultra" (288 GB HBM3e, 8 TB/s, 15 PFLOPS dense NVFP4 per GPU).
  [DS-H20] NVIDIA HGX H20 specifications as listed at launch (Tom's Hardware, "New Nvidia AI
  GPUs designed to get around US export bans come to China", 2024): 96 GB HBM3, 4.0 TB/s, FP8
  296 and BF16 148 TFLOPS (dense: 15% of the H100's 989), NVLink 900 GB/s, 400 W; the MIG user
  guide lists the H20 at 96 GB.
  [DS-RTXP6K] NVIDIA RTX PRO 6000 Blackwell Server Edition product page (nvidia.com/en-us/
  data-center/rtx-pro-6000-blackwell-server-edition): 96 GB GDDR7, 1,597 GB/s, FP4 4 PFLOPS,
  FP8 2 PFLOPS, FP16/BF16 1 PFLOPS (with sparsity), PCIe Gen5 x16, no NVLink, up to 600 W.
  [DS-FP32] FP32 without tensor cores (CUDA cores; vector units on the MI300X), which a float32
  model's math runs at (``HardwareSpec.fp32_flops_per_s``), per GPU: H100 SXM 67 and PCIe 51
  [DS-H100]; H200 67 [DS-H200]; H20 44 as listed at launch [DS-H20]; A100 19.5 [DS-A100]; L40S
  91.6 [DS-L40S]; L4 30.3 [DS-L4]; RTX PRO 6000 120 [DS-RTXP6K]; B200 and B300 75 (NVIDIA
  Blackwell Technical Brief, table 3; HGX B200 and B300: 600 TFLOPS per 8 GPUs); GB200 5,760
  and GB300 6,000 (rounded, "6 PFLOPS") TFLOPS per 72 GPUs [DS-GB200] [DS-GB300]; MI300X 163.4
  TFLOPS (AMD CDNA 3 white paper, endnote MI300-11).
  [MLPERF-GB200] MLPerf Inference v6.1 system description
  GB200-NVL72_GB200-186GB_aarch64x16_Dynamo (Crusoe): 186 GB per GPU, 4 GPUs per node (a
  compute tray), 4x BlueField-3 (ConnectX-7) NICs per 4-GPU node, NVLink across trays
  through NVLink switches.
  [AWS-G7E] Amazon EC2 G7e announcement: 8 RTX PRO 6000 Blackwell Server Edition GPUs and
  1,600 Gbps of networking on g7e.48xlarge (200 Gb/s per GPU).
  [BABEL] BabelStream triad on Azure ND-series VMs, Azure/AI-benchmarking-guide Azure_Results
  (A100 1.70, H100 2.97, H200 4.15, MI300X 4.09 TB/s): achievable/peak memory bandwidth.
  [MAMF] stas00/ml-engineering, compute/accelerator "Maximum Achievable Matmul FLOPS", best
  shape, no sparsity: achievable/peak dense GEMM throughput. BF16: A100 271.2, H100 794.5,
  B200 1,745.0, B300 1,769.0, GB200 1,822.0, MI300X 668.4 TFLOPS. FP8 (float8_e4m3fn): H100
  1,402.6 of 1,979, H200 1,453.4 of 1,979, B200 3,432.5 of 4,500, B300 3,353.3 of 4,500, GB200
  3,615.6 of 5,000 TFLOPS.
  [AZ-GB200] Azure/AI-benchmarking-guide Azure_Results/ND_GB200_v6_results.md, cuBLASLt GEMM
  with random inputs: FP4 best 7,627.6 TFLOPS (16384^3) of 10,000.
  [NCCL-P2P] NVIDIA/nccl#1264: H100 peer-to-peer copies reach 380 of 450 GB/s per direction.
  [DEEPOPS] NVIDIA DeepOps multi-node all-reduce: 191 of 200 GB/s (HDR) per 8-GPU node.
  [NIC] per-GPU NICs: DGX A100 8x ConnectX-6 HDR 200 Gb/s; HGX H100/H200 and DGX B200 8x
  ConnectX-7 NDR 400 Gb/s (MLPerf system descriptions); GB200 NVL72 one ConnectX-7-class
  400 Gb/s NIC per GPU [MLPERF-GB200]; HGX B300 and GB300 NVL72 one ConnectX-8 800 Gb/s per GPU
  [DS-B300] [DS-GB300].
  [PRICE] One basis for every GPU RunPod rents, so that comparisons between GPU types are fair:
  RunPod's on-demand Community Cloud list price per GPU-hour (runpod.io/pricing), the one
  provider and tier that lists nearly the whole catalog. Read 2026-09-25 (tgarg01/silybench-data
  derived/csv/gpu_prices.csv) for H100 SXM, H100 PCIe, H200, B200, A100 SXM 80GB and L40S; the
  A100 SXM 40GB and the B300 from the 2026-08-19 RunPod snapshot of the privum/ai-compute-prices
  dataset (its other RunPod Community prices equal the 2026-09-25 ones; RunPod's catalog still
  listed the B300 at $6.94 on 2026-09-18); the L4 from deploybase.ai's "RunPod GPU Pricing"
  (2026-03-10), whose RunPod Community figures equal the 2026-09-25 list for all seven GPUs
  both name; the RTX PRO 6000 from runpod.io/pricing's JSON-LD read 2026-09-26 (Community $1.69,
  Secure $2.09; the same read gives the 2026-09-25 Community price of every other GPU both
  name). RunPod lists neither the MI300X nor rack-scale GB200: DigitalOcean's on-demand MI300X
  price (2026-10-07, HF dataset tokenwatt/gpu-cloud-prices) and Spheron's on-demand GB200
  superchip price ($9.08 per superchip of 2 GPUs, 2026-03-17, spheron.network "NVIDIA H200 vs
  B200 vs GB200") stand in, marked as another basis. No dated public on-demand price was found
  for the GB300 or the H20: RunPod lists neither; CoreWeave's pricing page lists GB300 NVL72 as
  "Contact sales" (read 2026-09-20, api-evangelist/coreweave plans/coreweave-plans-pricing.yml)
  and Nebius's as "Contact us" (read 2026-10-07, api-evangelist/nebius
  plans/nebius-plans-pricing.yml); no public list price was found for the China-only H20. They
  carry none, and plans that use them ask for ``usd_per_hour`` in a hardware file. Community
  Cloud is the low end of the market (hyperscalers list the same GPUs at 2-4x); plans depend on
  the price ratios. Override any price with ``--hardware``.
  [SMI] Device memory is the total the device reports, as nvidia-smi prints it (MiB; rocm-smi
  for the MI300X, in bytes), not the datasheet's "GB": vLLM sizes its KV cache from the total
  CUDA reports times --gpu-memory-utilization (vllm/v1/worker/gpu_worker.py, init_device:
  total_memory from torch.cuda.mem_get_info), and the two differ by up to 7% (H100 "80GB":
  81,559 MiB = 85.5e9 bytes; B300 "288GB": 275,040 MiB). Printed totals: modal-labs/
  modal-client#2797 (H100 81559, A100 80GB 81920, A100 40GB 40960, L40S 46068, L4 23034 MiB);
  NVIDIA/nccl#1264 and vllm-project/vllm#55169 (H100 81559 MiB); NVIDIA/TensorRT-LLM#10278
  (B200 183359 MiB); nvidia-smi outputs in public logs for the H100 PCIe (81559), H200 (143771),
  H20 (97871), RTX PRO 6000 Blackwell Server Edition (97887), B300 SXM6 (275040), GB200
  (189471) and GB300 (284208 MiB), and rocm-smi's "VRAM Total Memory (B): 206141652992" for the
  MI300X. CUDA's own total is about 0.5% below nvidia-smi's on the H100, H200 and B200 (memory
  the driver reserves; pytorch/ao#4002 prints 178.35 GiB for a B200), which is left out.
Where no measurement was found a factor is the closest GPU's, marked ASSUMED; override any
field with ``--hardware FILE``.
"""

from __future__ import annotations

from typing import Any

from .hardware import GB, TB, TFLOPS, US, HardwareSpec

MIB = float(1 << 20)


def _gpu(**fields: Any) -> HardwareSpec:
    return HardwareSpec(**fields)


# ASSUMED latencies: one-way small-message NVLink/RDMA ~2-3 us plus NCCL launch. TP collectives
# over NVLink use [AIC-AR] (hardware.py): per system, the engines' CUDA-graph custom all-reduce
# fitted to latency + 2(t-1)/t x bytes / bandwidth (tools/aic_allreduce.py prints the fit); the
# H20, which the database has no system for, takes the H100's (the same NVLink 4 switch). PCIe
# GPUs keep an ASSUMED 20 us floor at link bandwidth (custom all-reduce needs NVLink beyond two
# GPUs).
# NVLink 5: 18 links x 100 GB/s = 1.8 TB/s per GPU, 900 GB/s per direction [DS-B200] [DS-GB200].
NVLINK5_BANDWIDTH = 900 * GB
BUILTIN_GPUS: tuple[HardwareSpec, ...] = (
    _gpu(
        id="h100-sxm",
        name="NVIDIA H100 SXM5 80GB",
        aliases=("h100",),
        memory_bytes=81559 * MIB,  # [SMI]
        mem_bandwidth_bytes_per_s=3.35 * TB,  # [DS-H100]
        dense_flops_per_s=989 * TFLOPS,  # [DS-H100]
        fp32_flops_per_s=67 * TFLOPS,  # [DS-H100] SXM column: FP32, no tensor cores
        fp8_flops_per_s=1979 * TFLOPS,  # [DS-H100] 3,958 sparse
        intra_node_link="NVLink 4",
        intra_node_bandwidth_bytes_per_s=450 * GB,
        network_bandwidth_bytes_per_s=50 * GB,  # [NIC] 400 Gb/s
        memory_efficiency=0.89,
        compute_efficiency=0.80,  # [BABEL] [MAMF]
        fp8_compute_efficiency=0.71,  # [MAMF] 1,402.6 / 1,979
        link_efficiency=0.84,  # [NCCL-P2P]
        allreduce_latency_s=3.0 * US,  # [AIC-AR] h100_sxm
        allreduce_bandwidth_bytes_per_s=179 * GB,
        usd_per_hour=2.69,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-09-25",
    ),
    _gpu(
        id="h200-sxm",
        name="NVIDIA H200 SXM 141GB",
        aliases=("h200",),
        memory_bytes=143771 * MIB,  # [SMI]
        mem_bandwidth_bytes_per_s=4.8 * TB,  # [DS-H200]
        dense_flops_per_s=989 * TFLOPS,
        fp32_flops_per_s=67 * TFLOPS,  # [DS-H200]: FP32, no tensor cores
        fp8_flops_per_s=1979 * TFLOPS,  # [DS-H200]
        intra_node_link="NVLink 4",
        intra_node_bandwidth_bytes_per_s=450 * GB,
        network_bandwidth_bytes_per_s=50 * GB,  # [NIC]
        memory_efficiency=0.86,
        compute_efficiency=0.80,  # [BABEL] [MAMF: =H100]
        fp8_compute_efficiency=0.73,  # [MAMF] 1,453.4 / 1,979
        link_efficiency=0.84,
        allreduce_latency_s=3.0 * US,  # [AIC-AR] h200_sxm
        allreduce_bandwidth_bytes_per_s=188 * GB,
        usd_per_hour=3.59,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-09-25",
    ),
    _gpu(
        id="h20",
        name="NVIDIA H20 96GB (HGX H20)",
        memory_bytes=97871 * MIB,  # [SMI]; [DS-H20]: 96 GB
        mem_bandwidth_bytes_per_s=4.0 * TB,  # [DS-H20]
        dense_flops_per_s=148 * TFLOPS,  # [DS-H20]
        fp32_flops_per_s=44 * TFLOPS,  # [DS-H20]: FP32, no tensor cores
        fp8_flops_per_s=296 * TFLOPS,  # [DS-H20]
        intra_node_link="NVLink 4",
        intra_node_bandwidth_bytes_per_s=450 * GB,  # [DS-H20] 900 GB/s both directions
        network_bandwidth_bytes_per_s=50 * GB,  # ASSUMED: HGX H100's [NIC] (same baseboard)
        memory_efficiency=0.89,  # ASSUMED: H100's [BABEL] (HBM3)
        compute_efficiency=0.80,  # ASSUMED: H100's [MAMF]
        link_efficiency=0.84,  # ASSUMED: H100's [NCCL-P2P]
        allreduce_latency_s=3.0 * US,  # ASSUMED: the H100's [AIC-AR]
        allreduce_bandwidth_bytes_per_s=179 * GB,
        price_source="no dated public on-demand price found; give usd_per_hour in a "
        "--hardware file",
    ),
    _gpu(
        id="a100-sxm-80gb",
        name="NVIDIA A100 SXM4 80GB",
        aliases=("a100", "a100-80gb"),
        memory_bytes=81920 * MIB,  # [SMI]
        mem_bandwidth_bytes_per_s=2.039 * TB,  # [DS-A100]
        dense_flops_per_s=312 * TFLOPS,  # [DS-A100]; no FP8 tensor cores
        fp32_flops_per_s=19.5 * TFLOPS,  # [DS-A100]: FP32, no tensor cores
        intra_node_link="NVLink 3",
        intra_node_bandwidth_bytes_per_s=300 * GB,
        network_bandwidth_bytes_per_s=25 * GB,  # [NIC] HDR 200 Gb/s
        memory_efficiency=0.83,
        compute_efficiency=0.87,  # [BABEL] [MAMF]
        link_efficiency=0.84,
        allreduce_latency_s=5.3 * US,  # [AIC-AR] a100_sxm
        allreduce_bandwidth_bytes_per_s=109 * GB,
        usd_per_hour=1.39,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-09-25",
    ),
    _gpu(
        id="a100-sxm-40gb",
        name="NVIDIA A100 SXM4 40GB",
        aliases=("a100-40gb",),
        memory_bytes=40960 * MIB,  # [SMI]
        mem_bandwidth_bytes_per_s=1.555 * TB,  # [DS-A100]
        dense_flops_per_s=312 * TFLOPS,
        fp32_flops_per_s=19.5 * TFLOPS,  # [DS-A100]: FP32, no tensor cores
        intra_node_link="NVLink 3",
        intra_node_bandwidth_bytes_per_s=300 * GB,
        network_bandwidth_bytes_per_s=25 * GB,
        memory_efficiency=0.83,
        compute_efficiency=0.87,
        link_efficiency=0.84,
        allreduce_latency_s=5.3 * US,  # [AIC-AR] a100_sxm
        allreduce_bandwidth_bytes_per_s=109 * GB,
        usd_per_hour=1.00,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-08-19",
    ),
    _gpu(
        id="h100-pcie",
        name="NVIDIA H100 PCIe 80GB",
        memory_bytes=81559 * MIB,  # [SMI]
        mem_bandwidth_bytes_per_s=2.0 * TB,  # [DS-H100] PCIe
        dense_flops_per_s=756 * TFLOPS,
        fp32_flops_per_s=51 * TFLOPS,  # [DS-H100] PCIe column: FP32, no tensor cores
        fp8_flops_per_s=1513 * TFLOPS,  # [DS-H100] PCIe, 3,026 sparse
        intra_node_link="PCIe Gen5 x16",
        intra_node_bandwidth_bytes_per_s=64 * GB,
        network_bandwidth_bytes_per_s=25 * GB,  # ASSUMED
        memory_efficiency=0.85,
        compute_efficiency=0.80,  # ASSUMED (as SXM)
        usd_per_hour=1.99,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-09-25",
    ),
    _gpu(
        id="l40s",
        name="NVIDIA L40S 48GB",
        memory_bytes=46068 * MIB,  # [SMI]
        mem_bandwidth_bytes_per_s=0.864 * TB,  # [DS-L40S]
        dense_flops_per_s=362.05 * TFLOPS,
        fp32_flops_per_s=91.6 * TFLOPS,  # [DS-L40S]: FP32, no tensor cores
        fp8_flops_per_s=733 * TFLOPS,  # [DS-L40S] 1,466 sparse
        intra_node_link="PCIe Gen4 x16",
        intra_node_bandwidth_bytes_per_s=32 * GB,
        # ASSUMED: 2x 200 GbE per 4-GPU PCIe server = 100 Gb/s per GPU.
        network_bandwidth_bytes_per_s=12.5 * GB,
        network_latency_s=10 * US,
        intra_node_latency_s=8 * US,
        allreduce_latency_s=20 * US,
        memory_efficiency=0.80,
        compute_efficiency=0.70,  # ASSUMED
        link_efficiency=0.80,
        gpus_per_node=8,
        usd_per_hour=0.79,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-09-25",
    ),
    _gpu(
        id="l4",
        name="NVIDIA L4 24GB",
        memory_bytes=23034 * MIB,  # [SMI]
        mem_bandwidth_bytes_per_s=0.3 * TB,  # [DS-L4]
        dense_flops_per_s=121 * TFLOPS,
        fp32_flops_per_s=30.3 * TFLOPS,  # [DS-L4]: FP32, no tensor cores
        fp8_flops_per_s=242.5 * TFLOPS,  # [DS-L4] 485 sparse
        intra_node_link="PCIe Gen4 x16",
        intra_node_bandwidth_bytes_per_s=32 * GB,
        network_bandwidth_bytes_per_s=6.25 * GB,
        network_latency_s=10 * US,  # ASSUMED 50 Gb/s
        intra_node_latency_s=8 * US,
        allreduce_latency_s=20 * US,
        # Power-capped at 72 W: community torch matmul runs reach 59-71 of 121 TFLOPS.
        memory_efficiency=0.80,
        compute_efficiency=0.50,
        link_efficiency=0.80,
        usd_per_hour=0.44,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-03-10",
    ),
    _gpu(
        id="rtx-pro-6000",
        name="NVIDIA RTX PRO 6000 Blackwell Server Edition 96GB",
        memory_bytes=97887 * MIB,  # [SMI]; [DS-RTXP6K]: 96 GB
        mem_bandwidth_bytes_per_s=1.597 * TB,  # [DS-RTXP6K]
        dense_flops_per_s=500 * TFLOPS,  # [DS-RTXP6K] 1 PFLOPS sparse
        fp32_flops_per_s=120 * TFLOPS,  # [DS-RTXP6K]: FP32, no tensor cores
        fp8_flops_per_s=1000 * TFLOPS,  # [DS-RTXP6K] 2 PFLOPS sparse
        fp4_flops_per_s=2000 * TFLOPS,  # [DS-RTXP6K] 4 PFLOPS sparse
        # PCIe only, no NVLink [DS-RTXP6K]: Gen5 x16, 128 GB/s both directions.
        intra_node_link="PCIe Gen5 x16",
        intra_node_bandwidth_bytes_per_s=64 * GB,
        network_bandwidth_bytes_per_s=25 * GB,  # [AWS-G7E] 1,600 Gb/s per 8 GPUs
        network_latency_s=10 * US,  # ASSUMED as L40S
        intra_node_latency_s=8 * US,
        allreduce_latency_s=20 * US,
        memory_efficiency=0.80,  # ASSUMED: L40S's (GDDR, PCIe)
        compute_efficiency=0.70,  # ASSUMED: L40S's
        link_efficiency=0.80,  # ASSUMED: L40S's
        gpus_per_node=8,  # [AWS-G7E]
        usd_per_hour=1.69,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-09-26",
    ),
    _gpu(
        id="b200",
        name="NVIDIA B200 (HGX, 1000 W)",
        memory_bytes=183359 * MIB,  # [SMI]; [DS-B200]: 180 GB
        mem_bandwidth_bytes_per_s=8.0 * TB,  # [DS-B200]
        dense_flops_per_s=2250 * TFLOPS,  # [DS-B200] 36 PFLOPS sparse / 8 / 2
        fp32_flops_per_s=75 * TFLOPS,  # [DS-FP32]: FP32, no tensor cores
        fp8_flops_per_s=4500 * TFLOPS,  # [DS-B200] 72 / 8 / 2
        fp4_flops_per_s=9000 * TFLOPS,  # [DS-B200] 144 / 8 / 2
        intra_node_link="NVLink 5",
        intra_node_bandwidth_bytes_per_s=NVLINK5_BANDWIDTH,
        network_bandwidth_bytes_per_s=50 * GB,  # [NIC]
        memory_efficiency=0.80,
        compute_efficiency=0.78,  # ASSUMED mem; [MAMF]
        fp8_compute_efficiency=0.76,  # [MAMF] 3,432.5 / 4,500
        link_efficiency=0.84,
        allreduce_latency_s=4.5 * US,  # [AIC-AR] b200_sxm
        allreduce_bandwidth_bytes_per_s=225 * GB,
        usd_per_hour=5.98,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-09-25",
    ),
    _gpu(
        id="b300",
        name="NVIDIA B300 (HGX B300)",
        memory_bytes=275040 * MIB,  # [SMI]; [DS-B300]: 288 GB (2.3 TB / 8)
        mem_bandwidth_bytes_per_s=8.0 * TB,  # [DS-B300]
        dense_flops_per_s=2250 * TFLOPS,  # [DS-B300] 36 PFLOPS sparse / 8 / 2
        fp32_flops_per_s=75 * TFLOPS,  # [DS-FP32]: FP32, no tensor cores
        fp8_flops_per_s=4500 * TFLOPS,  # [DS-B300] 72 / 8 / 2
        fp4_flops_per_s=13125 * TFLOPS,  # [DS-B300] 105 PFLOPS dense / 8
        intra_node_link="NVLink 5",
        intra_node_bandwidth_bytes_per_s=NVLINK5_BANDWIDTH,
        network_bandwidth_bytes_per_s=100 * GB,  # [NIC] ConnectX-8 800 Gb/s
        memory_efficiency=0.80,  # ASSUMED: B200's
        compute_efficiency=0.79,  # [MAMF] 1,769.0 / 2,250
        fp8_compute_efficiency=0.75,  # [MAMF] 3,353.3 / 4,500
        link_efficiency=0.84,  # ASSUMED: B200's
        allreduce_latency_s=4.5 * US,  # [AIC-AR] b300_sxm
        allreduce_bandwidth_bytes_per_s=225 * GB,
        usd_per_hour=6.94,
        price_source="[PRICE] RunPod Community Cloud on-demand, 2026-08-19",
    ),
    _gpu(
        id="gb200",
        name="NVIDIA GB200 NVL72 (per GPU)",
        memory_bytes=189471 * MIB,  # [SMI]; [DS-GB200] [MLPERF-GB200]: 186 GB
        mem_bandwidth_bytes_per_s=8.0 * TB,  # [DS-GB200] 576 TB/s / 72
        dense_flops_per_s=2500 * TFLOPS,  # [DS-GB200] 360 PFLOPS sparse / 72 / 2
        fp32_flops_per_s=5760 / 72 * TFLOPS,  # [DS-GB200] FP32 5,760 TFLOPS per 72 GPUs
        fp8_flops_per_s=5000 * TFLOPS,  # [DS-GB200] 720 / 72 / 2
        fp4_flops_per_s=10000 * TFLOPS,  # [DS-GB200] 1,440 / 72 / 2
        # One NVLink domain of 72 GPUs over 18 compute trays of 4 [DS-GB200] [MLPERF-GB200].
        intra_node_link="NVLink 5 (NVL72)",
        intra_node_bandwidth_bytes_per_s=NVLINK5_BANDWIDTH,
        gpus_per_node=4,
        nvlink_domain_gpus=72,
        network_bandwidth_bytes_per_s=50 * GB,  # [NIC] ConnectX-7 400 Gb/s
        memory_efficiency=0.80,  # ASSUMED: B200's
        compute_efficiency=0.73,  # [MAMF] 1,822.0 / 2,500
        fp8_compute_efficiency=0.72,  # [MAMF] 3,615.6 / 5,000
        fp4_compute_efficiency=0.76,  # [AZ-GB200] 7,627.6 / 10,000
        link_efficiency=0.84,  # ASSUMED: B200's
        allreduce_latency_s=4.1 * US,  # [AIC-AR] gb200
        allreduce_bandwidth_bytes_per_s=330 * GB,
        usd_per_hour=4.54,
        price_source="other basis: Spheron on-demand GB200 superchip $9.08 / 2 GPUs, "
        "2026-03-17 (not on RunPod's list)",
    ),
    _gpu(
        id="gb300",
        name="NVIDIA GB300 NVL72 (per GPU)",
        memory_bytes=284208 * MIB,  # [SMI]; [DS-GB300]: 288 GB
        mem_bandwidth_bytes_per_s=8.0 * TB,  # [DS-GB300] 576 TB/s / 72
        dense_flops_per_s=2500 * TFLOPS,  # [DS-GB300] 360 PFLOPS sparse / 72 / 2
        fp32_flops_per_s=6000 / 72 * TFLOPS,  # [DS-GB300] FP32 6 PFLOPS per 72 GPUs
        fp8_flops_per_s=5000 * TFLOPS,  # [DS-GB300] 720 / 72 / 2
        fp4_flops_per_s=15000 * TFLOPS,  # [DS-GB300] 1,080 PFLOPS dense / 72
        intra_node_link="NVLink 5 (NVL72)",
        intra_node_bandwidth_bytes_per_s=NVLINK5_BANDWIDTH,
        gpus_per_node=4,  # [DS-GB300] 18 compute trays of 4
        nvlink_domain_gpus=72,
        network_bandwidth_bytes_per_s=100 * GB,  # [NIC] ConnectX-8 800 Gb/s
        memory_efficiency=0.80,  # ASSUMED: B200's
        compute_efficiency=0.73,  # ASSUMED: GB200's [MAMF] (same 2.5 PFLOPS BF16 peak)
        link_efficiency=0.84,  # ASSUMED: B200's
        allreduce_latency_s=4.0 * US,  # [AIC-AR] gb300
        allreduce_bandwidth_bytes_per_s=377 * GB,
        price_source="no public on-demand list price (CoreWeave, Nebius: contact sales); "
        "give usd_per_hour in a --hardware file",
    ),
    _gpu(
        id="mi300x",
        name="AMD Instinct MI300X 192GB",
        memory_bytes=206141652992,  # [SMI] (rocm-smi, in bytes)
        mem_bandwidth_bytes_per_s=5.3 * TB,  # [DS-MI300X]
        dense_flops_per_s=1307.4 * TFLOPS,
        fp32_flops_per_s=163.4 * TFLOPS,  # [DS-MI300X]: FP32, no tensor cores
        fp8_flops_per_s=2614.9 * TFLOPS,  # [DS-MI300X] 5,229.8 sparse
        # 7 xGMI links x 64 GB/s per direction.
        intra_node_link="Infinity Fabric (xGMI)",
        intra_node_bandwidth_bytes_per_s=448 * GB,
        network_bandwidth_bytes_per_s=50 * GB,  # ASSUMED 400 Gb/s
        memory_efficiency=0.77,
        compute_efficiency=0.51,  # [BABEL] [MAMF]
        link_efficiency=0.80,
        usd_per_hour=2.59,
        price_source="other basis: DigitalOcean on-demand, 2026-10-07 (not on RunPod's list)",
        side_streams=False,  # ROCm: shared experts run inline ([SHARED-STREAM] in fixed_costs)
    ),
)
