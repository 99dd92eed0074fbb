"""How soon faults surface: seconds from a fault to the error that names it, beside the timeout.

The tests check that each fault ends in the right one-line error, that nothing hangs and that no
process is left; how long that takes depends on the machine's load, so the figures are here,
measured ``--repeats`` times (median and worst printed), one case after another in one run:

- **run**: ``run_plan`` of a two-rank AFD plan on a tiny Llama with ``--timeout-s 3`` while
  rank 1 exits, is SIGKILLed or hangs at its third iteration (the runtime's test seam,
  ``RunOptions(fault=FaultInjection(...))``), per decode step: seconds from the call to
  ``RunFailedError``, beside a fault-free run of the same request (start-up, tracing and
  compiling included in both);
- **step**: a rank of a running ``StepDriver`` (AFD, TP 2 FFN owner, ``timeout_s=20``) SIGKILLed
  between steps: seconds from the kill to the step that fails;
- **wire**: two ranks' transport between CPU ranks (the native wire, set up as a run sets it up:
  authenticated connections, ``timeout_s=10``); the peer exits while the other waits for it
  (seconds to "lost rank 1"), and a rank without the run's secret tries to join (seconds for
  the other to give up, beside its 3 s join timeout);
- **native**: the native wire itself over a socket pair: milliseconds an 80 MB send takes to
  return before the peer reads anything, and seconds a receive nobody answers waits (beside
  its 2 s timeout);
- **refusal**: ``opweave run PLAN --model-path M`` with a plan for another model: seconds to
  its one ``error:`` line (no vLLM import, no rank started).

How soon a serving client gets its error after a rank dies: ``serve_load.py --kill-rank-after``.

Run: ``uv run python tools/bench/faults.py [--repeats 3] [--only run,step,wire,native,refusal]``.
Prints figures; asserts nothing but that each fault ended in an error.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CASES = ("run", "step", "wire", "native", "refusal")
RUN_FAULTS = [  # (rank:iteration:mode, decode step): the faults the runtime's tests inject
    ("1:3:exit", "per-request"),
    ("1:3:kill", "per-request"),
    ("1:3:hang", "per-request"),
    ("1:3:kill", "traced"),
    ("1:3:hang", "compiled"),
]
KEY = bytes(range(32))


def _row(label: str, seconds: list[float], beside: str = "") -> None:
    median, worst = statistics.median(seconds), max(seconds)
    print(f"  {label:<44} {median:8.2f} s  (worst {worst:6.2f} s){beside}")


def bench_run(model_dir: Path, repeats: int) -> None:
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import FaultInjection, Request, RunFailedError, RunOptions, run_plan

    plan = canonical_plan(load_model(model_dir), "afd", gpu="cpu", batch=4, microbatches=2)
    request = [Request((5, 6, 7), 12)]
    print("\nrun_plan, AFD on 2 ranks, timeout 3 s: seconds from the call to the error")
    for step in sorted({s for _, s in RUN_FAULTS}, key=[s for _, s in RUN_FAULTS].index):
        options = RunOptions(timeout_s=3, decode_step=step)
        run_plan(plan, model_dir, request, options)  # compile caches
        clean = []
        for _ in range(repeats):
            start = time.monotonic()
            run_plan(plan, model_dir, request, options)
            clean.append(time.monotonic() - start)
        _row(f"{step}: no fault (the whole run)", clean)
        for fault, fault_step in RUN_FAULTS:
            if fault_step != step:
                continue
            took, message = [], ""
            rank, iteration, mode = fault.split(":")
            injected = FaultInjection(rank=int(rank), iteration=int(iteration), mode=mode)
            faulty = RunOptions(timeout_s=3, decode_step=step, fault=injected)
            for _ in range(repeats):
                start = time.monotonic()
                try:
                    run_plan(plan, model_dir, request, faulty)
                except RunFailedError as exc:
                    took.append(time.monotonic() - start)
                    message = str(exc)
                else:
                    sys.exit(f"error: {fault} ({step}) ended without an error")
            how = message.split(") ", 1)[-1][:60]  # after "rank 1 (owner 1, ...: stages ...)"
            _row(f"{step}: rank 1 {fault.rsplit(':', 1)[1]} at iteration 3", took, f"  {how}")


def bench_step(model_dir: Path, repeats: int) -> None:
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Cluster, RunFailedError, RunOptions, StepDriver, StepItem

    model = load_model(model_dir)
    layout = canonical_plan(model, "afd", gpu="cpu", batch=2, microbatches=2, tp=2)
    took = []
    for _ in range(repeats):
        cluster = Cluster(layout, model, model_dir, RunOptions(timeout_s=20))
        try:
            driver = StepDriver(cluster)
            driver.add("a", [5, 6, 7])
            driver.step([StepItem("a", 0, 3)])
            os.kill(cluster.pids[3], signal.SIGKILL)  # owner 1's TP follower
            start = time.monotonic()
            try:
                while True:
                    driver.step([StepItem("a", 3, 1)])
                    time.sleep(0.05)  # as the test's scheduler: a step now and then
            except RunFailedError:
                took.append(time.monotonic() - start)
        finally:
            cluster.close()
    print("\nStepDriver, AFD with a TP-2 FFN owner, timeout 20 s: seconds from the kill")
    _row("rank 3 SIGKILLed between steps -> failed step", took)


def _wire_rank(rank: int, port: int, scenario: str, out: mp.Queue) -> None:
    import torch

    from opweave.runtime.transport import Message, PeerError, Transport
    from tests.helpers import join_gloo_pair

    join_gloo_pair(rank, port)
    if scenario == "impostor":
        key = KEY if rank == 0 else b"not the run's secret"
        start = time.monotonic()
        try:
            Transport(rank, torch.device("cpu"), timeout_s=3.0, key=key)
        except PeerError:
            if rank == 0:
                out.put(time.monotonic() - start)
    else:
        tr = Transport(rank, torch.device("cpu"), timeout_s=10.0, key=KEY)
        if rank == 1:
            os._exit(0)  # without a word
        start = time.monotonic()
        try:
            tr.recv(Message(1, range(1), 1), "waiting for rank 1")
        except PeerError:
            out.put(time.monotonic() - start)
    out.close()
    out.join_thread()
    os._exit(0)


def _wire(scenario: str) -> float:
    from tests.helpers import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_wire_rank, args=(r, port, scenario, out)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=120)
    for p in procs:
        p.join(30)
    return float(seconds)


def bench_wire(repeats: int) -> None:
    print("\nthe transport between two CPU ranks (native wire): seconds to the error")
    dies = [_wire("peer_dies") for _ in range(repeats)]
    _row("peer exits while waited for (timeout 10 s)", dies)
    impostor = [_wire("impostor") for _ in range(repeats)]
    _row("a rank without the secret (join timeout 3 s)", impostor)


def bench_native(repeats: int) -> None:
    import torch

    from opweave.runtime._private.native import NativeWire
    from opweave.runtime.transport import PeerError

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    big = torch.arange(20 << 20, dtype=torch.float32)  # 80 MB: far beyond a socket's buffer
    sends, waits = [], []
    for _ in range(repeats):
        a, b = socket.socketpair()
        zero, one = NativeWire({1: a}, timeout_s=2.0, spin_s=0.0), NativeWire({0: b}, 2.0, 0.0)
        try:
            start = time.monotonic()
            zero.send(1, 5, [as_bytes(big)], zero.ones)
            sends.append(time.monotonic() - start)
            one.recv(0, 5, big.numel() * 4, "receiving the big one")
            zero.drain()
            start = time.monotonic()
            try:
                one.recv(0, 6, 8, "receiving what never comes")
            except PeerError:
                waits.append(time.monotonic() - start)
        finally:
            zero.close()
            one.close()
    print("\nnative wire over a socket pair")
    print(
        f"  {'an 80 MB send returns, nothing read yet':<44} "
        f"{statistics.median(sends) * 1e3:8.1f} ms (worst {max(sends) * 1e3:6.1f} ms)"
    )
    _row("an unanswered receive gives up (timeout 2 s)", waits)


def bench_refusal(model_dir: Path, tmp: Path, repeats: int) -> None:
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import write_tiny_model

    other = write_tiny_model("qwen3", tmp / "qwen3")
    plan = tmp / "plan-for-qwen3.json"
    plan.write_text(canonical_plan(load_model(other), "afd", gpu="cpu", batch=2).model_dump_json())
    took = []
    for _ in range(repeats):
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "opweave.cli", "run", str(plan), "--model-path", str(model_dir)],
            capture_output=True,
            text=True,
        )
        took.append(time.monotonic() - start)
        if proc.returncode != 2:
            sys.exit(f"error: the refusal exited {proc.returncode}: {proc.stderr[-500:]}")
    print("\nopweave run with a plan for another model: seconds to its error line")
    _row("exit 2 (process start and imports included)", took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    args = parser.parse_args()
    only = [c for c in args.only.split(",") if c]
    unknown = sorted(set(only) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.helpers
    from opweave.runtime import write_tiny_model

    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.repeats} repeats")
    with tempfile.TemporaryDirectory(prefix="opweave-bench-") as folder:
        tmp = Path(folder)
        model_dir = write_tiny_model("llama", tmp / "llama")
        benches: dict[str, Callable[[], None]] = {
            "run": lambda: bench_run(model_dir, args.repeats),
            "step": lambda: bench_step(model_dir, args.repeats),
            "wire": lambda: bench_wire(args.repeats),
            "native": lambda: bench_native(args.repeats),
            "refusal": lambda: bench_refusal(model_dir, tmp, args.repeats),
        }
        for case in only:
            benches[case]()


if __name__ == "__main__":
    main()
