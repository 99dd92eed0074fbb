"""Plan schema, stage templates and the canonical baselines (colocated, AFD, CAD).

A plan is what the planner writes and the runtime installs; the two meet only here.
A stage template cuts a partition block's operator sequence into contiguous stages and is tiled
over every block; stage positions map round-robin onto an ordered list of owners (paper §4, B.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..errors import ConfigError
from .base import FileSchema, schema_version_field
from .hardware import HardwareCatalog, HardwareSpec
from .model import ModelSpec, OpClass, OperatorSpec
from .parallelism import MAX_GROUP_GPUS, Parallelism
from .precision import WEIGHT_FORMATS, KvCacheDtype
from .registry import SUPPORTED_FAMILIES

PLAN_SCHEMA_VERSION = 1
# A TP group runs an all-reduce per layer and stays within a node; wider replicas add
# data-parallel ranks (and expert parallelism over them): parallelism.GROUP_GPUS.
TP_DEGREES = (1, 2, 4, 8)
# Bounds far beyond any deployment; past them a plan file is corrupt (and a count of 10^400
# would overflow the simulator's arithmetic).
MAX_REPLICAS = 1 << 16
MAX_GPUS = 1 << 16  # replicas x tp x dp over every owner
MAX_BATCH = 1 << 20
# microbatches overlap a token's stages on the owners; a handful does (the planner searches up to
# 4), and a simulated iteration's events grow with their count
MAX_MICROBATCHES = 64
MAX_CONTEXT = 1 << 31
Strategy = Literal["colocated", "afd", "cad", "opweave"]


class StageTemplate(FileSchema):
    """Cut points into the partition block's operator sequence.

    ``cuts`` are block-op indices where a stage begins. When the first cut is not 0, the last
    stage wraps around the block boundary (stages may span layers).
    """

    cuts: tuple[int, ...] = Field(min_length=1, max_length=1 << 16)

    @model_validator(mode="after")
    def _sorted(self) -> StageTemplate:
        if list(self.cuts) != sorted(set(self.cuts)) or self.cuts[0] < 0:
            raise ValueError("template cuts must be distinct, sorted and non-negative")
        return self

    @property
    def num_stages(self) -> int:
        return len(self.cuts)


class Owner(FileSchema):
    """A device-group type: GPU type x parallelism (TP, EP, DP), with its replicas.

    One replica spans ``tp x dp`` GPUs: ``dp`` data-parallel ranks of ``tp`` GPUs each run the
    owner's non-expert operators (attention with its own KV cache) on ``ceil(resident_batch /
    dp)`` requests each; routed experts are sharded over ``ep`` sets of GPUs (``ep`` divides
    ``tp x dp``; each expert tensor-parallel over the rest) and dense FFN layers span all
    ``tp x dp`` GPUs. ``ep = tp x dp`` is the wide-EP layout (all-to-all dispatch and combine).
    ``ep`` and ``dp`` default to 1: tensor parallelism only. Whether a model's operators split so
    (``opweave.costmodel.parallelism_problem``) is checked where the model is known.
    """

    gpu: str = Field(description="GPU id from the catalog, or a profiled device name.")
    tp: int = Field(description="Tensor-parallel degree of each DP rank (1, 2, 4 or 8).")
    ep: int = Field(
        default=1,
        ge=1,
        le=MAX_GROUP_GPUS,
        description="Expert-parallel degree: GPU sets the routed experts are sharded over; "
        "divides tp x dp (1: experts tensor-parallel over the whole replica).",
    )
    dp: int = Field(
        default=1,
        ge=1,
        le=MAX_GROUP_GPUS,
        description="Data-parallel attention ranks of one replica, each of tp GPUs with its "
        "own slice of the resident batch.",
    )
    replicas: int = Field(
        ge=1, le=MAX_REPLICAS, description="Replicas of this owner in the deployment."
    )
    resident_batch: int = Field(
        ge=1,
        le=MAX_BATCH,
        description="Requests each replica serves per iteration (split over its DP ranks).",
    )

    @model_validator(mode="after")
    def _tp(self) -> Owner:
        if self.tp not in TP_DEGREES:
            raise ValueError(f"tp must be one of {TP_DEGREES}, got {self.tp}")
        if self.tp * self.dp > MAX_GROUP_GPUS:
            raise ValueError(
                f"tp x dp = {self.tp * self.dp} GPUs per replica; at most {MAX_GROUP_GPUS}"
            )
        if (self.tp * self.dp) % self.ep:
            raise ValueError(f"ep {self.ep} must divide tp x dp = {self.tp * self.dp}")
        return self

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(tp=self.tp, ep=self.ep, dp=self.dp)

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.dp


class PlanModel(FileSchema):
    name: str = Field(
        min_length=1,
        max_length=200,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="The model's name (built-in, or its folder's): no control characters, "
        "since deployment scripts and logs print it.",
    )
    family: str = Field(min_length=1, max_length=100, pattern=r"^[a-z0-9_]+$")

    @field_validator("family")
    @classmethod
    def _known_family(cls, family: str) -> str:
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(f"{family!r} is not a supported family")
        return family

    num_layers: int = Field(ge=1)
    period_layers: int = Field(ge=1)
    prefix_layers: int = Field(
        default=0, ge=0, description="Irregular layers before the first block."
    )
    config_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="The config's digest.")
    quant: str = Field(
        default="bf16",
        max_length=100,
        pattern=r"^[a-z0-9-]+(\+[a-z0-9-]+)*$",
        description="Weight format the plan assumed, as --quant names it (bf16, fp16, fp32: "
        "unquantised).",
    )
    kv_cache_dtype: KvCacheDtype = Field(
        default="bf16", description="KV-cache dtype the plan assumed."
    )

    @field_validator("quant")
    @classmethod
    def _known_formats(cls, quant: str) -> str:
        parts = quant.split("+")
        unknown = [p for p in parts if p not in WEIGHT_FORMATS]
        if unknown:
            raise ValueError(
                f"{unknown[0]!r} is not a weight format; use {', '.join(WEIGHT_FORMATS)} (or "
                "several joined by +)"
            )
        if parts != sorted(set(parts)):
            raise ValueError(f"{quant!r}: join distinct formats in sorted order, as plan writes")
        return quant

    def config_problem(self, model: ModelSpec) -> str | None:
        """Why the plan this describes cannot run ``model``, to follow "plan" in a message; None
        when it was made for ``model``'s config. Where the names match but the configs do not,
        it names the recorded fields that differ, or else says the fingerprints differ."""
        if self.config_sha256 == model.config_sha256:
            ours = plan_model(model)
            edited = [
                f"{field} {getattr(self, field)}, the config's {getattr(ours, field)}"
                for field in ("family", "num_layers", "period_layers", "prefix_layers")
                if getattr(self, field) != getattr(ours, field)
            ]
            if not edited:
                return None
            return (
                f"records {'; '.join(edited)} beside this config's fingerprint: the file was "
                "edited; plan the model again"
            )
        if self.name != model.name:
            return (
                f"was made for model {self.name!r}, not {model.name!r}; pass the model the "
                "plan was made for, or plan this one"
            )
        ours = plan_model(model)
        differs = [
            f"{field} {getattr(self, field)}, this config {getattr(ours, field)}"
            for field in (
                "family",
                "num_layers",
                "period_layers",
                "prefix_layers",
                "quant",
                "kv_cache_dtype",
            )
            if getattr(self, field) != getattr(ours, field)
        ] or ["a size, count or setting of the config differs"]
        return (
            f"was made for another config of {model.name} ({'; '.join(differs)}; config "
            f"fingerprint {self.config_sha256[:12]}, this config's {model.config_sha256[:12]}); "
            "pass the config the plan was made for (and its --quant / --kv-cache-dtype), or "
            "plan this one"
        )

    @property
    def precision_options(self) -> dict[str, str | None]:
        """``load_model``'s ``quant`` and ``kv_cache_dtype`` that re-derive the model the plan
        was made for (the checkpoint's own format where it is a mix of several)."""
        return {
            "quant": self.quant if self.quant in WEIGHT_FORMATS else None,
            "kv_cache_dtype": "fp8" if self.kv_cache_dtype == "fp8" else "auto",
        }


class Prediction(FileSchema):
    tpot_s: float = Field(gt=0)
    usd_per_million_tokens: float | None = Field(default=None, ge=0)
    tokens_per_s_per_replica_set: float | None = Field(default=None, gt=0)
    stages_per_token: int = Field(ge=1)
    internode_bytes_per_token: float = Field(default=0.0, ge=0)
    compute_occupancy: float | None = Field(
        default=None, ge=0, le=1, description="Mean busy share of owners."
    )


class PrefillPool(FileSchema):
    """A P/D deployment's prefill pool beside the plan's decode owners: ``replicas`` engines
    of ``tp x dp`` GPUs that prefill every prompt and send its KV cache to the decode GPUs."""

    gpu: str = Field(description="GPU id of the prefill engines.")
    tp: int = Field(description="Tensor-parallel degree of each DP rank (1, 2, 4 or 8).")
    ep: int = Field(default=1, ge=1, le=MAX_GROUP_GPUS, description="Expert-parallel degree.")
    dp: int = Field(default=1, ge=1, le=MAX_GROUP_GPUS, description="Data-parallel ranks.")
    replicas: int = Field(ge=1, le=MAX_REPLICAS, description="Prefill engines.")

    @model_validator(mode="after")
    def _tp(self) -> PrefillPool:
        if self.tp not in TP_DEGREES:
            raise ValueError(f"tp must be one of {TP_DEGREES}, got {self.tp}")
        if (self.tp * self.dp) % self.ep:
            raise ValueError(f"ep {self.ep} must divide tp x dp = {self.tp * self.dp}")
        return self

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.replicas


class Plan(FileSchema):
    """A serving plan: template + owners + batching + microbatching + prediction; a P/D
    deployment's plan also names its prefill pool."""

    schema_version: Literal[1] = PLAN_SCHEMA_VERSION
    _schema_version = schema_version_field(PLAN_SCHEMA_VERSION)
    strategy: Strategy
    model: PlanModel
    context_tokens: int = Field(ge=1, le=MAX_CONTEXT)
    tpot_slo_s: float | None = Field(default=None, gt=0)
    template: StageTemplate
    owners: tuple[Owner, ...] = Field(min_length=1)
    microbatches: int = Field(ge=1, le=MAX_MICROBATCHES)
    prediction: Prediction | None = None
    profiles: tuple[str, ...] = Field(
        default=(), description="Provenance of the latency profiles used."
    )
    prefill: PrefillPool | None = Field(
        default=None,
        description="P/D: the prefill pool the decode owners take their requests' KV cache "
        "from; none: every decode replica prefills its own requests.",
    )
    hardware: tuple[HardwareSpec, ...] = Field(
        default=(),
        max_length=16,
        description="The owners' GPU types as the planner saw them (a built-in entry, a "
        "--hardware file's or a profile's device): re-simulating or deploying the plan uses "
        "these unless handed other specs.",
    )

    @model_validator(mode="after")
    def _hardware_of_owners(self) -> Plan:
        ids = [hw.id for hw in self.hardware]
        if len(set(ids)) != len(ids):
            raise ValueError("hardware lists a GPU type twice")
        used = {o.gpu for o in self.owners} | ({self.prefill.gpu} if self.prefill else set())
        stray = set(ids) - used
        if stray:
            problem = f"hardware describes {sorted(stray)[0]}, which no owner uses"
            # an owner's GPU, or the entry's id, edited away from the other
            gpus = [("prefill pool", self.prefill.gpu)] if self.prefill else []
            gpus = [(f"owner {i}", o.gpu) for i, o in enumerate(self.owners)] + gpus
            other = next(((who, gpu) for who, gpu in gpus if gpu not in ids), None)
            if other is not None:
                problem += (
                    f", and {other[0]}'s gpu {other[1]!r} is none it describes: the file was "
                    "edited; plan again"
                )
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _shape_of_strategy(self) -> Plan:
        owners = {"colocated": 1, "afd": 2, "cad": 2}.get(self.strategy)
        if owners is not None and len(self.owners) != owners:
            raise ValueError(
                f"{self.strategy} plans have {owners} owner{'s' if owners > 1 else ''}, this one "
                f"{len(self.owners)}; label a plan of other owners opweave"
            )
        if self.strategy == "colocated" and self.template.num_stages != 1:
            raise ValueError(
                f"colocated plans have one stage, this one {self.template.num_stages}; label a "
                "pipeline opweave"
            )
        return self

    @model_validator(mode="after")
    def _balanced(self) -> Plan:
        gpus = sum(o.replicas * o.gpus_per_replica for o in self.owners)
        if gpus > MAX_GPUS:
            raise ValueError(f"the plan uses {gpus} GPUs; at most {MAX_GPUS} are supported")
        batches = {o.replicas * o.resident_batch for o in self.owners}
        if len(batches) != 1:
            raise ValueError(
                "every owner must serve the same global batch (replicas x resident_batch)"
            )
        for owner in self.owners:
            if owner.resident_batch < self.microbatches:
                raise ValueError(
                    f"resident_batch {owner.resident_batch} of owner {owner.gpu} is smaller "
                    f"than microbatches {self.microbatches}"
                )
        return self

    @property
    def global_batch(self) -> int:
        return self.owners[0].replicas * self.owners[0].resident_batch


@dataclass(frozen=True)
class Segment:
    """One stage instance along the model: consecutive operators run by one owner."""

    position: int
    template_stage: int
    owner: int
    ops: tuple[OperatorSpec, ...]

    @property
    def holds_state(self) -> bool:
        return any(op.holds_state for op in self.ops)


def check_template(model: ModelSpec, template: StageTemplate) -> None:
    """Raise ConfigError unless every stage of the template is a legal cut (paper §5.1).

    Stages are contiguous; each holds at least one non-small operator (small ops attach to a
    neighbour); attention state never leaves its ``core_attn`` (an operator is indivisible).
    The same holds for the stages it makes in a prefix of irregular layers.
    """
    block = model.block
    n = len(block.op_names)
    if template.cuts[-1] >= n:
        raise ConfigError(f"template cut {template.cuts[-1]} is past the block's {n} operators")
    first = block.prefix_layers
    layer0 = model.layers[first : first + block.period_layers]
    classes = [op.op_class for layer in layer0 for op in layer.ops]
    cuts = template.cuts
    for j, start in enumerate(cuts):
        end = cuts[j + 1] if j + 1 < len(cuts) else cuts[0] + n
        members = [classes[i % n] for i in range(start, end)]
        if all(c is OpClass.SMALL for c in members):
            names = [block.op_names[i % n] for i in range(start, end)]
            raise ConfigError(
                f"template stage {j} holds only small operators {names}; "
                "attach them to a neighbouring stage"
            )
    if block.prefix_layers:
        _check_prefix_stages(model, template)


def _block_index(model: ModelSpec) -> list[list[int | None]]:
    """For each layer's operators, its index in the block sequence: a block layer's own; a
    prefix layer's operator that of the same name in the block layer it aligns with (None when
    that layer has none, e.g. a dense FFN against an MoE block: it never starts a stage)."""
    block = model.block
    starts = {off: block.op_layers.index(off) for off in range(block.period_layers)}
    by_name = [
        {
            name: i
            for i, (name, o) in enumerate(zip(block.op_names, block.op_layers, strict=True))
            if o == off
        }
        for off in range(block.period_layers)
    ]
    out: list[list[int | None]] = []
    for layer in model.layers:
        _, off = block.block_layer(layer.index)
        if layer.index >= block.prefix_layers:
            out.append([starts[off] + j for j in range(len(layer.ops))])
        else:
            out.append([by_name[off].get(op.name) for op in layer.ops])
    return out


def _tagged(model: ModelSpec, template: StageTemplate) -> list[tuple[int, int, OperatorSpec]]:
    """Every layer operator with its stage position and template stage.

    Stage ``j`` of block ``i`` has position ``i * k + j`` (``k`` stages per template; shifted
    by one when the first stage wraps in from a previous block), renumbered so that the model's
    first operator is at position 0.
    """
    stage_of = {c: j for j, c in enumerate(template.cuts)}
    k = template.num_stages
    shift = 0 if template.cuts[0] == 0 else 1
    block = model.block
    # ops before the first cut belong to the wrapped last stage of the previous block
    stage, blk = k - 1, block.block_layer(0)[0] - 1
    tagged: list[tuple[int, int, OperatorSpec]] = []
    for layer, index in zip(model.layers, _block_index(model), strict=True):
        for op, i in zip(layer.ops, index, strict=True):
            if i is not None and i in stage_of:
                stage, blk = stage_of[i], block.block_layer(layer.index)[0]
            tagged.append((blk * k + stage + shift, stage, op))
    origin = tagged[0][0]
    return [(position - origin, stage, op) for position, stage, op in tagged]


def _check_prefix_stages(model: ModelSpec, template: StageTemplate) -> None:
    prefix_ops = {id(op) for layer in model.layers[: model.block.prefix_layers] for op in layer.ops}
    instances: dict[int, list[tuple[int, OperatorSpec]]] = {}
    for position, stage, op in _tagged(model, template):
        instances.setdefault(position, []).append((stage, op))
    # the model's first stage may be a partial one (it starts mid-template), as without a prefix
    for members in list(instances.values())[1:]:
        if not any(id(op) in prefix_ops for _, op in members):
            continue
        if all(op.op_class is OpClass.SMALL for _, op in members):
            raise ConfigError(
                f"template stage {members[0][0]} holds only small operators "
                f"{[op.key for _, op in members]} in the model's first "
                f"{model.block.prefix_layers} layers; attach them to a neighbouring stage"
            )


def segments(model: ModelSpec, template: StageTemplate, num_owners: int) -> list[Segment]:
    """Tile ``template`` over the model: the ordered stage instances and their owners.

    Stage instances are numbered along the model (:func:`_tagged`) and instance ``p`` runs on
    owner ``p % num_owners``. Consecutive instances on the same owner merge into one segment.
    ``embed`` joins the first segment and ``final_norm``/``lm_head``/``sample`` the last.
    """
    check_template(model, template)
    tagged = _tagged(model, template)
    out: list[Segment] = []
    ops: list[OperatorSpec] = list(model.pre_ops)
    first_stage = tagged[0][1]
    for i, (position, stage, op) in enumerate(tagged):
        if not ops or (len(ops) == len(model.pre_ops) and not out):
            first_stage = stage
        ops.append(op)
        last = i + 1 == len(tagged)
        if last:
            ops.extend(model.post_ops)
        if last or tagged[i + 1][0] % num_owners != position % num_owners:
            out.append(
                Segment(
                    position=len(out),
                    template_stage=first_stage,
                    owner=position % num_owners,
                    ops=tuple(ops),
                )
            )
            ops = []
    return out


def planned_catalog(plan: Plan, catalog: HardwareCatalog | None = None) -> HardwareCatalog:
    """The catalog to re-evaluate ``plan`` with: ``catalog`` when one is given (a what-if
    with other specs), else the built-ins with the GPU specs the plan was made with over them."""
    if catalog is not None:
        return catalog
    out = HardwareCatalog()
    for hw in plan.hardware:
        out.add(hw)
    return out


def hardware_drift(plan: Plan, hw: HardwareSpec) -> str | None:
    """How ``hw`` differs from the spec of the same GPU type the plan was made with, or None
    (also when the plan recorded none)."""
    planned = next((p for p in plan.hardware if p.id == hw.id), None)
    if planned is None or planned == hw:
        return None
    old, new = planned.model_dump(), hw.model_dump()
    # the figures; the name and the price's basis describe them
    changed = [
        f"{k} {old[k]} -> {new[k]}"
        for k in new
        if old[k] != new[k] and k not in ("name", "price_source")
    ]
    if not changed:
        return None
    return f"{hw.id}: {', '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}"


# -- canonical templates --------------------------------------------------------------------
def colocated_template(model: ModelSpec) -> StageTemplate:
    """One stage: the whole model on one owner."""
    del model
    return StageTemplate(cuts=(0,))


def afd_template(model: ModelSpec) -> StageTemplate:
    """Attention-FFN disaggregation: attention module vs FFN/MoE, per layer."""
    names = model.block.op_names
    return StageTemplate(
        cuts=tuple(i for i, n in enumerate(names) if n in ("attn_norm", "ffn_norm"))
    )


def cad_template(model: ModelSpec) -> StageTemplate:
    """Core-attention disaggregation: each core_attn alone vs everything else."""
    names = model.block.op_names
    cuts: set[int] = set()
    for i, n in enumerate(names):
        if n == "core_attn":
            cuts.update((i, (i + 1) % len(names)))
    return StageTemplate(cuts=tuple(sorted(cuts)))


TEMPLATES = {"colocated": colocated_template, "afd": afd_template, "cad": cad_template}


def plan_model(model: ModelSpec) -> PlanModel:
    return PlanModel(
        name=model.name,
        family=model.family,
        num_layers=model.num_layers,
        period_layers=model.block.period_layers,
        prefix_layers=model.block.prefix_layers,
        config_sha256=model.config_sha256,
        quant=model.precision.quant,
        kv_cache_dtype=model.precision.kv_cache_dtype,
    )


def canonical_plan(
    model: ModelSpec,
    strategy: Literal["colocated", "afd", "cad"],
    *,
    gpu: str,
    batch: int,
    microbatches: int = 1,
    context_tokens: int = 1,
    tp: int = 1,
    replicas: int = 1,
    ep: int = 1,
    dp: int = 1,
) -> Plan:
    """The canonical template of a baseline; every owner gets ``tp``, ``ep``, ``dp`` and
    ``replicas``.

    Colocated has one owner; AFD and CAD have two, which alternate along the model
    (``owners[0]`` runs the first segment: the attention module for AFD, the rest-of-model
    stage for CAD, whose first core_attn comes after a projection).

    >>> from opweave.costmodel import load_model
    >>> plan = canonical_plan(load_model("qwen3-32b"), "cad", gpu="h100-sxm", batch=8,
    ...                       microbatches=2)
    >>> [o.gpu for o in plan.owners], plan.template.cuts
    (['h100-sxm', 'h100-sxm'], (3, 4))
    """
    if strategy not in TEMPLATES:
        raise ConfigError(f"unknown strategy {strategy!r}; use one of {', '.join(TEMPLATES)}")
    template = TEMPLATES[strategy](model)
    num_owners = 1 if strategy == "colocated" else 2
    owners = tuple(
        Owner(gpu=gpu, tp=tp, ep=ep, dp=dp, replicas=replicas, resident_batch=batch)
        for _ in range(num_owners)
    )
    return Plan(
        strategy=strategy,
        model=plan_model(model),
        context_tokens=context_tokens,
        template=template,
        owners=owners,
        microbatches=microbatches,
    )
