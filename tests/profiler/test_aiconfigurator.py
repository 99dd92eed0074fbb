"""``opweave profile --from aiconfigurator``: profiles imported from NVIDIA's silicon database.

Without the package, the tests write a small database in its layout (parquet tables under
``<system>/<op>/<engine>/<version>/``) with latencies from a formula of their own, so every
expected value below is computed here, independently of the importer. With the package
installed, one test checks a real row.
"""

from __future__ import annotations

import json
import math
from importlib.util import find_spec
from pathlib import Path

import pytest

from opweave.costmodel import ProfiledLatency, RooflineLatency, default_catalog, load_model
from opweave.profiler import ProfilerError, import_profile
from tests.helpers import run_cli

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}
M_GRID = (1, 2, 4, 8)
NK_GRID = (32, 64, 256, 384, 512, 1024, 2048)
BATCHES = (1, 2, 4, 8)
CONTEXTS = (512, 1024)


def gemm_ms(m: int, n: int, k: int) -> float:
    """The fixture's GEMM latency: a floor plus a weight read and a per-row term."""
    return 0.004 + n * k * 2 / 2.5e9 + m * n * 1e-7


def attention_ms(batch: int, context: int) -> float:
    return 0.006 + batch * context * 2e-6


def ar_ms(elements: int) -> float:
    return 0.005 + elements * 1e-8


def ag_ms(elements: int) -> float:
    return 0.007 + elements * 3e-9


def _write(folder: Path, name: str, columns: dict[str, list], schema_version: int = 1) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "collection_meta.yaml").write_text(f"schema_version: {schema_version}\n")
    pq.write_table(pa.table(columns), folder / f"{name}.parquet")


def write_database(root: Path, *, head_dim: int = 64, schema_version: int = 1) -> Path:
    data = root / "data"
    base = data / "h100_sxm"
    shapes = [(m, n, k) for m in M_GRID for n in NK_GRID for k in NK_GRID]
    _write(
        base / "gemm" / "vllm" / "0.24.0",
        "gemm_perf",
        {
            "gemm_dtype": ["bfloat16"] * len(shapes),
            "m": [s[0] for s in shapes],
            "n": [s[1] for s in shapes],
            "k": [s[2] for s in shapes],
            "latency": [gemm_ms(*s) for s in shapes],
        },
        schema_version,
    )
    # decode attention of the tiny model's layout at TP 1 (4 heads over 2 KV heads); step is
    # the tokens after a 1-token prompt, as the database records them
    cells = [(b, s) for b in BATCHES for s in (256, 512, 1024)]
    n = len(cells)
    _write(
        base / "attention" / "vllm" / "0.24.0",
        "generation_attention_perf",
        {
            "batch_size": [c[0] for c in cells],
            "isl": [1] * n,
            "step": [c[1] - 1 for c in cells],
            "num_heads": [4] * n,
            "num_key_value_heads": [2] * n,
            "head_dim": [head_dim] * n,
            "attn_dtype": ["bfloat16"] * n,
            "kv_cache_dtype": ["bfloat16"] * n,
            "window_size": [0] * n,
            "latency": [attention_ms(*c) for c in cells],
        },
    )
    sizes = [2**i for i in range(7, 16)]
    _write(
        base / "comm" / "vllm" / "0.24.0",
        "custom_allreduce_perf",
        {
            "allreduce_dtype": ["bfloat16"] * len(sizes),
            "num_gpus": [2] * len(sizes),
            "message_size": sizes,
            "backend": ["vllm_graph"] * len(sizes),
            "latency": [ar_ms(e) for e in sizes],
        },
    )
    # NCCL's table: an all-gather to read, and an all-reduce the engine's own one replaces
    ops = [(op, e) for op in ("all_gather", "all_reduce") for e in sizes]
    _write(
        base / "comm" / "nccl" / "2.29.2",
        "nccl_perf",
        {
            "op_name": [o for o, _ in ops],
            "nccl_dtype": ["half"] * len(ops),
            "num_gpus": [2] * len(ops),
            "message_size": [e for _, e in ops],
            "latency": [ag_ms(e) if o == "all_gather" else 1.0 for o, e in ops],
        },
    )
    return data


@pytest.fixture
def tiny(tmp_path: Path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(CONFIG))
    return load_model(str(path)), path


def _table(profile, key: str, tp: int = 1):
    return next(t for t in profile.ops if t.op == key and t.tp == tp)


def test_gemm_at_a_measured_shape_is_the_database_row(tmp_path: Path, tiny) -> None:
    model, _ = tiny
    run = import_profile(model, "h100", database=write_database(tmp_path), batches=BATCHES, tp=[1])
    down = _table(run.profile, "down_proj@full")  # hidden 256 <- intermediate 512
    assert [row[0] for row in down.latency_s] == [gemm_ms(b, 256, 512) * 1e-3 for b in BATCHES]
    assert down.source is not None and down.source.startswith("aiconfigurator gemm bfloat16")
    assert "4 measured" in down.source
    # q, k and v run as one GEMM: n = (4 + 2 + 2) x 64
    qkv = _table(run.profile, "qkv_proj@full")
    assert qkv.latency_s[1][0] == gemm_ms(2, 512, 256) * 1e-3
    assert run.profile.provenance.source == "aiconfigurator"
    assert run.profile.provenance.settings["system"] == "h100_sxm"


def test_interpolation_lies_between_neighbours(tmp_path: Path, tiny) -> None:
    model, _ = tiny
    run = import_profile(
        model, "h100", database=write_database(tmp_path), batches=(2, 3, 4), tp=[1]
    )
    down = _table(run.profile, "down_proj@full")
    lo, mid, hi = (row[0] for row in down.latency_s)
    assert lo == gemm_ms(2, 256, 512) * 1e-3 and hi == gemm_ms(4, 256, 512) * 1e-3
    assert lo < mid < hi
    # log-log between m = 2 and m = 4, computed here
    t = (math.log(3) - math.log(2)) / (math.log(4) - math.log(2))
    assert mid == pytest.approx(math.exp((1 - t) * math.log(lo) + t * math.log(hi)), rel=1e-12)
    assert "interpolated" in (down.source or "")
    attn = _table(run.profile, "core_attn@full")
    assert attn.contexts == (1024, 2048, 4096)
    assert attn.latency_s[0][0] == attention_ms(2, 1024) * 1e-3
    # beyond the longest measured context: in proportion to the context (KV-read bound)
    assert attn.latency_s[0][1] == pytest.approx(attention_ms(2, 1024) * 2e-3, rel=1e-12)


def test_a_shape_outside_the_data_falls_back_to_the_roofline(tmp_path: Path, tiny) -> None:
    model, _ = tiny
    run = import_profile(
        model, "h100", database=write_database(tmp_path, head_dim=128), batches=BATCHES, tp=[1]
    )
    attn = _table(run.profile, "core_attn@full")
    assert attn.source is not None and attn.source.startswith("roofline")
    assert "no decode attention for 4 heads / 2 KV heads of 64" in attn.source
    roof = RooflineLatency(default_catalog().get("h100"))
    layer = model.layers[0]
    op = next(o for o in layer.ops if o.name == "core_attn")
    assert attn.latency_s[2][1] == roof.op_latency_s(model, op, layer, 1, 4, attn.contexts[1])
    norm = _table(run.profile, "attn_norm@full")
    assert norm.source == "roofline (attn_norm is not in the database)"
    assert "core_attn@full@tp1" in run.profile.provenance.settings["roofline_tables"]


def test_allreduce_is_the_engines_measured_one(tmp_path: Path, tiny) -> None:
    model, _ = tiny
    run = import_profile(
        model, "h100", database=write_database(tmp_path), batches=BATCHES, tp=[1, 2]
    )
    reduce, gather = run.profile.collectives
    assert (reduce.kind, reduce.gpus) == ("allreduce", 2)
    assert reduce.source == "vllm custom all-reduce (0.24.0)"
    o_proj = next(o for o in model.layers[0].ops if o.name == "o_proj")
    # 4 tokens x 256 BF16 values = 1024 elements: a measured message size
    measured = ar_ms(1024) * 1e-3
    assert ProfiledLatency(run.profile).collective_s(o_proj, 2, 4) == pytest.approx(
        measured, rel=1e-12
    )
    # the head's logits are all-gathered: NCCL's measured all-gather of the gathered tensor
    assert (gather.kind, gather.gpus, gather.source) == ("allgather", 2, "NCCL all-gather (2.29.2)")
    head = next(o for o in model.post_ops if o.name == "lm_head")
    # 8 tokens x 1000 logits = 8000 elements, between the measured 4096 and 8192: log-log
    lo, hi = ag_ms(4096) * 1e-3, ag_ms(8192) * 1e-3
    t = (math.log(8000) - math.log(4096)) / (math.log(8192) - math.log(4096))
    expected = math.exp((1 - t) * math.log(lo) + t * math.log(hi))
    got = ProfiledLatency(run.profile).collective_s(head, 2, 8)
    assert got == pytest.approx(expected, rel=1e-9)
    assert got != pytest.approx(RooflineLatency(run.profile.device).collective_s(head, 2, 8))


def test_an_all_reduce_table_without_backends_is_read(tmp_path: Path, tiny) -> None:
    """TensorRT-LLM's all-reduce tables have no ``backend`` column: every row is read."""
    model, _ = tiny
    db = write_database(tmp_path)
    sizes = [2**i for i in range(7, 16)]
    _write(
        db / "h100_sxm" / "comm" / "trtllm" / "1.3.0rc20",
        "custom_allreduce_perf",
        {
            "allreduce_dtype": ["bfloat16"] * len(sizes),
            "num_gpus": [2] * len(sizes),
            "message_size": sizes,
            "latency": [ar_ms(e) / 2 for e in sizes],
        },
    )
    run = import_profile(model, "h100", engine="trtllm", database=db, batches=BATCHES, tp=[2])
    reduce = run.profile.collective("allreduce", 2)
    assert reduce is not None and reduce.source == "trtllm custom all-reduce (1.3.0rc20)"
    assert reduce(2048) == pytest.approx(ar_ms(1024) / 2 * 1e-3, rel=1e-12)  # 1024 BF16 values


def test_a_newer_version_without_the_table_leaves_the_older_one_in_use(
    tmp_path: Path, tiny
) -> None:
    """A version folder may hold another table of the op only (B200's SGLang 0.5.16 ``moe``
    holds a DeepSeek-V4 module table alone): the newest version that has the table is read."""
    model, _ = tiny
    db = write_database(tmp_path)
    _write(db / "h100_sxm" / "gemm" / "vllm" / "0.99.0", "other_perf", {"latency": [1.0]})
    run = import_profile(model, "h100", database=db, batches=BATCHES, tp=[1])
    assert run.versions["gemm_perf"] == "0.24.0"
    down = _table(run.profile, "down_proj@full")
    assert [row[0] for row in down.latency_s] == [gemm_ms(b, 256, 512) * 1e-3 for b in BATCHES]


def test_allreduce_fit_is_the_fastest_graph_time_per_cell(tmp_path: Path) -> None:
    """Two engines' tables on 2, 4 and 8 GPUs: the fit takes the faster per cell, graph rows
    only, and recovers the latency and bandwidth the faster one was written with."""
    db = write_database(tmp_path)
    cells = [(g, 2**i) for g in (2, 4, 8) for i in range(9, 20)]  # 1 KiB .. 1 MiB of BF16

    def ms(latency_us: float, gb_s: float, gpus: int, elements: int) -> float:
        return (latency_us * 1e-6 + 2 * (gpus - 1) / gpus * elements * 2 / (gb_s * 1e9)) * 1e3

    for engine, version, lat, bw in (
        ("vllm", "0.24.0", 5.0, 150.0),
        ("sglang", "0.5.14", 3.0, 200.0),
    ):
        rows = [(g, e, backend) for g, e in cells for backend in ("graph", "eager")]
        _write(
            db / "h100_sxm" / "comm" / engine / version,
            "custom_allreduce_perf",
            {
                "allreduce_dtype": ["bfloat16"] * len(rows),
                "num_gpus": [g for g, _, _ in rows],
                "message_size": [e for _, e, _ in rows],
                "backend": [f"{engine}_{b}" for _, _, b in rows],
                # eager calls are slower by far: the fit must not see them
                "latency": [ms(lat, bw, g, e) * (1 if b == "graph" else 0.1) for g, e, b in rows],
            },
        )
    from opweave.profiler import open_database
    from opweave.profiler._private.aic_allreduce import allreduce_fit

    fit = allreduce_fit(open_database(db), "h100_sxm")
    # eager rows written 10x faster would win if read: the fit is the faster graph table's
    assert fit.latency_s == pytest.approx(3.0e-6, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(200e9, rel=1e-6)
    assert fit.points == len(cells) and fit.max_residual_s < 1e-12
    assert fit.sources == ("vllm 0.24.0", "sglang 0.5.14")


def test_a_newer_layout_is_a_clear_error(tmp_path: Path, tiny) -> None:
    model, _ = tiny
    db = write_database(tmp_path, schema_version=3)
    with pytest.raises(ProfilerError, match="schema_version 3, not 1 or 2"):
        import_profile(model, "h100", database=db, batches=BATCHES, tp=[1])


def test_both_metadata_schemas_of_the_tested_release_read_alike(tmp_path: Path, tiny) -> None:
    # aiconfigurator-core 0.12 ships schema 2 beside 1 (B200 SGLang GEMMs): provenance only
    model, _ = tiny
    runs = [
        import_profile(
            model,
            "h100",
            database=write_database(tmp_path / str(v), schema_version=v),
            batches=BATCHES,
            tp=[1],
        )
        for v in (1, 2)
    ]
    one, two = (r.profile.model_dump(exclude={"provenance"}) for r in runs)
    assert one == two


def test_cli_import_then_plan_says_where_latencies_came_from(tmp_path: Path, tiny) -> None:
    _, config = tiny
    db = write_database(tmp_path)
    out = tmp_path / "h100.json"
    done = run_cli(
        "profile",
        "--model",
        str(config),
        "--from",
        "aiconfigurator",
        "--device",
        "h100",
        "--database",
        str(db),
        "--tp",
        "1",
        "--batches",
        "1,2,4,8",
        "-o",
        str(out),
        "--json",
    )
    doc = json.loads(done.stdout)
    assert doc["system"] == "h100_sxm" and doc["source"] == "aiconfigurator"
    plan_file = tmp_path / "plan.json"
    plan = json.loads(
        run_cli(
            "plan",
            str(config),
            "--gpus",
            "h100",
            "--context",
            "1K",
            "--tpot-slo-ms",
            "1000",
            "--profile",
            str(out),
            "-o",
            str(plan_file),
            "--json",
        ).stdout
    )
    assert any("imported from NVIDIA's silicon database" in a for a in plan["assumptions"])
    (source,) = json.loads(plan_file.read_text())["profiles"]
    assert source.startswith("h100-sxm:aiconfigurator:")
    sim = json.loads(
        run_cli(
            "simulate", str(plan_file), "--model", str(config), "--profile", str(out), "--json"
        ).stdout
    )
    assert sim["tpot_s"] > 0 and not sim["notes"]
    est = json.loads(
        run_cli(
            "estimate",
            str(config),
            "--gpu",
            "h100",
            "--batch",
            "4",
            "--context",
            "1K",
            "--profile",
            str(out),
            "--json",
        ).stdout
    )
    assert est["profile"]["source"] == "aiconfigurator"


@pytest.mark.skipif(find_spec("aiconfigurator_core") is not None, reason="the extra is installed")
def test_missing_extra_is_a_one_line_error(tmp_path: Path) -> None:
    done = run_cli(
        "profile",
        "--model",
        "qwen3-32b",
        "--from",
        "aiconfigurator",
        "--device",
        "h100",
        "-o",
        str(tmp_path / "p.json"),
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: opweave profile --from aiconfigurator needs the ")
    assert "opweave-profiler[aiconfigurator]" in done.stderr


@pytest.mark.skipif(find_spec("aiconfigurator_core") is None, reason="needs aiconfigurator-core")
def test_real_database_row() -> None:
    """With the package: qwen3-32b's o_proj at TP 1 (n 5120, k 8192, both measured) at batch 8
    is the fastest BF16 row the H100 vLLM table holds for that shape."""
    from opweave.profiler import open_database

    db = open_database()
    run = import_profile(load_model("qwen3-32b"), "h100", database=db, batches=(8,), tp=[1])
    rows = pq.read_table(db.root / "h100_sxm/gemm/vllm/0.24.0/gemm_perf.parquet").to_pandas()
    hit = rows[(rows.gemm_dtype == "bfloat16") & (rows.m == 8) & (rows.n == 5120)]
    expected = hit[hit.k == 8192].latency.min() * 1e-3
    assert _table(run.profile, "o_proj@full").latency_s[0][0] == expected


@pytest.mark.skipif(find_spec("aiconfigurator_core") is None, reason="needs aiconfigurator-core")
def test_catalog_all_reduce_is_the_databases_fit() -> None:
    """The GPU catalog's TP all-reduce (hardware.py [AIC-AR]) is the fit of the tested
    release's CUDA-graph tables, to the figures' rounding (0.1 us, 1 GB/s)."""
    from opweave.profiler import open_database
    from opweave.profiler._private.aic_allreduce import allreduce_fit
    from opweave.profiler._private.aic_db import SYSTEMS

    db = open_database()
    catalog = default_catalog()
    for gpu in ("a100-sxm-80gb", "h100-sxm", "h200-sxm", "b200", "b300", "gb200", "gb300"):
        fit, hw = allreduce_fit(db, SYSTEMS[gpu]), catalog.get(gpu)
        assert hw.allreduce_latency_s == pytest.approx(fit.latency_s, abs=0.051e-6), gpu
        assert hw.allreduce_bandwidth_bytes_per_s == pytest.approx(
            fit.bandwidth_bytes_per_s, abs=0.51e9
        ), gpu


@pytest.mark.skipif(find_spec("aiconfigurator_core") is None, reason="needs aiconfigurator-core")
def test_the_cost_models_kernel_fractions_are_the_databases_medians() -> None:
    """kernel_rates.py's fused-MoE and prefill-attention fractions ([AIC-MOE], [AIC-ATTN]) are
    the tested release's medians, to the figures' rounding (0.01)."""
    from opweave.costmodel._private import kernel_rates as k
    from opweave.profiler import open_database
    from opweave.profiler._private.aic_fractions import kernel_fractions

    found = kernel_fractions(open_database())

    def rounded(d: dict) -> dict:
        return {key: round(v, 2) for key, v in d.items()}

    assert rounded(found.grouped) == k.GROUPED_GEMM
    assert {a: rounded(f) for a, f in found.grouped_by_arch.items()} == k.GROUPED_GEMM_BY_ARCH
    assert tuple(rounded(found.widths).items()) == k.GROUPED_GEMM_WIDTH
    assert rounded(found.prefill) == k.PREFILL_ATTENTION


@pytest.mark.skipif(find_spec("aiconfigurator_core") is None, reason="needs aiconfigurator-core")
def test_real_database_deepseek_on_b200_imports_every_kernel_it_has() -> None:
    """The tested release's B200 SGLang tables: GEMMs under the version-2 metadata schema, the
    fused MoE of 0.5.14 beside a 0.5.16 folder without one."""
    from opweave.profiler import open_database

    run = import_profile(
        load_model("deepseek-v3"),
        "b200",
        engine="sglang",
        tp=[8],
        batches=(8,),
        contexts=(1024,),
        database=open_database(),
    )
    assert run.versions["gemm_perf"] == run.versions["moe_perf"] == "0.5.14"
    sources = {t.op.split("@")[0]: t.source or "" for t in run.profile.ops}
    assert sources["experts"].startswith("aiconfigurator moe fp8_block")
    assert sources["o_proj"].startswith("aiconfigurator gemm")


@pytest.mark.skipif(find_spec("aiconfigurator_core") is None, reason="needs aiconfigurator-core")
def test_real_database_gpt_oss_at_an_engine_only_split() -> None:
    """gpt-oss-120b's MXFP4 experts (intermediate 2880) split over 8 GPUs as the engines split
    them (whole 32-value blocks, the busiest rank's share): asked for, TP 8 is imported, as
    `opweave estimate` costs it; the default degrees, which plans use, leave it out."""
    from opweave.profiler import open_database

    config = Path(__file__).resolve().parents[2] / "tools/bench/configs/gpt-oss-120b.json"
    model, db = load_model(str(config)), open_database()
    run = import_profile(
        model, "b200", engine="sglang", tp=[8], batches=(1,), contexts=(1024,), database=db
    )
    assert {t.tp for t in run.profile.ops} == {8}
    default = import_profile(
        model, "b200", engine="sglang", batches=(1,), contexts=(1024,), database=db
    )
    assert 8 not in {t.tp for t in default.profile.ops}


# a two-layer DeepSeek-V3 at DeepSeek-V3's latent (512 + 64), the one the database's MLA
# attention was measured at; 4 heads, so 4 per rank at TP 1 and 2 at TP 2
MLA_CONFIG = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def mla_ms(heads: int, batch: int, context: int) -> float:
    return 0.010 + heads * batch * context * 1e-6


def write_mla(root: Path) -> Path:
    """The tiny database plus SGLang's MLA decode attention for 4 and 2 heads per rank."""
    data = write_database(root)
    cells = [(h, b, s) for h in (4, 2) for b in BATCHES for s in (1024, 2048, 4096)]
    _write(
        data / "h100_sxm" / "mla" / "sglang" / "0.5.14",
        "generation_mla_perf",
        {
            "mla_dtype": ["bfloat16"] * len(cells),
            "kv_cache_dtype": ["bfloat16"] * len(cells),
            "num_heads": [c[0] for c in cells],
            "batch_size": [c[1] for c in cells],
            "isl": [1] * len(cells),
            "step": [c[2] - 1 for c in cells],
            "latency": [mla_ms(*c) for c in cells],
        },
    )
    return data


def _mla_model(tmp_path: Path, **changes):
    path = tmp_path / "tiny-mla" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(MLA_CONFIG | changes))
    return load_model(str(path))


def test_mla_decode_attention_is_the_databases_latent_attention(tmp_path: Path) -> None:
    model = _mla_model(tmp_path)
    db = write_mla(tmp_path)
    run = import_profile(
        model,
        "h100",
        engine="sglang",
        database=db,
        batches=BATCHES,
        tp=[1, 2],
        contexts=(1024, 2048, 4096),
    )
    for tp, heads in ((1, 4), (2, 2)):
        attn = _table(run.profile, "core_attn@full", tp)
        assert attn.latency_s == tuple(
            tuple(mla_ms(heads, b, s) * 1e-3 for s in (1024, 2048, 4096)) for b in BATCHES
        )
        assert (attn.source or "").startswith("aiconfigurator generation_mla: 12 measured")
    # vLLM's table times the whole MLA module (projections included): the roofline's, and why
    run = import_profile(model, "h100", database=db, batches=BATCHES, tp=[1])
    attn = _table(run.profile, "core_attn@full")
    assert attn.source == "roofline (no MLA decode attention for vllm in the database)"


def test_mla_at_another_latent_falls_back_and_says_so(tmp_path: Path) -> None:
    model = _mla_model(tmp_path, kv_lora_rank=256)
    run = import_profile(
        model, "h100", engine="sglang", database=write_mla(tmp_path), batches=BATCHES, tp=[1]
    )
    attn = _table(run.profile, "core_attn@full")
    assert attn.source == (
        "roofline (MLA decode attention is measured at a 512 + 64 latent only, not 256 + 64)"
    )
    roof = RooflineLatency(default_catalog().get("h100"))
    layer = model.layers[0]
    op = next(o for o in layer.ops if o.name == "core_attn")
    assert attn.latency_s[1][0] == roof.op_latency_s(model, op, layer, 1, 2, attn.contexts[0])


def _write_moe(data: Path, balanced_ms: float, power_law_ms: float) -> None:
    """The tiny MLA model's experts (8 of hidden 256 x 64, top 2, BF16) at TP 1 in SGLang's
    fused-MoE table, under balanced and power-law routing."""
    rows = [(d, t) for d in ("balanced", "power_law_1.01") for t in BATCHES]
    _write(
        data / "h100_sxm" / "moe" / "sglang" / "0.5.14",
        "moe_perf",
        {
            "moe_dtype": ["bfloat16"] * len(rows),
            "num_tokens": [t for _, t in rows],
            "hidden_size": [256] * len(rows),
            "inter_size": [64] * len(rows),
            "topk": [2] * len(rows),
            "num_experts": [8] * len(rows),
            "moe_tp_size": [1] * len(rows),
            "moe_ep_size": [1] * len(rows),
            "distribution": [d for d, _ in rows],
            "latency": [balanced_ms if d == "balanced" else power_law_ms for d, _ in rows],
        },
    )


def test_balanced_moe_rows_faster_than_memory_are_passed_over(tmp_path: Path) -> None:
    """Balanced routing of 4 tokens over 8 experts (top 2) touches at least the 5.47 experts
    random routing touches in expectation: 5.47 x 3 x 256 x 64 x 2 bytes = 538 kB, 0.16 us at
    the H100's 3.35 TB/s. A balanced table below that is not a measurement of those experts."""
    model = _mla_model(tmp_path)
    experts = next(o for o in model.layers[1].ops if o.name == "experts")
    floor_s = float(experts.weight_bytes_read(4)) / 3.35e12
    assert floor_s == pytest.approx(8 * (1 - 0.75**4) * 3 * 256 * 64 * 2 / 3.35e12, rel=1e-9)

    def imported(balanced_ms: float) -> tuple[str, float]:
        db = write_mla(tmp_path / str(balanced_ms))
        _write_moe(db, balanced_ms, power_law_ms=0.02)
        run = import_profile(model, "h100", engine="sglang", database=db, batches=BATCHES, tp=[1])
        table = _table(run.profile, "experts@full")
        return table.source or "", table.latency_s[BATCHES.index(4)][0]

    source, seconds = imported(balanced_ms=0.1 * floor_s * 1e3)
    assert source.startswith("aiconfigurator moe bfloat16 power_law_1.01 (balanced rows faster")
    assert seconds == pytest.approx(0.02e-3)
    source, seconds = imported(balanced_ms=0.01)  # 10 us: above every point's floor
    assert source.startswith("aiconfigurator moe bfloat16 balanced")
    assert seconds == pytest.approx(0.01e-3)
