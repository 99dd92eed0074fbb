"""Qwen3-VL-MoE (qwen3_vl_moe: Qwen3-MoE's text layers in Qwen3-VL's multimodal wrapper) in the
runtime.

The tiny model also runs through every family-wide test (exactness, every plan kind, the traced
decode step, the operator contract) with the experts as transformers 5 saves them, one fused
tensor each in its compute layout ``[E, out, in]``. The released checkpoints store them
``[E, in, out]`` (transformers transposes them when it loads one); here: a copy of the tiny
model in that layout gives transformers' tokens whole, over two tensor-parallel ranks (each
expert's channels cut) and over two expert-parallel ranks (whole experts), and a file in
neither layout is a one-line error.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import CheckpointError, Request, RunOptions, run_plan

MAX_NEW_TOKENS = 16  # the family-wide tests' count: hf_greedy's cache is shared with them
FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.fixture(scope="module")
def vl_moe(tiny_model):
    return tiny_model("qwen3_vl_moe")


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of ``src`` whose fused expert tensors are ``change(tensor)``."""
    shutil.copytree(src, dst)
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no iterator)
        metadata = f.metadata()
    for name in tensors:
        if name.endswith(FUSED):
            tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, dst / "model.safetensors", metadata=metadata)
    return dst


@pytest.fixture(scope="module")
def released(vl_moe, tmp_path_factory):
    """The tiny model with its experts stored as the released checkpoints store them."""
    dst = tmp_path_factory.mktemp("released") / "qwen3_vl_moe"
    return _rewrite(vl_moe, dst, lambda t: t.transpose(1, 2))


def test_the_tiny_model_is_a_qwen3_vl_moe_with_fused_experts(vl_moe, released):
    arch = load_model(vl_moe).arch
    assert arch.family == "qwen3_vl_moe" and arch.moe is not None and arch.moe.experts_in_out
    hidden, inter, experts = arch.hidden_size, arch.moe.intermediate_size, arch.moe.num_experts
    name = "model.language_model.layers.0.mlp.experts.down_proj"
    for folder, shape in ((vl_moe, [experts, hidden, inter]), (released, [experts, inter, hidden])):
        with safe_open(folder / "model.safetensors", "pt") as f:
            assert f.get_slice(name).get_shape() == shape


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2)])
def test_released_layout_generates_transformers_greedy_tokens(
    tp, ep, vl_moe, released, hf_greedy, prompts
):
    """Whole, every expert's channels over two TP ranks, or whole experts over two EP ranks:
    the released layout's tokens are transformers' (of the same weights, as it saves them)."""
    plan = canonical_plan(
        load_model(released), "colocated", gpu="cpu", batch=4, microbatches=1, tp=tp, ep=ep, dp=ep
    )
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    result = run_plan(plan, released, requests, RunOptions(timeout_s=30.0))
    assert result is not None and len(result.ranks) == tp * ep
    assert [list(o.token_ids) for o in result.outputs] == hf_greedy(vl_moe, prompts, MAX_NEW_TOKENS)


def test_experts_in_neither_layout_are_a_one_line_error(vl_moe, tmp_path):
    bad = _rewrite(vl_moe, tmp_path / "bad", lambda t: t[:, :-1])
    plan = canonical_plan(load_model(bad), "colocated", gpu="cpu", batch=2, microbatches=1)
    with pytest.raises(CheckpointError, match=r"experts\.(gate_up|down)_proj' has shape") as err:
        run_plan(plan, bad, [Request((4, 5, 6), 2)], RunOptions(timeout_s=30.0))
    assert "\n" not in str(err.value)
