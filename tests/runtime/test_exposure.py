"""What a local process without the run's secret can do to a running plan: nothing.

Once every rank has joined, no port of the run takes a new connection: the driver closes its
control port, and each rank makes its listening ports (gloo's on CPU, NCCL's on CUDA, once every
connection it uses is made: test_connect.py) drop connecting packets, so a connection flood
leaves no descriptor behind and the run keeps generating transformers' greedy tokens. (Before,
gloo kept every connection it accepted; about 20,000 connect-and-close attempts exhausted a
rank's descriptors and gloo aborted it.) Also: a killed driver takes its ranks with it and its
reaper removes the run's folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from opweave.costmodel import canonical_plan, load_model
from opweave.runtime import Cluster, OfflineDriver, Request, RunOptions
from tests.helpers import alive, listening, sockets

MAX_NEW_TOKENS = 16  # shares hf_greedy's cache with the other runtime tests
FLOOD_S = 3.0  # per port


def test_a_connection_flood_against_every_port_leaves_the_run_serving(
    tiny_model, hf_greedy, prompts
):
    model_dir = tiny_model("llama")
    model = load_model(model_dir)
    plan = canonical_plan(model, "afd", gpu="cpu", batch=4, microbatches=2, tp=2)
    cluster = Cluster(plan, model, model_dir, RunOptions(timeout_s=20))
    try:
        ports = listening([*cluster.pids, os.getpid()])
        # gloo listens in every rank (a port per process group); the driver no longer does
        assert {pid for _, _, pid in ports} == set(cluster.pids), ports
        before = {pid: sockets().descriptors(pid) for pid in cluster.pids}
        for addr, port, _ in ports:
            (tried,) = sockets().flood([(addr, port)], FLOOD_S / len(ports) * 4)
            assert tried["attempts"] > 10 and tried["made"] == 0, tried
        after = {pid: sockets().descriptors(pid) for pid in cluster.pids}
        assert after == before
        requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in prompts]
        driver = OfflineDriver(cluster, requests, model.arch.eos_token_ids)
        driver.run()
        tokens = [list(out.token_ids) for out in driver.outputs()]
        cluster.shutdown()
    finally:
        cluster.close()
    assert tokens == hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)


_DRIVER = textwrap.dedent(
    """
    import sys, time
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Cluster, RunOptions

    model = load_model(sys.argv[1])
    plan = canonical_plan(model, "afd", gpu="cpu", batch=4, microbatches=2)
    cluster = Cluster(plan, model, sys.argv[1], RunOptions(), start_method=sys.argv[2])
    print(cluster.run_dir, *cluster.pids, flush=True)
    time.sleep(600)
    """
)


def test_a_killed_driver_leaves_no_rank_and_no_folder(tiny_model, tmp_path):
    """SIGKILL (or the OOM killer) runs no clean-up in the driver: its ranks follow it (a
    parent-death signal, through the launcher when it has one) and the run's reaper removes
    the run's folder."""
    model_dir = tiny_model("llama")
    temp = tmp_path / "tmp"
    temp.mkdir()
    for method in ("fork", "launcher"):
        proc = subprocess.Popen(
            [sys.executable, "-c", _DRIVER, str(model_dir), method],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TMPDIR": str(temp)},
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            words = proc.stdout.readline().split()
            assert words, f"the driver did not start its ranks ({method})"
            run_dir, ranks = Path(words[0]), [int(w) for w in words[1:]]
            assert run_dir.parent == temp and run_dir.is_dir() and len(ranks) == 2
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            deadline = time.monotonic() + 30  # generous: only a hang would take this long
            while time.monotonic() < deadline and (
                any(alive(p) for p in ranks) or list(temp.iterdir())
            ):
                time.sleep(0.1)
            assert not [p for p in ranks if alive(p)], f"ranks outlived the driver ({method})"
            assert list(temp.iterdir()) == [], f"left behind ({method}): {list(temp.iterdir())}"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_ranks_that_went_with_their_launcher_are_said_to_have():
    """A launcher that dies takes its ranks along (their parent-death signal): they are named
    as stopped with it, not as killed themselves; a rank whose own exit it reported before
    keeps that."""
    import threading
    from types import SimpleNamespace

    from opweave.runtime._private.launch import RankProcess, _Launcher

    launcher = object.__new__(_Launcher)
    launcher.proc = SimpleNamespace(  # pyright: ignore[reportAttributeAccessIssue]
        stdout=iter([b"started 0 111\n", b"started 1 112\n", b"exited 1 -9\n"]),
        wait=lambda: -9,
        returncode=-9,
        pid=100,
    )
    launcher.pids, launcher.status, launcher.orphaned, launcher.dead = {}, {}, set(), False
    launcher._started = threading.Condition()
    launcher._read()
    first, second = (
        RankProcess(r, 111 + r, Path(os.devnull), launcher=launcher, tag=r) for r in (0, 1)
    )
    assert launcher.dead
    assert first.ended() == (
        "was stopped with the rank launcher (process 100), which was killed by signal 9 (SIGKILL)"
    )
    assert second.ended() == "was killed by signal 9 (SIGKILL)"
