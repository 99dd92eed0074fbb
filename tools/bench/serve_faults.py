"""Load and faults on a server: how it stops, how it fails, what it leaves, beside plain vLLM.

For each server -- ``opweave run --strategy afd`` (two ranks under vLLM's engine) and plain vLLM
(``python -m vllm.entrypoints.openai.api_server``) on the same tiny random Llama -- with
``--clients`` streaming clients (``max_tokens`` :data:`STREAM_TOKENS`, ``ignore_eos``: long
enough that both servers are still streaming at the drain deadline), one case after another:

- **drain**: SIGTERM while every client streams, ``--shutdown-timeout`` D: seconds from the
  signal to the process's exit, its status, how the clients' streams ended (an error event, a
  bare ``[DONE]``, or just cut), and ``/health`` during the drain;
- **kill**: SIGKILL of the server process: processes of the server still alive 10 s later, and
  entries left in its ``TMPDIR``;
- **engine**: SIGKILL of vLLM's engine-core process under load: seconds until every client got
  an error (time-to-fail), until the server exited, and its status;
- **rank** (OpWeave only): SIGKILL of rank 1 under load, likewise.

Every case also reports leftovers: processes of the server alive 10 s after its exit and
entries in its ``TMPDIR``. Run inside the vLLM environment (the nox ``vllm`` session's venv)::

    .nox/vllm/bin/python tools/bench/serve_faults.py [--clients 4] [--drain-s 5] [--repeats 1]

Prints figures; asserts nothing. Timings depend on the machine's load: run it more than once.
"""

from __future__ import annotations

import argparse
import contextlib
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

CASES = ("drain", "kill", "engine", "rank")
# tokens each client asks for; the tiny model's context holds them. Plain vLLM streams a tiny
# model's tokens fast: 500 (the earlier figure) ended its streams before a 4 s deadline, so its
# drain row measured an idle stop, not a drain
STREAM_TOKENS = 4000
MODEL_LEN = 4096


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _health(base: str) -> int | None:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [pid], [pid]
    while frontier:
        p = frontier.pop()
        for child, pp in parent.items():
            if pp == p and child not in found:
                found.append(child)
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Server:
    def __init__(self, kind: str, model: Path, drain_s: float, root: Path) -> None:
        self.kind = kind
        self.temp = Path(tempfile.mkdtemp(dir=root, prefix=f"{kind}-"))
        port = _free_port()
        self.base = f"http://127.0.0.1:{port}"
        common = ["--max-model-len", str(MODEL_LEN), "--dtype", "float32", "--port", str(port)]
        common += ["--shutdown-timeout", f"{drain_s:g}"]
        if kind == "opweave":
            cmd = [sys.executable, "-m", "opweave.cli", "run", "--strategy", "afd"]
            cmd += ["--model-path", str(model), "--timeout-s", "5", *common]
        else:
            cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
            # on CPU this share of the host's memory is reserved (KV cache): a shared machine
            # has far less than vLLM's default 0.92 free
            cmd += ["--model", str(model), "--gpu-memory-utilization", "0.2", *common]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env |= {"HF_HUB_OFFLINE": "1", "TMPDIR": str(self.temp)}
        self.log = self.temp.parent / f"{self.temp.name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + 600
        while _health(self.base) != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{kind} did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.5)
        self.pids = _tree(self.proc.pid)

    def leftovers(self) -> tuple[int, int]:
        """(processes still alive 10 s after the server's end, entries in its TMPDIR)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in self.pids):
            time.sleep(0.2)
        alive = [p for p in self.pids if _alive(p)]
        left = len(list(self.temp.iterdir()))
        for p in alive:  # the benchmark leaves nothing behind itself
            with_kill(p)
        return len(alive), left

    def stop(self) -> None:
        if self.proc.poll() is None:
            with_kill(self.proc.pid)
            self.proc.wait()


def with_kill(pid: int) -> None:
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)


def _client(base: str, model: Path, out: dict, started: threading.Event) -> None:
    body = {"model": str(model), "prompt": "a b c", "max_tokens": STREAM_TOKENS, "ignore_eos": True}
    body |= {"stream": True, "temperature": 0}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    out["end"] = None
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if line == "data: [DONE]":
                    out["end"] = out["end"] or "[DONE] only"
                elif line.startswith("data: "):
                    if "error" in json.loads(line[6:]):
                        out["end"] = "error event"
                    started.set()
        out["end"] = out["end"] or "cut (no error)"
    except Exception as exc:
        out["end"] = out["end"] or f"cut ({type(exc).__name__})"
    out["at"] = time.monotonic()


def _load(server: Server, model: Path, clients: int) -> tuple[list[threading.Thread], list[dict]]:
    threads, outs, flags = [], [], []
    for _ in range(clients):
        out, go = {}, threading.Event()
        t = threading.Thread(target=_client, args=(server.base, model, out, go), daemon=True)
        t.start()
        threads.append(t)
        outs.append(out)
        flags.append(go)
    for go in flags:
        go.wait(300)
    time.sleep(1.0)
    return threads, outs


def _ends(outs: list[dict]) -> str:
    counts: dict[str, int] = {}
    for o in outs:
        counts[o.get("end") or "no end"] = counts.get(o.get("end") or "no end", 0) + 1
    return ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))


def case(kind: str, name: str, model: Path, args: argparse.Namespace, root: Path) -> dict:
    server = Server(kind, model, args.drain_s, root)
    try:
        threads, outs = _load(server, model, args.clients)
        t0 = time.monotonic()
        row: dict = {}
        if name == "drain":
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            row["health_during"] = _health(server.base)
        elif name == "kill":
            server.proc.send_signal(signal.SIGKILL)
        else:
            tree = _tree(server.proc.pid)
            if name == "engine":
                victims = [p for p in tree if "EngineCor" in _name(p)]
            else:
                victims = [p for p in tree if _name(p) == "opweave-rank1"]
            if not victims:
                return {"skipped": f"no {name} process"}
            os.kill(victims[0], signal.SIGKILL)
        try:
            row["status"] = server.proc.wait(300)
        except subprocess.TimeoutExpired:
            row["status"] = "hung"
        row["exit_s"] = time.monotonic() - t0
        for t in threads:
            t.join(60)
        ats = [o["at"] for o in outs if "at" in o]
        row["clients_failed_s"] = max(ats) - t0 if len(ats) == len(outs) else None
        row["streams"] = _ends(outs)
        row["left_processes"], row["left_files"] = server.leftovers()
        return row
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--drain-s", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--servers", default="opweave,vllm")
    args = parser.parse_args()
    from opweave.runtime import write_tiny_model

    root = Path(tempfile.mkdtemp(prefix="serve-faults-"))
    model = write_tiny_model(
        "llama",
        root / "llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MODEL_LEN,
    )
    print(f"{args.clients} streaming clients, drain deadline {args.drain_s:g} s; shared machine")
    for name in args.only.split(","):
        for kind in args.servers.split(","):
            if name == "rank" and kind == "vllm":
                continue
            rows = [case(kind, name, model, args, root) for _ in range(args.repeats)]
            if "skipped" in rows[0]:
                print(f"{name:<7} {kind:<8} {rows[0]['skipped']}")
                continue
            exits = [r["exit_s"] for r in rows]
            fails = [r["clients_failed_s"] for r in rows if r["clients_failed_s"] is not None]
            print(
                f"{name:<7} {kind:<8} exit {statistics.median(exits):6.1f} s "
                f"(worst {max(exits):5.1f}), status {sorted({str(r['status']) for r in rows})}, "
                f"clients ended {statistics.median(fails) if fails else float('nan'):6.1f} s, "
                f"streams: {rows[-1]['streams']}; "
                + (f"/health during drain {rows[-1]['health_during']}; " if name == "drain" else "")
                + f"left: {max(r['left_processes'] for r in rows)} processes, "
                f"{max(r['left_files'] for r in rows)} files"
            )


if __name__ == "__main__":
    main()
