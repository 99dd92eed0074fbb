"""Multi-process runtime on CPU: TPOT of colocated vs AFD vs CAD, and orchestration overhead.

For each strategy a tiny random Llama serves several requests of different prompt lengths on
local CPU ranks (one process per rank, one thread each). AFD and CAD run twice, side by side:
with the runtime's CPU point-to-point transport (sockets read and written by the ranks' own
threads, the default) and with gloo's ``isend``/``irecv`` (``OPWEAVE_P2P=torch``). Per rank
the decode loop's wall time is split into time inside operators (compute), time blocked in
transfers and TP collectives (communication wait, which includes waiting for the upstream
stage) and the remainder: the runtime's own orchestration (batch merge/split, admission,
packing headers, Python dispatch between actions). Target: orchestration under 10% of the
loop. Prints figures; asserts nothing.

Run: ``uv run python tools/bench/runtime.py [--hidden 64] [--layers 2] [--tokens 32]``.
On a machine shared with other jobs, TPOT is noisy; the overhead share is the stable figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import LocalModel, Request, run_plan, write_tiny_model


def bench(model_dir: str, strategy: str, requests: list[Request], mb: int) -> dict[str, Any]:
    spec = load_model(model_dir)
    plan = canonical_plan(
        spec,
        strategy,
        gpu="cpu",
        batch=len(requests),
        microbatches=1 if strategy == "colocated" else mb,
    )
    result = run_plan(plan, model_dir, requests, timeout_s=120)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    model_dir = str(
        write_tiny_model(
            "llama",
            tempfile.mkdtemp(prefix="opweave-bench-"),
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=max(4, args.hidden // 64),
            num_key_value_heads=max(2, args.hidden // 128),
        )
    )
    prompts = [tuple(range(5, 5 + 4 + 3 * i)) for i in range(args.requests)]
    requests = [Request(p, args.tokens) for p in prompts]
    print(
        f"tiny llama: hidden {args.hidden}, {args.layers} layers; {args.requests} requests "
        f"(prompts {len(prompts[0])}..{len(prompts[-1])} tokens), {args.tokens} new tokens each; "
        f"AFD/CAD with {args.microbatches} microbatches; median of {args.repeats} runs"
    )
    torch.set_num_threads(1)
    local = LocalModel(model_dir)
    local.generate([list(p) for p in prompts], args.tokens)  # warm-up
    reference = None
    rows = []
    cases = [("colocated", "socket")] + [
        (s, p2p) for s in ("afd", "cad") for p2p in ("socket", "torch")
    ]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {c: [] for c in cases}
    for _ in range(args.repeats):  # interleaved, so machine-speed drift hits every case alike
        for strategy, p2p in cases:
            os.environ["OPWEAVE_P2P"] = p2p
            results[(strategy, p2p)].append(bench(model_dir, strategy, requests, args.microbatches))
    os.environ.pop("OPWEAVE_P2P", None)
    for (strategy, p2p), runs in results.items():
        runs.sort(key=lambda r: r["tpot_s"])
        result = runs[len(runs) // 2]
        tokens = [o["token_ids"] for o in result["outputs"]]
        reference = reference or tokens
        assert tokens == reference, f"{strategy} tokens differ from colocated"
        label = (
            strategy
            if strategy == "colocated"
            else f"{strategy} ({'gloo' if p2p == 'torch' else p2p})"
        )
        rows.append((label, result, statistics.median(r["tpot_s"] for r in runs)))

    print(f"\n{'strategy':<14} {'TPOT ms':>9} {'iterations':>10} {'ranks':>5}")
    for strategy, result, tpot in rows:
        print(
            f"{strategy:<14} {tpot * 1e3:9.3f} {result['iterations']:10d} {len(result['ranks']):5d}"
        )
    by = {label: tpot for label, _, tpot in rows}
    for s in ("afd", "cad"):
        print(f"{s}: gloo p2p / socket p2p TPOT = {by[f'{s} (gloo)'] / by[f'{s} (socket)']:.2f}x")
    print(
        f"\n{'strategy':<14} {'rank':>4} {'stages':<28} {'loop ms':>8} {'compute':>8} "
        f"{'comm wait':>9} {'orchestration':>13}"
    )
    worst = 0.0
    for strategy, result, _ in rows:
        for r in result["ranks"]:
            loop = r["loop_s"]
            share = r["overhead_s"] / loop
            worst = max(worst, share)
            stages = ", ".join(r["stages"])
            stages = stages if len(stages) <= 28 else stages[:25] + "..."
            print(
                f"{strategy:<14} {r['rank']:>4} {stages:<28} {loop * 1e3:8.1f} "
                f"{100 * r['busy_s'] / loop:7.1f}% {100 * r['comm_s'] / loop:8.1f}% "
                f"{100 * share:12.1f}%"
            )
    verdict = "meets" if worst < 0.10 else "MISSES"
    print(f"\nworst orchestration share: {100 * worst:.1f}% ({verdict} the < 10% target)")
    rtt = gloo_round_trip_us()
    hops = rows[1][1]["ranks"][0]["messages_sent"] / rows[1][1]["iterations"]
    print(
        f"idle gloo loopback round trip (4 KB): {rtt:.0f} us; AFD sends {hops:.1f} messages per "
        "iteration per rank"
    )


if __name__ == "__main__":
    main()
