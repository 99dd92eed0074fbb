"""Real signals to real ``opweave`` processes, and what a run exposes on the network.

Each command runs in a session of its own, with SIGINT at its default disposition (a shell
starts background jobs with SIGINT ignored, and the test's own process may be one), and a
temporary folder of its own (``TMPDIR``: other test runs share /tmp); the test signals it the
way a terminal's Ctrl-C (SIGINT) or a supervisor (SIGTERM) would. Afterwards: the exit status
and its one line, no process of the run left, nothing left in its temporary folder. While a run
on one node is up, every socket any of its processes listens on is on loopback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import alive, descendants, listening, rank_pids, start_opweave


def _wait_for(what, timeout_s: float, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {log.read_text()[-2000:]}")
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"timed out: {log.read_text()[-2000:]}")


RUN = ["run", "--strategy", "afd", "--prompt", "t5 t6 t7", "--max-tokens", "50", "--json"]
# the CLI's test seam: rank 1 stops at its third iteration, so the run stays up
HANG = ["--fault", "1:3:hang"]


@pytest.mark.parametrize(
    ("sig", "code", "line"),
    [
        (signal.SIGTERM, 143, "error: terminated (SIGTERM)"),
        (signal.SIGINT, 130, "error: interrupted (SIGINT)"),
        (signal.SIGHUP, 129, "error: hung up (SIGHUP)"),  # the terminal or session closed
    ],
    ids=["SIGTERM", "SIGINT", "SIGHUP"],
)
def test_a_signal_stops_an_offline_run_and_everything_it_started(
    sig, code, line, tiny_model, tmp_path
):
    args = [*RUN, "--model-path", str(tiny_model("llama")), "--timeout-s", "120", *HANG]
    proc, log, temp = start_opweave(args, tmp_path)
    ranks = _wait_for(lambda: len(rank_pids(proc.pid)) == 2 and rank_pids(proc.pid), 60, proc, log)
    run_dirs = _wait_for(lambda: list(temp.iterdir()), 10, proc, log)
    assert [p.name.startswith("opweave-run-") for p in run_dirs] == [True]
    started = [*descendants(proc.pid), proc.pid]
    time.sleep(0.5)  # the ranks are serving (rank 1 hangs at its third iteration)

    if sig == signal.SIGTERM:  # network exposure, checked while the run is up
        sockets = listening(started)
        assert sockets, "the run listens for its ranks' control connections"
        assert all(addr == "127.0.0.1" for addr, _, _ in sockets), sockets

    proc.send_signal(sig)
    assert proc.wait(30) == code
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    assert lines == [line], lines
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in started):
        time.sleep(0.1)
    assert not [p for p in started if alive(p)], "processes outlived the run"
    assert set(ranks.values()) <= set(started)
    assert list(temp.iterdir()) == []


def test_sigint_stops_a_profile_run(write_config, tmp_path):
    """``opweave profile`` starts its own transfer processes: none of them outlives Ctrl-C."""
    from tests.helpers import TINY_LLAMA

    model = write_config(TINY_LLAMA, "tiny")
    out = tmp_path / "p.json"
    # far more repeats than it could time before the signal
    args = ["profile", "-m", str(model), "--device", "cpu", "-o", str(out), "--repeats", "60000"]
    proc, log, temp = start_opweave(args, tmp_path)
    time.sleep(6.0)  # past torch's import: timing
    assert proc.poll() is None, log.read_text()[-2000:]
    started = [*descendants(proc.pid), proc.pid]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    text = log.read_text()
    assert text.strip().splitlines()[-1] == "error: interrupted (SIGINT)", text[-2000:]
    assert "Traceback" not in text
    time.sleep(0.5)
    assert not [p for p in started if alive(p)]
    assert not out.exists()
    assert list(temp.iterdir()) == []


def test_the_control_channel_refuses_a_peer_without_the_secret(tiny_model):
    """A process without the run's secret is dropped at the handshake; once every rank has
    joined, the driver's control port is closed, so no process can reach it at all; the run goes
    on and its results are unchanged."""
    import socket
    import threading

    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Cluster, Request
    from opweave.runtime._private.control import (
        AuthError,
        ChannelClosed,
        client_handshake,
        server_handshake,
    )
    from opweave.runtime._private.driver import OfflineDriver

    key = bytes(range(32))
    for wrong in (b"\x00" * 32, b"wrong key"):  # the handshake: a guessed key is refused
        server, client = socket.socketpair()
        outcome: list[object] = []

        def serve(sock=server, out=outcome) -> None:
            try:
                out.append(server_handshake(sock, key))
            except (AuthError, ChannelClosed, OSError) as exc:
                out.append(exc)
            finally:
                sock.close()

        thread = threading.Thread(target=serve)
        thread.start()
        with client, pytest.raises((AuthError, ChannelClosed, OSError)):
            client_handshake(client, wrong, 0)
        thread.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], AuthError)
    model_dir = tiny_model("llama")
    spec = load_model(model_dir)
    plan = canonical_plan(spec, "colocated", gpu="cpu", batch=1)
    cluster = Cluster(plan, spec, model_dir)
    try:
        host, port = cluster.control_address
        assert host == "127.0.0.1"
        with pytest.raises(ConnectionRefusedError):  # every rank joined: the port is closed
            socket.create_connection((host, port), timeout=5).close()
        driver = OfflineDriver(cluster, [Request((5, 6, 7), 4)], spec.arch.eos_token_ids)
        driver.run()
        assert len(driver.outputs()[0].token_ids) == 4
        cluster.shutdown()
    finally:
        cluster.close()
