"""Quantised checkpoints: block-FP8, per-tensor FP8 and MXFP4 safetensors load, shard over TP
with their scales, and generate the greedy tokens transformers generates on the same weights
dequantised by the tests' own code (:mod:`tests.quantise`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from opweave.cli.app import main
from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import (
    CheckpointError,
    LocalModel,
    Request,
    RunOptions,
    Shard,
    ShardingError,
    StageModule,
    UnsupportedModelError,
    run_plan,
    write_tiny_model,
)
from tests.quantise import gpt_oss_mxfp4_pair, quantised_pair

MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def block_fp8_model(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8block")
    src = write_tiny_model("qwen3_moe", root / "src")
    return quantised_pair(src, root, "fp8-block")


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mxfp4")
    # experts' down projections split over TP 2 into whole 32-value scale groups
    src = write_tiny_model("qwen3_moe", root / "src", moe_intermediate_size=64)
    return quantised_pair(src, root, "mxfp4")


def _run(
    model_dir: Path, strategy: str, tp: int, prompts, ep: int = 1, dp: int = 1
) -> list[list[int]]:
    plan = canonical_plan(
        load_model(model_dir),
        strategy,
        gpu="cpu",
        batch=4 * dp,
        microbatches=1 if strategy == "colocated" or dp > 1 else 2,
        tp=tp,
        ep=ep,
        dp=dp,
    )
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=20.0))
    assert result is not None
    return [list(out.token_ids) for out in result.outputs]


# -- tokens ----------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["colocated", "afd"])
def test_block_fp8_checkpoint_over_tp2(strategy, block_fp8_model, hf_greedy, prompts):
    quant_dir, oracle_dir = block_fp8_model
    expected = hf_greedy(oracle_dir, prompts, MAX_NEW_TOKENS)
    assert _run(quant_dir, strategy, 2, prompts) == expected
    assert len({t for out in expected for t in out}) >= 8


@pytest.mark.parametrize("strategy", ["colocated", "afd"])
def test_mxfp4_experts_over_tp2(strategy, mxfp4_model, hf_greedy, prompts):
    quant_dir, oracle_dir = mxfp4_model
    assert _run(quant_dir, strategy, 2, prompts) == hf_greedy(oracle_dir, prompts, MAX_NEW_TOKENS)


@pytest.mark.parametrize("strategy", ["colocated", "afd"])
def test_gpt_oss_released_mxfp4_experts_over_tp2(strategy, tmp_path, hf_greedy, prompts):
    """gpt-oss's own layout: packed experts stored out-by-in, biases and attention unquantised."""
    src = write_tiny_model("gpt_oss", tmp_path / "src", intermediate_size=64)
    quant_dir, oracle_dir = gpt_oss_mxfp4_pair(src, tmp_path)
    assert load_model(quant_dir).precision.quant == "mxfp4"
    assert _run(quant_dir, strategy, 2, prompts) == hf_greedy(oracle_dir, prompts, MAX_NEW_TOKENS)


@pytest.mark.parametrize("strategy", ["colocated", "afd"])
def test_nvfp4_checkpoint_over_tp2(strategy, tmp_path, hf_greedy, prompts):
    src = write_tiny_model("qwen3_moe", tmp_path / "src", moe_intermediate_size=64)
    quant_dir, oracle_dir = quantised_pair(src, tmp_path, "nvfp4")
    assert load_model(quant_dir).precision.quant == "nvfp4"
    assert _run(quant_dir, strategy, 2, prompts) == hf_greedy(oracle_dir, prompts, MAX_NEW_TOKENS)


# (tp, ep, dp): one expert set per GPU of two attention replicas (by all-to-all); two sets of
# two GPUs, each expert's channels (and their scale blocks) split over its set
@pytest.mark.parametrize(
    ("fmt", "tp", "ep", "dp"),
    [("fp8-block", 2, 2, 2), ("mxfp4", 1, 2, 2), ("gpt-oss-mxfp4", 2, 2, 2)],
    ids=str,
)
def test_quantised_experts_under_expert_parallelism(
    fmt, tp, ep, dp, block_fp8_model, mxfp4_model, tmp_path, hf_greedy, prompts
):
    if fmt == "gpt-oss-mxfp4":
        src = write_tiny_model("gpt_oss", tmp_path / "src", intermediate_size=64)
        quant_dir, oracle_dir = gpt_oss_mxfp4_pair(src, tmp_path)
    else:
        quant_dir, oracle_dir = block_fp8_model if fmt == "fp8-block" else mxfp4_model
    expected = hf_greedy(oracle_dir, prompts, MAX_NEW_TOKENS)
    assert _run(quant_dir, "colocated", tp, prompts, ep=ep, dp=dp) == expected


def test_fp8_checkpoints_in_one_process(tmp_path, hf_greedy, prompts):
    """Per-tensor FP8, and 128x128 blocks larger than every tiny matrix (partial blocks)."""
    src = write_tiny_model("llama", tmp_path / "src")
    for fmt, block in (("fp8", (16, 16)), ("fp8-block", (128, 128))):
        quant_dir, oracle_dir = quantised_pair(src, tmp_path / fmt, fmt, block)
        model = LocalModel(quant_dir)
        assert load_model(quant_dir).precision.quant == fmt
        assert model.generate(prompts, MAX_NEW_TOKENS) == hf_greedy(
            oracle_dir, prompts, MAX_NEW_TOKENS
        )


def test_opweave_run_serves_a_block_fp8_checkpoint_offline(
    block_fp8_model, hf_greedy, prompts, capsys
):
    """The CLI path: ``opweave run --strategy afd --tp 2`` on the quantised folder."""
    quant_dir, oracle_dir = block_fp8_model
    args = ["run", "--strategy", "afd", "--tp", "2", "--model-path", str(quant_dir)]
    for p in prompts:
        args += ["--prompt", " ".join(f"t{t}" for t in p)]
    code = main([*args, "--max-tokens", str(MAX_NEW_TOKENS), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    doc = json.loads(out.out)
    tokens = [o["token_ids"] for o in doc["outputs"]]
    assert tokens == hf_greedy(oracle_dir, prompts, MAX_NEW_TOKENS)
    # a rank reads its quantised slices and their scales, not dequantised weights: 1 byte a
    # value where the unquantised checkpoint stores 4
    oracle = load_model(oracle_dir).weight_bytes
    assert sum(r["weight_bytes_read"] for r in doc["ranks"]) < oracle


# -- errors ----------------------------------------------------------------------------------
def _edit(folder: Path, drop: str | None = None, **qc) -> Path:
    if drop is not None:
        tensors = load_file(folder / "model.safetensors")
        del tensors[drop]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] |= qc
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def fp8_llama(tmp_path) -> Path:
    src = write_tiny_model("llama", tmp_path / "src")
    return quantised_pair(src, tmp_path, "fp8-block", (32, 32))[0]


def test_a_tp_slice_that_cuts_a_scale_block_is_refused(fp8_llama):
    """Blocks of 32 rows, 16 key/value rows per rank at TP 2: refused before any rank starts,
    and by a rank that loads the slice anyway."""
    plan = canonical_plan(load_model(fp8_llama), "colocated", gpu="cpu", batch=2, tp=2)
    with pytest.raises(
        ShardingError,
        match=r"^plan owner 0 \(cpu x tp 2\) cannot shard L0.qkv_proj: self_attn.k_proj shards of "
        r"16 are not whole 32x32 FP8 scale blocks at tp 2",
    ):
        run_plan(plan, fp8_llama, [Request((5, 6), 2)])
    with pytest.raises(
        ShardingError,
        match=r"^model.layers.0.self_attn.k_proj.weight: a tensor-parallel slice \[16, 32\) of "
        r"dimension 0 cuts its fp8-block scale blocks of 32; choose a tp",
    ):
        StageModule(fp8_llama, [(0, "qkv_proj")], shard=Shard(rank=1, size=2))


def test_a_missing_scale_tensor_names_it(fp8_llama):
    name = "model.layers.1.mlp.down_proj.weight"
    _edit(fp8_llama, drop=name + "_scale_inv")
    with pytest.raises(
        CheckpointError,
        match=rf"fp8-block tensor '{name}' has no scale tensor '{name}_scale_inv'; the "
        "checkpoint is incomplete",
    ):
        LocalModel(fp8_llama)


def test_a_quantised_tensor_the_config_leaves_unquantised_is_refused(fp8_llama):
    _edit(fp8_llama, modules_to_not_convert=["o_proj"])
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model.layers.0.self_attn.o_proj.weight' is stored as fp8-block weights, "
        r"but the config \(.*\) leaves model.layers.0.self_attn.o_proj unquantised",
    ):
        LocalModel(fp8_llama)


def test_scales_of_another_block_size_are_refused(fp8_llama):
    _edit(fp8_llama, weight_block_size=[16, 16])
    with pytest.raises(CheckpointError, match=r"scale tensor '.*_scale_inv' has shape \[2, 2\]"):
        LocalModel(fp8_llama)


def test_an_unsupported_format_is_a_one_line_cli_error(tmp_path, capsys):
    src = write_tiny_model("llama", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (src / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    args = ["run", "--strategy", "colocated", "--model-path", str(src), "--prompt", "t5"]
    code = main([*args, "--max-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: the runtime does not run int4-wo weights yet (config.json")
    assert "it serves fp8, fp8-block, mxfp4, nvfp4 checkpoints, or unquantised ones" in err
    assert len(err.splitlines()) == 1
    with pytest.raises(UnsupportedModelError, match="does not run int4-wo weights"):
        LocalModel(src)


def test_mxfp4_groups_cut_by_tp_are_refused_before_any_rank_starts(tmp_path):
    """Experts of 32 channels: each of 2 ranks would hold 16 columns of a 32-value group."""
    src = write_tiny_model("qwen3_moe", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (src / "config.json").write_text(json.dumps(config))
    plan = canonical_plan(load_model(src), "afd", gpu="cpu", batch=2, tp=2)
    with pytest.raises(
        ShardingError,
        match=r"^plan owner 1 \(cpu x tp 2\) cannot shard L1.experts: mlp.experts.down_proj "
        r"shards of 16 are not whole 1x32 MXFP4 scale blocks at tp 2",
    ):
        run_plan(plan, src, [Request((5, 6), 2)])


# -- FP8 KV cache ----------------------------------------------------------------------------
def _fp8_kv_attention(module, query, key, value, *args, **kwargs):
    """transformers' SDPA attention over keys and values as an FP8 E4M3 cache with scale 1.0
    holds them (rounding is idempotent: cached keys come back unchanged)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    key, value = (t.to(torch.float8_e4m3fn).to(t.dtype) for t in (key, value))
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, *args, **kwargs)


def _fp8_kv_greedy(model_dir: Path, prompts) -> list[list[int]]:
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("opweave_test_fp8_kv", _fp8_kv_attention)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype="auto", attn_implementation="opweave_test_fp8_kv"
    )
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([list(p)]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
        )
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize(
    ("strategy", "decode_step"), [("colocated", "per-request"), ("afd", "static")]
)
def test_a_plan_with_an_fp8_kv_cache(strategy, decode_step, tiny_model, hf_greedy, prompts):
    model_dir = tiny_model("llama")
    model = load_model(model_dir, kv_cache_dtype="fp8")
    plan = canonical_plan(model, strategy, gpu="cpu", batch=4, microbatches=1, tp=2)
    assert plan.model.kv_cache_dtype == "fp8"
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    options = RunOptions(timeout_s=20.0, decode_step=decode_step)
    result = run_plan(plan, model_dir, requests, options)
    assert result is not None
    tokens = [list(out.token_ids) for out in result.outputs]
    expected = _fp8_kv_greedy(model_dir, prompts)
    assert tokens == expected
    # the rounding is visible: the same model with its KV cache in float32 differs
    assert expected != hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)


def test_quantising_while_loading_is_refused(tiny_model):
    """``--quant`` on an unquantised checkpoint costs a format the runtime does not make."""
    model_dir = tiny_model("llama")
    with pytest.raises(
        UnsupportedModelError,
        match=r"^--quant fp8-block: the runtime serves a checkpoint in the format it is stored in",
    ):
        StageModule(model_dir, [(0, "qkv_proj")], model=load_model(model_dir, quant="fp8-block"))


def test_opweave_run_a_plan_file_with_an_fp8_kv_cache(tmp_path, tiny_model, prompts, capsys):
    model_dir = tiny_model("llama")
    plan = canonical_plan(
        load_model(model_dir, kv_cache_dtype="fp8"), "colocated", gpu="cpu", batch=4
    )
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.model_dump_json())
    prompt = prompts[3]
    args = ["run", str(plan_file), "--model-path", str(model_dir), "--json"]
    args += ["--prompt", " ".join(f"t{t}" for t in prompt), "--max-tokens", str(MAX_NEW_TOKENS)]
    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out)["outputs"][0]["token_ids"] == _fp8_kv_greedy(model_dir, [prompt])[0]
