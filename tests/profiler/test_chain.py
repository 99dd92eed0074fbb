"""The decode-order chain a CPU profile is timed in: which layers it holds, which calls count
under which key."""

from __future__ import annotations

import pytest

from opweave.profiler._private.operators import plan_block, resolve_model, select_targets


def _layer_bytes(source, layer: int) -> int:
    return sum(op.weight_bytes for op in source.cost.operators if op.layer == layer)


def _chain(folder, working_set: float):
    source = resolve_model(folder)
    targets = select_targets(source)
    (chain,) = plan_block(source, targets, working_set)
    return source, chain


def test_chain_grows_by_whole_layers_until_the_working_set(tiny_model) -> None:
    folder = tiny_model("llama")  # four identical layers
    source, small = _chain(folder, 0)
    assert {r.layer for r in small.refs} == {None, 0}
    one = _layer_bytes(source, 0)
    _, two = _chain(folder, 1.5 * one)  # one layer is not enough, two are
    assert {r.layer for r in two.refs} == {None, 0, 1}
    _, whole = _chain(folder, 1e15)  # more than the model: every layer, once
    layers = source.cost.num_layers
    assert {r.layer for r in whole.refs} == {None, *range(layers)}
    assert whole.refs[0].name == "embed"
    assert [r.name for r in whole.refs][-3:] == ["final_norm", "lm_head", "sample"]


def test_every_layer_of_the_chain_is_timed_under_its_key(tiny_model) -> None:
    folder = tiny_model("llama")
    source, chain = _chain(folder, 1e15)
    per_key: dict[str, int] = {}
    for index, target in chain.timed.items():
        ref = chain.refs[index]
        per_key[target.key] = per_key.get(target.key, 0) + 1
        if ref.layer is not None:
            assert target.key == f"{ref.name}@full"
    layers = source.cost.num_layers
    assert per_key["qkv_proj@full"] == layers and per_key["core_attn@full"] == layers
    assert per_key["lm_head"] == 1 and per_key["embed"] == 1
    # every call of the chain is timed: the tiny llama has no operator without a table
    assert len(chain.timed) == len(chain.refs)


def test_keys_measured_under_another_key_pool_into_it(tiny_model) -> None:
    folder = tiny_model("gemma3_text")  # sliding layers and a global one share FFN shapes
    source, chain = _chain(folder, 1e15)
    attention = {i: layer.attention.value for i, layer in enumerate(source.cost.layers)}
    assert len(set(attention.values())) == 2
    for name in ("gate_up_proj", "down_proj"):
        calls = [(r.layer, chain.timed[i]) for i, r in enumerate(chain.refs) if r.name == name]
        assert {attention[layer] for layer, _ in calls} == set(attention.values())
        (target,) = {t.key: t for _, t in calls}.values()  # one table over both kinds
        assert target.same_as is None
    for i, ref in enumerate(chain.refs):  # attention itself stays per kind
        if ref.name == "core_attn":
            assert chain.timed[i].key == f"core_attn@{attention[ref.layer]}"


def test_profile_records_its_chain_and_working_set(tiny_model, quick_profile) -> None:
    folder = tiny_model("llama")
    source = resolve_model(folder)
    settings = quick_profile(folder, working_set_bytes=0.0).profile.provenance.settings
    assert settings["chain_layers"] == [0] and settings["working_set_bytes"] == 0
    settings = quick_profile(folder).profile.provenance.settings  # default: twice the cache
    assert settings["chain_layers"] == list(range(source.cost.num_layers))
    assert settings["working_set_bytes"] > 0


def test_working_set_must_not_be_negative(tiny_model) -> None:
    from opweave.profiler import ProfilerError, profile_model

    with pytest.raises(ProfilerError, match="working set must not be negative"):
        profile_model(tiny_model("llama"), working_set_bytes=-1.0, progress=False)
