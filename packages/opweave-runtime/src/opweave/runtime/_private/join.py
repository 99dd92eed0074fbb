"""A rank's life: join the run, load, report ready, serve, report, exit.

A rank joins its run through an authenticated control connection to the driver (its address
given, or read from the rendezvous store), then torch.distributed for its tensor-parallel group
and the transport between ranks; it loads its operators while a heartbeat tells the driver it is
alive, reports ready, serves (:class:`~.rank.StageWorker`), sends its statistics and exits. Any
failure is reported to the driver in one line before the rank exits.

``python -m opweave.runtime._private.join SPEC_FILE`` is a spawned rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from opweave.costmodel import Plan

from .connect import connect_all, message_peers, ports_may_close
from .control import ChannelClosed, ControlClient, store_namespace
from .messages import PROTOCOL_VERSION, Error, Hello, Loading, Ready, Stats
from .nccl_env import apply_nccl_defaults
from .placement import Placement, plan_model
from .prefill import PrefillWorker
from .proc import die_with_parent, name_process, refuse_new_connections, watch_parent
from .rank import StageWorker
from .spec import RankSpec, read_spec
from .wire import PeerError, group_blame

CONTROL_KEY = "opweave/control"  # store key under which the driver publishes its address
_HEARTBEAT_S = 1.0


@contextlib.contextmanager
def heartbeat(control: ControlClient) -> Iterator[None]:
    """While weights load (possibly minutes), tell the driver this rank is alive."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(_HEARTBEAT_S):
            with contextlib.suppress(ChannelClosed):
                control.send(Loading())

    thread = threading.Thread(target=loop, name="opweave-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def in_namespace(store: Any, key: bytes) -> Any:
    """A TCP store seen through the prefix of the run whose secret is ``key``
    (:func:`store_namespace`): what the driver and every rank of the run read and write."""
    return dist.PrefixStore(store_namespace(key), store)  # pyright: ignore[reportPrivateImportUsage]


def _store(spec: RankSpec, timeout: timedelta) -> Any:
    if "file" in spec.store:
        store = dist.FileStore(spec.store["file"], spec.world_size)  # pyright: ignore[reportPrivateImportUsage]
        store.set_timeout(timeout)  # its own default is 5 minutes: ranks may load for longer
        return store
    if "host" in spec.store:
        return in_namespace(
            dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                spec.store["host"], int(spec.store["port"]), spec.world_size, False, timeout=timeout
            ),
            bytes.fromhex(spec.key),
        )
    return None  # torchrun: env://


def connect(spec: RankSpec) -> tuple[ControlClient, Any]:
    """The rank's authenticated control connection to the driver, and its rendezvous store."""
    timeout = timedelta(seconds=spec.options.join_timeout_s)
    store = _store(spec, timeout)
    if spec.control is not None:
        host, port = spec.control
    else:
        if store is None:  # torchrun's store, reached through the environment
            store = in_namespace(
                dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    spec.world_size,
                    False,
                    timeout=timeout,
                ),
                bytes.fromhex(spec.key),
            )
        host, port_text = store.get(CONTROL_KEY).decode().rsplit(":", 1)
        port = int(port_text)
    key = bytes.fromhex(spec.key)
    control = ControlClient(host, port, key, spec.rank, spec.options.join_timeout_s)
    control.send(Hello(spec.rank, os.getpid(), socket.gethostname(), PROTOCOL_VERSION))
    return control, store


def init_group(spec: RankSpec, store: Any) -> Placement:
    """Join the run's default process group (long timeout: other nodes may start late)."""
    kwargs: dict[str, Any] = dict(
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.options.join_timeout_s),
    )
    backend = "nccl" if spec.options.device == "cuda" else "gloo"
    if store is not None and "env" not in spec.store:
        dist.init_process_group(backend, store=store, **kwargs)
    else:
        dist.init_process_group(backend, init_method="env://", **kwargs)
    plan = Plan.model_validate(spec.plan)
    return Placement(plan, plan_model(plan, spec.model_dir))


def connect_peers(worker: StageWorker | PrefillWorker, placement: Placement, rank: int) -> None:
    """Make every connection NCCL would make lazily (:mod:`.connect`); CPU ranks on the native
    wire are connected already (gloo connects a group when it is made)."""
    if worker.transport.native is not None or placement.world_size == 1:
        return
    info = placement.ranks[rank]
    groups: list[tuple[tuple[int, ...], object]] = []
    if info.tp_size > 1:
        groups.append((info.group, worker.group))
    if worker.ep is not None:
        groups.append((info.ep_group, worker.ep.group))
    peers = message_peers(placement, rank)
    connect_all(placement, rank, worker.device, groups, peers)
    worker.transport.connected = frozenset(peers)


def run_rank(spec: RankSpec) -> int:
    """The whole life of one rank; 0 after a clean shutdown, 1 after reporting an error."""
    name_process(f"opweave-rank{spec.rank}")
    apply_nccl_defaults()  # torchrun's ranks get no launcher environment
    torch.set_num_threads(spec.options.threads)
    with contextlib.suppress(Exception):  # a crash in native code leaves its stack in the log
        faulthandler.enable(file=sys.__stderr__ or sys.stderr)
    control: ControlClient | None = None
    worker: StageWorker | PrefillWorker | None = None
    try:
        control, store = connect(spec)
        load_start = time.perf_counter()
        with heartbeat(control):
            placement = init_group(spec, store)
            kind = PrefillWorker if placement.ranks[spec.rank].prefills else StageWorker
            worker = kind(
                spec.rank,
                spec.options,
                control,
                placement,
                model_dir=spec.model_dir,
                local_rank=spec.local_rank,
                local_world_size=spec.local_world_size,
                host=spec.host,
                key=bytes.fromhex(spec.key),
            )
            connect_peers(worker, placement, spec.rank)
        load_s = time.perf_counter() - load_start
        # every process group and peer is connected now: no other process may connect to this
        # rank's ports (gloo's keep what they accept; NCCL's stall behind silent connections)
        if ports_may_close(worker.device):
            refuse_new_connections()
        module = worker.module
        control.send(
            Ready(
                spec.rank,
                module.checkpoint.bytes_read,
                module.weight_bytes,
                load_s,
                tuple(module.kernels),
            )
        )
        worker.serve()
        control.send(Stats(worker.stats(load_s)))
        worker.transport.close()
        if isinstance(worker, StageWorker):
            worker.runq.close()
        control.close()
        return 0
    except ChannelClosed:
        return 0 if control is None else 1  # the driver is gone: nobody to report to
    except BaseException as exc:
        traceback.print_exc()
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, PeerError):
            report = Error("peer", text, exc.peer, exc.suspects)
        elif worker is not None and _peer_gone(exc):
            # a tensor- or expert-parallel collective waited in vain, or its peer hung up: a
            # peer of the group stopped, not this rank (the driver names it: the one peer, or
            # the group's silent one)
            p = worker.placement
            groups = [g for g in (*p.tp_groups, *p.ep_groups) if spec.rank in g]
            peers = tuple(sorted({r for g in groups for r in g if r != spec.rank}))
            report = Error("peer", text, *group_blame(peers))
        else:
            report = Error("error", f"{type(exc).__name__}: {text}")
        if control is not None:
            with contextlib.suppress(ChannelClosed, OSError):
                control.send(report)
        sys.stdout.flush()
        return 1
    finally:
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def _peer_gone(exc: BaseException) -> bool:
    """gloo's errors when a collective's peer did not answer within the group's timeout, or
    closed its connection (its process ended)."""
    text = str(exc)
    timed_out = "Timed out waiting" in text and ("recv" in text or "send" in text)
    return timed_out or "Connection closed by peer" in text or "Connection reset by peer" in text


def main(argv: list[str]) -> int:
    """``python -m opweave.runtime._private.join SPEC_FILE``: a spawned rank."""
    die_with_parent()
    watch_parent(os.getppid())
    return run_rank(read_spec(Path(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
