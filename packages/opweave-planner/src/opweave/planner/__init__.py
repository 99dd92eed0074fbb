"""opweave.planner: serving-plan search and schedule simulation for operator-level
disaggregated LLM decode (OpWeave paper §4-5, appendices B-C).

Give it a model, one or two GPU types, a context length and a TPOT SLO; it returns the plan of
lowest cost per token whose simulated steady-state TPOT meets the SLO, and the best colocated,
AFD and CAD plans for comparison. Plans follow the costmodel Plan schema, which the runtime
installs. Depends on opweave-costmodel and numpy only (matplotlib for Gantt charts, optional).
"""

from __future__ import annotations

from ._private.api import plan
from ._private.deployment import plan_deployment
from ._private.deployment_result import KINDS, Deployment, DeploymentResult, Fleet, Pool
from ._private.devices import Device, profile_device_id, resolve_devices
from ._private.evaluate import SimResult, simulate_plan
from ._private.gantt import gantt
from ._private.host import NO_HOST, Draft, HostModel, host_effects, host_time, with_cold_caches
from ._private.result import (
    PlanResult,
    describe_plan,
    parallelism_words,
    plan_summary,
    plan_title,
)
from ._private.search import SearchProgress, SearchStats
from ._private.simulator import (
    EventRun,
    Pipeline,
    TraceEvent,
    cycle_time,
    lower_bound,
    simulate_events,
)
from ._private.space import MICROBATCHES, PATTERNS, U_GRID, Candidate, candidate_templates

__all__ = [
    # planning
    "plan",
    "PlanResult",
    # whole deployments for a workload
    "plan_deployment",
    "KINDS",
    "Deployment",
    "DeploymentResult",
    "Fleet",
    "Pool",
    "SearchProgress",
    "SearchStats",
    "describe_plan",
    "plan_title",
    "parallelism_words",
    "plan_summary",
    # simulation
    "simulate_plan",
    "SimResult",
    "TraceEvent",
    "gantt",
    # schedule model
    "Pipeline",
    "EventRun",
    "cycle_time",
    "lower_bound",
    "simulate_events",
    # plan space
    "Candidate",
    "candidate_templates",
    "MICROBATCHES",
    "PATTERNS",
    "U_GRID",
    # devices
    "Device",
    "profile_device_id",
    "resolve_devices",
    # host-side effects (CPU ranks; none on GPUs)
    "HostModel",
    "NO_HOST",
    "Draft",
    "host_effects",
    "host_time",
    "with_cold_caches",
]
