"""Per-request state: admitted, advanced, bounded for sliding/linear layers, released by free."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from opweave.runtime import BatchMeta, RequestStateError, StageModule, TokenBatch


def _prefill(stage: StageModule, rid: str, tokens: list[int]) -> TokenBatch:
    meta = BatchMeta((rid,), (len(tokens),), (0,))
    return stage(TokenBatch(meta, {"token_ids": torch.tensor(tokens)}))


def _core_attn(stage: StageModule, layer: int):
    return next(op for op in stage.operators if op.name == "core_attn" and op.layer == layer)


@pytest.mark.parametrize(
    ("family", "layer"), [("llama", 0), ("gemma3_text", 0), ("qwen3_next", 0), ("qwen3_next", 3)]
)
def test_free_releases_state_memory(family, layer, tiny_model):
    stage = StageModule.whole_model(tiny_model(family))
    stage.admit(["keep", "drop"])
    _prefill(stage, "keep", [5, 6, 7])
    _prefill(stage, "drop", list(range(10, 30)))
    op = _core_attn(stage, layer)
    held = [weakref.ref(t) for t in op._state_tensors("drop")]
    keep_bytes = stage.state_bytes("keep")
    assert stage.state_bytes("drop") > 0

    stage.free("drop")
    gc.collect()

    assert all(ref() is None for ref in held)
    assert stage.state_bytes() == keep_bytes
    assert stage.request_ids == ("keep",)


def test_sliding_layer_state_is_bounded_by_window(tiny_model):
    # layers 0-1 slide over a window of 8, layer 2 is global
    stage = StageModule.whole_model(tiny_model("gemma3_text"))
    spec = stage.arch
    stage.admit(["short", "long"])
    _prefill(stage, "short", list(range(5, 8)))
    _prefill(stage, "long", list(range(5, 45)))
    per_token = 2 * spec.num_kv_heads * spec.head_dim * 4
    sliding, full = _core_attn(stage, 0), _core_attn(stage, 2)
    assert sliding.state_bytes("long") == spec.sliding_window * per_token
    assert sliding.state_bytes("short") <= spec.sliding_window * per_token
    assert full.state_bytes("long") >= 40 * per_token > full.state_bytes("short")


def test_linear_layer_state_does_not_grow(tiny_model):
    stage = StageModule.whole_model(tiny_model("qwen3_next"))
    stage.admit(["a", "b"])
    _prefill(stage, "a", [5, 6])
    _prefill(stage, "b", list(range(5, 105)))
    op = _core_attn(stage, 0)
    assert op.state_bytes("a") == op.state_bytes("b") > 0


def test_state_errors_name_the_request(tiny_model):
    stage = StageModule.whole_model(tiny_model("llama"))
    stage.admit("a")
    with pytest.raises(RequestStateError, match="already admitted"):
        stage.admit("a")
    with pytest.raises(RequestStateError, match="'ghost' is not admitted"):
        stage.free("ghost")
    _prefill(stage, "a", [5, 6, 7])
    stale = BatchMeta(("a",), (1,), (1,))  # the layer holds 3 tokens, not 1
    with pytest.raises(RequestStateError, match="holds 3 tokens, batch says 1"):
        stage(TokenBatch(stale, {"token_ids": torch.tensor([9])}))


@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "qwen3_next"])
def test_chunked_prefill_continues_the_cache(family, tiny_model):
    """Feeding a prompt in pieces (a multi-token step after cached tokens) equals one prefill."""
    model_dir = tiny_model(family)  # window 8: the second piece spans the ring buffer's wrap
    whole = StageModule.whole_model(model_dir)
    pieces = StageModule.whole_model(model_dir)
    prompt = list(range(40, 60))
    whole.admit("r")
    pieces.admit("r")
    expected = _prefill(whole, "r", prompt)["token_ids"]
    _prefill(pieces, "r", prompt[:11])
    meta = BatchMeta(("r",), (9,), (11,))
    got = pieces(TokenBatch(meta, {"token_ids": torch.tensor(prompt[11:])}))["token_ids"]
    assert torch.equal(got, expected)
