"""The coordinator: install a plan on local worker processes, watch them, collect the result.

It starts one process per rank of this node with torchrun's conventions (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``; the node-0 coordinator hosts the
rendezvous store), hands each its plan, model folder and (rank 0) the requests, and then stays out
of the loop: it only polls the processes. A plan spanning several machines runs with one
coordinator per node (``nnodes``/``node_rank``); under ``torchrun`` no coordinator is needed at
all (see :func:`run_from_env`).

Start method: on CPU the workers are forked from this process, which already imported torch, so a
rank starts in milliseconds instead of re-importing torch (seconds); the child uses one intra-op
thread (GNU OpenMP is not fork-safe beyond that, and ranks share the cores anyway). CUDA workers
are spawned as fresh interpreters, since CUDA does not survive a fork.

Faults: a rank that exits non-zero or dies, or whose peers time out waiting for it, ends the run:
the coordinator kills every process group it started and raises one line naming the culprit rank
and its stages. Each worker also dies with the coordinator (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opweave.costmodel import Plan, load_model

from ..errors import OpWeaveRuntimeError, RunFailedError
from .driver import Request, check_requests
from .placement import Placement, check_plan, total_ranks
from .wire import spin_budget
from .worker import WorkerSpec, run_worker

_GRACE_S = 1.0  # after a first failure, how long the others get to report before being killed
_POLL_S = 0.02


@dataclass
class _Child:
    rank: int
    pid: int
    popen: subprocess.Popen[bytes] | None = None
    status: int | None = None  # exit code; negative = killed by that signal
    killed_by_us: bool = False

    def poll(self) -> int | None:
        if self.status is not None:
            return self.status
        if self.popen is not None:
            self.status = self.popen.poll()
            return self.status
        pid, raw = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            self.status = os.waitstatus_to_exitcode(raw)
        return self.status

    def kill(self) -> None:
        if self.poll() is None:
            self.killed_by_us = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.popen is not None:
            self.status = self.popen.wait()
        elif self.status is None:
            _, raw = os.waitpid(self.pid, 0)
            self.status = os.waitstatus_to_exitcode(raw)


def resolve_backend(device: str) -> tuple[str, str]:
    """``auto`` -> cuda + nccl when a GPU is visible, else cpu + gloo."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise OpWeaveRuntimeError(f"device must be cpu, cuda or auto, got {device!r}")
    return device, "nccl" if device == "cuda" else "gloo"


def run_plan(
    plan: Plan,
    model_dir: str | Path,
    requests: Sequence[Request],
    *,
    ranks: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    device: str = "auto",
    timeout_s: float = 60.0,
    start_method: str = "auto",
    tp_mode: str = "auto",
) -> dict[str, Any] | None:
    """Run ``requests`` under ``plan`` on this node's ranks; the result on node 0, else ``None``.

    The result holds ``outputs`` (per request its ``prompt_token_ids``, generated ``token_ids``
    and ``finish_reason``), the measured ``tpot_s``, and ``ranks``: per rank its stages, weight
    bytes read and resident, and time in operators (``compute_s``), blocked in transfers
    (``comm_s``) and elsewhere in the loop (``overhead_s``).
    """
    model = load_model(model_dir)
    world = total_ranks(plan)
    check_plan(plan, model, world if ranks is None else ranks)
    check_requests(requests)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise OpWeaveRuntimeError(f"node rank {node_rank} is not in 0..{nnodes - 1}")
    if world % nnodes:
        raise OpWeaveRuntimeError(f"{world} ranks do not split evenly over {nnodes} nodes")
    if node_rank > 0 and master_port is None:
        raise OpWeaveRuntimeError("nodes other than 0 need --master-port of node 0")
    device, backend = resolve_backend(device)
    spin_budget(own_core=False)  # a malformed OPWEAVE_WAIT fails here, before any rank starts
    if start_method == "auto":
        start_method = "fork" if device == "cpu" else "spawn"
    per_node = world // nnodes
    local = range(node_rank * per_node, (node_rank + 1) * per_node)
    placement = Placement(plan, model)
    run_dir = Path(tempfile.mkdtemp(prefix="opweave-run-"))
    extra_env = _child_env(master_addr)
    children: list[_Child] = []
    store = None
    try:
        for lr, rank in enumerate(local):
            spec = WorkerSpec(
                plan=plan.model_dump(mode="json"),
                model_dir=str(model_dir),
                rank=rank,
                world_size=world,
                local_rank=lr,
                master_addr=master_addr,
                master_port=master_port,
                backend=backend,
                device=device,
                timeout_s=timeout_s,
                run_dir=str(run_dir),
                requests=[r.to_json() for r in requests] if rank == 0 else [],
                tp_mode=tp_mode,
                local_world_size=per_node,
            )
            children.append(_start(spec, run_dir, start_method, extra_env))
        # The store is hosted only after every fork, so no child inherits its server thread;
        # local workers wait for the port file, remote ones retry until the port answers.
        if node_rank == 0:
            store = _host_store(master_addr, master_port, timeout_s)
            tmp = run_dir / "store_port.tmp"
            tmp.write_text(str(store.port))
            tmp.rename(run_dir / "store_port")
        _watch(children, placement, run_dir, timeout_s)
        if 0 not in local:
            return None
        return json.loads((run_dir / "result.json").read_text())
    finally:
        for child in children:
            child.kill()
        del store
        shutil.rmtree(run_dir, ignore_errors=True)


def _child_env(master_addr: str) -> dict[str, str]:
    """Extra environment of every worker: gloo on the loopback device for 127.0.0.1 runs."""
    env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    if master_addr in ("127.0.0.1", "localhost") and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _host_store(addr: str, port: int | None, timeout_s: float) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    host = addr if port is not None else "127.0.0.1"
    try:
        return dist.TCPStore(
            host,
            port or 0,
            None,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except RuntimeError as exc:
        raise OpWeaveRuntimeError(
            f"cannot host the rendezvous store on {host}:{port}: {exc}"
        ) from None


def _start(spec: WorkerSpec, run_dir: Path, method: str, extra_env: dict[str, str]) -> _Child:
    env = {
        **extra_env,
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(spec.world_size),
        "LOCAL_RANK": str(spec.local_rank),
        "MASTER_ADDR": spec.master_addr,
    }
    log = run_dir / f"rank{spec.rank}.log"
    (run_dir / f"rank{spec.rank}.alive").touch()
    if method == "spawn":
        path = run_dir / f"rank{spec.rank}.json"
        path.write_text(spec.to_json())
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "opweave.runtime._private.worker_main", str(path)],
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return _Child(spec.rank, popen.pid, popen)
    if method != "fork":
        raise OpWeaveRuntimeError(f"start method must be fork or spawn, got {method!r}")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child: never returns into the caller's stack
        code = 1
        try:
            os.setsid()
            from .worker_main import child_main, die_with_parent

            die_with_parent()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(env)
            import torch

            torch.set_num_threads(1)
            code = child_main(spec)
        finally:
            os._exit(code)
    return _Child(spec.rank, pid)


def _watch(children: list[_Child], placement: Placement, run_dir: Path, timeout_s: float) -> None:
    """Poll until every local rank exits 0; on the first failure diagnose, kill all, raise."""
    stall_s = 2 * timeout_s + 30
    while True:
        statuses = [c.poll() for c in children]
        if all(s == 0 for s in statuses):
            return
        if any(s not in (None, 0) for s in statuses):
            deadline = time.monotonic() + _GRACE_S
            while time.monotonic() < deadline and any(c.poll() is None for c in children):
                time.sleep(_POLL_S)
            break
        newest = max(
            (run_dir / f"rank{c.rank}.alive").stat().st_mtime for c in children if c.status is None
        )
        if time.time() - newest > stall_s:
            break
        time.sleep(_POLL_S)
    alive = {c.rank for c in children if c.poll() is None}
    for child in children:
        child.kill()
    raise RunFailedError(_diagnose(children, alive, placement, run_dir, timeout_s))


def _diagnose(
    children: list[_Child], alive: set[int], placement: Placement, run_dir: Path, timeout_s: float
) -> str:
    """Blame one rank: a crash beats an own error beats the peer others were waiting on."""
    reports: dict[int, dict[str, Any]] = {}
    for child in children:
        path = run_dir / f"rank{child.rank}.error.json"
        if path.exists():
            reports[child.rank] = json.loads(path.read_text())

    def who(rank: int) -> str:
        return f"rank {rank} ({placement.describe(rank)})"

    for child in children:
        if child.rank not in alive and child.status not in (0, None) and child.rank not in reports:
            code = child.status
            how = (
                f"was killed by signal {-code} ({signal.Signals(-code).name})"
                if code < 0
                else f"exited with status {code}"
            )
            return f"{who(child.rank)} {how} without reporting an error; the run was stopped"
    for rank, rep in sorted(reports.items()):
        if rep["kind"] == "error":
            return f"{who(rank)} failed: {rep['message']}"
    local = {c.rank for c in children}
    for rank, rep in sorted(reports.items()):
        peer = rep.get("peer")
        if peer is None or peer in reports:
            continue
        state = "stopped responding" if peer in alive else "failed"
        if peer not in local:
            state = "failed or stopped responding (on another node)"
        return f"{who(peer)} {state}: rank {rank} reported: {rep['message']}"
    if reports:
        rank, rep = next(iter(sorted(reports.items())))
        return f"{who(rank)} failed: {rep['message']}"
    if alive:  # the watchdog fired: blame the rank whose heartbeat is oldest
        stalest = min(alive, key=lambda r: (run_dir / f"rank{r}.alive").stat().st_mtime)
        return (
            f"{who(stalest)} stopped responding: no progress for {2 * timeout_s + 30:g} s; "
            "the run was stopped"
        )
    return "the run failed without a report"


def torchrun_env() -> dict[str, str] | None:
    """The torchrun variables when this process is one of its workers, else ``None``."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    if all(k in os.environ for k in keys):
        return {k: os.environ[k] for k in keys}
    return None


def run_from_env(
    plan: Plan,
    model_dir: str | Path,
    requests: Sequence[Request],
    *,
    device: str = "auto",
    timeout_s: float = 60.0,
    tp_mode: str = "auto",
) -> dict[str, Any] | None:
    """Run this process as the rank ``torchrun`` made it (``RANK``, ``WORLD_SIZE``, ...).

    ``torchrun --nnodes 2 --nproc-per-node 2 ... -m opweave.cli run plan.json ...`` on each node
    starts every rank itself; rank 0 returns the result, the others ``None``. Failure handling is
    torchrun's: a rank that raises exits non-zero and the agent stops the others.
    """
    env = torchrun_env()
    if env is None:
        raise OpWeaveRuntimeError("not started by torchrun: RANK, WORLD_SIZE, ... are not set")
    world = int(env["WORLD_SIZE"])
    check_plan(plan, load_model(model_dir), world)
    check_requests(requests)
    device, backend = resolve_backend(device)
    spin_budget(own_core=False)
    spec = WorkerSpec(
        plan=plan.model_dump(mode="json"),
        model_dir=str(model_dir),
        rank=int(env["RANK"]),
        world_size=world,
        local_rank=int(env["LOCAL_RANK"]),
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
        backend=backend,
        device=device,
        timeout_s=timeout_s,
        requests=[r.to_json() for r in requests] if env["RANK"] == "0" else [],
        tp_mode=tp_mode,
        env_init=True,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    )
    if device == "cpu":
        import torch

        torch.set_num_threads(1)
    return run_worker(spec)
