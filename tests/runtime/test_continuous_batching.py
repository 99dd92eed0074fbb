"""Requests joining and leaving mid-run, and stages cut at arbitrary operator boundaries."""

from __future__ import annotations

import pytest

from opweave.runtime import LocalModel, operator_sequence

MAX_NEW_TOKENS = 12


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe", "qwen3_next"])
def test_requests_joining_mid_run_stay_exact(family, tiny_model, hf_greedy, prompts):
    model_dir = tiny_model(family)
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    model = LocalModel(model_dir)
    # Staggered arrivals: two at once, one after 3 steps, one after 7 (mixing prefill with decode).
    arrivals = {0: prompts[:2], 3: prompts[2:3], 7: prompts[3:]}
    ids: dict[str, int] = {}
    finished = {}
    step = 0
    while step <= max(arrivals) or model.has_unfinished():
        for p in arrivals.get(step, ()):
            ids[model.add_request(p, MAX_NEW_TOKENS)] = prompts.index(p)
        batch_size = len(model.running) + len(model.waiting)
        for gen in model.step():
            finished[ids[gen.request_id]] = gen
        if step in (4, 8):
            assert batch_size > 1  # requests really shared iterations
        step += 1

    assert [finished[i].token_ids for i in range(len(prompts))] == expected
    assert model.state_bytes() == 0  # every finished request released its caches


def test_max_running_queues_the_rest(tiny_model, hf_greedy, prompts):
    model_dir = tiny_model("qwen2")
    model = LocalModel(model_dir, max_running=2)
    for p in prompts:
        model.add_request(p, 6)
    model.step()
    assert len(model.running) == 2 and len(model.waiting) == len(prompts) - 2
    outputs = {}
    while model.has_unfinished():
        outputs.update((g.request_id, g.token_ids) for g in model.step())
    assert [outputs[f"req-{i}"] for i in range(len(prompts))] == hf_greedy(model_dir, prompts, 6)


def test_stop_token_ends_request_and_frees_it(tiny_model, hf_greedy, prompts):
    model_dir = tiny_model("mistral")
    reference = hf_greedy(model_dir, prompts[:1], MAX_NEW_TOKENS)[0]
    stop = reference[4]
    model = LocalModel(model_dir)
    model.add_request(prompts[0], MAX_NEW_TOKENS, stop_token_ids=[stop])
    done = []
    while model.has_unfinished():
        done += model.step()
    assert done[0].token_ids == reference[: reference.index(stop) + 1]
    assert done[0].finish_reason == "stop"
    assert model.state_bytes() == 0


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "mixtral", "qwen3_next"])
def test_cut_at_every_operator_boundary_stays_exact(family, tiny_model, hf_greedy, prompts):
    """One stage per operator: every boundary's activations cross pack/unpack, like a send."""
    model_dir = tiny_model(family)
    n_ops = len(operator_sequence(model_dir))

    model = LocalModel(model_dir, cuts=range(1, n_ops))

    assert len(model.segments) == n_ops
    assert model.generate(prompts, MAX_NEW_TOKENS) == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert model.weight_bytes == LocalModel(model_dir).weight_bytes
