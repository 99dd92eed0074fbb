"""Multi-process runtime on CPU: TPOT of colocated vs AFD vs CAD, and orchestration overhead.

For each strategy a tiny random Llama (and, with ``--small``, a second, larger one) serves
several requests of different prompt lengths on local CPU ranks (one process per rank, one
thread each), side by side in one run:

- Python-driven (``--decode-step per-request``, every operator launched from Python) vs native
  submission (``--decode-step compiled``: each rank's whole decode iteration -- receives,
  segments' steps, sends -- compiled by inductor into one C++ program over the native wire, one
  call per token; the sampled tokens stay on the ranks and the driver submits each decode
  iteration before the previous one's tokens are back), and between them the compiled steps
  called one segment at a time from Python (``RunOptions(rank_programs=False)``, "segments");
- for AFD and CAD (Python-driven), the runtime's CPU transport (the native wire, the default)
  vs gloo's ``isend``/``irecv`` (the ``test_torch_p2p`` seam: torch point-to-point, the path
  CUDA runs over NCCL).

Per rank the decode loop's wall time is split into time inside operators (compute), time
blocked in transfers and TP collectives (communication wait, which includes waiting for the
upstream stage) and the remainder: the runtime's own orchestration (batch merge/split,
admission, packing headers, Python dispatch between actions). Target: orchestration at most 5%
of the loop. Beside them, "descheduled" is the share of the loop the rank was ready to run but
waited for a CPU (Linux's schedstat): on a machine with fewer cores than ranks plus the driver
it is the other processes' time, and it inflates whichever of the three shares it falls in.
Each case runs ``--repeats`` times, interleaved, and the median is printed; compiled cases
first run once unmeasured (inductor compiles every segment then, and caches it; each run
builds its programs in the warm-up, before the first request). TPOT is taken from each request's
third token on, and so are the loop's shares (from each rank's third iteration on). Prints
figures; asserts nothing but equal tokens.

Run: ``uv run python tools/bench/runtime.py [--hidden 64] [--layers 2] [--tokens 32] [--small]``.

``--pd`` instead compares prefill/decode disaggregation: per strategy, the plan with a prefill
pool of ``--prefill-replicas`` colocated replicas (which compute every prompt and send its KV
cache to the decode ranks) beside the same plan without it (each replica prefills its own
requests), in one run, interleaved: mean TTFT (from the start: every request arrives then),
steady TPOT as above, the state bytes the pool sent, and whether the tokens are equal. Prompts
are ``--isl`` tokens long. ``uv run python tools/bench/runtime.py --pd [--isl 96]``.
On a machine shared with other jobs, TPOT is noisy; the overhead share is the stable figure.

Before and after a change: ``--baseline REF`` (e.g. ``--small --baseline main``) measures git
REF's code beside the working tree's in the same run. REF is checked out into a temporary git
worktree; each side runs in a worker process of this venv with ``PYTHONPATH`` set to its own
``packages/*/src`` (REF's copy of this script where it supports ``--baseline``, else this copy,
on REF's packages, through REF's API: before ``RunOptions``, keyword arguments and environment
variables); ``--repeats`` rounds alternate between the sides (each round runs every case
of every model once; REF and this tree take turns going first); per model and case it prints
each side's median TPOT, host time per token and orchestration share, with the median of the
rounds' new/old ratios, and whether the tokens are the same on both sides. Both sides share this
venv (see tools/bench/_baseline.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import _baseline  # tools/bench/_baseline.py, beside this script

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import LocalModel, Request, run_plan, write_tiny_model

try:
    from opweave.runtime import RunOptions
except ImportError:  # a --baseline REF from before RunOptions: see run_options()
    RunOptions = None

# label -> decode step, rank programs: Python-driven, compiled steps one segment at a time,
# native submission (one rank program per token)
MODES = {
    "python": ("per-request", True),
    "segments": ("compiled", False),
    "native": ("compiled", True),
}


def bench(
    model_dir: str,
    strategy: str,
    requests: list[Request],
    mb: int,
    options: dict[str, Any],
    prefill_replicas: int = 0,
) -> dict[str, Any]:
    spec = load_model(model_dir)
    plan = canonical_plan(
        spec,
        strategy,
        gpu="cpu",
        batch=len(requests),
        microbatches=1 if strategy == "colocated" else mb,
        # as a plan made for these requests: state slabs sized once, for the longest
        context_tokens=max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests),
    )
    if prefill_replicas:
        from opweave.costmodel import PrefillPool

        pool = PrefillPool(gpu="cpu", tp=1, replicas=prefill_replicas)
        plan = plan.model_copy(update={"prefill": pool})
    if RunOptions is not None:
        result = run_plan(plan, model_dir, requests, RunOptions(**options))
    else:
        result = run_plan(plan, model_dir, requests, **_before_run_options(options))
    assert result is not None
    return result.model_dump(mode="json")


def _before_run_options(options: dict[str, Any]) -> dict[str, Any]:
    """``run_plan``'s keyword arguments for ``options`` (RunOptions' fields) in the runtime
    before RunOptions (a ``--baseline REF`` older than it, whose copy of this script predates
    ``--baseline``): the decode step was a keyword argument, and two environment variables,
    inherited by the ranks, chose the rest (``OPWEAVE_P2P=socket|torch``: its Python socket wire
    or torch point-to-point; ``OPWEAVE_RANK_PROGRAM=0``: compiled steps one by one)."""
    os.environ["OPWEAVE_P2P"] = "torch" if options["test_torch_p2p"] else "socket"
    os.environ["OPWEAVE_RANK_PROGRAM"] = "1" if options["rank_programs"] else "0"
    return {"decode_step": options["decode_step"]}


def gloo_round_trip_us(rounds: int = 300) -> float:
    """Median loopback gloo round trip of a 4 KB message (one eager chunk) between two forks:
    the floor under every cross-rank hop, which on a small VM is dominated by wake-up latency."""
    import os
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    read, write = os.pipe()
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:  # child: ping-pong, rank 0 reports through the pipe
            torch.set_num_threads(1)
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False)
            dist.init_process_group("gloo", store=client, rank=rank, world_size=2)
            buf, peer, times = torch.zeros(4096, dtype=torch.uint8), 1 - rank, []
            for _ in range(rounds):
                start = time.perf_counter()
                if rank == 0:
                    dist.isend(buf, peer).wait()
                dist.irecv(buf, peer).wait(timedelta(seconds=30))
                if rank == 1:
                    dist.isend(buf, peer).wait()
                times.append(time.perf_counter() - start)
            if rank == 0:
                os.write(write, f"{statistics.median(times) * 1e6:.1f}".encode())
            dist.barrier()
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(write)
    return float(os.read(read, 64))


def steady_tpot(result: dict[str, Any]) -> float:
    """Mean time between tokens from each request's third token on: the prefill and the first
    decode step, where a request's state first moves into its slab rows, are left out."""
    gaps = [
        (t[-1] - t[2]) / (len(t) - 3)
        for t in (o["token_times_s"] for o in result["outputs"])
        if len(t) > 3
    ]
    return statistics.mean(gaps)


def steady_split(rank: dict[str, Any]) -> dict[str, float]:
    """A rank's loop from its third iteration on (the same window as :func:`steady_tpot`): its
    wall time, compute / communication-wait / orchestration shares, the share it waited for a
    CPU, and orchestration seconds per iteration."""
    line = rank["timeline"]
    first = min(2, len(line["end_s"]) - 1)
    loop = line["end_s"][-1] - line["end_s"][first]
    busy = line["busy_s"][-1] - line["busy_s"][first]
    comm = line["comm_s"][-1] - line["comm_s"][first]
    rest = max(loop - busy - comm, 0.0)
    runq = line["runq_s"][-1] - line["runq_s"][first] if line["runq_s"] else 0.0
    iterations = max(len(line["end_s"]) - 1 - first, 1)
    loop = max(loop, 1e-12)
    return {
        "loop_s": loop,
        "compute": busy / loop,
        "comm": comm / loop,
        "orchestration": rest / loop,
        "descheduled": runq / loop,
        "host_s_per_iteration": rest / iterations,
    }


def tiny_llama(hidden: int, layers: int, parent: str) -> str:
    return str(
        write_tiny_model(
            "llama",
            os.path.join(parent, f"llama-{hidden}x{layers}"),
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=max(4, hidden // 64),
            num_key_value_heads=max(2, hidden // 128),
        )
    )


CaseKey = tuple[str, str, str]  # strategy, p2p, mode


def cases() -> list[CaseKey]:
    out = [(s, "socket", mode) for s in ("colocated", "afd", "cad") for mode in MODES]
    return out + [(s, "torch", "python") for s in ("afd", "cad")]


def case_label(case: CaseKey) -> str:
    strategy, p2p, mode = case
    return f"{strategy} {mode}" + (" gloo" if p2p == "torch" else "")


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """What the tables print of one run (and what a ``--baseline`` worker sends back)."""
    return {
        "tokens": [o["token_ids"] for o in result["outputs"]],
        "tpot_s": steady_tpot(result),
        "ranks": [
            {
                "rank": r["rank"],
                "stages": r["stages"],
                "submissions_per_token": r["submissions_per_token"],
                "split": steady_split(r),
            }
            for r in result["ranks"]
        ],
    }


def requests_for(args: argparse.Namespace) -> list[Request]:
    prompts = [tuple(range(5, 5 + 4 + 3 * i)) for i in range(args.requests)]
    return [Request(p, args.tokens) for p in prompts]


def run_case(model_dir: str, case: CaseKey, args: argparse.Namespace) -> dict[str, Any]:
    strategy, p2p, mode = case
    step, programs = MODES[mode]
    options = {"decode_step": step, "rank_programs": programs, "test_torch_p2p": p2p == "torch"}
    return summary(bench(model_dir, strategy, requests_for(args), args.microbatches, options))


def warm_up(model_dir: str, args: argparse.Namespace) -> None:
    """Compile (and cache) every segment and program before anything is measured."""
    LocalModel(model_dir).generate([[5, 6, 7]], 4)
    for case in cases():
        if MODES[case[2]][0] != "per-request":
            run_case(model_dir, case, args)


def measure_round(model_dir: str, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every case once, in order: one round, keyed by case label."""
    return {case_label(c): run_case(model_dir, c, args) for c in cases()}


def header(label: str, args: argparse.Namespace) -> str:
    prompts = [len(r.prompt_token_ids) for r in requests_for(args)]
    return (
        f"\n== {label}; {args.requests} requests (prompts {prompts[0]}..{prompts[-1]} "
        f"tokens), {args.tokens} new tokens each; AFD/CAD with {args.microbatches} microbatches; "
        f"median of {args.repeats} runs"
    )


def host_s(run: dict[str, Any]) -> float:
    return max(r["split"]["host_s_per_iteration"] for r in run["ranks"])


def orchestration(run: dict[str, Any]) -> float:
    return max(r["split"]["orchestration"] for r in run["ranks"])


def report(rounds: list[dict[str, dict[str, Any]]]) -> None:
    """The tables of one model's rounds (one dict of case label -> summary per round)."""
    reference = None
    rows = []
    for label in rounds[0]:
        runs = sorted((r[label] for r in rounds), key=lambda run: run["tpot_s"])
        result = runs[len(runs) // 2]
        reference = reference or result["tokens"]
        assert result["tokens"] == reference, f"{label} tokens differ from colocated"
        rows.append((label, result, statistics.median(run["tpot_s"] for run in runs)))

    print(
        f"\n{'case':<22} {'TPOT ms':>8} {'launches/token':>14} {'host ms/token':>13} "
        f"{'orchestration':>13}"
    )
    by: dict[str, float] = {}
    worst: dict[str, float] = {mode: 0.0 for mode in MODES}
    for label, result, tpot in rows:
        by[label] = tpot
        ranks = result["ranks"]
        share = orchestration(result)
        kind = label.split()[1]
        if "gloo" not in label:
            worst[kind] = max(worst[kind], share)
        launches = max(r["submissions_per_token"] for r in ranks)
        print(
            f"{label:<22} {tpot * 1e3:8.3f} {launches:14.2f} {host_s(result) * 1e3:13.3f} "
            f"{100 * share:12.1f}%"
        )
    for s in ("colocated", "afd", "cad"):
        print(
            f"{s}: native / python TPOT = {by[f'{s} native'] / by[f'{s} python']:.2f}x, "
            f"native / segments = {by[f'{s} native'] / by[f'{s} segments']:.2f}x",
            end="",
        )
        if s != "colocated":
            print(
                f"; gloo / socket p2p = {by[f'{s} python gloo'] / by[f'{s} python']:.2f}x", end=""
            )
        print()
    print(
        f"\n{'case':<22} {'rank':>4} {'stages':<28} {'loop ms':>8} {'compute':>8} "
        f"{'comm wait':>9} {'orchestration':>13} {'descheduled':>11}"
    )
    for label, result, _ in rows:
        for r in result["ranks"]:
            split = r["split"]
            loop, busy, comm, rest, runq = (
                split[k] for k in ("loop_s", "compute", "comm", "orchestration", "descheduled")
            )
            stages = ", ".join(r["stages"])
            stages = stages if len(stages) <= 28 else stages[:25] + "..."
            print(
                f"{label:<22} {r['rank']:>4} {stages:<28} {loop * 1e3:8.1f} "
                f"{100 * busy:7.1f}% {100 * comm:8.1f}% {100 * rest:12.1f}% {100 * runq:10.1f}%"
            )
    for kind, share in worst.items():
        verdict = "meets" if share <= 0.05 else "MISSES"
        print(f"worst orchestration share, {kind}: {100 * share:.1f}% ({verdict} the <= 5% target)")


def run_model(model_dir: str, label: str, args: argparse.Namespace) -> None:
    print(header(label, args))
    warm_up(model_dir, args)
    # interleaved, so machine-speed drift hits every case alike
    report([measure_round(model_dir, args) for _ in range(args.repeats)])


def report_side_by_side(
    rounds: dict[str, list[dict[str, dict[str, Any]]]], old: str, new: str
) -> None:
    """One model's rounds on both sides, per case: each side's median TPOT and host time per
    token with the median of the rounds' new/old ratios, and each side's median orchestration
    share with the median of the rounds' differences (percentage points)."""
    both = [label for label in rounds[new][0] if label in rounds[old][0]]
    for side, other in ((old, new), (new, old)):
        only = [label for label in rounds[side][0] if label not in rounds[other][0]]
        if only:
            print(f"only on {side}: {', '.join(only)}")
    same = all(
        a[label]["tokens"] == b[label]["tokens"]
        for a, b in zip(rounds[old], rounds[new], strict=True)
        for label in both
    )
    print(f"tokens: {'the same' if same else 'DIFFERENT'} on both sides in every case and round")
    print(
        f"\n{'':<22} {'TPOT ms':^26} {'host ms/token':^26} {'orchestration share':^23}\n"
        f"{'case':<22} "
        + f"{'old':>8} {'new':>8} {'new/old':>8} " * 2
        + f"{'old':>7} {'new':>7} {'new-old':>7}"
    )

    def paired(label: str, figure: Any) -> tuple[float, float, list[float], list[float]]:
        """Each side's median, and per round new/old and new - old."""
        o, n = ([figure(r[label]) for r in rounds[side]] for side in (old, new))
        pairs = list(zip(o, n, strict=True))
        ratios = [b / a for a, b in pairs if a > 0]
        return statistics.median(o), statistics.median(n), ratios, [b - a for a, b in pairs]

    worst: dict[str, dict[str, float]] = {old: {}, new: {}}
    for label in both:
        t_old, t_new, t_ratio, _ = paired(label, lambda run: run["tpot_s"])
        h_old, h_new, h_ratio, _ = paired(label, host_s)
        o_old, o_new, _, o_diff = paired(label, orchestration)
        print(
            f"{label:<22} {t_old * 1e3:8.3f} {t_new * 1e3:8.3f} "
            f"{statistics.median(t_ratio):7.2f}x {h_old * 1e3:8.3f} {h_new * 1e3:8.3f} "
            f"{statistics.median(h_ratio):7.2f}x {100 * o_old:6.1f}% {100 * o_new:6.1f}% "
            f"{100 * statistics.median(o_diff):+6.1f}"
        )
        if "gloo" not in label:
            kind = label.split()[1]
            for side, share in ((old, o_old), (new, o_new)):
                worst[side][kind] = max(worst[side].get(kind, 0.0), share)
    for side in (old, new):
        shares = ", ".join(f"{k} {100 * v:.1f}%" for k, v in worst[side].items())
        print(f"worst orchestration share on {side}: {shares}")


def run_baseline(ref: str, models: list[tuple[str, str]], args: argparse.Namespace) -> None:
    """``--baseline REF``: both sides' workers, one round each in turn (see _baseline.py)."""
    argv = _baseline.worker_argv(sys.argv[1:])
    task = {"models": [[label, model_dir] for label, model_dir in models]}
    with (
        _baseline.checkout(ref) as (tree, old),
        tempfile.TemporaryDirectory(prefix="opweave-baseline-logs-") as logs,
    ):
        new = "this tree"
        scratch = Path(logs)
        workers = {
            side: _baseline.Worker(
                side, root, Path(__file__), argv, scratch, _baseline.extension_env(scratch, key)
            )
            for side, root, key in ((old, tree, "old"), (new, _baseline.ROOT, "new"))
        }
        try:
            for worker in workers.values():
                if worker.note:
                    print(worker.note)
            got: dict[str, list[dict[str, Any]]] = {side: [] for side in workers}
            for i in range(args.repeats):
                for side in _baseline.alternate(list(workers), i):
                    load = os.getloadavg()[0]
                    print(f"round {i + 1}: {side} (load average {load:.1f})", flush=True)
                    got[side].append(workers[side].ask(task))
        finally:
            for worker in workers.values():
                worker.close()
    print(
        f"\nold: {old}; new: {new} ({_baseline.ROOT}); {args.repeats} rounds, alternating; "
        f"{os.cpu_count()} CPUs"
    )
    for label, _ in models:
        print(header(label, args))
        report_side_by_side(
            {side: [r[label] for r in runs] for side, runs in got.items()}, old, new
        )


def run_pd(model_dir: str, label: str, args: argparse.Namespace) -> None:
    """``--pd``: each strategy's plan with a prefill pool beside the same plan without it."""
    requests = [Request(tuple(range(5, 5 + args.isl)), args.tokens) for _ in range(args.requests)]
    options = {"decode_step": args.decode_step}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for strategy in ("colocated", "afd", "cad"):
            for pool in (0, args.prefill_replicas):
                result = bench(model_dir, strategy, requests, args.microbatches, options, pool)
                runs.setdefault((strategy, pool), []).append(result)
    print(
        f"\n== {label}; {args.requests} requests of {args.isl} prompt tokens arriving at once, "
        f"{args.tokens} new tokens each; --decode-step {args.decode_step}; P/D: a prefill pool "
        f"of {args.prefill_replicas} colocated replica(s); median of {args.repeats} runs"
    )
    rows = []
    for strategy in ("colocated", "afd", "cad"):
        alone, pd = runs[(strategy, 0)], runs[(strategy, args.prefill_replicas)]
        sent = pd[0]["transfer"]
        same = [o["token_ids"] for o in alone[0]["outputs"]] == [
            o["token_ids"] for o in pd[0]["outputs"]
        ]
        rows.append(
            [
                strategy,
                f"{statistics.median(r['ttft_s'] for r in alone) * 1e3:.1f}",
                f"{statistics.median(r['ttft_s'] for r in pd) * 1e3:.1f}",
                f"{statistics.median(steady_tpot(r) for r in alone) * 1e3:.2f}",
                f"{statistics.median(steady_tpot(r) for r in pd) * 1e3:.2f}",
                f"{sent['bytes'] / 1e6:.2f} MB / {sent['messages']}",
                "yes" if same else "NO",
            ]
        )
    heads = ["plan", "TTFT ms", "TTFT ms P/D", "TPOT ms", "TPOT ms P/D", "state sent", "same"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    for line in [heads, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths, strict=True)))


def serve_worker(args: argparse.Namespace) -> None:
    """``--worker``: per task, one round of every model (each warmed up before its first)."""
    warm: set[str] = set()

    def handle(task: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for label, model_dir in task["models"]:
            if model_dir not in warm:
                warm_up(model_dir, args)
                warm.add(model_dir)
            out[label] = measure_round(model_dir, args)
        return out

    _baseline.serve(handle)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__[__doc__.index("Before and after") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="also a hidden-512, 4-layer model")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each case once a round)")
    parser.add_argument("--pd", action="store_true", help="P/D against no prefill pool (above)")
    parser.add_argument("--prefill-replicas", type=int, default=1, help="with --pd")
    parser.add_argument("--isl", type=int, default=96, help="with --pd: prompt tokens")
    parser.add_argument("--decode-step", default="per-request", help="with --pd")
    _baseline.add_arguments(parser)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    if args.worker:
        serve_worker(args)
        return
    shapes = [(args.hidden, args.layers)] + ([(512, 4)] if args.small else [])
    with tempfile.TemporaryDirectory(prefix="opweave-bench-") as tmp:
        models = [
            (f"llama hidden {hidden}, {layers} layers", tiny_llama(hidden, layers, tmp))
            for hidden, layers in shapes
        ]
        if args.pd:
            for label, model_dir in models:
                run_pd(model_dir, label, args)
            return
        if args.baseline:
            run_baseline(args.baseline, models, args)
        else:
            for label, model_dir in models:
                run_model(model_dir, label, args)
    rtt = gloo_round_trip_us()
    print(f"\nidle gloo loopback round trip (4 KB): {rtt:.0f} us")


if __name__ == "__main__":
    main()
