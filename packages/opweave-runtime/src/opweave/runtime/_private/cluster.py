"""The driver's side of a run: install a plan on rank processes, talk to them, watch them.

:class:`Cluster` is what the driver (:mod:`.stepping`) stands on, for offline generation and for
vLLM's engine alike. It starts this node's ranks (:mod:`.launch`), hosts the rendezvous (a file
store for a run on one node; a TCP store on ``master_addr`` for several nodes, whose other nodes
start their ranks with :func:`~.nodes.run_node`), accepts every rank's authenticated control
connection, and then carries the control messages (:mod:`.messages`): :meth:`submit` sends a
microbatch's :class:`~.work.Work` to the ranks that serve it, :meth:`result` returns the sampled
tokens the last segment's leaders send back.

Faults. A rank that dies closes its control connection (on any node), one that fails reports
why before it exits, one that hangs is named by the peers that time out waiting for it (or, as a
backstop, by a step that yields no result within the timeout): the cluster then waits a moment
for the other reports, blames one rank (:func:`~.faults.diagnose`), kills this node's ranks,
closes every connection (so the other nodes' ranks exit too), and raises
:class:`~opweave.runtime.RunFailedError` from every call, naming the rank, its owner and stages.
Nothing of a run outlives it: processes are reaped and the run's folder removed.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import selectors
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opweave.costmodel import ModelSpec, Plan

from ..errors import OpWeaveRuntimeError, RunFailedError
from . import native
from .control import SECRET_ENV, run_secret, store_namespace
from .controlhub import Conn, ControlHub
from .faults import RankView, diagnose
from .join import CONTROL_KEY, in_namespace
from .launch import STOP_S, RankProcess, node_layout, rank_specs, starter
from .messages import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    Prefill,
    PrefillBatch,
    Prefilled,
    Ready,
    Result,
    Shutdown,
    Stats,
    Warm,
    Warmed,
    encode,
)
from .nodes import OTHER_SECRET_KEY, RUN_KEY, Topology, host_store
from .options import RunOptions
from .placement import Placement, check_plan, total_ranks
from .reaper import Reaper
from .results import RankStats
from .schedule import compile_schedule
from .stepping import submit_warm_up
from .weights import check_weights
from .wire import node_address
from .work import Work

PREFILL_KEY = -1  # a prefill's results are expected under (its number, PREFILL_KEY)
_GRACE_S = 2.0  # after a first failure, how long the other ranks get to report
_POLL_S = 0.05


class Cluster(ControlHub):
    """A plan installed on rank processes, with this process as their driver (node 0)."""

    def __init__(
        self,
        plan: Plan,
        model: ModelSpec,
        model_dir: str | Path,
        options: RunOptions | None = None,
        *,
        topology: Topology | None = None,
        start_method: str = "auto",
        torchrun: bool = False,
    ) -> None:
        """``start_method``: how this node's ranks start (:func:`~.launch.starter`): ``fork``
        (CPU default while this process has started no thread since it imported the runtime),
        ``launcher`` (otherwise, CUDA's default and what a process running vLLM's engine must
        use), ``spawn`` or ``auto``. ``torchrun``: this is the process torchrun made rank 0; it
        starts rank 0 and drives the others, which torchrun started
        (:func:`~.nodes.run_torchrun_rank`), through torchrun's rendezvous (``MASTER_ADDR`` and
        ``MASTER_PORT``)."""
        options = options or RunOptions()
        topology = topology or Topology()
        check_plan(plan, model)
        check_weights(model_dir, model)
        if options.native(total_ranks(plan)):
            native.load()  # built once here (cached), not by every rank at once
        self.plan = plan
        self.options = options
        self.placement = Placement(plan, model)
        self.world = total_ranks(plan)
        if torchrun:  # every rank is a "node" of its own to this driver
            topology = Topology(
                self.world, 0, None, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            )
        self.layout = node_layout(self.world, topology.nnodes, topology.nodes)
        multi = topology.nnodes > 1
        if multi and topology.master_port is None:
            raise OpWeaveRuntimeError("a run over several nodes needs --master-port")
        self.timeout_s = options.timeout_s
        self.join_timeout_s = options.join_timeout_s
        self.on_failure: list[Callable[[], None]] = []
        self.failed: RunFailedError | None = None
        self._results: queue.Queue[Result | Prefilled | None] = queue.Queue()
        self._conns: dict[int, Conn] = {}  # touched by the IO thread only, once registered
        self._claimed: set[int] = set()
        self._new_conns: queue.SimpleQueue[Conn] = queue.SimpleQueue()
        self._hang: tuple[list[int], float] | None = None
        self._lock = threading.Lock()
        self._failing_since: float | None = None
        self._first_signal: str | None = None
        self._closing = False
        self._stopping = False
        self._started = time.monotonic()
        self._expected: dict[tuple[int, int], set[int]] = {}
        self._receivers = self._who_gets_work()
        self._key = run_secret(multi_process_origin=multi)
        self.run_dir = Path(tempfile.mkdtemp(prefix="opweave-run-"))
        # if this process is killed, the reaper kills the ranks and removes the run's folder
        self._reaper: Reaper | None = Reaper([self.run_dir])
        self.children: list[RankProcess] = []
        self._store: Any = None
        self._public_store: Any = None  # the store itself, for the keys outside the run's
        self._other_secrets: set[str] = set()  # nodes started with another secret, told
        self._next_secret_check = 0.0
        host = node_address(topology.master_addr) if multi else "127.0.0.1"
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, 0))
            self._listener.listen(max(self.world, 8))
            control = (host, self._listener.getsockname()[1])
            # the control port; closed once every rank has joined (nobody else may connect)
            self.control_address = control
            self._start_ranks(model_dir, topology, host, control, start_method)
            if multi:  # hosted after every fork, so no rank inherits the store's thread
                agent = torchrun and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                raw = host_store(
                    topology.master_addr, topology.master_port, self.join_timeout_s, client=agent
                )
                raw.set(RUN_KEY, store_namespace(self._key))
                self._store = in_namespace(raw, self._key)
                self._store.set(CONTROL_KEY, f"{control[0]}:{control[1]}")
                self._public_store = raw
            self._start_io()
            self._wait_ready()
            self.first_iteration = 0  # the driver's first iteration (1 after a warm-up)
            # whether decode steps are static (built at the warm-up): a driver may then keep
            # the sampled tokens on the ranks (Work.forward, Work.carried)
            self.static_decode = options.decode_step.static
            if self.static_decode:
                self.warm_up()
        except BaseException:
            self.close()
            raise

    def _start_ranks(
        self,
        model_dir: str | Path,
        topology: Topology,
        host: str,
        control: tuple[str, int],
        start_method: str,
    ) -> None:
        multi = topology.nnodes > 1
        store = (
            {"host": topology.master_addr, "port": topology.master_port}
            if multi
            else {"file": str(self.run_dir / "store")}
        )
        start = starter(
            start_method, device=self.options.device, close_fds=[self._listener.fileno()]
        )
        self.start_method = start.name
        for spec in rank_specs(
            self.plan,
            model_dir,
            self.options,
            self.layout[0],
            key=self._key,
            host=host,
            store=store,
            control=control,
        ):
            child = start.start(spec, self.run_dir)
            self.children.append(child)
            if self._reaper is not None:
                self._reaper.watch(child.pid)

    # -- what the driver uses -----------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    @property
    def microbatches(self) -> int:
        return self.plan.microbatches

    @property
    def pids(self) -> list[int]:
        """Process ids of this node's ranks."""
        return [c.pid for c in self.children]

    def result_parts(self, microbatch: int) -> int:
        """How many result messages one iteration of ``microbatch`` yields (one per replica of
        the last segment's owner that serves it)."""
        return len(self._result_ranks[microbatch])

    def warm_up(self) -> None:
        """Build every rank's static decode steps before any traffic (every ``--decode-step``
        but ``per-request``): compiling a step (``compiled``, ``traced``) takes from seconds to
        minutes, longer than a rank waits for its peers, and would otherwise fall on the first
        requests; and the rows a decode step receives into are laid out from what it saw here.

        Iteration 0 prefills two tokens for a warm-up request in every slot, so each rank sees
        the inputs of each of its actions; then every rank chooses its iteration runner (builds
        each action's static decode step, runs it once on padding rows, allocates its input
        rows), frees the warm-up's requests and says so, within ``join_timeout_s``. The
        driver starts at :attr:`first_iteration`.
        """
        everyone = submit_warm_up(self)
        deadline = time.monotonic() + self.join_timeout_s
        for rank in range(self.world):
            self._send(rank, Warm(everyone))
        self._await_ranks(
            lambda c: c.warmed,
            deadline,
            f"did not compile its decode steps within {self.join_timeout_s:g} s "
            "(see its log with OPWEAVE_DEBUG=1)",
        )
        self.first_iteration = 1

    def submit(self, work: Work) -> None:
        """Send ``work`` to every rank serving its microbatch; its result is then expected
        from the last segment's leaders."""
        self.check()
        k = work.microbatch
        with self._lock:
            self._expected[(work.iteration, k)] = set(self._result_ranks[k])
        frames: dict[tuple[bool, bool], bytes] = {}  # one encoding per kind of receiver
        for rank, needs in self._receivers[k].items():
            frame = frames.get(needs)
            if frame is None:
                tokens, params = needs
                frame = frames[needs] = encode(work.for_rank(tokens=tokens, params=params))
            self._send_frame(rank, frame)

    def prefill(self, replica: int, prompts: Sequence[Prefill]) -> None:
        """Send ``prompts`` to prefill replica ``replica``'s ranks, which run them as one batch;
        each rank then reports its part of each (:class:`~.messages.Prefilled`) among the
        results."""
        self.check()
        ranks = [r.rank for r in self.placement.prefill_ranks(replica)]
        with self._lock:
            for message in prompts:
                self._expected[(message.seq, PREFILL_KEY)] = set(ranks)
        frame = encode(PrefillBatch(tuple(prompts)))
        for rank in ranks:
            self._send_frame(rank, frame)

    @property
    def prefill_parts(self) -> int:
        """Messages one prefill yields: one per rank of a prefill replica."""
        pool = self.plan.prefill
        return pool.tp * pool.dp if pool is not None else 0

    def result(self, timeout_s: float | None = None) -> Result | Prefilled:
        """The next result message; raises :class:`RunFailedError` once the run failed, or if
        nothing arrives within the timeout."""
        wait = self.timeout_s + 5.0 if timeout_s is None else timeout_s
        try:
            msg = self._results.get(timeout=wait)
        except queue.Empty:
            self._signal_hang(wait)
            msg = self._results.get()
        if msg is None:
            self._results.put(None)  # every later call fails too
            assert self.failed is not None
            raise self.failed
        return msg

    def check(self) -> None:
        """Raise :class:`RunFailedError` if the run has failed."""
        if self.failed is not None:
            raise self.failed

    def shutdown(self) -> list[RankStats]:
        """Stop every rank after the work submitted so far; their statistics, in rank order."""
        self.check()
        self._stopping = True
        for rank in range(self.world):
            self._send(rank, Shutdown())
        deadline = time.monotonic() + max(self.timeout_s, STOP_S)
        while time.monotonic() < deadline and self.failed is None:
            conns = list(self._conns.values())
            if all(c.stats is not None or c.state == "closed" for c in conns):
                break
            time.sleep(_POLL_S)
        self.check()
        for child in self.children:
            if child.wait(STOP_S) is None:
                child.kill()
        missing = [r for r in range(self.world) if self._conns[r].stats is None]
        if missing:
            raise RunFailedError(
                f"{self.describe(missing[0])} exited without its statistics after the shutdown"
            )
        return [RankStats.model_validate(self._conns[r].stats) for r in range(self.world)]

    def close(self) -> None:
        """Kill whatever still runs, close every connection, remove the run's folder."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        for child in self.children:
            child.kill()
        with contextlib.suppress(AttributeError, OSError):
            self._wake_w.send(b"x")
        io = getattr(self, "_io", None)
        if io is not None:
            io.join(timeout=5)
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.sock.close()
        with contextlib.suppress(OSError):
            self._listener.close()
        for name in ("_wake_r", "_wake_w"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        self._store = self._public_store = None
        if self.failed is not None and os.environ.get("OPWEAVE_DEBUG") == "1":
            print(f"opweave: the ranks' logs are kept in {self.run_dir}", file=sys.stderr)
        else:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.close()

    def describe(self, rank: int) -> str:
        node = next(n for n, ranks in enumerate(self.layout) if rank in ranks)
        where = f" on node {node}" if len(self.layout) > 1 else ""
        return f"rank {rank}{where} ({self.placement.describe(rank)})"

    # -- setup --------------------------------------------------------------------------------
    def _who_gets_work(self) -> dict[int, dict[int, tuple[bool, bool]]]:
        """Per microbatch: each rank serving it, and whether it needs the token ids (it runs
        the first segment) and sampling parameters (the last)."""
        out: dict[int, dict[int, tuple[bool, bool]]] = {
            k: {} for k in range(self.placement.microbatches)
        }
        results: dict[int, list[int]] = {k: [] for k in out}
        for rank in range(self.world):
            info = self.placement.ranks[rank]
            for a in compile_schedule(self.placement, rank):
                tokens, params = out[a.microbatch].get(rank, (False, False))
                out[a.microbatch][rank] = (tokens or a.first, params or a.last)
                if a.last and info.is_leader:
                    results[a.microbatch].append(rank)
        self._result_ranks = results
        return out

    def _wait_ready(self) -> None:
        """Until every rank has loaded its weights and said so; at most ``join_timeout_s``."""
        self._await_ranks(
            lambda c: c.state == "ready",
            self._started + self.join_timeout_s,
            f"was not ready {self.join_timeout_s:g} s after the start (stuck loading or "
            "starting; see its log with OPWEAVE_DEBUG=1)",
        )

    def _await_ranks(self, done: Callable[[Conn], bool], deadline: float, late: str) -> None:
        """Until ``done`` holds for every rank's connection; past ``deadline`` (monotonic), a
        :class:`RunFailedError` naming the first rank it does not hold for, then ``late``."""
        while True:
            self.check()
            finished = {c.rank for c in list(self._conns.values()) if done(c)}
            waiting = set(range(self.world)) - finished
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RunFailedError(f"{self.describe(min(waiting))} {late}")
            time.sleep(_POLL_S)

    def _handle(self, conn: Conn, msg: Any) -> None:
        if isinstance(msg, Result | Prefilled):
            with self._lock:
                if isinstance(msg, Prefilled):
                    key = (msg.seq, PREFILL_KEY)
                else:
                    key = (msg.iteration, msg.microbatch)
                waiting = self._expected.get(key)
                if waiting is not None:
                    waiting.discard(conn.rank)
                    if not waiting:
                        del self._expected[key]
            self._results.put(msg)
        elif isinstance(msg, Hello):
            conn.pid, conn.host = msg.pid, msg.host
            if msg.version != PROTOCOL_VERSION:
                conn.report = Error(
                    "error",
                    f"speaks control protocol {msg.version}, the driver {PROTOCOL_VERSION}: "
                    "install the same OpWeave on every node",
                )
                self._signal(f"rank {conn.rank} speaks another protocol")
        elif isinstance(msg, Ready):
            conn.state, conn.ready = "ready", msg
        elif isinstance(msg, Warmed):
            conn.warmed = True
        elif isinstance(msg, Stats):
            conn.stats = msg.stats
        elif isinstance(msg, Error):
            conn.report = msg
            self._signal(f"rank {conn.rank} reported an error")
        # Loading only refreshes last_seen

    def _watch(self) -> None:
        """Local exits, join and load deadlines; and, once failing, the end of the grace."""
        now = time.monotonic()
        while not self._new_conns.empty():
            conn = self._new_conns.get()
            self._conns[conn.rank] = conn
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        for child in self.children:
            code = child.poll()
            if code not in (None, 0) or (code == 0 and not self._stopping):
                self._signal(f"rank {child.rank} exited")
        if self._failing_since is None:
            if len(self._conns) < self.world and now >= self._next_secret_check:
                self._next_secret_check = now + 1.0
                self._tell_other_secrets()
            if len(self._conns) < self.world and now - self._started > self.join_timeout_s:
                missing = sorted(set(range(self.world)) - set(self._conns))
                self._signal(f"ranks {missing} did not join within {self.join_timeout_s:g} s")
            for conn in list(self._conns.values()):
                if conn.state == "joined" and now - conn.last_seen > self.timeout_s + 5:
                    self._signal(f"rank {conn.rank} stopped responding while loading")
        self._finish_failure()

    def _tell_other_secrets(self) -> None:
        """Say once for each node that found this run has another secret than its own
        (:func:`~.nodes.check_same_secret`): its ranks cannot join, and the run waits for
        ranks with the right one until the join deadline."""
        store = self._public_store
        if store is None:
            return
        try:
            if not store.check([OTHER_SECRET_KEY]):
                return
            text = store.get(OTHER_SECRET_KEY).decode(errors="replace")
        except (RuntimeError, OSError):
            return
        for who in text.split(";"):
            # anyone reaching the store can write there: only a node's or rank's name is said
            if re.fullmatch(r"(node|rank) [0-9]{1,6}", who) and who not in self._other_secrets:
                self._other_secrets.add(who)
                print(
                    f"warning: {who} was started with another {SECRET_ENV} and cannot join; "
                    "start it again with this node's value",
                    file=sys.stderr,
                )

    # -- failure ------------------------------------------------------------------------------
    def _signal(self, why: str) -> None:
        if self.failed is not None or self._closing:
            return
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            self._first_signal = why

    def _signal_hang(self, waited_s: float) -> None:
        """Called by a driver whose step produced nothing within the timeout."""
        with self._lock:
            # a prefill owed comes first: the driver holds the decode ranks' next works for it
            first = {
                r for key, ranks in self._expected.items() if key[1] == PREFILL_KEY for r in ranks
            }
            rest = {r for ranks in self._expected.values() for r in ranks} - first
            owing = sorted(first) + sorted(rest)
        self._hang = (owing, waited_s)
        self._signal("a step yielded no result")

    def _finish_failure(self, *, force: bool = False) -> None:
        if self._failing_since is None or self.failed is not None:
            return
        children = {c.rank: c for c in self.children}

        def settled(c: Conn) -> bool:
            if c.report is not None:
                return True
            # a local rank that went silent: wait for its exit status too (a crash is named)
            child = children.get(c.rank)
            return c.state == "closed" and (child is None or child.poll() is not None)

        done = len(self._conns) == self.world and all(settled(c) for c in self._conns.values())
        if not force and not done and time.monotonic() - self._failing_since < _GRACE_S:
            return
        views = {r: RankView(c.report, c.state == "closed") for r, c in self._conns.items()}
        message = diagnose(
            views,
            children,
            self.world,
            self.describe,
            hang=self._hang,
            first_signal=self._first_signal,
        )
        if self.options.log_dir is not None:
            message += f"; the ranks' logs are in {self.options.log_dir}"
        self.failed = RunFailedError(message)
        for child in self.children:
            child.kill()
        for conn in list(self._conns.values()):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
            with contextlib.suppress(OSError):
                conn.sock.close()
            conn.state = "closed"
        self._store = self._public_store = None
        self._results.put(None)
        for callback in self.on_failure:
            with contextlib.suppress(Exception):
                callback()
