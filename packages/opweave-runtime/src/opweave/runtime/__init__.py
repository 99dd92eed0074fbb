"""OpWeave runtime: the decode operators of a model, stages built from them, and plan execution.

A model's decode is a fixed sequence of operators (:func:`operator_sequence`, the cost model's
order); a plan cuts it into contiguous stages (:class:`StageModule`) that each load only their
own weights (under tensor parallelism, only their shard) and pass a :class:`TokenBatch` on,
packed into one tensor (:func:`pack` / :func:`unpack`) at a cut. :class:`LocalModel` runs every
operator in one process with continuous batching and is the token-exact reference.

A plan runs on one process per rank (:class:`Cluster`), configured by one :class:`RunOptions`
that every rank receives: the same stage-worker program under one driver (:class:`StepDriver`),
fed by offline generation (:func:`run_plan`) or by vLLM's engine (:mod:`opweave.runtime.vllm`).
Operators run the kernels a :class:`KernelSet` picks for their device and dtype.
"""

from ._private.batch import BatchMeta, TokenBatch, pack, unpack
from ._private.cluster import Cluster
from ._private.decode import StaticStep
from ._private.driver import OfflineDriver, Request, run_plan
from ._private.engine import Generation, LocalModel
from ._private.graph import (
    OpRef,
    build_operator,
    check_runtime_support,
    layer_operator_names,
    model_spec,
    operator_sequence,
)
from ._private.kernels import KernelSet, register_kernels
from ._private.launch import node_layout
from ._private.nodes import Topology, layout_from_file, run_node, run_torchrun_rank, torchrun_env
from ._private.ops import Operator, StatefulOperator
from ._private.options import (
    DecodeStep,
    FaultInjection,
    Kernels,
    RunOptions,
    Wait,
    resolve_device_name,
)
from ._private.placement import Placement, check_plan, plan_model, total_ranks
from ._private.quant import QuantisedSlice, dequantise, register_weight_kernel, weight_formats
from ._private.reaper import Reaper
from ._private.results import (
    RUN_RESULT_SCHEMA_VERSION,
    DriverStats,
    Output,
    PoolTransfer,
    RankStats,
    RunResult,
)
from ._private.schedule import compile_schedule
from ._private.stage import StageModule
from ._private.stepping import StepDriver, StepItem
from ._private.tensor_parallel import Shard
from ._private.tiny import TINY_CONFIGS, write_tiny_model
from ._private.weights import Checkpoint, TensorSource, check_weights
from ._private.work import SamplingParams, Work
from .errors import (
    CheckpointError,
    OpWeaveRuntimeError,
    PlanMismatchError,
    RequestStateError,
    RunFailedError,
    ShardingError,
    UnsupportedModelError,
)

__all__ = [
    "Reaper",
    # model description (the cost model's ModelSpec)
    "model_spec",
    "check_runtime_support",
    "OpRef",
    "operator_sequence",
    "layer_operator_names",
    # operators and stages
    "Operator",
    "StatefulOperator",
    "Checkpoint",
    "TensorSource",
    "Shard",
    "build_operator",
    "KernelSet",
    "register_kernels",
    "register_weight_kernel",
    "weight_formats",
    "QuantisedSlice",
    "dequantise",
    "StageModule",
    "StaticStep",
    # activations between operators
    "BatchMeta",
    "TokenBatch",
    "pack",
    "unpack",
    # single-process execution
    "LocalModel",
    "Generation",
    # how a run is configured
    "RunOptions",
    "DecodeStep",
    "Kernels",
    "Wait",
    "FaultInjection",
    "Topology",
    # a plan on processes
    "Cluster",
    "StepDriver",
    "StepItem",
    "Work",
    "SamplingParams",
    "node_layout",
    "layout_from_file",
    "run_node",
    "run_torchrun_rank",
    "torchrun_env",
    "resolve_device_name",
    "Placement",
    "check_plan",
    "plan_model",
    "check_weights",
    "total_ranks",
    "compile_schedule",
    # offline generation
    "OfflineDriver",
    "Request",
    "run_plan",
    "RunResult",
    "RankStats",
    "DriverStats",
    "Output",
    "PoolTransfer",
    "RUN_RESULT_SCHEMA_VERSION",
    # test models
    "TINY_CONFIGS",
    "write_tiny_model",
    # errors
    "OpWeaveRuntimeError",
    "UnsupportedModelError",
    "CheckpointError",
    "RequestStateError",
    "PlanMismatchError",
    "ShardingError",
    "RunFailedError",
]
