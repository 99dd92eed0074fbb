"""Which tensor-parallel degrees a model's operators can be sharded over (Megatron-style).

The runtime shards exactly as described here, and the planner only proposes degrees that pass,
so a plan never asks for a split the runtime would refuse:

- ``embed`` / ``lm_head`` split the vocabulary;
- softmax attention (``qkv_proj``, ``core_attn``, ``o_proj``) splits query heads; key/value heads
  split too, or, with fewer KV heads than ranks, each KV head is held by ``tp / kv_heads`` ranks
  (as vLLM does);
- gated DeltaNet splits key heads (each with its value heads);
- dense and expert feed-forward layers split their intermediate channels;
- norms, rope, the router and sampling are replicated;
- a block-scaled FP8 weight's shards hold whole scale blocks (``quantize.block_tp_problem``).

``engine_splits=True`` also accepts the uneven splits serving engines run and the runtime does
not (MXFP4 routed experts in whole scale blocks, ``quantize.mxfp4_expert_blocks``): estimates of
engine deployments use it, the runtime and the planner never do.
"""

from __future__ import annotations

from collections.abc import Iterable

from .architecture import LINEAR
from .model import ModelSpec, OperatorSpec
from .quantize import block_tp_problem


def _split(n: int, tp: int, what: str) -> str | None:
    return None if n % tp == 0 else f"{what} of {n} does not split over tp {tp}"


def op_tp_problem(
    model: ModelSpec, op: OperatorSpec, tp: int, *, engine_splits: bool = False
) -> str | None:
    """Why operator ``op`` cannot be sharded over ``tp`` ranks (``None``: it can)."""
    a, name = model.arch, op.name
    where = op.key
    if tp == 1:
        return None
    if name in ("embed", "lm_head"):
        return _split(a.vocab_size, tp, f"{where}: vocabulary")
    if name in ("qkv_proj", "core_attn", "o_proj"):
        assert op.layer is not None
        if a.layer_types[op.layer] == LINEAR:
            assert a.linear_attn is not None
            return _split(a.linear_attn.num_k_heads, tp, f"{where}: linear key heads")
        problem = _split(a.num_heads, tp, f"{where}: attention heads")
        kv = a.num_kv_heads
        if problem is None and name != "o_proj" and kv % tp and tp % kv:
            problem = f"{where}: {kv} key/value heads neither split over tp {tp} nor divide it"
        return problem or block_tp_problem(op, model.precision, tp)
    if name in ("gate_up_proj", "down_proj"):
        problem = _split(a.intermediate_size, tp, f"{where}: intermediate size")
        return problem or block_tp_problem(op, model.precision, tp)
    if name == "experts":
        assert a.moe is not None
        problem = _split(a.moe.intermediate_size, tp, f"{where}: intermediate size")
        return problem or block_tp_problem(op, model.precision, tp, engine_splits=engine_splits)
    if name == "shared_expert":
        assert a.moe is not None
        return _split(a.moe.shared_intermediate_size, tp, f"{where}: intermediate size")
    return block_tp_problem(op, model.precision, tp)


def tp_problem(
    model: ModelSpec,
    tp: int,
    ops: Iterable[OperatorSpec] | None = None,
    *,
    engine_splits: bool = False,
) -> str | None:
    """Why ``model`` (or just its operators ``ops``) cannot run at tensor-parallel degree
    ``tp``; ``None`` when it can (``engine_splits``: see the module docstring).

    >>> from opweave.costmodel import load_model
    >>> tp_problem(load_model("qwen3-32b"), 8) is None
    True
    >>> tp_problem(load_model("qwen3-32b"), 3)
    'embed: vocabulary of 151936 does not split over tp 3'
    """
    if tp < 1:
        return f"tp must be at least 1, got {tp}"
    for op in model.operators if ops is None else ops:
        problem = op_tp_problem(model, op, tp, engine_splits=engine_splits)
        if problem:
            return problem
    return None
