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
- for AFD and CAD (Python-driven), the runtime's CPU point-to-point transport (sockets read and
  written by the ranks' own threads, the default) vs gloo's ``isend``/``irecv`` (the path CUDA
  ranks take with NCCL; ``RunOptions(test_torch_p2p=True)``).

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
On a machine shared with other jobs, TPOT is noisy; the overhead share is the stable figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import LocalModel, Request, RunOptions, run_plan, write_tiny_model

# label -> decode step, rank programs: Python-driven, compiled steps one segment at a time,
# native submission (one rank program per token)
MODES = {
    "python": ("per-request", True),
    "segments": ("compiled", False),
    "native": ("compiled", True),
}


def bench(
    model_dir: str, strategy: str, requests: list[Request], mb: int, options: RunOptions
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
    result = run_plan(plan, model_dir, requests, options)
    assert result is not None
    return result.model_dump(mode="json")


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


def run_model(model_dir: str, label: str, args: argparse.Namespace) -> None:
    prompts = [tuple(range(5, 5 + 4 + 3 * i)) for i in range(args.requests)]
    requests = [Request(p, args.tokens) for p in prompts]
    print(
        f"\n== {label}; {args.requests} requests (prompts {len(prompts[0])}..{len(prompts[-1])} "
        f"tokens), {args.tokens} new tokens each; AFD/CAD with {args.microbatches} microbatches; "
        f"median of {args.repeats} runs"
    )
    cases = [(s, "socket", mode) for s in ("colocated", "afd", "cad") for mode in MODES]
    cases += [(s, "torch", "python") for s in ("afd", "cad")]

    def run(strategy: str, p2p: str, mode: str) -> dict[str, Any]:
        step, programs = MODES[mode]
        options = RunOptions(
            decode_step=step, rank_programs=programs, test_torch_p2p=p2p == "torch"
        )
        return bench(model_dir, strategy, requests, args.microbatches, options)

    for case in cases:  # compile (and cache) every segment and program before measuring
        if MODES[case[2]][0] != "per-request":
            run(*case)
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {c: [] for c in cases}
    for _ in range(args.repeats):  # interleaved, so machine-speed drift hits every case alike
        for case in cases:
            results[case].append(run(*case))
    reference = None
    rows = []
    for (strategy, p2p, mode), runs in results.items():
        runs.sort(key=steady_tpot)
        result = runs[len(runs) // 2]
        tokens = [o["token_ids"] for o in result["outputs"]]
        reference = reference or tokens
        assert tokens == reference, f"{strategy} ({p2p}, {mode}) tokens differ from colocated"
        label = f"{strategy} {mode}" + (" gloo" if p2p == "torch" else "")
        rows.append((label, result, statistics.median(steady_tpot(r) for r in runs)))

    print(
        f"\n{'case':<22} {'TPOT ms':>8} {'launches/token':>14} {'host ms/token':>13} "
        f"{'orchestration':>13}"
    )
    by: dict[str, float] = {}
    worst: dict[str, float] = {mode: 0.0 for mode in MODES}
    for label, result, tpot in rows:
        by[label] = tpot
        ranks = result["ranks"]
        share = max(steady_split(r)["orchestration"] for r in ranks)
        kind = label.split()[1]
        if "gloo" not in label:
            worst[kind] = max(worst[kind], share)
        launches = max(r["submissions_per_token"] for r in ranks)
        host = max(steady_split(r)["host_s_per_iteration"] for r in ranks)
        print(
            f"{label:<22} {tpot * 1e3:8.3f} {launches:14.2f} {host * 1e3:13.3f} "
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
            split = steady_split(r)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="also a hidden-512, 4-layer model")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    models = [(args.hidden, args.layers)] + ([(512, 4)] if args.small else [])
    with tempfile.TemporaryDirectory(prefix="opweave-bench-") as tmp:
        for hidden, layers in models:
            model_dir = tiny_llama(hidden, layers, tmp)
            LocalModel(model_dir).generate([[5, 6, 7]], 4)  # warm-up
            run_model(model_dir, f"llama hidden {hidden}, {layers} layers", args)
    rtt = gloo_round_trip_us()
    print(f"\nidle gloo loopback round trip (4 KB): {rtt:.0f} us")


if __name__ == "__main__":
    main()
