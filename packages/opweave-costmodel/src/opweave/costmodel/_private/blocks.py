"""The partition block of a model: its repeating, layer-aligned operator pattern (paper §4, B.1).

Derived from the layers' signatures, never hard-coded per model: 1 layer for Llama or Qwen3,
6 for Gemma 3 (5 sliding + 1 global), 4 for Qwen3-Next (3 linear + 1 full), and for DeepSeek-V3
a 1-layer MoE block after a prefix of 3 dense layers.
"""

from __future__ import annotations

from .model import LayerSpec, OperatorName, PartitionBlock


def partition_block(layers: tuple[LayerSpec, ...]) -> PartitionBlock:
    """The repeating block of a model's layers, after an irregular prefix if there is one.

    Without a prefix the block is the smallest period ``p`` with layer ``i`` interchangeable with
    layer ``i - p`` for all ``i``. A prefix of ``k`` layers is taken when it shortens the
    description: the pair ``(k, p)`` minimises ``k + p`` (ties: the shorter prefix), ``p``
    being the smallest period of layers ``k..n-1``, and every prefix layer having the attention
    kind and window of the block layer it aligns with (so the block's per-kind cut patterns
    apply to it; only its feed-forward may differ). DeepSeek-V3: 3 dense layers, then a
    1-layer MoE block.

    >>> from opweave.costmodel import load_model
    >>> block = load_model("gemma-3-27b").block
    >>> block.prefix_layers, block.period_layers, block.num_full_blocks
    (0, 6, 10)
    """
    n = len(layers)
    ids: dict[object, int] = {}
    sigs = [ids.setdefault(layer.signature, len(ids)) for layer in layers]
    kinds = [(layer.attention, layer.window_tokens) for layer in layers]
    periods = _suffix_periods(sigs)
    prefix, period = 0, periods[0]
    for k in range(1, n):
        if k >= prefix + period:
            break
        p = periods[k]
        if k + p < prefix + period and all(kinds[i] == kinds[k + (i - k) % p] for i in range(k)):
            prefix, period = k, p
    names: list[OperatorName] = []
    offsets: list[int] = []
    for offset, layer in enumerate(layers[prefix : prefix + period]):
        for op in layer.ops:
            names.append(op.name)
            offsets.append(offset)
    return PartitionBlock(
        period_layers=period,
        num_full_blocks=(n - prefix) // period,
        remainder_layers=(n - prefix) % period,
        op_names=tuple(names),
        op_layers=tuple(offsets),
        prefix_layers=prefix,
    )


def _suffix_periods(seq: list[int]) -> list[int]:
    """Smallest period of every suffix ``seq[k:]``, in O(n): a string's periods are its
    reverse's, and the prefix function of the reversed sequence gives every prefix's."""
    rev = seq[::-1]
    pi = [0] * len(rev)
    for i in range(1, len(rev)):
        j = pi[i - 1]
        while j and rev[i] != rev[j]:
            j = pi[j - 1]
        pi[i] = j + (rev[i] == rev[j])
    n = len(seq)
    return [(n - k) - pi[n - k - 1] for k in range(n)]
