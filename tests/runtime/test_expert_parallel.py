"""Expert parallelism with data-parallel attention: an MoE owner's experts sharded over its GPUs,
each GPU an attention replica with its own slice of the batch, tokens equal to transformers'."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors import safe_open

from opweave.costmodel import Plan, canonical_plan, load_model
from opweave.runtime import PlanMismatchError, Request, RunOptions, run_plan

MAX_NEW_TOKENS = 16  # the same as the other runtime tests, so hf_greedy's cache is shared
TIMEOUT_S = 20.0


def _ep_plan(model_dir: Path, strategy: str, *, ep: int = 2, batch: int = 4, mb: int = 1) -> Plan:
    return canonical_plan(
        load_model(model_dir), strategy, gpu="cpu", batch=batch, microbatches=mb, ep=ep, dp=ep
    )


def _run(model_dir: Path, plan: Plan, prompts, **kw) -> dict:
    requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=TIMEOUT_S, **kw))
    assert result is not None
    return result.model_dump(mode="json")


def _checkpoint_bytes(model_dir: Path) -> tuple[int, dict[int, int]]:
    """Bytes of every tensor in the checkpoint, and of each routed expert's (summed over
    layers), from the safetensors header: ``experts.<e>.`` tensors or fused ``[E, ...]`` ones."""
    total, per = 0, {}
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no iterator)
            t = f.get_slice(name)
            shape = t.get_shape()
            size = {"F32": 4, "BF16": 2, "F16": 2}[t.get_dtype()] * math.prod(shape)
            total += size
            if ".experts." not in name:
                continue
            index = name.split(".experts.", 1)[1].split(".")[0]
            if index.isdigit():
                per[int(index)] = per.get(int(index), 0) + size
            else:  # fused: experts along dim 0
                for e in range(shape[0]):
                    per[e] = per.get(e, 0) + size // shape[0]
    return total, per


@pytest.mark.parametrize("decode_step", ["per-request", "static"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_ep2_owner_generates_transformers_tokens(
    family, decode_step, tiny_model, hf_greedy, prompts
):
    model_dir = tiny_model(family)
    plan = _ep_plan(model_dir, "colocated")
    result = _run(model_dir, plan, prompts, decode_step=decode_step)
    assert [o["token_ids"] for o in result["outputs"]] == hf_greedy(
        model_dir, prompts, MAX_NEW_TOKENS
    )
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert [(r["owner"], r["replica"]) for r in ranks] == [(0, 0), (0, 1)]
    # each rank read everything but the other rank's experts
    total, experts = _checkpoint_bytes(model_dir)
    n = len(experts)
    for i, r in enumerate(ranks):
        others = sum(b for e, b in experts.items() if not i * n // 2 <= e < (i + 1) * n // 2)
        assert r["weight_bytes_read"] == total - others
