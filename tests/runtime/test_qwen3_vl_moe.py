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


def _tokens(folder: Path, prompts, tp: int = 1, ep: int = 1) -> list[list[int]]:
    plan = canonical_plan(
        load_model(folder), "colocated", gpu="cpu", batch=4, microbatches=1, tp=tp, ep=ep, dp=ep
    )
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    result = run_plan(plan, folder, requests, RunOptions(timeout_s=30.0))
    assert result is not None and len(result.ranks) == tp * ep
    return [list(o.token_ids) for o in result.outputs]


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_released_layout_generates_transformers_greedy_tokens(
    tp, ep, vl_moe, released, hf_greedy, prompts
):
    """Whole; every expert's channels over two TP ranks; whole experts over two EP ranks; both
    (each rank a channel half of its expert set): the released layout's tokens are
    transformers' (of the same weights, as it saves them)."""
    assert _tokens(released, prompts, tp, ep) == hf_greedy(vl_moe, prompts, MAX_NEW_TOKENS)


def test_square_experts_are_told_apart_by_gate_up(tiny_model, hf_greedy, prompts, tmp_path):
    """Experts as wide as the model (moe_intermediate_size = hidden_size): down_proj is square
    in both layouts, so gate_up_proj's shape decides."""
    from opweave.runtime import write_tiny_model

    saved = write_tiny_model("qwen3_vl_moe", tmp_path / "saved", moe_intermediate_size=64)
    assert load_model(saved).arch.moe.intermediate_size == load_model(saved).arch.hidden_size
    flipped = _rewrite(saved, tmp_path / "flipped", lambda t: t.transpose(1, 2))
    assert _tokens(flipped, prompts) == hf_greedy(saved, prompts, MAX_NEW_TOKENS)


def test_experts_stored_in_two_layouts_are_a_one_line_error(tmp_path):
    """(With gate_up_proj square, H = 2I as in the family-wide tiny model, its layout cannot
    be seen, and down_proj's decides.)"""
    from opweave.runtime import write_tiny_model

    saved = write_tiny_model("qwen3_vl_moe", tmp_path / "saved", moe_intermediate_size=48)
    half = tmp_path / "half"
    shutil.copytree(saved, half)
    with safe_open(saved / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no iterator)
        metadata = f.metadata()
    for name in tensors:
        if name.endswith("mlp.experts.down_proj"):  # gate_up_proj left as transformers saves it
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, half / "model.safetensors", metadata=metadata)
    plan = canonical_plan(load_model(half), "colocated", gpu="cpu", batch=2, microbatches=1)
    with pytest.raises(CheckpointError, match="stored in different layouts") as err:
        run_plan(plan, half, [Request((4, 5, 6), 2)], RunOptions(timeout_s=30.0))
    assert "\n" not in str(err.value)


def test_experts_in_neither_layout_are_a_one_line_error(vl_moe, tmp_path):
    bad = _rewrite(vl_moe, tmp_path / "bad", lambda t: t[:, :-1])
    plan = canonical_plan(load_model(bad), "colocated", gpu="cpu", batch=2, microbatches=1)
    with pytest.raises(CheckpointError, match=r"experts\.(gate_up|down)_proj' has shape") as err:
        run_plan(plan, bad, [Request((4, 5, 6), 2)], RunOptions(timeout_s=30.0))
    assert "\n" not in str(err.value)


def test_quantised_experts_in_the_released_layout_are_refused(released, tmp_path):
    """The transposed layout is read unquantised only: a block-FP8 one is a one-line error
    naming the tensor, not a wrong dequantisation."""
    import torch

    quantised = tmp_path / "fp8"
    shutil.copytree(released, quantised)
    with safe_open(released / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (no iterator)
        metadata = f.metadata()
    for name in list(tensors):
        if name.endswith("mlp.experts.gate_up_proj"):
            w = tensors[name]
            tensors[name] = w.to(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.ones(w.shape[0], 1, 1)
    save_file(tensors, quantised / "model.safetensors", metadata=metadata)
    plan = canonical_plan(load_model(quantised), "colocated", gpu="cpu", batch=2, microbatches=1)
    with pytest.raises(CheckpointError, match=r"gate_up_proj is quantised and stored \[experts"):
        run_plan(plan, quantised, [Request((4, 5, 6), 2)], RunOptions(timeout_s=30.0))
