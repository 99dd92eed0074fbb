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


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5),  # no dimension
        torch.ones(2, 0),  # no elements
        torch.tensor([True, False]),
        torch.arange(12, dtype=torch.int32).reshape(2, 6)[:, 1::2],
        torch.randn(2, 3, dtype=torch.float16),
        torch.randn(2, 3, requires_grad=True),
    ],
)
def test_round_trip_of_every_kind_of_tensor(tensor: torch.Tensor) -> None:
    meta = BatchMeta(("a", "b"), (1, 1), (3, 4), slots=(0, 1))
    out = unpack(pack(TokenBatch(meta, {"x": tensor})))
    assert out.meta == meta
    assert out["x"].dtype == tensor.dtype and out["x"].shape == tensor.shape
    assert torch.equal(out["x"], tensor.detach())


def test_round_trip_of_a_header_larger_than_the_first_read() -> None:
    ids = tuple(f"request-{i:04d}-" + "x" * 40 for i in range(300))  # ~18 KB of header
    meta = BatchMeta(ids, (1,) * 300, tuple(range(300)), slots=tuple(range(300)))
    hidden = torch.randn(300, 8)
    out = unpack(pack(TokenBatch(meta, {"hidden": hidden})))
    assert out.meta == meta and torch.equal(out["hidden"], hidden)


def test_unpack_of_a_message_inside_a_larger_buffer() -> None:
    """A transport may hand over a view into its receive buffer, at an aligned offset."""
    batch = _batch()
    packed = pack(batch)
    arena = torch.zeros(64 + packed.numel() + 32, dtype=torch.uint8)
    arena[64 : 64 + packed.numel()] = packed
    out = unpack(arena[64 : 64 + packed.numel()])
    assert out.meta == batch.meta
    for name, t in batch.tensors.items():
        assert torch.equal(out[name], t), name
