"""opweave.costmodel: schemas, catalogs and the analytical cost model of OpWeave.

Import this from any scheduler: it depends on pydantic and numpy only.

>>> from opweave.costmodel import load_model, default_catalog, estimate_step
>>> spec = load_model("qwen3-32b")
>>> est = estimate_step(spec, default_catalog().get("h100"), tp=2, batch=16, context=4096)
>>> est.fits
True
"""

from __future__ import annotations

from functools import lru_cache

from ._private.analysis import (
    Analysis,
    CadFeasibility,
    GpuAnalysis,
    HeterogeneousAnalysis,
    analyze,
)
from ._private.architecture import FULL as FULL_ATTENTION
from ._private.architecture import LINEAR as LINEAR_ATTENTION
from ._private.architecture import SLIDING as SLIDING_ATTENTION
from ._private.architecture import (
    Architecture,
    ExpertsSpec,
    LinearAttentionSpec,
    MLASpec,
    RopeSpec,
    resolve_architecture,
)
from ._private.blocks import partition_block
from ._private.engine_step import EngineStepCost, causal_pairs
from ._private.estimate import StepEstimate, estimate_step
from ._private.expert_comm import (
    alltoall_bytes_per_gpu,
    alltoall_s,
    dispatch_bytes_per_token,
    expert_load_imbalance,
    gather_scatter_s,
    max_expert_load_imbalance,
)
from ._private.families import model_spec_from_config
from ._private.fit import (
    EfficiencyFit,
    fit_efficiency,
    fit_efficiency_report,
    profile_operators,
    synthesize_profile,
)
from ._private.fixed_costs import without_fixed_costs
from ._private.formulas import (
    boundary_transfer_s,
    fan_out_s,
    intra_node_link,
    link_time_s,
    max_resident_batch,
    pod_gpus,
    replica_counts,
    usd_per_hour_per_request,
    usd_per_million_tokens,
)
from ._private.gpu_catalog import BUILTIN_GPUS
from ._private.hardware import (
    HARDWARE_SCHEMA_VERSION,
    HardwareCatalog,
    HardwareSpec,
    load_hardware_file,
)
from ._private.host import HOST_PROFILES, HostProfile, engine_host, host_profile
from ._private.model import (
    AttentionKind,
    LayerSpec,
    LinearShape,
    ModelSpec,
    MoESpec,
    OpClass,
    OperatorName,
    OperatorSpec,
    PartitionBlock,
    TPCollective,
)
from ._private.models import BUILTIN_MODELS, load_model, read_config
from ._private.nodes import (
    Node,
    copies_in_inventory,
    fits_inventory,
    inventory_nodes,
    node_layout,
    plan_groups,
    plan_nodes,
)
from ._private.parallelism import (
    BALANCED_BASIS,
    GROUP_GPUS,
    MAX_GROUP_GPUS,
    Parallelism,
    dp_batch,
    is_group_op,
    max_replica_batch,
    memory_bytes_per_gpu,
    parallel_op_latency_s,
    parallel_op_terms_s,
    parallelism_problem,
    request_bytes_per_gpu,
    weight_bytes_per_gpu,
    weight_share,
)
from ._private.plan import (
    MAX_MICROBATCHES,
    PLAN_SCHEMA_VERSION,
    TP_DEGREES,
    Owner,
    Plan,
    PlanModel,
    Prediction,
    PrefillPool,
    Segment,
    StageTemplate,
    afd_template,
    cad_template,
    canonical_plan,
    check_template,
    colocated_template,
    hardware_drift,
    plan_model,
    planned_catalog,
    segments,
)
from ._private.precision import (
    GPU_ARCH,
    KV_CACHE_CHOICES,
    QUANT_CHOICES,
    WEIGHT_FORMATS,
    GemmRate,
    Precision,
    QuantRule,
    WeightScheme,
    check_runs,
    gemm_rate,
    module_matches,
)
from ._private.profile import (
    MAX_STALL_OVERHEAD,
    PROFILE_SCHEMA_VERSION,
    CollectiveTable,
    IdleSlowdown,
    LatencyModel,
    OpLatencyTable,
    OrchestrationProfile,
    Profile,
    Provenance,
    TransferProfile,
    profile_key,
)
from ._private.quant_config import resolve_precision
from ._private.quantize import gemm_flops_per_s, tp_split, weight_only
from ._private.registry import SUPPORTED_FAMILIES, family_defaults, text_config
from ._private.roofline import (
    ProfiledLatency,
    RooflineLatency,
    bytes_moved_per_rank,
    max_batch,
    memory_bytes_per_rank,
    shard_fraction,
    state_bytes_per_rank,
    state_shard_fraction,
    weight_bytes_per_rank,
)
from ._private.serving import (
    DecodePoolEstimate,
    PrefillEngine,
    PrefillPoolEstimate,
    ServingEstimate,
    decode_handoff_s,
    decode_pool,
    decode_samples_first,
    decode_slot_steps,
    estimate_serving,
    kv_bytes_per_gpu,
    kv_transfer_s,
    prefill_pool,
)
from ._private.serving_sim import EngineSetup, SimResult, simulate
from ._private.sharding import tp_problem
from ._private.workload import (
    ENGINES,
    CacheBudget,
    Engine,
    GraphBatches,
    Lengths,
    Workload,
    default_batch_limits,
    load_workload_file,
    parse_engine,
    sglang_graph_max_bs,
    sglang_mem_fraction,
)
from .errors import (
    ConfigError,
    InfeasibleError,
    OpWeaveError,
    UnknownGPUError,
    UnknownModelError,
    UnsupportedModelError,
    UnsupportedPrecisionError,
)


@lru_cache(maxsize=1)
def default_catalog() -> HardwareCatalog:
    """The built-in GPU catalog."""
    return HardwareCatalog(BUILTIN_GPUS)


__all__ = [
    # models
    "BUILTIN_MODELS",
    "SUPPORTED_FAMILIES",
    "Architecture",
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "LINEAR_ATTENTION",
    "ExpertsSpec",
    "LinearAttentionSpec",
    "MLASpec",
    "RopeSpec",
    "resolve_architecture",
    "tp_problem",
    "AttentionKind",
    "LayerSpec",
    "ModelSpec",
    "MoESpec",
    "OpClass",
    "OperatorName",
    "LinearShape",
    "OperatorSpec",
    "PartitionBlock",
    "TPCollective",
    "family_defaults",
    "load_model",
    "model_spec_from_config",
    "text_config",
    "partition_block",
    "read_config",
    # precision: weight formats, KV-cache dtype, GEMM rates
    "KV_CACHE_CHOICES",
    "QUANT_CHOICES",
    "WEIGHT_FORMATS",
    "GemmRate",
    "Precision",
    "QuantRule",
    "WeightScheme",
    "check_runs",
    "gemm_flops_per_s",
    "tp_split",
    "weight_only",
    "gemm_rate",
    "GPU_ARCH",
    "module_matches",
    "resolve_precision",
    # hardware
    "BUILTIN_GPUS",
    "HARDWARE_SCHEMA_VERSION",
    "HardwareCatalog",
    "HardwareSpec",
    "default_catalog",
    "load_hardware_file",
    "without_fixed_costs",
    # serving engines' host time per step
    "HOST_PROFILES",
    "HostProfile",
    "engine_host",
    "host_profile",
    # profiles and latency
    "PROFILE_SCHEMA_VERSION",
    "IdleSlowdown",
    "LatencyModel",
    "CollectiveTable",
    "OpLatencyTable",
    "OrchestrationProfile",
    "ProfiledLatency",
    "Profile",
    "MAX_STALL_OVERHEAD",
    "Provenance",
    "RooflineLatency",
    "TransferProfile",
    "profile_key",
    "profile_operators",
    # fitting and synthesising profiles
    "EfficiencyFit",
    "fit_efficiency",
    "fit_efficiency_report",
    "synthesize_profile",
    # plans
    "MAX_MICROBATCHES",
    "PLAN_SCHEMA_VERSION",
    "TP_DEGREES",
    "Owner",
    "Plan",
    "PlanModel",
    "PrefillPool",
    "Prediction",
    "Segment",
    "StageTemplate",
    "afd_template",
    "cad_template",
    "canonical_plan",
    "check_template",
    "colocated_template",
    "hardware_drift",
    "plan_model",
    "planned_catalog",
    "segments",
    # deployment: nodes and inventories
    "Node",
    "copies_in_inventory",
    "fits_inventory",
    "inventory_nodes",
    "node_layout",
    "plan_groups",
    "plan_nodes",
    # owner parallelism (TP, EP, DP) and expert-parallel communication
    "BALANCED_BASIS",
    "GROUP_GPUS",
    "MAX_GROUP_GPUS",
    "Parallelism",
    "alltoall_bytes_per_gpu",
    "alltoall_s",
    "dispatch_bytes_per_token",
    "dp_batch",
    "expert_load_imbalance",
    "max_expert_load_imbalance",
    "gather_scatter_s",
    "is_group_op",
    "max_replica_batch",
    "memory_bytes_per_gpu",
    "parallel_op_latency_s",
    "parallel_op_terms_s",
    "parallelism_problem",
    "request_bytes_per_gpu",
    "weight_bytes_per_gpu",
    # analysis (paper §3)
    "Analysis",
    "CadFeasibility",
    "GpuAnalysis",
    "HeterogeneousAnalysis",
    "analyze",
    # serving formulas (one rule each, numpy, broadcasting)
    "boundary_transfer_s",
    "bytes_moved_per_rank",
    "fan_out_s",
    "intra_node_link",
    "link_time_s",
    "max_resident_batch",
    "pod_gpus",
    "replica_counts",
    "usd_per_hour_per_request",
    "usd_per_million_tokens",
    # roofline and estimates
    "StepEstimate",
    "estimate_step",
    "max_batch",
    "memory_bytes_per_rank",
    "shard_fraction",
    "state_shard_fraction",
    "state_bytes_per_rank",
    "weight_bytes_per_rank",
    "weight_share",
    # serving: workloads, prefill, aggregated engines and P/D pools
    "DecodePoolEstimate",
    "EngineSetup",
    "EngineStepCost",
    "Lengths",
    "PrefillEngine",
    "PrefillPoolEstimate",
    "ServingEstimate",
    "SimResult",
    "Workload",
    "load_workload_file",
    "causal_pairs",
    "decode_handoff_s",
    "decode_pool",
    "decode_samples_first",
    "decode_slot_steps",
    "ENGINES",
    "Engine",
    "default_batch_limits",
    "parse_engine",
    "CacheBudget",
    "GraphBatches",
    "sglang_mem_fraction",
    "sglang_graph_max_bs",
    "estimate_serving",
    "kv_bytes_per_gpu",
    "kv_transfer_s",
    "prefill_pool",
    "simulate",
    # errors
    "ConfigError",
    "InfeasibleError",
    "OpWeaveError",
    "UnknownGPUError",
    "UnknownModelError",
    "UnsupportedModelError",
    "UnsupportedPrecisionError",
]
