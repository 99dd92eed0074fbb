"""An OpWeave profile from NVIDIA's silicon database (``opweave profile --from aiconfigurator``).

Every operator of the model at every batch, context and TP degree of the grid is the sum of the
database kernels it runs, in the model's precision:

- GEMM operators (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, ``shared_expert``,
  ``router``, ``lm_head``): one GEMM of ``m`` = batch tokens per linear the engines fuse (q/k/v,
  gate/up, MLA's two down-projections, gated DeltaNet's input pairs), its ``n`` split over TP
  for column-parallel linears, its ``k`` for row-parallel ones (``o_proj``, ``down_proj``,
  ``out_proj``), neither for replicated ones (MLA's down-projections, routers); MLA's
  ``kv_b_proj`` halves are the per-head batched GEMMs around the latent (``mla_bmm``);
- ``core_attn`` of full and sliding layers: decode attention by batch, context (the window's
  for sliding layers), heads and KV heads per rank, head dim and KV-cache dtype; a head layout
  the database lacks but one of its KV-head counts divides is looked up as the same work split
  differently (``b`` requests of ``h`` heads over ``kv`` KV heads run as ``b kv / kv'``
  requests of ``h kv' / kv`` over ``kv'``: decode kernels parallelise over requests times KV
  heads);
- ``core_attn`` of MLA layers: the latent (absorbed) decode attention by batch, context and
  heads per rank, where the engine's table times it alone (SGLang, TensorRT-LLM) and the
  model's latent is DeepSeek-V3's (512 + 64), at which the database measured it;
- ``core_attn`` of gated-DeltaNet layers: the decode convolution plus the recurrent update;
- ``experts``: the fused-MoE kernel at the layer's shape, TP degree and balanced routing.

Norms, rope, embedding and sampling, and any shape the database lacks
take the roofline of the catalog GPU (its cited fixed costs included), per operator. Each table
says which (``OpLatencyTable.source``); the TP all-reduce is the engine's measured one, the
head's all-gather NCCL's.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from opweave.costmodel import (
    TP_DEGREES,
    CollectiveTable,
    HardwareSpec,
    LayerSpec,
    ModelSpec,
    OperatorSpec,
    OpLatencyTable,
    Profile,
    Provenance,
    RooflineLatency,
    TPCollective,
    default_catalog,
    profile_key,
    tp_problem,
    tp_split,
    weight_only,
)

from ..errors import ProfilerError
from .aic_db import TESTED_RANGE, Database, open_database, system_for
from .aic_kernels import Curve, KernelTables, load_kernels
from .aic_tables import How, Lookup, interp, worst

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
INTERPOLATION = (
    "piecewise linear in log latency over the log of each shape dimension between measured "
    "neighbours (GEMM: m per measured (n, k), bilinear in (n, k); attention: context per "
    "measured batch, then batch); beyond the measured contexts or batches of decode attention, "
    "in proportion to them (KV-read bound); a GEMM narrower than measured at the narrowest, "
    "wider than measured as column slices"
)
# DeepSeek-V3's latent (kv_lora_rank, qk_rope_head_dim): the shape of the database's MLA
# attention (aiconfigurator-core's DeepSeek model builds its generation MLA at these widths)
MLA_LATENT = (512, 64)
GEMM_OPS = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "shared_expert", "router", "lm_head"}
# linears the engines run as one GEMM (vLLM's QKVParallelLinear, MergedColumnParallelLinear,
# DeepSeek's fused_qkv_a_proj, gated DeltaNet's in_proj_qkvz / in_proj_ba)
FUSED = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
    frozenset({"in_proj_qkv", "in_proj_z"}),
    frozenset({"in_proj_b", "in_proj_a"}),
    frozenset({"q_a_proj", "kv_a_proj_with_mqa"}),
)
GEMM_DTYPES = {
    "bf16": "bfloat16",
    "fp16": "bfloat16",
    "fp8": "fp8",
    "fp8-block": "fp8_block",
    "nvfp4": "nvfp4",
    "int4-wo": "int4_wo",
}
MOE_DTYPES = GEMM_DTYPES | {"mxfp4": "w4a16_mxfp4"}
# the database's compute dtype is BF16; FP16 runs the same kernels at the same width
COMPUTE = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class ImportRun:
    """A profile imported from the database, and where each table came from."""

    profile: Profile
    database: str
    system: str
    engine: str
    versions: dict[str, str]
    cells: Counter[str]

    def describe(self) -> str:
        roofline = sorted(
            f"{t.op}@tp{t.tp}" for t in self.profile.ops if (t.source or "").startswith("roofline")
        )
        counts = ", ".join(f"{n} {how}" for how, n in self.cells.items() if n)
        return (
            f"{len(self.profile.ops)} operator tables from the {self.database} ({self.system}, "
            f"{self.engine}): cells {counts}; roofline tables: {len(roofline)}"
        )


def _format(op: OperatorSpec, model: ModelSpec) -> str | None:
    """The database dtype of ``op``'s GEMMs; None for weight-only quantised weights (W4A16
    NVFP4: the database times W4A4 kernels only), which stay on the roofline."""
    if weight_only(op):
        return None
    return op.weight_format or COMPUTE.get(model.precision.compute_dtype)


def _gemms(op: OperatorSpec, tp: int) -> list[tuple[str, float, float]]:
    """(kind, n, k) per GEMM the engine runs for ``op`` on one of ``tp`` ranks; kind is
    ``gemm`` or an MLA batched GEMM (``mla_gen_pre`` / ``mla_gen_post``)."""
    entries: dict[object, list] = {}
    for i, linear in enumerate(op.linears):
        prefix, _, leaf = linear.module.rpartition(".")
        if leaf == "kv_b_proj":
            entries[i] = ["mla_gen_pre" if op.name == "qkv_proj" else "mla_gen_post", 0.0, 0.0]
            continue
        sharded, row = tp_split(linear.module)
        split = tp if sharded else 1
        if row:
            entries[i] = ["gemm", float(linear.out_features), linear.in_features / split]
            continue
        fused = next((j for j, group in enumerate(FUSED) if leaf in group), None)
        entry = entries.setdefault(
            i if fused is None else (prefix, fused), ["gemm", 0.0, float(linear.in_features)]
        )
        entry[1] += linear.out_features / split
    return [(str(kind), float(n), float(k)) for kind, n, k in entries.values()]


@dataclass(frozen=True)
class _Mapper:
    model: ModelSpec
    kernels: KernelTables
    hardware: HardwareSpec

    def lookup(
        self, op: OperatorSpec, layer: LayerSpec | None, tp: int, batch: int, context: int
    ) -> tuple[Lookup | None, str]:
        """Seconds of ``op`` from the database and what it used, or None and why not."""
        arch = self.model.arch
        if op.name in GEMM_OPS:
            return self._gemm_op(op, tp, batch)
        if op.name == "core_attn" and layer is not None:
            if op.sparse_attended_tokens is not None:
                return None, "DeepSeek Sparse Attention (its indexer) is not in the database"
            if layer.attention.value == "linear":
                return self._gdn(tp, batch)
            window = layer.window_tokens
            attended = context if window is None else min(context, window)
            if arch.mla is not None:
                return self._mla(math.ceil(arch.num_heads / tp), batch, attended)
            heads = math.ceil(arch.num_heads / tp)
            kv = math.ceil(arch.num_kv_heads / tp)
            return self._attention(batch, attended, heads, kv, arch.head_dim)
        if op.name == "experts" and op.moe is not None:
            return self._moe(op, tp, batch)
        return None, f"{op.name} is not in the database"

    def _gemm_op(self, op: OperatorSpec, tp: int, batch: int) -> tuple[Lookup | None, str]:
        fmt = _format(op, self.model)
        dtype = GEMM_DTYPES.get(fmt or "")
        table = self.kernels.gemm.get(dtype or "")
        if table is None:
            what = fmt or f"weight-only {op.weight_format}"
            return None, f"no {what} GEMMs in the database"
        arch, total, how = self.model.arch, 0.0, "measured"
        for kind, n, k in _gemms(op, tp):
            if kind == "gemm":
                found = table(batch, n, k)
                what = f"GEMM n={n:g} k={k:g}"
            else:
                curve = self.kernels.mla_bmm.get((kind, math.ceil(arch.num_heads / tp)))
                found = None if curve is None else interp(*curve, batch)
                what = f"{kind} batched GEMM"
            if found is None:
                return None, f"{what} outside the database's {dtype} shapes"
            total += found[0]
            how = worst(how, found[1])  # type: ignore[arg-type]
        return (total, how), f"gemm {dtype}"  # type: ignore[return-value]

    def _attention(
        self, batch: int, context: int, heads: int, kv: int, head_dim: int
    ) -> tuple[Lookup | None, str]:
        tables = self.kernels.attention
        table = tables.get((heads, kv, head_dim))
        scale: float = 1.0
        if table is None:
            for (h2, kv2, d2), other in sorted(tables.items(), reverse=True):
                if d2 == head_dim and kv % kv2 == 0 and h2 * kv == heads * kv2:
                    table, scale = other, kv / kv2
                    break
        if table is None:
            return None, f"no decode attention for {heads} heads / {kv} KV heads of {head_dim}"
        found = table(batch * scale, context)
        if found is not None and scale != 1.0:
            found = (found[0], worst(found[1], "interpolated"))
        return found, "generation_attention"

    def _mla(self, heads: int, batch: int, context: int) -> tuple[Lookup | None, str]:
        """The latent (absorbed) decode attention of ``heads`` heads per rank. The database
        measured it at DeepSeek-V3's latent only (its table records no widths); another
        latent is a different kernel's work, so it takes the roofline."""
        mla = self.model.arch.mla
        assert mla is not None
        if (mla.kv_lora_rank, mla.qk_rope_head_dim) != MLA_LATENT:
            return None, (
                f"MLA decode attention is measured at a {MLA_LATENT[0]} + {MLA_LATENT[1]} latent "
                f"only, not {mla.kv_lora_rank} + {mla.qk_rope_head_dim}"
            )
        if not self.kernels.mla:
            return None, f"no MLA decode attention for {self.kernels.engine} in the database"
        table = self.kernels.mla.get((heads,))
        if table is None:
            return None, f"no MLA decode attention for {heads} heads per rank"
        return table(batch, context), "generation_mla"

    def _gdn(self, tp: int, batch: int) -> tuple[Lookup | None, str]:
        la = self.model.arch.linear_attn
        assert la is not None
        nk, nv = math.ceil(la.num_k_heads / tp), math.ceil(la.num_v_heads / tp)
        key = (nk, nv, la.k_head_dim, la.v_head_dim)
        curves = [c for k, c in self.kernels.gdn.items() if k[:4] == key]
        if not curves:
            return None, f"no gated DeltaNet for {nk} key / {nv} value heads per rank"
        total, how = 0.0, "measured"
        for curve in curves:  # the decode convolution and the recurrent update
            found = interp(*curve, batch)
            if found is None:
                return None, f"gated DeltaNet at batch {batch} outside the database"
            total += found[0]
            how = worst(how, found[1])  # type: ignore[arg-type]
        return (total, how), "gdn"  # type: ignore[return-value]

    def _moe(self, op: OperatorSpec, tp: int, batch: int) -> tuple[Lookup | None, str]:
        moe = self.model.arch.moe
        assert moe is not None and op.moe is not None
        dtype = MOE_DTYPES.get(_format(op, self.model) or "")
        key = (str(dtype), self.model.hidden_size, moe.intermediate_size, moe.num_experts)
        passed = []
        for distribution, curves in self.kernels.moe.items():
            curve = curves.get((*key, moe.top_k, tp, 1))
            if curve is None:
                continue
            if distribution == "balanced" and self._faster_than_memory(op, tp, curve):
                passed.append(distribution)
                continue
            label = f"moe {dtype} {distribution}"
            if passed:
                label += f" ({', '.join(passed)} rows faster than the experts' weights read)"
            return interp(*curve, batch), label
        why = f"no fused MoE for {key[1:]} top-{moe.top_k} {dtype} at tp={tp}"
        if passed:
            why += f" but {', '.join(passed)} rows faster than the experts' weights read"
        return None, why

    def _faster_than_memory(self, op: OperatorSpec, tp: int, curve: Curve) -> bool:
        """Whether a balanced-routing curve has a point below the time its experts' weights
        take at the GPU's datasheet bandwidth. Balanced routing (the collector's pattern: token
        ``i`` to experts ``i + j * ceil(E / k)``) touches ``min(E, tokens * k)`` experts, at
        least the expectation of random routing that ``weight_bytes_read`` counts; each GPU
        reads ``1 / tp`` of them. Such a point did not read them (newer collections' balanced
        rows imply up to 1.2x the H100's, H200's and B200's peak), so it is not a measurement of
        the operator the cost model describes."""
        tokens, seconds = curve
        floor = np.array([float(op.weight_bytes_read(t)) for t in tokens]) / tp
        return bool(np.any(seconds < floor / self.hardware.mem_bandwidth_bytes_per_s))


@functools.lru_cache(maxsize=8)
def _kernels(
    db: Database,
    system: str,
    engine: str,
    engine_version: str | None,
    gemm_dtypes: frozenset[str],
    moe_dtypes: frozenset[str],
    kv_dtype: str,
) -> KernelTables:
    """The database's tables, read once per process for one system, engine and precision
    (benchmarks import many models and batch sizes; the tables are never modified)."""
    return load_kernels(
        db,
        system,
        engine,
        engine_version,
        gemm_dtypes=set(gemm_dtypes),
        moe_dtypes=set(moe_dtypes),
        kv_dtype=kv_dtype,
    )


def _keys(model: ModelSpec) -> list[tuple[OperatorSpec, LayerSpec | None]]:
    """One (operator, layer) per profile key: the first layer that holds it."""
    seen: dict[str, tuple[OperatorSpec, LayerSpec | None]] = {}
    for op in model.pre_ops:
        seen.setdefault(profile_key(op, None), (op, None))
    for layer in model.layers:
        for op in layer.ops:
            seen.setdefault(profile_key(op, layer), (op, layer))
    for op in model.post_ops:
        seen.setdefault(profile_key(op, None), (op, None))
    return list(seen.values())


def _table(
    mapper: _Mapper,
    roof: RooflineLatency,
    op: OperatorSpec,
    layer: LayerSpec | None,
    tp: int,
    batches: Sequence[int],
    contexts: Sequence[int],
    cells: Counter[str],
) -> OpLatencyTable:
    context_bound = (
        op.name == "core_attn" and layer is not None and layer.attention.value != "linear"
    )
    cols = tuple(contexts) if context_bound else (contexts[0],)
    # the table times each operator alone, as the database's kernels are: a shared expert's
    # roofline cells keep its launches too (ProfiledLatency overlaps it where engines do)
    alone = op.alone()
    rows, hows, used, why = [], Counter(), set(), set()
    for b in batches:
        row = []
        for s in cols:
            found, what = mapper.lookup(op, layer, tp, b, s)
            if found is None:
                row.append(roof.op_latency_s(mapper.model, alone, layer, tp, b, s))
                hows["roofline"] += 1
                why.add(what)
            else:
                row.append(found[0])
                hows[found[1]] += 1
                used.add(what)
        rows.append(tuple(row))
    cells.update(hows)
    counts = ", ".join(f"{hows[h]} {h}" for h in (*_HOWS, "roofline") if hows[h])
    if not used:
        source = f"roofline ({'; '.join(sorted(why))})"
    else:
        source = f"aiconfigurator {', '.join(sorted(used))}: {counts}"
        if why:
            source += f" (roofline where {'; '.join(sorted(why))})"
    return OpLatencyTable(
        op=profile_key(op, layer),
        tp=tp,
        batches=tuple(batches),
        contexts=cols,
        latency_s=tuple(rows),
        source=source,
    )


_HOWS: tuple[How, ...] = ("measured", "interpolated", "extrapolated")


def _tps(model: ModelSpec, hw: HardwareSpec, tps: Sequence[int] | None) -> list[int]:
    if tps is None:
        return [t for t in TP_DEGREES if t <= hw.gpus_per_node and tp_problem(model, t) is None]
    for t in tps:
        if t not in TP_DEGREES or t > hw.gpus_per_node:
            raise ProfilerError(f"--tp {t} is not a TP degree of one {hw.id} node")
        # a degree asked for may split as the engines the database measured split it (MXFP4
        # experts in whole scale blocks, the busiest rank's share): estimates of engine
        # deployments read such tables; plans leave the split out (the runtime does not serve it)
        problem = tp_problem(model, t, engine_splits=True)
        if problem is not None:
            raise ProfilerError(problem)
    return sorted(set(tps))


def import_profile(
    model: ModelSpec,
    gpu: str,
    *,
    engine: str = "vllm",
    engine_version: str | None = None,
    tp: Sequence[int] | None = None,
    batches: Sequence[int] = BATCHES,
    contexts: Sequence[int] | None = None,
    database: str | Path | Database | None = None,
    hardware: HardwareSpec | None = None,
) -> ImportRun:
    """A profile of ``model`` on catalog GPU ``gpu`` from the silicon database (the installed
    ``aiconfigurator-core``'s, or a folder in its layout)."""
    hw = hardware or default_catalog().get(gpu)
    db = database if isinstance(database, Database) else open_database(database)
    system = system_for(hw.id, db)
    grid_s = (
        contexts
        or [s for s in CONTEXTS if s <= model.max_context_tokens]
        or [model.max_context_tokens]
    )
    if sorted(set(batches)) != list(batches) or batches[0] < 1:
        raise ProfilerError("batches must be distinct, increasing and at least 1")
    degrees = _tps(model, hw, tp)
    formats = {_format(op, model) or "" for op in model.operators}
    kv_dtype = "fp8" if model.precision.kv_cache_dtype == "fp8" else "bfloat16"
    kernels = _kernels(
        db,
        system,
        engine,
        engine_version,
        frozenset(GEMM_DTYPES[f] for f in formats if f in GEMM_DTYPES),
        frozenset(MOE_DTYPES[f] for f in formats if f in MOE_DTYPES),
        kv_dtype,
    )
    mapper, roof, cells = _Mapper(model, kernels, hw), RooflineLatency(hw), Counter[str]()
    tables = [
        _table(mapper, roof, op, layer, t, batches, grid_s, cells)
        for t in degrees
        for op, layer in _keys(model)
    ]
    collectives = tuple(
        CollectiveTable(
            kind="allreduce" if used == TPCollective.ALLREDUCE else "allgather",
            gpus=t,
            message_bytes=tuple(int(x) for x in curves[t][0]),
            latency_s=tuple(float(y) for y in curves[t][1]),
            source=source,
        )
        for used, curves, source in (
            (TPCollective.ALLREDUCE, kernels.allreduce, kernels.allreduce_source),
            (TPCollective.ALLGATHER, kernels.allgather, kernels.allgather_source),
        )
        if any(op.tp_collective == used for op in model.operators)
        for t in degrees
        if t > 1 and t in curves
    )
    settings: dict[str, str | int | float | list[int] | list[str]] = {
        "database": db.origin,
        "system": system,
        "engine": engine,
        "engine_version": engine_version or "newest measured",
        "table_versions": [f"{k}={v}" for k, v in sorted(kernels.versions.items())],
        "batches": list(batches),
        "contexts": list(grid_s),
        "tp": degrees,
        "interpolation": INTERPOLATION,
        "kv_cache_dtype": kv_dtype,
        "quant": model.precision.quant,
        "cells": [f"{how}={n}" for how, n in sorted(cells.items())],
        "roofline_tables": sorted(
            f"{t.op}@tp{t.tp}" for t in tables if (t.source or "").startswith("roofline")
        ),
    }
    if kernels.moe:
        settings["moe_distributions"] = list(kernels.moe)
    versions = {"aiconfigurator-core": db.package_version or "folder"}
    for dist in ("opweave-profiler", "opweave-costmodel"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = "source"
    profile = Profile(
        device=hw,
        model=model.name,
        config_sha256=model.config_sha256,
        dtype=model.dtype,
        ops=tuple(tables),
        collectives=collectives,
        provenance=Provenance(
            source="aiconfigurator",
            device_name=hw.name,
            versions=versions,
            settings=settings,
            note=(
                f"imported from NVIDIA's silicon database ({db.origin}, read as "
                f"aiconfigurator-core {TESTED_RANGE} lays it out): {system}, {engine} "
                f"{engine_version or 'newest measured per table'}; operators it does not "
                "cover use the roofline (each table's source says which)"
            ),
        ),
    )
    return ImportRun(
        profile=profile,
        database=db.origin,
        system=system,
        engine=engine,
        versions=dict(kernels.versions),
        cells=cells,
    )
