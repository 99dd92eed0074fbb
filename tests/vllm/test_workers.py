"""The vLLM executor's stage workers without vLLM: one process per plan owner, driven step by step.

:class:`WorkerPool` imports nothing from vLLM, so these run in the main suite: the workers give the
same tokens as the in-process pipeline, drop finished requests, fail fast with a named culprit when
one is killed, and leave no process behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import PlanMismatchError, RunFailedError, write_tiny_model
from opweave.runtime.vllm._engine import PlanPipeline, StepEngine, WorkItem
from opweave.runtime.vllm._workers import WorkerPool

PROMPTS = {"a": [5, 6, 7], "b": [8, 9, 10, 11, 12, 13], "c": [20]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _greedy(engine: StepEngine, steps: int) -> dict[str, list[int]]:
    """Prefill every prompt, then ``steps - 1`` decode steps; greedy tokens per request."""
    for rid, prompt in PROMPTS.items():
        engine.add(rid, prompt)
    out: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for step in range(steps):
        items = []
        for rid, prompt in PROMPTS.items():
            known = len(engine.requests[rid].token_ids)
            first = step == 0
            items.append(WorkItem(rid, 0, len(prompt)) if first else WorkItem(rid, known - 1, 1))
        ids, logits = engine.run(items)
        assert logits is not None
        for rid, row in zip(ids, logits, strict=True):
            token = int(torch.argmax(row))
            engine.append_token(rid, token)
            out[rid].append(token)
    return out


@pytest.mark.parametrize("strategy", ["afd", "cad"])
def test_workers_give_the_in_process_tokens(model_dir, strategy) -> None:
    plan = canonical_plan(load_model(model_dir), strategy, gpu="cpu", batch=4, microbatches=2)
    pool = WorkerPool(model_dir, plan, timeout_s=60)
    try:
        assert len(pool.pids) == 2 and all(_alive(p) for p in pool.pids)
        workers = _greedy(StepEngine(pool), steps=6)
    finally:
        pool.close()
    assert _greedy(StepEngine(PlanPipeline(model_dir, plan)), steps=6) == workers
    assert not any(_alive(p) for p in pool.pids)


def test_a_killed_worker_fails_the_step_and_is_named(model_dir) -> None:
    plan = canonical_plan(load_model(model_dir), "afd", gpu="cpu", batch=4, microbatches=2)
    pool = WorkerPool(model_dir, plan, timeout_s=60)
    failures: list[str] = []
    pool.on_failure.append(lambda: failures.append("called"))
    try:
        engine = StepEngine(pool)
        engine.add("a", PROMPTS["a"])
        ids, _ = engine.run([WorkItem("a", 0, 3)])
        assert ids == ["a"]
        engine.append_token("a", 1)
        os.kill(pool.pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RunFailedError, match=r"owner 1 .* killed by signal 9 \(SIGKILL\)"):
            engine.run([WorkItem("a", 3, 1)])
        assert time.monotonic() - start < 10
        with pytest.raises(RunFailedError, match="owner 1"):
            pool.check()
        assert failures == ["called"]
        assert not any(_alive(p) for p in pool.pids)  # the survivor was killed and reaped too
    finally:
        pool.close()


def test_plans_with_replicas_or_tp_are_refused(model_dir) -> None:
    plan = canonical_plan(load_model(model_dir), "afd", gpu="cpu", batch=4, tp=2)
    with pytest.raises(PlanMismatchError, match="replicas 1 and tp 1"):
        WorkerPool(model_dir, plan)
