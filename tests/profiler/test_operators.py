"""Random weights match real checkpoints; synthetic KV state is what the runtime would hold."""

from __future__ import annotations

import pytest
import torch

from opweave.runtime import (
    TINY_CONFIGS,
    BatchMeta,
    Checkpoint,
    TokenBatch,
    build_operator,
    model_spec,
    operator_sequence,
)

FAMILIES = list(TINY_CONFIGS)  # every family the runtime serves

# Random weights use one name where checkpoints of different families differ (the runtime asks
# the checkpoint which it holds).
_ONE_NAME = (
    ("model.language_model.", "model."),
    ("block_sparse_moe.", "mlp."),
    ("mlp.shared_experts.", "mlp.shared_expert."),
    ("mlp.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
)


def _one_name(name: str) -> str:
    for theirs, ours in _ONE_NAME:
        name = name.replace(theirs, ours)
    return name


@pytest.mark.parametrize("family", FAMILIES)
def test_random_weights_have_the_checkpoint_shapes(family, tiny_model) -> None:
    """Every tensor the runtime reads exists in tensor_shapes with the checkpoint's shape."""
    from opweave.profiler import RandomCheckpoint, tensor_shapes

    folder = tiny_model(family)
    spec = model_spec(folder)
    real = Checkpoint(folder)
    ops = [build_operator(spec, real, ref) for ref in operator_sequence(spec)]
    shapes = tensor_shapes(spec.arch)
    for name in list(real.names_read):
        if ".experts." in name and name not in shapes:  # per-expert files, stacked on load
            continue
        tensor = real.get(name)
        assert shapes[_one_name(name)] == tuple(tensor.shape), name
    fake = RandomCheckpoint(spec.arch, seed=1)
    built = [build_operator(spec, fake, ref) for ref in operator_sequence(spec)]

    def names(operators) -> list[list[str]]:
        return [[_one_name(n) for n in op.weight_sizes] for op in operators]

    assert names(built) == names(ops)
    assert sum(op.weight_bytes for op in built) == sum(op.weight_bytes for op in ops)


def test_random_weights_are_finite_reproducible_and_shared_when_tied(tiny_model) -> None:
    from opweave.profiler import RandomCheckpoint

    folder = tiny_model("qwen3")  # tied embeddings
    arch = model_spec(folder).arch
    a, b = RandomCheckpoint(arch, seed=3), RandomCheckpoint(arch, seed=3)
    name = a.layer_name(0, "mlp.gate_proj.weight")
    assert torch.equal(a.get(name), b.get(name)) and torch.isfinite(a.get(name)).all()
    embed = a.get(a.model_name("embed_tokens.weight"), shared=True)
    assert a.get(a.lm_head_name(), shared=True) is embed
    with pytest.raises(Exception, match="no shape known"):
        a.get("model.layers.0.no_such.weight")


def _attention(folder, layer: int):
    spec = model_spec(folder)
    from opweave.profiler import RandomCheckpoint

    ckpt = RandomCheckpoint(spec.arch)
    refs = [r for r in operator_sequence(spec) if r.layer == layer]
    ops = [build_operator(spec, ckpt, r) for r in refs]
    idx = next(i for i, r in enumerate(refs) if r.name == "core_attn")
    return spec.arch, ops[:idx], ops[idx]


@pytest.mark.parametrize(("family", "layer", "window"), [("llama", 0, None), ("mistral", 0, 8)])
def test_state_writer_holds_context_tokens_and_rewinds(family, layer, window, tiny_model) -> None:
    from opweave.profiler._private.state import StateWriter

    spec, prefix, attn = _attention(tiny_model(family), layer)
    writer = StateWriter(attn, prefix, budget_bytes=1e9)
    assert writer.direct
    rids, context = ("a", "b", "c"), 40
    writer.fill(rids, context)
    kv_per_token = 2 * spec.num_kv_heads * spec.head_dim * 4
    held = min(context + 1, window or context + 1)
    assert attn.state_bytes("a") == held * kv_per_token
    q = torch.randn(3, spec.num_heads, spec.head_dim)
    k = torch.randn(3, spec.num_kv_heads, spec.head_dim)
    batch = TokenBatch(BatchMeta(rids, (1, 1, 1), (context,) * 3), {"q": q, "k": k, "v": k})
    for _ in range(3):  # the same decode step, repeatedly, thanks to rewind
        out = attn(batch)
        writer.rewind(rids, context)
    assert out["hidden"].shape == (3, spec.num_heads * spec.head_dim)
    assert attn._states["a"].length == context
    writer.release()
    assert attn.request_ids == ()


def test_state_writer_shares_buffers_beyond_its_budget(tiny_model) -> None:
    from opweave.profiler._private.state import StateWriter

    spec, prefix, attn = _attention(tiny_model("llama"), 0)
    per_request = 2 * spec.num_kv_heads * spec.head_dim * 4 * 101
    writer = StateWriter(attn, prefix, budget_bytes=2 * per_request)
    writer.fill(tuple(f"r{i}" for i in range(5)), 100)
    assert writer.aliased
    assert attn._states["r0"].k.data_ptr() == attn._states["r2"].k.data_ptr()
    assert attn._states["r0"].k.data_ptr() != attn._states["r1"].k.data_ptr()
    writer.release()


def test_state_writer_falls_back_to_prefill(tiny_model) -> None:
    """If the runtime's state layout is not recognised, public prefill still works."""
    from opweave.profiler._private.state import StateWriter

    _, prefix, attn = _attention(tiny_model("qwen3_next"), 3)  # full attention layer
    writer = StateWriter(attn, prefix, budget_bytes=1e9)
    writer.layout = None
    writer.fill(("a", "b"), 20)
    assert writer.context == {"a": 20, "b": 20}
    assert attn._context_lens == {"a": 20, "b": 20}
    writer.release()
