"""Where a run's ranks are: its nodes, the rendezvous between them, and the nodes other than 0.

A run on one node needs nothing here. A run over several nodes (``--nnodes``, or torchrun's
environment) has node 0 host the driver and a TCP rendezvous store on the master address; every
other node starts its own ranks (:func:`run_node`), which find the driver through the store, and
a torchrun worker other than rank 0 runs its one rank in its own process
(:func:`run_torchrun_rank`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from opweave.costmodel import ModelSpec, Plan

from ..errors import OpWeaveRuntimeError, RunFailedError
from . import native
from .control import SECRET_ENV, run_secret, store_namespace
from .join import run_rank
from .launch import RankProcess, fork_is_safe, node_layout, rank_specs, starter
from .options import RunOptions
from .placement import check_plan, total_ranks
from .reaper import Reaper
from .weights import check_weights
from .wire import node_address

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_POLL_S = 0.05
# Public keys of the rendezvous store, outside every run's namespace: the namespace of the run
# node 0 hosts, and the nodes that found it is not theirs (another secret), each "node N;"
RUN_KEY = "opweave/run"
OTHER_SECRET_KEY = "opweave/other-secret"


@dataclass(frozen=True)
class Topology:
    """The nodes of a run: how many, which ranks each starts (``nodes``; default: equal
    contiguous ranges), this one's index, and node 0's address (and rendezvous port)."""

    nnodes: int = 1
    node_rank: int = 0
    nodes: Sequence[Sequence[int]] | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None


def torchrun_env() -> dict[str, str] | None:
    """torchrun's variables when this process is one of its workers, else ``None``."""
    if all(k in os.environ for k in TORCHRUN_KEYS):
        return {k: os.environ[k] for k in TORCHRUN_KEYS}
    return None


def run_node(
    plan: Plan, model: ModelSpec, model_dir: str | Path, options: RunOptions, topology: Topology
) -> None:
    """A node other than 0: start its ranks, which join node 0's driver, and wait for them.

    Returns after every rank exited cleanly (the driver shut the run down); raises
    :class:`RunFailedError` when one failed (the driver on node 0 names the cause).
    """
    check_plan(plan, model)
    check_weights(model_dir, model)
    node_rank, nnodes = topology.node_rank, topology.nnodes
    layout = node_layout(total_ranks(plan), nnodes, topology.nodes)
    if not 0 < node_rank < nnodes:
        raise OpWeaveRuntimeError(f"node rank {node_rank} is not in 1..{nnodes - 1}")
    if topology.master_port is None:
        raise OpWeaveRuntimeError("nodes other than 0 need --master-port of node 0")
    key = run_secret(multi_process_origin=True)
    check_same_secret(topology.master_addr, topology.master_port, key, options, f"node {node_rank}")
    if options.native(total_ranks(plan)):
        native.load()  # built once here (cached), not by every rank at once
    run_dir = Path(tempfile.mkdtemp(prefix="opweave-node-"))
    reaper = Reaper([run_dir])  # removes it if this process is killed
    children: list[RankProcess] = []
    try:
        specs = rank_specs(
            plan,
            model_dir,
            options,
            layout[node_rank],
            key=key,
            host=node_address(topology.master_addr),
            store={"host": topology.master_addr, "port": topology.master_port},
        )
        # a node runs no engine: a fork where it is safe, else a fresh interpreter per rank
        fork = options.device == "cpu" and fork_is_safe()
        start = starter("fork" if fork else "spawn", device=options.device)
        for spec in specs:
            children.append(start.start(spec, run_dir))
            reaper.watch(children[-1].pid)
        while any(c.poll() is None for c in children):
            if any(c.poll() not in (None, 0) for c in children):
                break
            time.sleep(_POLL_S)
        failed = [c for c in children if c.poll() not in (None, 0)]
        if failed:
            c = failed[0]
            tail = c.log_tail()
            raise RunFailedError(
                f"rank {c.rank} on node {node_rank} {c.ended()}"
                + (f" ({tail})" if tail else "")
                + "; node 0's driver names the cause"
                + (f"; this node's rank logs are in {options.log_dir}" if options.log_dir else "")
            )
    finally:
        for child in children:
            child.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
        reaper.close()


def run_torchrun_rank(
    plan: Plan, model: ModelSpec, model_dir: str | Path, options: RunOptions
) -> None:
    """This process is a rank torchrun started (other than 0): run it here, joining the driver
    that torchrun's rank 0 hosts. Raises :class:`RunFailedError` if the rank fails."""
    env = torchrun_env()
    assert env is not None
    check_plan(plan, model, int(env["WORLD_SIZE"]))
    rank = int(env["RANK"])
    key = run_secret(multi_process_origin=True)
    check_same_secret(env["MASTER_ADDR"], int(env["MASTER_PORT"]), key, options, f"rank {rank}")
    (spec,) = rank_specs(
        plan,
        model_dir,
        options,
        [rank],
        key=key,
        host=node_address(env["MASTER_ADDR"]),
        store={"host": env["MASTER_ADDR"], "port": int(env["MASTER_PORT"])},
        local_ranks=[int(env["LOCAL_RANK"])],
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
    )
    if run_rank(spec) != 0:
        raise RunFailedError(f"rank {rank} failed; torchrun's rank 0 names the cause")


def check_same_secret(addr: str, port: int, key: bytes, options: RunOptions, who: str) -> None:
    """Before a node (or a torchrun worker) starts its ranks: wait for node 0's rendezvous
    store and the run it hosts, and refuse to start when that run has another secret. Its
    ranks would otherwise wait, without a word, for a driver they cannot find (the run's keys
    live under a namespace derived from the secret) until the join deadline. Node 0 is told
    too (:data:`OTHER_SECRET_KEY`)."""
    import torch.distributed as dist

    timeout = options.join_timeout_s
    try:
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            addr, port, None, False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        theirs = store.get(RUN_KEY).decode(errors="replace")
    except (RuntimeError, OSError):  # torch's DistStoreError is a RuntimeError
        raise OpWeaveRuntimeError(
            f"node 0's run did not appear at {addr}:{port} within {timeout:g} s; start node 0 "
            "(or check --master-addr and --master-port)"
        ) from None
    if theirs != store_namespace(key):
        with contextlib.suppress(RuntimeError, OSError):
            store.append(OTHER_SECRET_KEY, f"{who};")  # pyright: ignore[reportAttributeAccessIssue]
        raise OpWeaveRuntimeError(
            f"node 0's run at {addr}:{port} has another secret than {who}'s: set "
            f"{SECRET_ENV} to the same value on every node"
        )


def layout_from_file(path: str | Path) -> list[list[int]]:
    """Global ranks per node from a deployment's ``nodes.json`` (a list of
    ``{"gpu", "gpus", "ranks"}`` objects)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise OpWeaveRuntimeError(f"cannot read the node layout {path}: {exc}") from None
    if not isinstance(data, list) or not all(
        isinstance(n, dict)
        and isinstance(n.get("ranks"), list)
        and all(isinstance(r, int) and not isinstance(r, bool) for r in n["ranks"])
        for n in data
    ):
        raise OpWeaveRuntimeError(
            f'{path}: expected a list of nodes, each with its "ranks" (a list of rank numbers)'
        )
    return [list(n["ranks"]) for n in data]


def host_store(addr: str, port: int | None, timeout_s: float, *, client: bool = False) -> Any:
    """The run's TCP store on ``addr:port`` (``client``: torchrun's agent hosts it already).

    torch's store server would listen on every interface of the host; it is handed a socket
    bound to ``addr`` (the master address, one of this node's) instead, so only the network the
    other nodes reach node 0 on can reach it. torch's store protocol has no authentication,
    so the run keeps its keys under a prefix derived from its secret
    (:func:`~.control.store_namespace`; see the README's "Network exposure"); the run's own
    control and rank-to-rank connections prove the secret.
    """
    import torch.distributed as dist

    listener: socket.socket | None = None
    try:
        if not client:
            listener = _store_listener(addr, port or 0)
            port = listener.getsockname()[1]
        return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            addr,
            port or 0,
            None,
            is_master=not client,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=None if listener is None else listener.detach(),
        )
    except (RuntimeError, OSError) as exc:
        if listener is not None:
            listener.close()
        raise OpWeaveRuntimeError(
            f"cannot host the rendezvous store on {addr}:{port}: {exc}"
        ) from None


def _store_listener(addr: str, port: int) -> socket.socket:
    """A listening socket on ``addr:port``: the master address when it is this node's, else
    this node's address on the route to it (behind NAT, the master address is another's)."""
    host = socket.gethostbyname(addr)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
            sock.bind((node_address(addr), port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock
