"""Profile schema: operator and transfer latencies of one device type, and their lookup.

A profile is measured by the profiler or synthesised from the roofline; either way the planner
sees the same :class:`LatencyModel` interface. Lookups interpolate log-log between grid points
and extrapolate linearly in batch and context from the last two points.
"""

from __future__ import annotations

import math
from datetime import date
from typing import Literal, Protocol

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..errors import ConfigError
from .architecture import _DTYPES
from .base import FileSchema, schema_version_field
from .hardware import HardwareSpec
from .model import LayerSpec, ModelSpec, OperatorSpec
from .precision import UNQUANTISED

PROFILE_SCHEMA_VERSION = 1
_MAX_GRID = 1 << 31  # largest batch or context a table may hold
LinkKind = Literal["intra_node", "network"]


def profile_key(op: OperatorSpec, layer: LayerSpec | None) -> str:
    """Name of a distinct operator: layers of one attention kind share weights' shapes."""
    return op.name if layer is None else f"{op.name}@{layer.attention.value}"


# A measured latency lies between a GPU clock cycle (about a nanosecond) and an hour; outside,
# a table is corrupt and would yield absurd throughputs.
_LATENCY_RANGE = "latencies must be seconds from 1e-9 (a nanosecond) to 3600 (an hour)"


def _plausible(seconds: float) -> bool:
    return bool(np.isfinite(seconds)) and 1e-9 <= seconds <= 3600.0


class OpLatencyTable(FileSchema):
    """Median latency of one operator at one TP degree over a batch x context grid."""

    op: str = Field(description="profile_key, e.g. 'core_attn@full' or 'lm_head'.")
    tp: int = Field(default=1, ge=1, le=64)
    batches: tuple[int, ...] = Field(min_length=1)
    contexts: tuple[int, ...] = Field(min_length=1)
    latency_s: tuple[tuple[float, ...], ...] = Field(description="[batch][context] medians.")
    spread_s: tuple[tuple[float, ...], ...] | None = Field(
        default=None, description="[batch][context] interquartile range of the repeats."
    )
    source: str | None = Field(
        default=None,
        description="Where this table's latencies come from, when not what the profile's "
        "provenance says of all of them (an imported profile: the database table, or the "
        "roofline, and how many cells were measured, interpolated or extrapolated).",
    )

    @model_validator(mode="after")
    def _shape(self) -> OpLatencyTable:
        if list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ValueError("batches must be distinct, increasing and >= 1")
        if list(self.contexts) != sorted(set(self.contexts)) or self.contexts[0] < 1:
            raise ValueError("contexts must be distinct, increasing and >= 1")
        if self.batches[-1] > _MAX_GRID or self.contexts[-1] > _MAX_GRID:
            raise ValueError(f"batches and contexts must be at most {_MAX_GRID}")
        if len(self.latency_s) != len(self.batches) or any(
            len(row) != len(self.contexts) for row in self.latency_s
        ):
            raise ValueError("latency_s must be a [batch][context] table")
        if any(not _plausible(v) for row in self.latency_s for v in row):
            raise ValueError(_LATENCY_RANGE)
        return self

    def __call__(self, batch: float, context: float) -> float:
        table = np.log(np.asarray(self.latency_s, dtype=np.float64))
        per_context = np.array([_interp_log(self.batches, row, batch) for row in table.T])
        return float(np.exp(_interp_log(self.contexts, per_context, context)))


def _interp_log(xs: tuple[int, ...], log_ys: np.ndarray, x: float) -> float:
    """Interpolate log(y) in log(x); beyond the grid, extrapolate from the last two points."""
    if len(xs) == 1:
        return float(log_ys[0])
    lx = np.log(np.asarray(xs, dtype=np.float64))
    t = np.log(max(float(x), 1e-9))
    if t <= lx[0]:
        i = 0
    elif t >= lx[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(t, lx, log_ys))
    slope = (log_ys[i + 1] - log_ys[i]) / (lx[i + 1] - lx[i])
    if t <= lx[0]:
        slope = min(max(slope, 0.0), 1.0)  # never faster than flat, never superlinear
        return float(log_ys[0] + slope * (t - lx[0]))
    return float(log_ys[-1] + max(slope, 0.0) * (t - lx[-1]))


# the collectives a TP group runs after an operator (``TPCollective``: row-parallel linears
# all-reduce, a vocabulary-parallel head all-gathers its logits)
CollectiveKind = Literal["allreduce", "allgather"]


class CollectiveTable(FileSchema):
    """Latency of one tensor-parallel collective over ``gpus`` GPUs by message size.

    An imported profile carries the database's measured all-reduce and all-gather; a lookup
    interpolates log-log between message sizes and extrapolates as :class:`OpLatencyTable` does.
    An all-gather's message is what every GPU ends up holding (the gathered tensor), as NCCL's
    tests count it.
    """

    kind: CollectiveKind
    gpus: int = Field(ge=2, le=1024)
    message_bytes: tuple[int, ...] = Field(min_length=1, description="Payload per GPU.")
    latency_s: tuple[float, ...] = Field(min_length=1)
    source: str = Field(default="", description="Where the latencies come from.")

    @model_validator(mode="after")
    def _shape(self) -> CollectiveTable:
        sizes = list(self.message_bytes)
        if sizes != sorted(set(sizes)) or sizes[0] < 1 or sizes[-1] > 1 << 50:
            raise ValueError("message_bytes must be distinct, increasing, from 1 to 2^50")
        if len(self.latency_s) != len(sizes):
            raise ValueError("latency_s must give one latency per message size")
        if any(not _plausible(v) for v in self.latency_s):
            raise ValueError(_LATENCY_RANGE)
        return self

    def __call__(self, num_bytes: float) -> float:
        logs = np.log(np.asarray(self.latency_s, dtype=np.float64))
        return float(np.exp(_interp_log(self.message_bytes, logs, num_bytes)))


class TransferProfile(FileSchema):
    """Point-to-point transfer: ``latency_s + bytes / bandwidth_bytes_per_s`` on the link.

    ``host_send_s`` / ``host_recv_s`` are what one message costs the sending / receiving rank's
    *compute stream* on top of that. They are zero where a copy engine or a communication kernel
    moves the bytes alongside compute (GPUs); they are not where the rank's one thread packs,
    posts, waits for and unpacks every message and the transport's I/O threads compete with it
    for cores (CPU ranks). The profiler measures them while both ranks compute.
    """

    link: LinkKind
    latency_s: float = Field(ge=0)
    bandwidth_bytes_per_s: float = Field(gt=0)
    host_send_s: float = Field(
        default=0.0, ge=0, description="Compute-stream time a message costs its sender."
    )
    host_recv_s: float = Field(
        default=0.0, ge=0, description="Compute-stream time a message costs its receiver."
    )


class OrchestrationProfile(FileSchema):
    """Host time a rank's loop spends around the operators, beside transfers (CPU ranks).

    The runtime's ranks run a compiled schedule in Python: per stage and microbatch a rank
    takes its input, admits new requests and drops finished ones, routes the output by slot and
    posts it (``stage_s``); the driver on rank 0, per microbatch, collects the sampled tokens,
    retires and admits requests and builds the next batch (``drive_s``). Each is affine in the
    requests it handles. The planner charges them to the compute stream of the rank that does
    them. The profiler measures them from the runtime's own loop on CPU; they are zero where
    none was measured.
    """

    stage_s: float = Field(default=0.0, ge=0, description="Per stage and microbatch.")
    stage_per_request_s: float = Field(default=0.0, ge=0, description="... and per request.")
    drive_s: float = Field(default=0.0, ge=0, description="Driver, per microbatch.")
    drive_per_request_s: float = Field(default=0.0, ge=0, description="... and per request.")

    def stage(self, requests: float) -> float:
        """One stage's loop work for a microbatch of ``requests``."""
        return self.stage_s + self.stage_per_request_s * requests

    def drive(self, requests: float) -> float:
        """The driver's work for a microbatch of ``requests`` (all replicas' slots)."""
        return self.drive_s + self.drive_per_request_s * requests


NO_ORCHESTRATION = OrchestrationProfile()


class IdleSlowdown(FileSchema):
    """Operators run slower after their rank sat idle: its caches went cold meanwhile.

    A rank that waits for a message leaves its weights and state in caches that other work
    (other processes, other tenants of a VM's host) evicts. An operator that touches ``bytes``
    the rank last touched ``idle_s`` seconds of idling ago takes
    ``extra_s(bytes, idle_s) = bytes * s_per_byte * (1 - exp(-idle_s / time_constant_s))``
    longer than the profile says (it times operators back to back, hot), ``bytes`` counted up
    to ``max_bytes`` (what the profiler measured with: beyond the caches, data is cold whether
    the rank waited or not). The profiler measures it on CPU, where the profiled working set
    fits in the caches; where none was measured there is no slowdown.
    """

    s_per_byte: float = Field(ge=0, description="Extra seconds per byte after a long idle.")
    time_constant_s: float = Field(gt=0, description="Idle time over which caches go cold.")
    max_bytes: float | None = Field(
        default=None,
        gt=0,
        description="Bytes measured (the probe); an operator run is charged for at most these.",
    )

    def extra_s(self, num_bytes: float, idle_s: float) -> float:
        cold = num_bytes if self.max_bytes is None else min(num_bytes, self.max_bytes)
        return cold * self.s_per_byte * -math.expm1(-max(idle_s, 0.0) / self.time_constant_s)


# A profile's stall overhead beyond which its timings measured the machine's stalls, not the
# operators (a mean of 11 times the median).
MAX_STALL_OVERHEAD = 10.0


class Provenance(FileSchema):
    source: Literal["measured", "roofline", "aiconfigurator"] = Field(
        description="measured: the profiler timed the runtime's operators; roofline: "
        "synthesised; aiconfigurator: imported from NVIDIA's silicon database (each table's "
        "`source` says which of its cells the database covers)."
    )
    device_name: str
    date: str = Field(default_factory=lambda: date.today().isoformat())
    versions: dict[str, str] = Field(default_factory=dict)
    settings: dict[str, str | int | float | list[int] | list[str]] = Field(default_factory=dict)
    note: str = ""


class Profile(FileSchema):
    """Latencies of one device type for the operators of one model.

    The tables hold medians, robust for interpolating a grid, but a decode iteration takes the
    sum of its operators' *mean* times, which stalls (a shared VM's preemptions, interrupts)
    pull above the medians; ``stall_overhead`` (measured pooled over every timed call) puts
    them back: every operator latency looked up is ``median * (1 + stall_overhead)``.
    """

    schema_version: Literal[1] = PROFILE_SCHEMA_VERSION
    _schema_version = schema_version_field(PROFILE_SCHEMA_VERSION)
    device: HardwareSpec
    model: str
    config_sha256: str
    dtype: str
    ops: tuple[OpLatencyTable, ...]
    transfers: tuple[TransferProfile, ...] = ()
    collectives: tuple[CollectiveTable, ...] = Field(
        default=(),
        description="Measured TP collectives (an imported profile's all-reduce and "
        "all-gather); the cost model's collective terms stand in for any not given.",
    )
    orchestration: OrchestrationProfile | None = Field(
        default=None, description="The runtime loop's host time per stage and per microbatch."
    )
    idle_slowdown: IdleSlowdown | None = Field(
        default=None, description="How much slower operators run after their rank idled."
    )
    stall_overhead: float = Field(
        default=0.0,
        ge=0,
        le=MAX_STALL_OVERHEAD,
        description="The mean of timed operator calls over their median, less one: what stalls "
        "add to the tables' medians in expectation (operator latencies are scaled by 1 + this). "
        "At most 10: calls whose mean is 11 times their median measured no steady latency.",
    )
    provenance: Provenance

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, dtype: str) -> str:
        if dtype not in _DTYPES:
            raise ValueError(f"{dtype!r} is not a model dtype; one of {', '.join(_DTYPES)}")
        return dtype

    @model_validator(mode="after")
    def _distinct(self) -> Profile:
        # lookups take the first match: a repeated table or link would be silently ignored
        seen: set[tuple[str, int]] = set()
        for t in self.ops:
            if (t.op, t.tp) in seen:
                raise ValueError(f"ops: two tables for {t.op} at tp={t.tp}")
            seen.add((t.op, t.tp))
        groups = [(c.kind, c.gpus) for c in self.collectives]
        if len(set(groups)) < len(groups):
            raise ValueError("collectives: two tables for one kind and GPU count")
        links = [t.link for t in self.transfers]
        if len(set(links)) < len(links):
            raise ValueError("transfers: a link kind is given twice")
        return self

    def config_problem(self, model: ModelSpec) -> str | None:
        """Why this profile cannot price ``model``, to follow "profile for DEVICE" in a message;
        None when it was measured on ``model``'s config. Where the names match but the configs
        do not, it says what differs that the profile records (dtype, operators, the
        precision's part of the fingerprint), or else that the fingerprints differ."""
        if self.config_sha256 == model.config_sha256:
            if self.dtype == model.dtype:
                return None
            return (
                f"was measured in {self.dtype}, and {model.name} is costed in {model.dtype} "
                f"({model.precision.source}); cost it in the profile's dtype (--quant "
                f"{UNQUANTISED.get(self.dtype, self.dtype)}), or use a profile measured in "
                f"{model.dtype}"
            )
        if self.model != model.name:
            return (
                f"was measured on model {self.model!r}, not {model.name!r}; profile "
                f"{model.name} (opweave profile --model), or use the model the profile was "
                "measured on"
            )
        differs = []
        if self.dtype != model.dtype:
            differs.append(f"dtype {self.dtype}, this config {model.dtype}")
        have = {t.op for t in self.ops}
        want = {profile_key(op, None) for op in (*model.pre_ops, *model.post_ops)}
        want |= {profile_key(op, layer) for layer in model.layers for op in layer.ops}
        if want - have:
            differs.append(f"no table for this config's {', '.join(sorted(want - have)[:3])}")
        if have - want:
            differs.append(f"tables for {', '.join(sorted(have - want)[:3])}, not in this config")
        precision = model.precision
        if not differs and (precision.quantized or precision.kv_fp8):
            differs.append(
                f"this config is served with {precision.quant} weights and a "
                f"{precision.kv_cache_dtype} KV cache, which its fingerprint includes: was the "
                "profile measured at another --quant or --kv-cache-dtype?"
            )
        if not differs:
            differs.append("a size, count or setting of the config differs")
        return (
            f"was measured on another config of {model.name} ({'; '.join(differs)}; config "
            f"fingerprint {self.config_sha256[:12]}, this config's {model.config_sha256[:12]}); "
            "profile this config (opweave profile --model), or use the config the profile was "
            "measured on"
        )

    def describe(self) -> str:
        """Where this profile's latencies come from, in words, for the line that tells a user
        an estimate or a plan rests on it rather than on the roofline."""
        prov = self.provenance
        if prov.source == "aiconfigurator":
            settings = prov.settings
            roofline = sum((t.source or "").startswith("roofline") for t in self.ops)
            return (
                f"imported from NVIDIA's silicon database ({settings.get('database', '?')}, "
                f"{settings.get('system', '?')}, {settings.get('engine', '?')} "
                f"{settings.get('engine_version', '?')}); {len(self.ops) - roofline} of "
                f"{len(self.ops)} operator tables from its kernels, the rest roofline"
                + "".join(
                    f"; {kind.replace('all', 'all-')} measured ({source})"
                    for kind, source in dict.fromkeys((c.kind, c.source) for c in self.collectives)
                )
            )
        how = "measured by opweave profile" if prov.source == "measured" else "synthesised"
        words = f"{how} on {prov.device_name} ({prov.date}), {len(self.ops)} operator tables"
        if not self.collectives and any(t.tp > 1 for t in self.ops):
            words += "; tensor-parallel collectives from the roofline"
        return words

    def table(self, key: str, tp: int) -> OpLatencyTable:
        for t in self.ops:
            if t.op == key and t.tp == tp:
                return t
        have = sorted({f"{t.op} (tp={t.tp})" for t in self.ops})
        raise ConfigError(
            f"profile for {self.device.id} has no latencies for {key} at tp={tp}; "
            f"it has {', '.join(have[:8])}{'...' if len(have) > 8 else ''}; "
            "re-profile with that --tp"
        )

    def collective(self, kind: CollectiveKind, gpus: int) -> CollectiveTable | None:
        return next((c for c in self.collectives if c.kind == kind and c.gpus == gpus), None)

    def transfer(self, link: LinkKind) -> TransferProfile | None:
        return next((t for t in self.transfers if t.link == link), None)


class LatencyModel(Protocol):
    """What the planner and ``estimate`` need from a device type: latencies in seconds."""

    hardware: HardwareSpec

    def op_latency_s(
        self,
        model: ModelSpec,
        op: OperatorSpec,
        layer: LayerSpec | None,
        tp: int,
        batch: float,
        context: float,
    ) -> float: ...

    def collective_s(self, op: OperatorSpec, tp: int, batch: float) -> float: ...

    def transfer_s(self, link: LinkKind, num_bytes: float) -> float: ...
