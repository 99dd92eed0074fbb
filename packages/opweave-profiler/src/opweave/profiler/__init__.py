"""opweave.profiler: measure the OpWeave runtime's own operators and transport into profiles.

A profile (the cost model's :class:`~opweave.costmodel.Profile` schema) holds, for one device
type and one model, the median latency of every distinct decode operator over a batch x context
grid, plus point-to-point transfer latency and bandwidth and, on CPU, the serving loop's host
time per stage and per microbatch and how much slower operators run after their rank idled. The
operators timed are built by the runtime's own factory, so the planner's predictions and the
runtime's measurements describe the same code. Models need no weights: a config alone gives
random weights of the right shapes. :func:`import_profile` instead reads the operators' latencies
from NVIDIA's public silicon database (the ``aiconfigurator`` extra).

>>> from opweave.profiler import profile_model, save_profile          # doctest: +SKIP
>>> run = profile_model("gemma-3-27b", device="cuda")                 # doctest: +SKIP
>>> save_profile(run.profile, "gemma-3-27b.h200.json")                # doctest: +SKIP
"""

from ._private.aic_db import EXTRA as AICONFIGURATOR_EXTRA
from ._private.aic_db import TESTED_RANGE as AICONFIGURATOR_VERSIONS
from ._private.aic_db import Database, open_database
from ._private.aic_import import BATCHES as BATCHES_IMPORTED
from ._private.aic_import import ImportRun, import_profile
from ._private.device import CPU_PRICE_SOURCE, CPU_USD_PER_VCPU_HOUR, measure_peaks, resolve_device
from ._private.idle import IdleFit, fit_idle_slowdown, measure_idle_slowdown
from ._private.operators import ModelSource, OpTarget, resolve_model, select_targets
from ._private.orchestration import OrchestrationFit, measure_orchestration
from ._private.profile import (
    CPU_BATCHES,
    CPU_CONTEXTS,
    CUDA_BATCHES,
    CUDA_CONTEXTS,
    ProfileRun,
    default_grid,
    load_profile,
    profile_model,
    save_profile,
)
from ._private.random_weights import RandomCheckpoint, tensor_shapes
from ._private.timing import (
    Measurement,
    TimingSettings,
    make_timer,
    pinned_cpu,
    stall_overhead,
)
from ._private.transfer import TransferFit, fit_line, measure_transfer
from .errors import DeviceUnavailableError, ProfilerError

__all__ = [
    # profiling a model
    "ProfileRun",
    "profile_model",
    "default_grid",
    "CPU_BATCHES",
    "CPU_CONTEXTS",
    "CUDA_BATCHES",
    "CUDA_CONTEXTS",
    # profiles imported from NVIDIA's silicon database (aiconfigurator-core)
    "ImportRun",
    "import_profile",
    "BATCHES_IMPORTED",
    "Database",
    "open_database",
    "AICONFIGURATOR_EXTRA",
    "AICONFIGURATOR_VERSIONS",
    # profile files
    "load_profile",
    "save_profile",
    # operators and weights
    "ModelSource",
    "OpTarget",
    "resolve_model",
    "select_targets",
    "RandomCheckpoint",
    "tensor_shapes",
    # timing and devices
    "Measurement",
    "TimingSettings",
    "make_timer",
    "pinned_cpu",
    "stall_overhead",
    "resolve_device",
    "measure_peaks",
    "CPU_USD_PER_VCPU_HOUR",
    "CPU_PRICE_SOURCE",
    # transfers
    "TransferFit",
    "fit_line",
    "measure_transfer",
    # slowdown after idling
    "IdleFit",
    "fit_idle_slowdown",
    "measure_idle_slowdown",
    # the serving loop's host time
    "OrchestrationFit",
    "measure_orchestration",
    # errors
    "ProfilerError",
    "DeviceUnavailableError",
]
