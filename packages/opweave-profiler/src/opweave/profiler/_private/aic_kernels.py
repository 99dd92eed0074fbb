"""The kernel tables one import needs, read from the database for one system and engine.

Each operator family maps to the database's table for it: GEMMs (``gemm/gemm_perf``), decode
attention (``attention/generation_attention_perf``), fused MoE (``moe/moe_perf``), gated
DeltaNet (``linear_attention/gdn_perf``), MLA's latent (absorbed) decode attention
(``mla/generation_mla_perf``, measured at DeepSeek-V3's latent: 512 + 64 wide), MLA's per-head
batched GEMMs around the latent (``mla_bmm/mla_bmm_perf``), the engine's custom all-reduce
(``comm/<engine>``, NCCL's where the engine has none) and NCCL's all-gather
(``comm/nccl/<version>/nccl_perf``, the newest NCCL measured), which the engines run for a
vocabulary-parallel head's logits. The engine's version
is the one asked for where the database measured it, else the newest measured for that table
(recorded per table in the provenance).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import ProfilerError
from .aic_db import ENGINES, Database, version_key
from .aic_tables import (
    BatchContextTable,
    GemmTable,
    batch_context_tables,
    curves_by_key,
)

# op folder -> (table, columns)
GEMM = ("gemm", "gemm_perf", ("gemm_dtype", "m", "n", "k", "latency"))
ATTENTION = (
    "attention",
    "generation_attention_perf",
    (
        "batch_size",
        "isl",
        "step",
        "num_heads",
        "num_key_value_heads",
        "head_dim",
        "attn_dtype",
        "kv_cache_dtype",
        "window_size",
        "latency",
    ),
)
MOE = (
    "moe",
    "moe_perf",
    (
        "moe_dtype",
        "num_tokens",
        "hidden_size",
        "inter_size",
        "topk",
        "num_experts",
        "moe_tp_size",
        "moe_ep_size",
        "distribution",
        "latency",
    ),
)
GDN = (
    "linear_attention",
    "gdn_perf",
    (
        "phase",
        "kernel_source",
        "batch_size",
        "num_k_heads",
        "head_k_dim",
        "num_v_heads",
        "head_v_dim",
        "latency",
    ),
)
MLA_BMM = (
    "mla_bmm",
    "mla_bmm_perf",
    ("op_name", "bmm_dtype", "num_tokens", "num_heads", "latency"),
)
# MLA's latent decode attention alone (SGLang's and TensorRT-LLM's tables; vLLM's database times
# the whole MLA module, projections included, in ``mla_generation_module_perf``, not read)
MLA = (
    "mla",
    "generation_mla_perf",
    ("mla_dtype", "kv_cache_dtype", "num_heads", "batch_size", "isl", "step", "latency"),
)
ALLREDUCE = (
    "comm",
    "custom_allreduce_perf",
    ("allreduce_dtype", "num_gpus", "message_size", "backend", "latency"),
)
NCCL = ("comm", "nccl_perf", ("op_name", "nccl_dtype", "num_gpus", "message_size", "latency"))
# columns that older collections lack, and what their absence means
# (TensorRT-LLM's all-reduce tables name no backend: one per shape, or several of which the
# fastest is taken, as TRT-LLM's automatic strategy picks)
DEFAULTS: dict[str, dict[str, object]] = {
    "generation_attention_perf": {"window_size": 0},
    "custom_allreduce_perf": {"backend": ""},
}
# MoE routing the database measured, most even first: OpWeave's experts assume balanced load
# (a table whose rows are faster than its experts' weights can be read is passed over: aic_import)
DISTRIBUTIONS = ("balanced", "power_law_1.01", "power_law_1.2")

Curve = tuple[np.ndarray, np.ndarray]
Reader = Callable[[tuple[str, str, tuple[str, ...]]], dict[str, np.ndarray] | None]


@dataclass
class KernelTables:
    """What one (system, engine, version) of the database measured, keyed for lookups."""

    engine: str
    gemm: dict[str, GemmTable] = field(default_factory=dict)
    attention: dict[tuple, BatchContextTable] = field(default_factory=dict)
    # fused MoE per routing distribution the table measured, in DISTRIBUTIONS' order
    moe: dict[str, dict[tuple, Curve]] = field(default_factory=dict)
    gdn: dict[tuple, Curve] = field(default_factory=dict)
    mla_bmm: dict[tuple, Curve] = field(default_factory=dict)
    mla: dict[tuple, BatchContextTable] = field(default_factory=dict)
    allreduce: dict[int, Curve] = field(default_factory=dict)
    allreduce_source: str = ""
    allgather: dict[int, Curve] = field(default_factory=dict)
    allgather_source: str = ""
    versions: dict[str, str] = field(default_factory=dict)


def table_version(
    db: Database, system: str, op: str, engine: str, table: str, wanted: str | None = None
) -> str | None:
    """``wanted`` where it holds ``table``, else the newest version that does (a version
    folder may hold other tables of the op only: B200's SGLang 0.5.16 ``moe`` has just a
    DeepSeek-V4 module table, its fused-MoE table is 0.5.14's)."""
    found = [
        v
        for v in db.versions(system, op, engine)
        if (db.root / system / op / engine / v / f"{table}.parquet").is_file()
    ]
    if not found:
        return None
    return wanted if wanted in found else found[-1]


def load_kernels(
    db: Database,
    system: str,
    engine: str,
    version: str | None,
    *,
    gemm_dtypes: set[str],
    moe_dtypes: set[str],
    kv_dtype: str,
) -> KernelTables:
    """Read the tables of ``engine`` on ``system``; a version that the database has for none
    of them, or an engine it never measured there, is an error naming what it has."""
    if engine not in ENGINES:
        raise ProfilerError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    folders = [GEMM, ATTENTION, MOE, GDN, MLA_BMM, MLA, ALLREDUCE]
    measured = {v for spec in folders for v in db.versions(system, spec[0], engine)}
    if not measured:
        raise ProfilerError(f"the {db.origin} has no {engine} measurements for {system}")
    if version is not None and version not in measured:
        raise ProfilerError(
            f"the {db.origin} has no {engine} {version} measurements for {system}; it has "
            f"{', '.join(sorted(measured, key=version_key))}"
        )
    out = KernelTables(engine=engine)
    root = db.root / system

    def read(spec: tuple[str, str, tuple[str, ...]]) -> dict[str, np.ndarray] | None:
        op, table, columns = spec
        chosen = table_version(db, system, op, engine, table, version)
        if chosen is None:
            return None
        out.versions[table] = chosen
        return db.read(root / op / engine / chosen, table, columns, DEFAULTS.get(table))

    if (g := read(GEMM)) is not None:
        for dtype in gemm_dtypes:
            keep = g["gemm_dtype"] == dtype
            if keep.any():
                out.gemm[dtype] = GemmTable.of(
                    g["m"][keep], g["n"][keep], g["k"][keep], g["latency"][keep]
                )
    if (a := read(ATTENTION)) is not None:
        # full attention (window 0) in the compute dtype: sliding layers look up their window
        keep = (a["window_size"] == 0) & (a["attn_dtype"] == "bfloat16")
        keep &= a["kv_cache_dtype"] == kv_dtype
        keys = zip(
            a["num_heads"][keep], a["num_key_value_heads"][keep], a["head_dim"][keep], strict=True
        )
        # the KV length a decode step attends: the prompt (isl) plus the tokens since (step)
        context = a["isl"][keep] + a["step"][keep]
        out.attention = batch_context_tables(
            [tuple(int(x) for x in key) for key in keys],
            a["batch_size"][keep],
            context,
            a["latency"][keep],
        )
    if (m := read(MOE)) is not None:
        cols = ("hidden_size", "inter_size", "num_experts", "topk", "moe_tp_size", "moe_ep_size")
        for distribution in DISTRIBUTIONS:
            keep = np.isin(m["moe_dtype"], sorted(moe_dtypes)) & (m["distribution"] == distribution)
            if not keep.any():
                continue
            keys = [
                (str(dt), *(int(m[c][i]) for c in cols))
                for i, dt in zip(np.flatnonzero(keep), m["moe_dtype"][keep], strict=True)
            ]
            out.moe[distribution] = curves_by_key(keys, m["num_tokens"][keep], m["latency"][keep])
    if (d := read(GDN)) is not None:
        keep = d["phase"] == "generation"
        cols = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
        keys = [
            (*(int(d[c][i]) for c in cols), str(d["kernel_source"][i]))
            for i in np.flatnonzero(keep)
        ]
        out.gdn = curves_by_key(keys, d["batch_size"][keep], d["latency"][keep])
    if (b := read(MLA_BMM)) is not None:
        keep = b["bmm_dtype"] == "bfloat16"
        keys = [
            (str(name), int(h))
            for name, h in zip(b["op_name"][keep], b["num_heads"][keep], strict=True)
        ]
        out.mla_bmm = curves_by_key(keys, b["num_tokens"][keep], b["latency"][keep])
    if (g := read(MLA)) is not None:
        # ``num_heads`` is per rank (DeepSeek-V3's 128 over the table's ``tp_size``)
        keep = (g["mla_dtype"] == "bfloat16") & (g["kv_cache_dtype"] == kv_dtype)
        out.mla = batch_context_tables(
            [(int(h),) for h in g["num_heads"][keep]],
            g["batch_size"][keep],
            g["isl"][keep] + g["step"][keep],
            g["latency"][keep],
        )
    _load_allreduce(db, system, out, read)
    return out


def _by_gpus(table: dict[str, np.ndarray], keep: np.ndarray) -> dict[int, Curve]:
    """Per GPU count a curve by message bytes: ``message_size`` counts 16-bit elements."""
    curves = curves_by_key(
        [(int(g),) for g in table["num_gpus"][keep]],
        table["message_size"][keep] * 2,
        table["latency"][keep],
    )
    return {key[0]: curve for key, curve in curves.items()}


def _nccl(db: Database, system: str, out: KernelTables) -> tuple[dict[str, np.ndarray], str] | None:
    """NCCL's table of the newest NCCL measured on ``system`` (the engines ship recent NCCL)."""
    op, table, columns = NCCL
    version = table_version(db, system, op, "nccl", table)
    if version is None:
        return None
    out.versions[table] = version
    return db.read(db.root / system / op / "nccl" / version, table, columns), version


def graph_allreduce_rows(table: dict[str, np.ndarray]) -> np.ndarray:
    """The BF16 rows of a custom all-reduce table timed in a CUDA graph, as decode replays it
    (vLLM's and SGLang's tables name a graph backend); all BF16 rows of a table that names no
    backend (TensorRT-LLM's)."""
    keep = table["allreduce_dtype"] == "bfloat16"
    graph = keep & (np.char.find(table["backend"].astype(str), "graph") >= 0)
    return graph if graph.any() else keep


def _load_allreduce(db: Database, system: str, out: KernelTables, read: Reader) -> None:
    """The engine's custom all-reduce, CUDA-graph captured as decode runs it; else NCCL's.
    NCCL's all-gather beside it: its message is the gathered tensor, as NCCL's tests count it
    (at 512 MiB over 8 H100s the table's time is ~335 GB/s of bus bandwidth under that reading,
    NVLink's range; under the other it would be 8 times NVLink's)."""
    nccl = _nccl(db, system, out)
    if nccl is not None:
        table, version = nccl
        keep = (table["op_name"] == "all_gather") & (table["nccl_dtype"] == "half")
        if keep.any():
            out.allgather = _by_gpus(table, keep)
            out.allgather_source = f"NCCL all-gather ({version})"
    ar = read(ALLREDUCE)
    if ar is not None:
        keep = graph_allreduce_rows(ar)
        label = f"{out.engine} custom all-reduce ({out.versions['custom_allreduce_perf']})"
    elif nccl is not None:
        ar, version = nccl
        keep = (ar["op_name"] == "all_reduce") & (ar["nccl_dtype"] == "half")
        label = f"NCCL all-reduce ({version})"
    else:
        return
    out.allreduce = _by_gpus(ar, keep)
    out.allreduce_source = label
