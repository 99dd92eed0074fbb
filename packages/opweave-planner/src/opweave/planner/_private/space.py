"""The finite plan space the planner searches exactly (paper §4, §5.1).

* Templates: regularity-aware sub-block templates. Each attention kind present in the partition
  block (full, sliding, linear) gets one per-layer cut pattern, applied to every layer of that
  kind in the block, optionally with a cut at the block start:

  ``none``   no cut in the layer (it joins its neighbours: stages span layers)
  ``layer``  cut before ``attn_norm`` (layer-aligned stages)
  ``afd``    cuts before ``attn_norm`` and ``ffn_norm`` (attention module | FFN/MoE)
  ``ffn``    cut before ``ffn_norm`` only (FFN of one layer + attention of the next)
  ``cad``    cuts around ``core_attn`` (core attention alone, with its state)
  ``attn``   cuts before ``qkv_proj`` and ``o_proj`` (core attention with its QKV projection)

  Every cut is legal: stages are contiguous, ``core_attn`` keeps its KV/recurrent state, no stage
  holds only small operators (checked with :func:`check_template`). Colocated, AFD and CAD are
  members of this family (and are searched as the baselines).
* Owners: 1 or 2 owners; each owner takes one GPU type (homogeneous: all owners one type;
  heterogeneous: two types), a parallelism (:func:`candidate_parallelisms`) and a per-replica
  microbatch size ``u`` on a geometric grid; the resident batch is ``M * u``.
* Parallelism: a TP degree in {1, 2, 4, 8} (those the device supports); an owner that runs
  routed experts on a roofline device also takes data-parallel ranks ``dp`` such that a replica
  spans ``tp x dp`` in ``GROUP_GPUS`` (up to ``max_group_gpus``), with the experts either
  tensor-parallel over the whole replica (``ep = 1``) or one set per GPU (``ep = tp x dp``, the
  wide-EP layout), the two layouts engines offer (vLLM without and with
  ``--enable-expert-parallel``). A microbatch splits evenly over the DP ranks (``u`` a multiple
  of ``dp``). Dense models keep ``ep = dp = 1``: against TP over the same GPUs, attention-DP
  trades each layer's attention all-reduce for the dense FFN's gather and scatter and
  replicates the attention weights; on the built-in dense models on H100 (8K-32K context,
  batch 8-256) the cost model finds it at best 2.3% faster (Gemma-3-27B, 256 requests at 8K,
  TP 2 x DP 4 against TP 8) and up to 60% slower at small batches, not worth its search time
  (``opweave estimate --dp`` evaluates it). A measured profile times TP only, so a profiled
  device keeps ``ep = dp = 1`` too.
* Microbatches ``M`` in {1, 2, 3, 4}, shared by all owners.

Resident batches are ``M * u`` with ``u`` in {1, 2, 3, 4, 6, 8, ...} (powers of two and three
times powers of two), so the balancing global batch ``lcm(b_o)`` stays within ``3 * max(b_o)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from opweave.costmodel import (
    GROUP_GPUS,
    ModelSpec,
    OperatorSpec,
    Parallelism,
    RooflineLatency,
    StageTemplate,
    afd_template,
    cad_template,
    check_template,
    colocated_template,
)
from opweave.costmodel.errors import ConfigError

from .devices import Device

U_GRID: tuple[int, ...] = (
    1,
    2,
    3,
    4,
    6,
    8,
    12,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    192,
    256,
    384,
    512,
    768,
    1024,
)
MICROBATCHES: tuple[int, ...] = (1, 2, 3, 4)

PATTERNS: dict[str, tuple[str, ...]] = {
    "none": (),
    "layer": ("attn_norm",),
    "afd": ("attn_norm", "ffn_norm"),
    "ffn": ("ffn_norm",),
    "cad": ("core_attn", "o_proj"),
    "attn": ("qkv_proj", "o_proj"),
}


@dataclass(frozen=True)
class Candidate:
    """One (template, owner count) of the space, with a readable name."""

    name: str
    template: StageTemplate
    num_owners: int
    baseline: str | None = None


def _layer_kinds(model: ModelSpec) -> list[str]:
    first = model.block.prefix_layers  # the block's layers (a prefix is cut as they are)
    return [model.layers[first + i].attention.value for i in range(model.block.period_layers)]


def pattern_template(
    model: ModelSpec, patterns: dict[str, str], block_start: bool
) -> StageTemplate | None:
    """The template of one per-kind pattern assignment (``None`` when it has no cut)."""
    names = model.block.op_names
    kinds = _layer_kinds(model)
    cuts: set[int] = {0} if block_start else set()
    for i, (name, offset) in enumerate(zip(names, model.block.op_layers, strict=True)):
        if name in PATTERNS[patterns[kinds[offset]]]:
            cuts.add(i)
    if not cuts:
        return None
    return StageTemplate(cuts=tuple(sorted(cuts)))


def candidate_templates(
    model: ModelSpec, *, patterns: Sequence[str] = tuple(PATTERNS), max_stages_per_layer: int = 2
) -> list[Candidate]:
    """The baselines first (colocated, AFD, CAD), then every other structured template."""
    out = [
        Candidate("colocated", colocated_template(model), 1, "colocated"),
        Candidate("afd", afd_template(model), 2, "afd"),
        Candidate("cad", cad_template(model), 2, "cad"),
    ]
    seen = {c.template.cuts for c in out[1:]}
    kinds = sorted(set(_layer_kinds(model)))
    period = model.block.period_layers
    for combo in itertools.product(patterns, repeat=len(kinds)):
        assign = dict(zip(kinds, combo, strict=True))
        for block_start in (False, True):
            tpl = pattern_template(model, assign, block_start)
            if tpl is None or tpl.cuts in seen or tpl.num_stages > max_stages_per_layer * period:
                continue
            try:
                check_template(model, tpl)
            except ConfigError:
                continue
            seen.add(tpl.cuts)
            label = ",".join(f"{k}:{v}" for k, v in assign.items())
            out.append(Candidate(label + ("+block" if block_start else ""), tpl, 2))
    return out


def u_grid_for(max_resident: int, microbatches: int) -> list[int]:
    return [u for u in U_GRID if u * microbatches <= max_resident]


def candidate_parallelisms(
    device: Device, ops: Sequence[OperatorSpec], max_group_gpus: int = GROUP_GPUS[-1]
) -> tuple[Parallelism, ...]:
    """The parallelisms an owner running ``ops`` on ``device`` is offered (see the module doc),
    before the model's operators are checked to split so (the search keeps those
    :func:`opweave.costmodel.parallelism_problem` passes)."""
    plain = tuple(Parallelism(tp=tp) for tp in sorted(device.tps))
    if not any(op.moe is not None for op in ops) or not isinstance(device.latency, RooflineLatency):
        return plain
    # in (tp, ep, dp) order, the search's tie-break order: of two configurations the frontier
    # finds alike it keeps the first, the one the search would pick
    return tuple(
        sorted(
            Parallelism(tp=tp, ep=ep, dp=gpus // tp)
            for tp in device.tps
            for gpus in GROUP_GPUS
            if gpus % tp == 0 and gpus <= max_group_gpus
            for ep in dict.fromkeys((1, gpus))
        )
    )


def u_grid_for_dp(u_grid: Sequence[int], dp: int) -> list[int]:
    """Microbatch sizes a replica of ``dp`` DP ranks takes: multiples of ``dp``."""
    return [u for u in u_grid if u % dp == 0]
