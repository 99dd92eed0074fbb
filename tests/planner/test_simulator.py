"""Schedule simulator against hand-computed schedules, and its steady state against events."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opweave.planner import Pipeline, cycle_time, lower_bound, simulate_events


def two_stage(a: float, b: float, x: float, m: int, back: float | None = None) -> Pipeline:
    """Owner A runs segment 0, owner B segment 1; ``x`` each way (``back`` for the token)."""
    return Pipeline(
        owner_names=("A", "B"),
        seg_owner=(0, 1),
        compute_s=(a, b),
        transfer_s=(x, x if back is None else back),
        microbatches=m,
    )


def spans(run, resource: str, iteration: int = 0) -> list[tuple[float, float]]:
    return [
        (e.start_s, e.end_s)
        for e in run.events
        if e.resource == resource and e.iteration == iteration
    ]


def test_balanced_two_stages_two_microbatches_no_transfer_cost() -> None:
    p = two_stage(1.0, 1.0, 0.0, 2)
    # A: m0 [0,1] m1 [1,2]; B: m0 [1,2] m1 [2,3]; tokens back at 2 and 3: period 2.
    run = simulate_events(p, 4)
    assert spans(run, "A compute") == [(0.0, 1.0), (1.0, 2.0)]
    assert spans(run, "B compute") == [(1.0, 2.0), (2.0, 3.0)]
    assert spans(run, "A compute", 1) == [(2.0, 3.0), (3.0, 4.0)]
    assert cycle_time(p) == pytest.approx(2.0)
    assert run.periods_s() == pytest.approx([2.0, 2.0, 2.0])
    assert p.busy_s().tolist() == pytest.approx([2.0, 2.0, 0.0, 0.0, 0.0, 0.0])


def test_transfers_overlap_with_compute_of_the_next_microbatch() -> None:
    # 4 microbatches, 0.25 s transfers: A's compute (4 x 1 s) is the bottleneck, the transfers
    # hide behind it: TPOT = 4, not 4 + transfers.
    p = two_stage(1.0, 1.0, 0.25, 4)
    assert cycle_time(p) == pytest.approx(4.0)
    run = simulate_events(p, 5)
    send = [(e.start_s, e.end_s) for e in run.events if e.resource == "A send" and e.iteration == 0]
    assert send[0] == pytest.approx((1.0, 1.25))  # m0's activations leave while A runs m1
    assert spans(run, "A compute")[1] == pytest.approx((1.0, 2.0))
    assert spans(run, "B compute")[0] == pytest.approx((1.25, 2.25))
    busy = dict(zip(p.resource_names(), p.busy_s().tolist(), strict=True))
    assert busy["A compute"] == pytest.approx(4.0)
    assert busy["A send"] == pytest.approx(1.0)  # 4 activations
    assert busy["A recv"] == pytest.approx(1.0)  # 4 token ids back
    assert run.periods_s()[-1] == pytest.approx(4.0)


def test_cycle_of_one_microbatch_dominates() -> None:
    # Slow links: one microbatch's round trip (1 + 1 + 1 + 1 = 4 s) exceeds any resource's
    # work (2 s), so the pipeline idles: TPOT = 4.
    p = two_stage(1.0, 1.0, 1.0, 2)
    assert lower_bound(p) == pytest.approx(4.0)
    assert cycle_time(p) == pytest.approx(4.0)
    run = simulate_events(p, 6)
    assert run.periods_s()[-1] == pytest.approx(4.0)
    # B waits for A's activations: m0 at [2, 3] (1 s compute + 1 s transfer first)
    assert spans(run, "B compute")[0] == pytest.approx((2.0, 3.0))


def test_unbalanced_stages_leave_a_bubble_on_the_fast_owner() -> None:
    p = two_stage(1.0, 3.0, 0.0, 2)
    assert cycle_time(p) == pytest.approx(6.0)  # B: 2 x 3 s
    busy = p.busy_s()
    assert busy[0] / cycle_time(p) == pytest.approx(1 / 3)


def test_single_owner_runs_microbatches_back_to_back() -> None:
    p = Pipeline(("A",), (0,), (0.5,), (0.0,), microbatches=3)
    assert cycle_time(p) == pytest.approx(1.5)
    assert simulate_events(p, 3).periods_s() == pytest.approx([1.5, 1.5])


def test_same_owner_at_both_ends_needs_no_token_transfer() -> None:
    p = Pipeline(("A", "B"), (0, 1, 0), (1.0, 1.0, 1.0), (0.5, 0.5, 99.0), microbatches=1)
    # the 99 s "transfer" after the last segment stays on A and is ignored
    assert cycle_time(p) == pytest.approx(4.0)


pipelines = st.builds(
    lambda n, segs, m, xs: Pipeline(
        owner_names=tuple("ABC"[:n]),
        seg_owner=tuple(o % n for o, _, _ in segs),
        compute_s=tuple(c for _, c, _ in segs),
        transfer_s=tuple(x * xs for _, _, x in segs),
        microbatches=m,
    ),
    st.integers(1, 3),
    st.lists(
        st.tuples(st.integers(0, 2), st.floats(0.01, 1.0), st.floats(0.0, 1.0)),
        min_size=1,
        max_size=10,
    ),
    st.integers(1, 4),
    st.sampled_from([0.0, 0.1, 1.0]),
)


@settings(max_examples=60, deadline=None)
@given(pipelines)
def test_event_simulation_converges_to_the_exact_period(p: Pipeline) -> None:
    period = cycle_time(p)
    assert period >= lower_bound(p) * (1 - 1e-12)
    run = simulate_events(p, 40)
    ends = run.iteration_end_s
    mean = (ends[-1] - ends[-21]) / 20
    assert mean == pytest.approx(period, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(pipelines, st.integers(0, 9), st.floats(0.0, 1.0), st.booleans())
def test_period_is_monotone_in_every_duration(
    p: Pipeline, which: int, extra: float, transfer: bool
) -> None:
    s = which % p.num_segments
    comp, xfer = list(p.compute_s), list(p.transfer_s)
    (xfer if transfer else comp)[s] += extra
    slower = Pipeline(p.owner_names, p.seg_owner, tuple(comp), tuple(xfer), p.microbatches)
    assert cycle_time(slower) >= cycle_time(p) * (1 - 1e-12)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 3),
    st.integers(2, 8),
    st.integers(1, 4),
    st.integers(1, 4),
    st.lists(st.floats(0.01, 1.0), min_size=12, max_size=12),
)
def test_regular_blocks_are_composed_once_with_the_same_result(
    n: int, copies: int, m: int, k: int, vals: list[float]
) -> None:
    # a head, `copies` identical blocks of k stages round-robin over n owners, a tail
    period = k * n
    owners = [i % n for i in range(period * copies + 2)]
    comp = [vals[i % period % 12] for i in range(len(owners))]
    xfer = [vals[(i * 7) % 12] / 4 for i in range(len(owners))]
    comp[0] += 0.3
    comp[-1] += 0.2
    args = (tuple("ABC"[:n]), tuple(owners), tuple(comp), tuple(xfer), m)
    plain = Pipeline(*args)
    hinted = Pipeline(*args, period_hint=period)
    assert cycle_time(hinted) == pytest.approx(cycle_time(plain), rel=1e-12)
