"""The activation wire format: one flat tensor that round-trips a batch exactly."""

from __future__ import annotations

import pytest
import torch

from opweave.runtime import BatchMeta, TokenBatch, pack, unpack


def _batch() -> TokenBatch:
    meta = BatchMeta(("req-α", "b", "c"), (5, 1, 1), (0, 9, 40))
    g = torch.Generator().manual_seed(0)
    return TokenBatch(
        meta,
        {
            "hidden": torch.randn(7, 64, generator=g),
            "residual": torch.randn(7, 64, generator=g).to(torch.bfloat16),
            "q": torch.randn(7, 4, 16, generator=g),
            "topk_ids": torch.randint(0, 8, (7, 2), generator=g),
            "topk_weights": torch.rand(7, 2, generator=g, dtype=torch.float64),
            "mask": torch.rand(7, generator=g) > 0.5,
            "odd": torch.arange(
                3, dtype=torch.int8
            ),  # a size that is not a multiple of the alignment
            "empty": torch.empty(0, 5),
        },
    )


def test_pack_is_one_flat_byte_tensor():
    buf = pack(_batch())
    assert buf.dim() == 1 and buf.dtype == torch.uint8


def test_pack_unpack_round_trip_is_bit_exact():
    batch = _batch()
    out = unpack(pack(batch))
    assert out.meta == batch.meta
    assert list(out.tensors) == list(batch.tensors)
    for name, t in batch.tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_round_trip_of_non_contiguous_tensor():
    t = torch.randn(8, 6)[:, ::2]
    out = unpack(pack(TokenBatch(BatchMeta(("a",), (8,), (0,)), {"x": t})))
    assert torch.equal(out["x"], t)


def test_positions_and_last_rows_follow_the_schedule():
    meta = BatchMeta(("a", "b", "c"), (3, 1, 2), (0, 7, 4))
    assert meta.positions.tolist() == [0, 1, 2, 7, 4, 5]
    assert meta.last_rows.tolist() == [2, 3, 5]
    assert meta.num_tokens == 6


def test_meta_rejects_duplicate_requests():
    with pytest.raises(ValueError, match="once per batch"):
        BatchMeta(("a", "a"), (1, 1), (0, 0))
