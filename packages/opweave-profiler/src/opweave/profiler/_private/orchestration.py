"""The serving loop's host time around the operators, measured in the runtime's own loop.

A rank of the runtime runs its compiled schedule in Python. Besides operators and transfers,
each stage of each microbatch costs the loop some host work (take the work, admit and drop
requests, route the output by slot, post it), and the driver spends some per microbatch
(collect the sampled tokens, retire and admit requests, build the next work), on the token's
path from the last stage back to the first; the planner charges both
(:class:`~opweave.costmodel.OrchestrationProfile`).

It is measured, not modelled: the runtime serves the model colocated on one rank (one stage,
two microbatches, every message local, so nothing of it is transfer) at two microbatch sizes,
and reads the rank's and the driver's timelines. Per steady iteration the rest of the rank's
loop (the iteration less operators and waits) is divided by the Compute actions that ran, and
the driver's time is taken per microbatch it drove; the median at each size gives an affine
fit in the requests per microbatch.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from opweave.costmodel import (
    OrchestrationProfile,
    Owner,
    Plan,
    colocated_template,
    load_model,
    plan_model,
)
from opweave.runtime import Request, RunOptions, RunResult, run_plan
from opweave.runtime.errors import OpWeaveRuntimeError

from ..errors import ProfilerError

REQUESTS = (1, 8)  # requests per microbatch at the two measured points
MICROBATCHES = 2
WARMUP_TOKENS, TOKENS = 8, 40  # iterations left out while torch warms up; tokens per request
PROMPT_TOKENS = 4


@dataclass(frozen=True)
class OrchestrationFit:
    """The fitted per-stage and per-microbatch host times, and the points behind them."""

    profile: OrchestrationProfile
    points: tuple[tuple[int, float, float], ...]  # (requests, stage s, drive s) medians

    def describe(self) -> str:
        o = self.profile
        return (
            f"serving loop (colocated runs at {', '.join(str(p[0]) for p in self.points)} "
            f"requests per microbatch): per stage {o.stage_s * 1e6:.1f} us + "
            f"{o.stage_per_request_s * 1e6:.2f} us/request, driver per microbatch "
            f"{o.drive_s * 1e6:.1f} us + {o.drive_per_request_s * 1e6:.2f} us/request"
        )


def _affine(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line, both clipped at zero."""
    xs = [float(x) for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(sum((x - mx) * (y - my) for x, y in points) / var, 0.0) if var else 0.0
    return max(my - slope * mx, 0.0), slope


def _steady_per_action(result: RunResult, first: int) -> tuple[float, float]:
    """Medians from iteration ``first`` on: the rank's loop host time per Compute (its
    iteration less operators and waits) and the driver's time per microbatch it drove."""
    rank = result.ranks[0]
    line, computes = rank.timeline, rank.computes_per_iteration
    stage = []
    for i in range(max(first, 1), len(line.end_s)):
        end = line.end_s[i] - line.end_s[i - 1]
        busy = line.busy_s[i] - line.busy_s[i - 1]
        comm = line.comm_s[i] - line.comm_s[i - 1]
        stage.append((end - busy - comm) / computes)
    driver = result.driver
    spent = driver.timeline.drive_s
    start = max(first * driver.microbatches_per_iteration, 1)
    drive = [spent[j] - spent[j - 1] for j in range(start, len(spent))]
    return statistics.median(stage), statistics.median(drive)


def measure_orchestration(
    model_dir: str | Path,
    *,
    requests: tuple[int, ...] = REQUESTS,
    timeout_s: float = 120.0,
    seed: int = 0,
) -> OrchestrationFit:
    """Serve ``model_dir`` colocated on one CPU rank at each microbatch size in ``requests``
    and fit the loop's host time per stage and per driven microbatch."""
    spec = load_model(model_dir)
    rng = random.Random(seed)
    stage_pts: list[tuple[int, float]] = []
    drive_pts: list[tuple[int, float]] = []
    for u in requests:
        batch = u * MICROBATCHES
        plan = Plan(
            strategy="colocated",
            model=plan_model(spec),
            context_tokens=PROMPT_TOKENS + TOKENS,
            template=colocated_template(spec),
            owners=(Owner(gpu="cpu", tp=1, replicas=1, resident_batch=batch),),
            microbatches=MICROBATCHES,
        )
        reqs = [
            Request(
                tuple(rng.randrange(spec.vocab_size) for _ in range(PROMPT_TOKENS)),
                TOKENS,
                request_id=f"o{i}",
                stop_token_ids=(),  # every slot stays full for every iteration
            )
            for i in range(batch)
        ]
        try:
            result = run_plan(plan, model_dir, reqs, RunOptions(device="cpu", timeout_s=timeout_s))
        except OpWeaveRuntimeError as exc:
            raise ProfilerError(
                f"measuring the serving loop failed: {exc}; skip it with --no-orchestration "
                "(profile_model(orchestration=False))"
            ) from None
        assert result is not None
        stage, drive = _steady_per_action(result, WARMUP_TOKENS)
        stage_pts.append((u, stage))
        drive_pts.append((u, drive))
    stage_s, stage_per_request_s = _affine(stage_pts)
    drive_s, drive_per_request_s = _affine(drive_pts)
    profile = OrchestrationProfile(
        stage_s=stage_s,
        stage_per_request_s=stage_per_request_s,
        drive_s=drive_s,
        drive_per_request_s=drive_per_request_s,
    )
    points = tuple((u, s, d) for (u, s), (_, d) in zip(stage_pts, drive_pts, strict=True))
    return OrchestrationFit(profile, points)
