"""Point-to-point transfer latency and bandwidth between two processes.

A pipeline stage hands its activations to the next as one buffer made by the runtime's
:func:`~opweave.runtime.pack`, sent by the runtime's transport (between CPU processes its socket
wire, driven by the ranks' own threads; between GPUs NCCL). Two spawned processes play ping-pong
through that same transport with batches of several sizes; half the median round trip is the
one-way time, and a least-squares line through those points (weighted by 1/time, so small
messages count as much as large ones) gives ``latency_s + bytes / bandwidth``, the
:class:`TransferProfile` the planner uses.

Between CPU processes the transport is *host-driven*: a rank's one compute thread packs, sends,
waits for and unpacks every message (on a VM, sending to a rank that blocked also wakes its
virtual CPU), so a message costs both ranks compute time. A second phase measures that in the
regime of a pipelined plan: two microbatches circulate around a ring of the two processes, and
each rank, per microbatch, receives and unpacks a packed multi-request batch, runs a fixed
amount of GEMM work (about a stage's worth) and packs and sends it, so messages arrive while
the receiver computes the other microbatch. Both costs are timed directly with the clock around
the runtime's own calls: ``host_send_s`` is the send call (pack and post); ``host_recv_s`` is
what a rank does with an arrived message before its operators run (unpack it and derive the
schedule's positions and row offsets, which every fresh batch computes once). The planner adds
them to the sending and receiving ranks' compute streams, beside the idle one-way time on the
link. The ring's round time is kept in the provenance as a cross-check. GPUs (NCCL) move bytes
with their own engines beside compute: both are zero there.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing as mp
import secrets
import socket
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from opweave.costmodel import TransferProfile
from opweave.runtime import BatchMeta, TokenBatch, pack, unpack

from ..errors import ProfilerError

DEFAULT_SIZES = tuple(1024 * 4**k for k in range(9))  # 1 KiB .. 64 MiB
_WARMUP = 5
BUSY_REQUESTS, BUSY_HIDDEN = 4, 1024  # the busy phase's message: a decode microbatch of 4
BUSY_ROUNDS = 150
BUSY_CHUNKS = 5


@dataclass(frozen=True)
class TransferFit:
    """Measured one-way times and the fitted ``latency + bytes / bandwidth`` line."""

    backend: str
    latency_s: float
    bandwidth_bytes_per_s: float
    points: tuple[tuple[int, float], ...]  # (packed bytes, median one-way seconds)
    protocol: str = ""
    host_send_s: float = 0.0  # compute-stream cost of a message to its sender (CPU ranks)
    host_recv_s: float = 0.0  # ... and to its receiver
    busy: dict[str, float] | None = None  # the busy phase's raw figures, for provenance

    def profile(self) -> TransferProfile:
        """As a profile entry: two processes on one machine use the intra-node link."""
        return TransferProfile(
            link="intra_node",
            latency_s=self.latency_s,
            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s,
            host_send_s=self.host_send_s,
            host_recv_s=self.host_recv_s,
        )


def fit_line(
    points: list[tuple[int, float]] | tuple[tuple[int, float], ...],
) -> tuple[float, float]:
    """``(latency_s, bandwidth)`` minimising the relative error of ``a + bytes / bw``."""
    x = np.asarray([p[0] for p in points], dtype=np.float64)
    t = np.asarray([p[1] for p in points], dtype=np.float64)
    design = np.stack([1.0 / t, x / t], axis=1)
    (a, c), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if c <= 0:  # noise swamped the slope: use the largest message's throughput
        c = float(t[-1] / x[-1])
    return max(float(a), 0.0), 1.0 / float(c)


def unavailable_reason(device: torch.device) -> str | None:
    """Why point-to-point transfers cannot be measured here, or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if device.type == "cuda":
        if torch.cuda.device_count() < 2:
            return "NCCL needs two GPUs for a point-to-point transfer; this machine has one"
        if not dist.is_nccl_available():
            return "torch was built without NCCL"
    elif not dist.is_gloo_available():
        return "torch was built without gloo"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _batch(num_bytes: int, device: torch.device) -> TokenBatch:
    """One request's activations, about ``num_bytes`` once packed."""
    hidden = torch.zeros(max(num_bytes // 2, 1), dtype=torch.bfloat16, device=device)
    return TokenBatch(BatchMeta(("r0",), (1,), (0,)), {"hidden": hidden})


class _Endpoint:
    """Send/receive one batch the way the runtime's workers do: through the runtime's own
    ``Transport`` (its native wire between CPU ranks; between GPUs an eager fixed-size first
    chunk carrying the length, the tail as a second transfer)."""

    def __init__(self, rank: int, device: torch.device, key: bytes, *, spin_s: float = 0.0) -> None:
        from opweave.runtime.transport import Message, Transport

        self.rank, self.device = rank, device
        self.peer = 1 - rank
        self.transport = Transport(rank, device, timeout_s=60.0, key=key, spin_s=spin_s)
        self.out, self.inp = Message(self.peer, range(1), 1), Message(self.peer, range(1), 1)
        self.protocol = (
            "opweave.runtime Transport (pack; the native wire, read by the ranks' threads, "
            + ("spinning" if self.transport.spin_s > 0 else "blocking")
            + " while they wait)"
            if self.transport.native is not None
            else "opweave.runtime Transport (pack, eager chunk + tail, isend/irecv)"
        )

    def send(self, batch: TokenBatch, i: int, *, wait: bool = True) -> None:
        """Send ``batch``; unless ``wait``, completion is awaited by the next :meth:`reap`
        (as a pipeline stage posts its send and moves on to receive)."""
        self.transport.send(self.out, batch, epoch=i)
        if wait:
            self.transport.flush()

    def reap(self) -> None:
        self.transport.flush()

    def recv(self) -> torch.Tensor:
        """The next message's packed bytes."""
        part = self.transport.recv(self.inp, "profiling transfers")
        return part if isinstance(part, torch.Tensor) else pack(part)


def _worker(
    rank: int, port: int, backend: str, sizes: list[int], repeats: int, out: str, key: bytes
) -> None:
    """One side of the ping-pong; rank 0 writes the results to ``out``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    spin_s = 0.0
    if not cuda:  # each side on a core of its own, waiting as a rank there waits
        from opweave.runtime import RunOptions
        from opweave.runtime.transport import pin_to_core

        spin_s = RunOptions(device="cpu").spin_s(pin_to_core(rank, 2))
    try:
        end = _Endpoint(rank, device, key, spin_s=spin_s)
        results = []
        for size in sizes:
            batch = _batch(size, device)
            packed = pack(batch)
            reps = repeats if size < 8 * 2**20 else max(3, repeats // 3)
            times = []
            for i in range(_WARMUP + reps):
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                if rank == 0:
                    end.send(batch, i)
                    end.recv()
                else:
                    end.recv()
                    end.send(batch, i)
                if cuda:
                    torch.cuda.synchronize(device)
                if i >= _WARMUP:
                    times.append((time.perf_counter() - t0) / 2)
            results.append((packed.numel(), float(np.median(times))))
        busy = None if cuda else _busy_phase(end, rank, device)
        if rank == 0:
            Path(out).write_text(
                json.dumps({"protocol": end.protocol, "points": results, "busy": busy})
            )
    finally:
        dist.destroy_process_group()


def _busy_phase(end: _Endpoint, rank: int, device: torch.device) -> dict[str, float] | None:
    """Two microbatches circulate around the two ranks (receive, work, send, per microbatch),
    then rank 0 times the work alone while rank 1 waits. Rank 0 returns the figures.

    The send and receive costs are medians over every timed message; the round and the work
    alone (a cross-check, in the provenance) are the lowest of the medians of ``BUSY_CHUNKS``
    consecutive chunks, since another process that takes a core for a while inflates the
    rounds of some chunks, rarely of all of them.
    """
    import torch.distributed as dist

    a = torch.randn(8, 512, device=device)
    w = torch.randn(1536, 512, device=device)
    count = torch.tensor([_calibrate(a, w, target_s=1e-3)])
    dist.broadcast(count, src=0)  # both ranks run the same work
    iters = int(count.item())
    # what a stage boundary carries in decode: a few requests' schedule and two activations,
    # packed by the sender and unpacked by the receiver as the runtime's workers do
    rids = tuple(f"r{i}" for i in range(BUSY_REQUESTS))
    meta = BatchMeta(rids, (1,) * BUSY_REQUESTS, (256,) * BUSY_REQUESTS)
    rows = torch.zeros(BUSY_REQUESTS, BUSY_HIDDEN, dtype=torch.float32, device=device)
    batch = TokenBatch(meta, {"hidden": rows, "residual": rows.clone()})

    packed = pack(batch)

    def receive() -> None:
        buf = end.recv()  # waiting for the peer is the link's time, not the receiver's
        t0 = time.perf_counter()
        meta = unpack(buf).meta  # what a stage does with an arrived batch before its operators
        _ = meta.positions, meta.row_offsets
        recvs.append(time.perf_counter() - t0)

    def work() -> None:
        for _ in range(iters):
            torch.nn.functional.linear(a, w)

    marks: list[float] = []
    sends: list[float] = []
    recvs: list[float] = []
    epoch = 0
    for i in range(_WARMUP + BUSY_ROUNDS):
        marks.append(time.perf_counter())
        for _ in range(2):  # microbatches; rank 0 starts the first round without input
            if rank == 1 or i > 0:
                receive()
            work()
            t0 = time.perf_counter()
            end.send(batch, epoch, wait=False)
            sends.append(time.perf_counter() - t0)
            epoch += 1
    if rank == 0:
        for _ in range(2):
            receive()
    end.reap()
    if rank != 0:
        end.recv()  # rank 0 times the work alone meanwhile
        return None
    rounds = [b - a for a, b in itertools.pairwise(marks[_WARMUP:])]
    alone = []
    for i in range(_WARMUP + BUSY_ROUNDS):
        t0 = time.perf_counter()
        work()
        if i >= _WARMUP:
            alone.append(time.perf_counter() - t0)
    end.send(batch, epoch)  # release rank 1
    return {
        "round_s": min(_chunk_medians(rounds)),
        "send_s": float(np.median(sends[2 * _WARMUP :])),
        "recv_s": float(np.median(recvs[2 * _WARMUP :])),
        "work_alone_s": min(_chunk_medians(alone)),
        "bytes": float(packed.numel()),
    }


def _chunk_medians(values: list[float]) -> list[float]:
    return [float(np.median(c)) for c in np.array_split(np.asarray(values), BUSY_CHUNKS)]


def _calibrate(a: torch.Tensor, w: torch.Tensor, target_s: float) -> int:
    """GEMM calls that take about ``target_s`` on this rank (both ranks then agree on a count
    only approximately, which the median round absorbs)."""
    for _ in range(20):
        torch.nn.functional.linear(a, w)
    start = time.perf_counter()
    for _ in range(50):
        torch.nn.functional.linear(a, w)
    per_call = (time.perf_counter() - start) / 50
    return max(1, round(target_s / max(per_call, 1e-7)))


def measure_transfer(
    device: torch.device | str = "cpu",
    *,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    repeats: int = 10,
    timeout_s: float = 180.0,
) -> TransferFit:
    """Ping-pong packed buffers between two spawned processes and fit latency + bandwidth."""
    device = torch.device(device)
    reason = unavailable_reason(device)
    if reason is not None:
        raise ProfilerError(f"cannot measure transfers on {device}: {reason}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="opweave-transfer-") as tmp:
        out = Path(tmp) / "transfer.json"
        port = _free_port()
        key = secrets.token_bytes(32)  # the two sides authenticate as a run's ranks do
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, port, backend, sorted(sizes), repeats, str(out), key),
                daemon=True,
            )
            for rank in range(2)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(proc.is_alive() for proc in procs):
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                    proc.join(5)
            raise ProfilerError(
                f"transfer measurement ({backend}) did not finish in {timeout_s:.0f} s; "
                "re-run with --no-transfer to skip it"
            )
        codes = [proc.exitcode for proc in procs]
        if any(code != 0 for code in codes) or not out.is_file():
            raise ProfilerError(
                f"transfer measurement ({backend}) failed (worker exit codes {codes}); "
                "re-run with --no-transfer to skip it"
            )
        result = json.loads(out.read_text())
    points = tuple((int(n), float(t)) for n, t in result["points"])
    latency, bandwidth = fit_line(points)
    fit = TransferFit(backend, latency, bandwidth, points, result["protocol"])
    busy = result.get("busy")
    if busy is None:
        return fit
    return dataclasses.replace(
        fit, host_send_s=busy["send_s"], host_recv_s=busy["recv_s"], busy=busy
    )
