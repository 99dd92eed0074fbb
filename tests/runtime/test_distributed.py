"""The multi-process runtime: every plan kind generates transformers' greedy tokens.

Each run forks one process per rank (gloo on 127.0.0.1) under the offline driver. Runs cost
about a second, so each test checks several things of one run: tokens, per-rank stages,
weights, timings.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from opweave.costmodel import Owner, Plan, StageTemplate, canonical_plan, load_model, segments
from opweave.runtime import (
    TINY_CONFIGS,
    FaultInjection,
    Placement,
    PlanMismatchError,
    Request,
    RunFailedError,
    RunOptions,
    ShardingError,
    StageModule,
    compile_schedule,
    run_plan,
)
from opweave.runtime._private.schedule import Compute

MAX_NEW_TOKENS = 16  # the same as the single-process tests, so hf_greedy's cache is shared
TIMEOUT_S = 10.0


def _plan(model_dir: Path, strategy: str = "afd", *, batch: int = 4, mb: int = 2, **kw) -> Plan:
    plan = canonical_plan(load_model(model_dir), strategy, gpu="cpu", batch=batch, microbatches=mb)
    return Plan.model_validate(plan.model_dump() | kw) if kw else plan


def _owners(*specs: tuple[int, int, int]) -> list[dict]:
    """``(tp, replicas, resident_batch)`` per owner."""
    return [Owner(gpu="cpu", tp=t, replicas=r, resident_batch=b).model_dump() for t, r, b in specs]


def _run(model_dir: Path, plan: Plan, prompts, limits=None, **kw) -> dict:
    limits = limits or [MAX_NEW_TOKENS] * len(prompts)
    requests = [Request(tuple(p), n) for p, n in zip(prompts, limits, strict=True)]
    result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=TIMEOUT_S, **kw))
    assert result is not None
    return result.model_dump(mode="json")


def _tokens(result: dict) -> list[list[int]]:
    return [out["token_ids"] for out in result["outputs"]]


def _split_block_template(model_dir: Path) -> StageTemplate:
    """Two stages cutting a multi-layer partition block mid-layer (both wrap layer boundaries)."""
    n = len(load_model(model_dir).block.op_names)
    return StageTemplate(cuts=(3, n // 2 + 2))


FAMILIES = list(TINY_CONFIGS)  # every family the runtime implements
# Every family under every plan kind; "split" cuts a partition block mid-layer across two owners.
CASES = [(family, kind, {}) for family in FAMILIES for kind in ("colocated", "afd", "cad", "split")]
CASES.append(("qwen3_next", "split", {"microbatches": 3, "batch": 6}))
CASES.append(("gemma3_text", "cad", {"microbatches": 3, "batch": 6}))


@pytest.mark.parametrize(
    ("family", "kind", "extra"),
    CASES,
    ids=[f"{f}-{k}" + (f"-mb{e['microbatches']}" if e else "") for f, k, e in CASES],
)
def test_plan_kinds_generate_transformers_greedy_tokens(
    family, kind, extra, tiny_model, hf_greedy, prompts
):
    model_dir = tiny_model(family)
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    mb, batch = extra.get("microbatches", 2), extra.get("batch", 4)
    if kind == "split":
        plan = _plan(
            model_dir,
            "afd",
            batch=batch,
            mb=mb,
            template=_split_block_template(model_dir).model_dump(),
        )
    else:
        plan = _plan(model_dir, kind, batch=batch, mb=1 if kind == "colocated" else mb)

    result = _run(model_dir, plan, prompts)

    assert _tokens(result) == expected
    assert [o["prompt_token_ids"] for o in result["outputs"]] == [list(p) for p in prompts]
    for out in result["outputs"]:  # one arrival time per token, in order, within the run
        times = out["token_times_s"]
        assert len(times) == len(out["token_ids"]) and times[0] >= 0
        assert times == sorted(times) and times[-1] <= result["wall_s"]
    placement = Placement(plan, load_model(model_dir))
    ranks = result["ranks"]
    assert len(ranks) == placement.world_size
    # ranks with a core each busy-poll while they wait; a lone rank never waits for a peer
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    own_core = 1 < placement.world_size <= cores and hasattr(os, "sched_setaffinity")
    assert {r["wait"] for r in ranks} == {"spin" if own_core else "block"}
    for r in ranks:
        assert r["stages"] == placement.stage_labels(r["rank"])
        assert r["busy_s"] > 0 and r["loop_s"] >= r["busy_s"]
        # the timeline: cumulative times at every iteration's end, ending at the totals
        line = r["timeline"]
        assert all(len(v) == r["iterations"] for v in line.values())
        for key, values in line.items():
            assert values == sorted(values), key
        assert line["end_s"][-1] <= r["loop_s"]
        assert line["busy_s"][-1] == r["busy_s"]
        assert r["computes_per_iteration"] == plan.microbatches * sum(
            1 for seg in placement.segments if seg.owner == placement.ranks[r["rank"]].owner
        )
    # the driver's own bookkeeping: one entry per microbatch it drove, cumulative
    driver = result["driver"]
    assert driver["microbatches_per_iteration"] == plan.microbatches and driver["drive_s"] > 0
    assert driver["timeline"]["drive_s"] == sorted(driver["timeline"]["drive_s"])
    # Each operator's weights were read by exactly one rank: together, the model once, except
    # that a tied embedding is read by both the embed rank and the lm_head rank when they differ.
    spec = load_model(model_dir)
    whole = StageModule.whole_model(model_dir).checkpoint.bytes_read
    segs = segments(spec, plan.template, len(plan.owners))
    tied = spec.pre_ops[0].tied_to is not None and segs[0].owner != segs[-1].owner
    extra = spec.pre_ops[0].weight_bytes if tied else 0
    assert sum(r["weight_bytes_read"] for r in ranks) == whole + extra
    assert result["tpot_s"] > 0


SHAPES = {  # (strategy, tp, replicas, resident batch per replica)
    "colocated-tp2": ("colocated", 2, 1, 4),
    "colocated-2-replicas": ("colocated", 1, 2, 2),
    "afd-tp2": ("afd", 2, 1, 4),
    "cad-tp2-2-replicas": ("cad", 2, 2, 2),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tensor_parallel_and_replicated_plans_offline(shape, tiny_model, hf_greedy, prompts):
    """The plan shapes the serving tests serve, here under the offline driver."""
    strategy, tp, replicas, batch = SHAPES[shape]
    model_dir = tiny_model("llama")
    mb = 1 if strategy == "colocated" else 2
    plan = canonical_plan(
        load_model(model_dir),
        strategy,
        gpu="cpu",
        batch=batch,
        microbatches=mb,
        tp=tp,
        replicas=replicas,
    )
    result = _run(model_dir, plan, prompts)
    assert _tokens(result) == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert len(result["ranks"]) == len(plan.owners) * tp * replicas
    assert result["max_active"] == len(prompts)  # every replica's slots in use


def test_a_driver_with_other_threads_starts_its_ranks_from_the_launcher(
    tiny_model, hf_greedy, prompts
):
    """A fork copies only the calling thread, so a lock another thread holds (OpenMP's, oneDNN's,
    an engine's) stays locked forever in the rank. A driver with other threads therefore starts
    its ranks from its clean launcher, kept for every later run of the process; each run's ranks
    take that run's options."""
    import threading

    model_dir = tiny_model("llama")
    plan = _plan(model_dir, "afd")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        runs = []
        for wait in ("block", "spin"):
            runs.append(_run(model_dir, plan, prompts, wait=wait))
    finally:
        stop.set()
        other.join()
    assert [r["driver"]["start_method"] for r in runs] == ["launcher", "launcher"]
    assert [{rank["wait"] for rank in r["ranks"]} for r in runs] == [{"block"}, {"spin"}]
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert [_tokens(r) for r in runs] == [expected, expected]


@pytest.mark.parametrize("strategy", ["afd", "cad"])
def test_gloo_point_to_point_transfers_keep_the_tokens(strategy, tiny_model, hf_greedy, prompts):
    """Torch point-to-point (the path CUDA ranks take with NCCL, here through gloo's
    isend/irecv: the test seam ``test_torch_p2p``): activations cross the cut through its
    receive buffers, which the batch is read from in place."""
    model_dir = tiny_model("llama")
    result = _run(model_dir, _plan(model_dir, strategy), prompts, test_torch_p2p=True)
    assert _tokens(result) == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)


def test_gloo_carries_static_steps_rows_and_fans_them_out(tiny_model, hf_greedy, prompts):
    """Torch point-to-point (gloo here, NCCL on CUDA) with static decode steps: decode
    iterations send each link's rows in one headerless transfer, received into the step's own
    rows; a TP-2 core-attention owner's leader broadcasts them to its group."""
    model_dir = tiny_model("llama")
    plan = _plan(model_dir, "cad", owners=_owners((1, 1, 4), (2, 1, 4)))
    result = _run(model_dir, plan, prompts, decode_step="static", test_torch_p2p=True)
    assert _tokens(result) == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    assert {rank["decode_step"] for rank in result["ranks"]} == {"static"}


def test_a_replica_without_requests_sends_padding_rows(tiny_model, hf_greedy, prompts):
    """Static steps, one microbatch over two attention replicas, two requests: both sit in the
    first replica's slots, so the second one's decode steps have no request to run and its
    rows go to the FFN rank as padding, which leaves the requests' tokens alone."""
    model_dir = tiny_model("llama")
    plan = _plan(model_dir, "afd", mb=1, owners=_owners((1, 2, 2), (1, 1, 4)))
    result = _run(model_dir, plan, prompts[:2], decode_step="static")
    assert _tokens(result) == hf_greedy(model_dir, prompts[:2], MAX_NEW_TOKENS)
    idle = next(r for r in result["ranks"] if r["owner"] == 0 and r["replica"] == 1)
    assert idle["busy_s"] == 0 and idle["bytes_sent"] > 0  # it ran nothing, yet sent its rows


def test_requests_join_as_slots_free_up(tiny_model, hf_greedy, prompts):
    """Six requests, two slots (one per microbatch), different lengths and budgets: requests
    join mid-run as others leave, prefill mixing with decode; every finished request is freed."""
    model_dir = tiny_model("llama")
    more = [*prompts, (9, 8, 7, 6), tuple(range(200, 230))]
    limits = [16, 4, 9, 2, 16, 7]
    expected = hf_greedy(model_dir, more, MAX_NEW_TOKENS)
    plan = _plan(model_dir, "afd", batch=2, mb=2)

    result = _run(model_dir, plan, more, limits)

    assert _tokens(result) == [e[:n] for e, n in zip(expected, limits, strict=True)]
    assert result["max_active"] == 2  # never more than the plan's slots
    assert result["iterations"] > max(limits)  # later requests waited for a slot
    for r in result["ranks"]:  # finished requests' KV caches were freed on every stage
        assert r["requests_held_at_end"] == 0 and r["state_bytes_at_end"] == 0


@pytest.mark.parametrize("decode_step", ["static", "traced"])
def test_tokens_stay_on_the_ranks_between_static_steps(decode_step, tiny_model, hf_greedy, prompts):
    """Static steps: the driver runs ahead, the FFN owner's TP leader forwarding each decode
    step's tokens to both attention replicas. Two requests stop on a token the driver cannot
    foresee (each runs one step more, whose token is dropped), the others on their budgets, and
    two more wait for slots, so the running ahead pauses for their admission and resumes: the
    tokens are transformers', and every request's state is freed on every rank. Traced steps
    run each decode iteration as a rank program (the forwarded tokens leave from inside it);
    an iteration that admits a request runs its actions one by one."""
    model_dir = tiny_model("llama")
    more = [*prompts, (9, 8, 7, 6), tuple(range(200, 230))]
    reference = hf_greedy(model_dir, more, MAX_NEW_TOKENS)
    limits = [16, 5, 16, 9, 16, 7]
    stops: list[tuple[int, ...]] = [(reference[0][3],), (), (reference[2][6],), (), (), ()]
    expected = []
    for tokens, limit, stop in zip(reference, limits, stops, strict=True):
        end = next((j + 1 for j, t in enumerate(tokens) if t in stop), len(tokens))
        expected.append(tokens[: min(end, limit)])
    assert len(expected[0]) < 16 and len(expected[2]) < 16  # both stop early
    plan = _plan(model_dir, "afd", mb=1, owners=_owners((1, 2, 2), (2, 1, 4)))
    requests = [
        Request(tuple(p), n, stop_token_ids=stop)
        for p, n, stop in zip(more, limits, stops, strict=True)
    ]

    options = RunOptions(timeout_s=TIMEOUT_S, decode_step=decode_step)
    result = run_plan(plan, model_dir, requests, options)

    assert result is not None
    assert [list(o.token_ids) for o in result.outputs] == expected
    assert [o.finish_reason for o in result.outputs] == ["stop", "length", "stop", *["length"] * 3]
    assert result.driver.works_ahead > 0
    for r in result.ranks:
        assert r.requests_held_at_end == 0 and r.state_bytes_at_end == 0


@pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux's schedstat and two cores",
)
def test_a_rank_reports_the_time_another_process_held_its_core(tiny_model, prompts):
    """A colocated rank pins itself to the last core; a busy loop pinned there too takes some
    of it, which the rank reports as time it waited for a CPU (runqueue_s), inside its loop and
    on its timeline; without the busy loop the field is still there. How much of the loop each
    run waited: ``tools/bench/host_timing.py`` (a share depends on the machine's load)."""
    import subprocess
    import sys

    model_dir = tiny_model("llama")
    plan = _plan(model_dir, "colocated", mb=1)
    core = max(os.sched_getaffinity(0))
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    )
    try:
        time.sleep(0.5)
        busy = _run(model_dir, plan, prompts)["ranks"][0]
    finally:
        hog.kill()
        hog.wait()
    alone = _run(model_dir, plan, prompts)["ranks"][0]
    assert 0 < busy["runqueue_s"] < busy["loop_s"]
    assert len(busy["timeline"]["runq_s"]) == busy["iterations"]
    assert busy["timeline"]["runq_s"][-1] == busy["runqueue_s"]
    assert 0 <= alone["runqueue_s"] < alone["loop_s"]


def test_two_replicas_and_a_tensor_parallel_owner(tiny_model, hf_greedy, prompts):
    """Owner 0 as two replicas (each holding half the slots), owner 1 sharded over TP 2."""
    model_dir = tiny_model("qwen3_moe")
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    plan = _plan(model_dir, "afd", owners=_owners((1, 2, 2), (2, 1, 4)))

    result = _run(model_dir, plan, prompts)

    assert _tokens(result) == expected
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert [(r["owner"], r["replica"], r["tp_rank"]) for r in ranks.values()] == [
        (0, 0, 0),
        (0, 1, 0),
        (1, 0, 0),
        (1, 0, 1),
    ]
    assert ranks[3]["messages_sent"] == 0  # only the TP leader sends; it received once too
    # Each TP rank reads and keeps about half of the owner's weights (norms and the router
    # are replicated).
    full = _single_owner_bytes(model_dir, plan, 2)
    for r in (ranks[2], ranks[3]):
        assert r["weight_bytes"] == r["weight_bytes_read"]
        assert 0.5 * full <= r["weight_bytes_read"] <= 0.55 * full


def _single_owner_bytes(model_dir: Path, plan: Plan, rank: int) -> int:
    """What ``rank``'s operators read unsharded."""
    from opweave.runtime._private.schedule import rank_ops

    placement = Placement(plan, load_model(model_dir))
    return StageModule(model_dir, rank_ops(placement, rank)).checkpoint.bytes_read


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_tensor_parallel_core_attention_owner(family, tiny_model, hf_greedy, prompts):
    """CAD with the core-attention owner on TP 2: its heads (and KV / recurrent state) split."""
    model_dir = tiny_model(family)
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    plan = _plan(model_dir, "cad", owners=_owners((1, 1, 4), (2, 1, 4)))

    result = _run(model_dir, plan, prompts)

    assert _tokens(result) == expected


def test_operators_that_do_not_split_are_refused_before_any_rank_starts(tiny_model):
    """4 attention heads do not split over TP 8: an error naming the operator, no processes."""
    model_dir = tiny_model("llama")
    plan = _plan(model_dir, "afd", owners=_owners((8, 1, 4), (1, 1, 4)))
    before = _child_pids()
    with pytest.raises(ShardingError, match=r"owner 0 \(cpu x tp 8\) cannot shard L0.qkv_proj"):
        run_plan(plan, model_dir, [Request((5, 6), 2)])
    heads = _plan(model_dir, "cad", owners=_owners((1, 1, 4), (8, 1, 4)))
    with pytest.raises(ShardingError, match=r"L0.core_attn: attention heads of 4 .* tp 8"):
        run_plan(heads, model_dir, [Request((5, 6), 2)])
    assert _child_pids() == before


# -- the schedule, without processes ---------------------------------------------------------
SCHEDULE_PLANS = {
    "afd-replicas": dict(owners=_owners((1, 2, 2), (1, 1, 4)), microbatches=2),
    "cad-tp": dict(owners=_owners((2, 1, 6), (1, 3, 2)), microbatches=2),
    "afd-3mb": dict(owners=_owners((1, 1, 6), (1, 2, 3)), microbatches=3),
    "afd-uneven": dict(owners=_owners((1, 3, 2), (1, 2, 3)), microbatches=2),
}


@pytest.mark.parametrize("name", SCHEDULE_PLANS)
def test_every_send_has_exactly_one_matching_receive(name, tiny_model):
    model_dir = tiny_model("llama")
    plan = _plan(model_dir, name.split("-")[0], batch=6, **SCHEDULE_PLANS[name])
    placement = Placement(plan, load_model(model_dir))
    sends, recvs = Counter(), Counter()
    firsts: list[range] = []
    lasts: list[range] = []
    for rank in range(placement.world_size):
        leader = placement.ranks[rank].is_leader
        for action in compile_schedule(placement, rank):
            assert isinstance(action, Compute)
            if leader:
                recvs.update((link.peer, rank, link.tag, link.slots) for link in action.sources)
                sends.update((rank, link.peer, link.tag, link.slots) for link in action.dests)
            if action.first and leader:
                firsts.append(action.slots)
            if action.last and leader:
                lasts.append(action.slots)
    assert sends == recvs
    # Every slot of every microbatch is fed to the first segment by exactly one replica, and
    # comes back as a token from exactly one replica of the last.
    for parts in (firsts, lasts):
        assert sorted(slot for r in parts for slot in r) == list(range(plan.global_batch))


def test_select_and_merge_route_rows_by_slot():
    import torch

    from opweave.runtime import BatchMeta, TokenBatch, pack, unpack
    from opweave.runtime._private.transport import merge, select

    meta = BatchMeta(("a", "b", "c"), (3, 1, 2), (0, 7, 0), slots=(4, 5, 7))
    per_token = torch.arange(24.0).view(6, 4)
    batch = TokenBatch(meta, {"hidden": per_token, "logits": torch.arange(3.0)[:, None]})
    low, high, whole = (
        select(batch, range(4, 6)),
        select(batch, range(6, 8)),
        select(batch, range(9)),
    )
    assert low.meta.request_ids == ("a", "b") and high.meta.slots == (7,)
    assert torch.equal(low["hidden"], per_token[:4]) and torch.equal(
        high["logits"], batch["logits"][2:]
    )
    empty = select(batch, range(0, 4))
    assert empty.meta.request_ids == () and empty.tensors == {}
    back = merge([unpack(pack(low)), empty, unpack(pack(high))])
    assert back.meta == meta
    assert all(torch.equal(back[n], batch[n]) for n in batch.tensors)
    nothing = BatchMeta((), (), ())
    assert unpack(pack(TokenBatch(nothing, {}))).meta == nothing
    assert whole is batch


# -- faults ----------------------------------------------------------------------------------
def _child_pids() -> set[int]:
    """Live children of this process (from /proc; no psutil)."""
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != "Z":
                out.add(int(entry.name))
    return out


@pytest.mark.parametrize(
    ("fault", "expect", "decode_step"),
    [
        ("1:3:exit", "exited with status 1", "per-request"),
        ("1:3:kill", "killed by signal 9", "per-request"),
        ("1:3:hang", "stopped responding", "per-request"),
        # the other rank waits inside its rank program, in the native wire's receive (run by
        # Python, or by inductor's C++ wrapper)
        ("1:3:kill", "killed by signal 9", "traced"),
        ("1:3:hang", "stopped responding", "compiled"),
    ],
)
def test_a_dying_or_hanging_worker_fails_the_run_naming_it(fault, expect, decode_step, tiny_model):
    model_dir = tiny_model("llama")
    plan = _plan(model_dir, "afd")
    rank, iteration, mode = fault.split(":")
    injected = FaultInjection(rank=int(rank), iteration=int(iteration), mode=mode)
    before = _child_pids()

    # The run ends by itself with an error naming the rank and what happened to it, not by
    # pytest's timeout. How soon, beside the 3 s timeout: tools/bench/faults.py.
    with pytest.raises(RunFailedError) as info:
        run_plan(
            plan,
            model_dir,
            [Request((5, 6, 7), 12)] * 1,
            RunOptions(timeout_s=3, decode_step=decode_step, fault=injected),
        )

    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("rank 1 (owner 1, replica 0: stages L0.ffn_norm..L0.down_proj")
    assert expect in message
    assert _child_pids() <= before  # every worker process is gone


# -- bad input -------------------------------------------------------------------------------
def test_wrong_rank_count_and_wrong_model_are_refused(tiny_model, write_config):
    model_dir = tiny_model("llama")
    plan = _plan(model_dir, "cad")
    request = [Request((5, 6), 2)]
    with pytest.raises(PlanMismatchError, match=r"needs 2 ranks .* got 3; launch with --ranks 2"):
        run_plan(plan, model_dir, request, ranks=3)
    config = json.loads((model_dir / "config.json").read_text())
    deeper = write_config(config | {"num_hidden_layers": 3}, "deeper")
    with pytest.raises(PlanMismatchError, match="layers 2.* has layers 3; re-plan for this model"):
        run_plan(plan, deeper, request)
    other = write_config(config | {"rope_theta": 1234.0}, "other-llama")
    with pytest.raises(PlanMismatchError, match="config sha256 .* re-plan for this model"):
        run_plan(plan, other, request)


# -- CUDA / NCCL (skipped without a GPU) -----------------------------------------------------
def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() == 0, reason="needs a CUDA device")
def test_cuda_ranks_with_nccl(tiny_model, prompts):
    """One spawned process per GPU, NCCL transfers; tokens equal the single-process runtime's
    on the same device (CUDA kernels round differently from transformers on CPU)."""
    from opweave.runtime import LocalModel

    model_dir = tiny_model("qwen3_moe")
    strategy = "afd" if _cuda_devices() >= 2 else "colocated"
    plan = _plan(model_dir, strategy, mb=2 if strategy == "afd" else 1)
    expected = LocalModel(model_dir, device="cuda").generate(prompts, MAX_NEW_TOKENS)

    result = _run(model_dir, plan, prompts, device="cuda")

    assert _tokens(result) == expected
    assert all(r["device"].startswith("cuda") for r in result["ranks"])
