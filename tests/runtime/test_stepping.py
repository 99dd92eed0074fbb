"""The engine driver without vLLM: a plan's ranks advanced one scheduler step at a time.

:class:`StepDriver` is what vLLM's executor stands on; here a test plays the scheduler: requests
join and leave between steps, prompts arrive in chunks, a request restarts after preemption, and a
rank killed between steps fails the next one with an error naming it.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque

import pytest

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import Cluster, RequestStateError, RunFailedError, RunOptions
from opweave.runtime._private.stepping import StepDriver, StepItem
from opweave.runtime._private.work import SamplingParams

MAX_NEW_TOKENS = 16


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _cluster(model_dir, strategy: str = "afd", decode_step: str = "per-request", **plan) -> Cluster:
    """The ranks of ``strategy``'s canonical CPU plan (``plan``: batch, microbatches, tp, ...)
    for the model in ``model_dir``."""
    model = load_model(model_dir)
    layout = canonical_plan(model, strategy, gpu="cpu", **plan)
    return Cluster(layout, model, model_dir, RunOptions(timeout_s=20, decode_step=decode_step))


def _greedy(driver: StepDriver, prompts, *, chunk: int | None = None) -> list[list[int]]:
    """A scheduler: every request joins at once, prompts in chunks of ``chunk`` tokens."""
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        driver.add(rid, p)
    done = {rid: 0 for rid in rids}  # tokens computed
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    while any(len(v) < MAX_NEW_TOKENS for v in out.values()):
        items = []
        for rid in rids:
            if len(out[rid]) >= MAX_NEW_TOKENS:
                continue
            known = len(driver.requests[rid].token_ids)
            count = known - done[rid] if chunk is None else min(chunk, known - done[rid])
            items.append(StepItem(rid, done[rid], count))
            done[rid] += count
        for rid, token in driver.step(items).items():  # also appended to the requests
            out[rid].append(token)
        for rid in rids:
            if len(out[rid]) >= MAX_NEW_TOKENS and rid in driver.requests:
                driver.drop(rid)
    return [out[rid] for rid in rids]


@pytest.mark.parametrize(
    ("strategy", "tp", "replicas", "chunk"),
    [("afd", 1, 1, None), ("cad", 2, 2, 5), ("colocated", 1, 2, 3)],
    ids=["afd", "cad-tp2-replicas2-chunked", "colocated-replicas2-chunked"],
)
def test_steps_give_transformers_greedy_tokens(
    strategy, tp, replicas, chunk, tiny_model, hf_greedy, prompts
):
    model_dir = tiny_model("qwen3")
    mb = 1 if strategy == "colocated" else 2
    cluster = _cluster(
        model_dir, strategy, batch=4 // replicas, microbatches=mb, tp=tp, replicas=replicas
    )
    try:
        driver = StepDriver(cluster)
        assert driver.capacity == len(prompts) == 4
        tokens = _greedy(driver, prompts, chunk=chunk)
        driver.flush()  # the last requests' frees, without a next step
        stats = [r.model_dump(mode="json") for r in cluster.shutdown()]
    finally:
        cluster.close()
    assert tokens == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    # every request dropped was freed on every rank that held it
    assert all(r["requests_held_at_end"] == 0 and r["state_bytes_at_end"] == 0 for r in stats)


def test_slots_restart_and_sampling(tiny_model):
    model_dir = tiny_model("llama")
    cluster = _cluster(model_dir, batch=2, microbatches=2)
    try:
        driver = StepDriver(cluster)
        driver.add("a", [5, 6, 7])
        driver.add("b", [8, 9], SamplingParams(temperature=1.0, seed=7))
        # one request per microbatch: the emptiest microbatch gets each newcomer
        slots = {rid: driver.requests[rid].slot for rid in ("a", "b")}
        assert sorted(slots.values()) == [0, 1]
        with pytest.raises(RequestStateError, match="all 2 slots of the plan are taken"):
            driver.add("c", [1])
        first = driver.step([StepItem("a", 0, 3), StepItem("b", 0, 2)])
        assert set(first) == {"a", "b"}
        assert driver.requests["a"].token_ids == [5, 6, 7, first["a"]]  # the step appended it
        # preempted, then recomputed from scratch: the same next token as without it
        follow = driver.step([StepItem("a", 3, 1)])["a"]
        driver.restart("a", [5, 6, 7, first["a"]])  # as vLLM resumes it: every token known
        again = driver.step([StepItem("a", 0, 4)])["a"]
        assert again == follow
        driver.drop("b")
        driver.add("c", [1, 2])  # takes b's slot; b's state is freed with the next step
        assert driver.requests["c"].slot == slots["b"]
        assert set(driver.step([StepItem("c", 0, 2)])) == {"c"}
        stats = [r.model_dump(mode="json") for r in cluster.shutdown()]
    finally:
        cluster.close()
    # a and c are held by both owners' ranks; b was freed everywhere
    assert [r["requests_held_at_end"] for r in stats] == [2, 2]


def test_a_rank_killed_between_steps_fails_the_next_one(tiny_model):
    model_dir = tiny_model("llama")
    cluster = _cluster(model_dir, batch=2, microbatches=2, tp=2)
    notified: list[str] = []
    cluster.on_failure.append(lambda: notified.append("failed"))
    pids = cluster.pids
    try:
        driver = StepDriver(cluster)
        driver.add("a", [5, 6, 7])
        driver.step([StepItem("a", 0, 3)])
        os.kill(pids[3], signal.SIGKILL)  # owner 1's TP follower
        # the loss is seen between steps or in the next one, which fails naming the killed
        # rank (how soon: tools/bench/faults.py)
        with pytest.raises(RunFailedError) as info:
            while True:
                driver.step([StepItem("a", 3, 1)])
                time.sleep(0.05)
        message = str(info.value)
        assert message.startswith("rank 3 (owner 1, replica 0, tp rank 1 of 2: stages")
        assert "killed by signal 9 (SIGKILL)" in message and "\n" not in message
        with pytest.raises(RunFailedError, match="rank 3"):
            cluster.check()
        assert notified == ["failed"]
    finally:
        cluster.close()
    assert not any(_alive(p) for p in pids)


def test_carried_works_embed_the_tokens_the_ranks_sampled(tiny_model, hf_greedy):
    """A work can leave its tokens to the ranks: after a forward work the last segment's leader
    sends the tokens it sampled (a seeded sampled request's as well as a greedy one's) to the
    first segment's, and a carried work, which names no token ids, embeds those. Submitted all
    at once, before any result, carried works give the tokens that naming them one step at a
    time gives."""
    from opweave.runtime import Work

    model_dir = tiny_model("llama")
    prompts = ((5, 6, 7), (8, 9))
    steps = 6
    cluster = _cluster(model_dir, decode_step="static", batch=2, microbatches=1)
    i = cluster.first_iteration

    def prefill(rids: tuple[str, str], free: tuple[str, ...]) -> dict[str, list[int]]:
        nonlocal i
        params = {rids[1]: SamplingParams(temperature=1.0, seed=7)}
        lens = tuple(len(p) for p in prompts)
        ids = tuple(t for p in prompts for t in p)
        cluster.submit(Work(i, 0, rids, (0, 1), (0, 0), lens, (True,) * 2, ids, free, params))
        i += 1
        msg = cluster.result()
        return {rid: [t] for rid, t in zip(msg.request_ids, msg.token_ids, strict=True)}

    def contexts(step: int) -> tuple[int, int]:
        return (len(prompts[0]) + step, len(prompts[1]) + step)

    try:
        named = prefill(("g1", "s1"), ())
        for step in range(steps):
            last = tuple(named[rid][-1] for rid in ("g1", "s1"))
            work = Work(i, 0, ("g1", "s1"), (0, 1), contexts(step), (1, 1), (True,) * 2, last)
            cluster.submit(work)
            i += 1
            msg = cluster.result()
            for rid, t in zip(msg.request_ids, msg.token_ids, strict=True):
                named[rid].append(t)

        kept = prefill(("g2", "s2"), ("g1", "s1"))
        last = tuple(kept[rid][-1] for rid in ("g2", "s2"))
        for step in range(steps):  # every step submitted before the first result
            cluster.submit(
                Work(
                    i + step,
                    0,
                    ("g2", "s2"),
                    (0, 1),
                    contexts(step),
                    (1, 1),
                    (True,) * 2,
                    None if step else last,
                    forward=step < steps - 1,  # the last one's tokens go nowhere
                    carried=step > 0,
                )
            )
        for _ in range(steps):
            msg = cluster.result()
            for rid, t in zip(msg.request_ids, msg.token_ids, strict=True):
                kept[rid].append(t)
        stats = [r.model_dump(mode="json") for r in cluster.shutdown()]
    finally:
        cluster.close()
    assert kept["g2"] == named["g1"] and kept["s2"] == named["s1"]
    assert named["g1"] == hf_greedy(model_dir, prompts[:1], steps + 1)[0]
    # the sampled request's tokens are not greedy ones: the sampler's, not the step's, went on
    assert named["s1"] != hf_greedy(model_dir, prompts[1:], steps + 1)[0]
    ffn = next(r for r in stats if r["owner"] == 1)
    assert ffn["stages"][-1].endswith("sample")  # the owner that forwarded the tokens


def test_a_scheduler_running_ahead_over_static_steps(tiny_model, hf_greedy, prompts):
    """vLLM's asynchronous scheduling, played by the test: step N+1 is submitted before step N's
    tokens are collected, so its decode items name tokens still in flight. Over static decode
    steps the ranks keep those tokens (carried works); a request that stops while its next step
    is in flight has that step's token dropped, and a request joining then needs its prompt run
    beside the others, so that step first waits for the tokens in flight. Tokens are
    transformers'; every request is freed on every rank."""
    model_dir = tiny_model("llama")
    late = (9, 8, 7, 6)
    reference = hf_greedy(model_dir, [*prompts, late], MAX_NEW_TOKENS)
    stop_after = {"r1": 5}  # r1 stops early, as on a stop token: one more step is in flight
    cluster = _cluster(model_dir, decode_step="static", batch=4, microbatches=2)
    try:
        driver = StepDriver(cluster)
        driver.carry = True  # as the vLLM executor sets it when its engine schedules ahead
        rids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(rids, prompts, strict=True):
            driver.add(rid, p)
        scheduled = dict.fromkeys(rids, 0)  # vLLM's num_computed_tokens
        sampled = dict.fromkeys(rids, 0)  # tokens asked for, in flight included
        out: dict[str, list[int]] = {rid: [] for rid in rids}
        queue: deque = deque()
        dropped: list[str] = []
        while scheduled or queue:
            items = []
            for rid in list(scheduled):
                if sampled[rid] >= MAX_NEW_TOKENS:  # a budget is known ahead; a stop is not
                    continue
                count = len(driver.requests[rid].token_ids) if not scheduled[rid] else 1
                items.append(StepItem(rid, scheduled[rid], count))
                scheduled[rid] += count
                sampled[rid] += 1
            if items:
                queue.append(driver.submit(items))
            if len(queue) == 2 or not items:  # the batch queue is full: take the oldest
                for rid, token in driver.collect(queue.popleft()).items():
                    if rid in scheduled:
                        out[rid].append(token)
                    else:  # a step it ran after it stopped
                        dropped.append(rid)
                stopped = [r for r in scheduled if len(out[r]) >= stop_after.get(r, MAX_NEW_TOKENS)]
                for rid in stopped:
                    del scheduled[rid]
                    driver.drop(rid)
                    if rid == "r1":  # its slot goes to a new request
                        driver.add("r4", late)
                        scheduled["r4"] = sampled["r4"] = 0
                        out["r4"] = []
        driver.flush()
        carried = driver.carried_works
        stats = [r.model_dump(mode="json") for r in cluster.shutdown()]
    finally:
        cluster.close()
    expected = {f"r{i}": tokens for i, tokens in enumerate(reference)}
    expected["r1"] = expected["r1"][:5]
    assert out == expected
    assert dropped == ["r1"] and carried > 0
    assert all(r["requests_held_at_end"] == 0 and r["state_bytes_at_end"] == 0 for r in stats)


def test_a_request_added_again_under_its_id_keeps_its_new_state(tiny_model, hf_greedy):
    """A request dropped and added again under the same id before the next step lands in
    another microbatch; its old microbatch's free must not reach the ranks after its new
    admission (both microbatches run on every rank here), or its next step finds no state."""
    model_dir = tiny_model("llama")
    cluster = _cluster(model_dir, batch=2, microbatches=2)
    try:
        driver = StepDriver(cluster)
        driver.add("x", [1, 2, 3])
        driver.add("a", [5, 6, 7])
        assert (driver.requests["x"].slot, driver.requests["a"].slot) == (0, 1)
        driver.step([StepItem("x", 0, 3), StepItem("a", 0, 3)])
        driver.drop("x")
        driver.drop("a")
        driver.add("a", [5, 6, 7])
        assert driver.requests["a"].slot == 0  # the other microbatch
        tokens = [driver.step([StepItem("a", 0, 3)])["a"]]
        tokens.append(driver.step([StepItem("a", 3, 1)])["a"])
        stats = [r.model_dump(mode="json") for r in cluster.shutdown()]
    finally:
        cluster.close()
    assert tokens == hf_greedy(model_dir, [(5, 6, 7)], 2)[0]
    assert [r["requests_held_at_end"] for r in stats] == [1, 1]
