"""The host-time figures the runtime and the profiler measure, on this machine, beside their
independent counterparts.

The tests check that each figure is reported, in the right unit and place; what it comes to
depends on the machine's load, so the values are printed here (one run, cases in turn):

- **runqueue**: a colocated run of a tiny Llama (its rank pinned to the last core), alone and
  with a busy loop pinned to that core too, interleaved ``--repeats`` times: the share of the
  rank's loop it reported waiting for a CPU (``runqueue_s / loop_s``; with the busy loop about
  half is expected, alone about none);
- **idle**: the profiler's idle probe waiting 0.2 s spinning and blocked (wall and CPU seconds:
  spinning keeps the core busy, blocking leaves it idle), and one idle-slowdown measurement
  (an 8 MiB probe: its hot read bandwidth, and the extra picoseconds per byte after each gap);
- **orchestration**: the profiler's serving-loop fit (host seconds per stage and per driven
  microbatch at 1 and 8 requests), and a colocated run at another size (3 microbatches of 4
  requests): its measured host time per iteration outside operators and transfers beside the
  fit's ``M (stage(u) + drive(u))`` (the planner charges that per iteration);
- **stalls**: a small profile's stall overhead (sum of the cells' means over their medians,
  less one): what stalls added to the timed calls.

Run: ``uv run python tools/bench/host_timing.py [--repeats 3] [--only runqueue,idle,...]``.
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CASES = ("runqueue", "idle", "orchestration", "stalls")
PROMPTS = (tuple(range(5, 17)), (20, 21, 22), (30, 41, 52, 63, 74, 85, 96), tuple(range(100, 121)))


def bench_runqueue(model_dir: Path, repeats: int) -> None:
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Request, RunOptions, run_plan

    if not os.path.exists("/proc/thread-self/schedstat") or len(os.sched_getaffinity(0)) < 2:
        print("\nrunqueue: needs Linux's schedstat and two cores; skipped")
        return
    plan = canonical_plan(load_model(model_dir), "colocated", gpu="cpu", batch=4, microbatches=1)
    requests = [Request(p, 16) for p in PROMPTS]
    core = max(os.sched_getaffinity(0))
    shares: dict[str, list[float]] = {"alone": [], "busy loop on its core": []}
    for _ in range(repeats):
        for label in shares:
            hog = None
            if label != "alone":
                code = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
                hog = subprocess.Popen([sys.executable, "-c", code])
                time.sleep(0.5)
            try:
                result = run_plan(plan, model_dir, requests, RunOptions(timeout_s=60))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            assert result is not None
            rank = result.ranks[0]
            shares[label].append(rank.runqueue_s / rank.loop_s)
    print(f"\ncolocated rank on core {core}: share of its loop waiting for a CPU (runqueue_s)")
    for label, values in shares.items():
        print(
            f"  {label:<24} {100 * statistics.median(values):6.1f}%  (runs: "
            + ", ".join(f"{100 * v:.1f}%" for v in values)
            + ")"
        )


def bench_idle(repeats: int) -> None:
    from opweave.profiler import measure_idle_slowdown
    from opweave.profiler._private.idle import IdleWait

    print("\nthe idle probe waiting 0.2 s (wall and CPU seconds, median of the repeats)")
    for spin in (True, False):
        walls, cpus = [], []
        for _ in range(repeats):
            with IdleWait(spin) as idle:
                wall, cpu = time.perf_counter(), time.process_time()
                idle(0.2)
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
        label = "spinning" if spin else "blocked in select"
        print(
            f"  {label:<24} wall {statistics.median(walls):.3f} s, "
            f"CPU {statistics.median(cpus):.3f} s"
        )
    fit = measure_idle_slowdown(8 * 2**20, gaps_s=(1e-3, 20e-3), samples=5)
    print(f"  8 MiB probe read hot at {fit.probe_bytes / fit.hot_s / 1e9:.1f} GB/s; extra after")
    for gap, extra in fit.points:
        print(f"    a {gap * 1e3:g} ms gap: {extra * 1e12:+.2f} ps per byte")
    print(f"  fit: {fit.describe()}")


def bench_orchestration(model_dir: Path, repeats: int) -> None:
    from opweave.costmodel import Owner, Plan, colocated_template, load_model, plan_model
    from opweave.profiler import measure_orchestration
    from opweave.runtime import Request, RunOptions, run_plan

    fit = measure_orchestration(model_dir)
    print("\nserving-loop fit (host seconds per stage and per driven microbatch)")
    for requests, stage, drive in fit.points:
        print(f"  {requests} requests: stage {stage * 1e6:8.1f} us, drive {drive * 1e6:8.1f} us")
    spec = load_model(model_dir)
    m, u, tokens = 3, 4, 24
    plan = Plan(
        strategy="colocated",
        model=plan_model(spec),
        context_tokens=32,
        template=colocated_template(spec),
        owners=(Owner(gpu="cpu", tp=1, replicas=1, resident_batch=m * u),),
        microbatches=m,
    )
    rng = random.Random(1)
    reqs = [
        Request(tuple(rng.randrange(spec.vocab_size) for _ in range(6)), tokens, stop_token_ids=())
        for _ in range(m * u)
    ]
    predicted = m * (fit.profile.stage(u) + fit.profile.drive(u))
    measured = []
    for _ in range(repeats):
        result = run_plan(plan, model_dir, reqs, RunOptions(device="cpu", timeout_s=120))
        assert result is not None
        line = result.ranks[0].timeline
        host = [  # from the 9th iteration on: past the prefill and the first decode shapes
            (line.end_s[i] - line.end_s[i - 1])
            - (line.busy_s[i] - line.busy_s[i - 1])
            - (line.comm_s[i] - line.comm_s[i - 1])
            for i in range(8, tokens)
        ]
        measured.append(statistics.median(host))
    got = statistics.median(measured)
    print(
        f"  a colocated run, {m} microbatches of {u}: host time per iteration {got * 1e6:.1f} us "
        f"measured, {predicted * 1e6:.1f} us from the fit ({got / predicted:.2f}x)"
    )


def bench_stalls(model_dir: Path) -> None:
    from opweave.profiler import TimingSettings, profile_model

    # the profiler tests' quick settings (tests/profiler/conftest.py)
    timing = TimingSettings(warmup=1, repeats=3, cell_budget_s=0.005, passes=2)
    run = profile_model(
        model_dir,
        batches=(1, 4),
        contexts=(16, 64),
        transfer=False,
        orchestration=False,
        idle=False,
        progress=False,
        timing=timing,
    )
    print(f"\na small profile: {run.profile.provenance.settings['stalls']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    args = parser.parse_args()
    only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(only) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    from opweave.runtime import write_tiny_model

    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.repeats} repeats")
    with tempfile.TemporaryDirectory(prefix="opweave-bench-") as folder:
        model_dir = write_tiny_model("llama", Path(folder) / "llama")
        benches: dict[str, Callable[[], None]] = {
            "runqueue": lambda: bench_runqueue(model_dir, args.repeats),
            "idle": lambda: bench_idle(args.repeats),
            "orchestration": lambda: bench_orchestration(model_dir, args.repeats),
            "stalls": lambda: bench_stalls(model_dir),
        }
        for case in only:
            benches[case]()


if __name__ == "__main__":
    main()
