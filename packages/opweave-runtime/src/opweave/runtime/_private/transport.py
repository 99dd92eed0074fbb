"""Point-to-point messages between ranks, the TP leader fan-out, and batch routing by slot.

One message per boundary per microbatch: the sender packs the whole :class:`TokenBatch` (schedule
header and every activation) into one flat ``uint8`` tensor (:func:`pack`) and sends it.

Between CPU ranks every message travels on the native wire (:mod:`.native`): one TCP connection
per pair of ranks, written by the wire's C++ writer thread and read by the receiving rank's own
thread (gloo's I/O threads cost a pipeline about 2 ms per message on a busy CPU); a message
carries its length and tag, which the receiver checks. Measured against the Python socket wire
it replaced (two ranks on their own cores of a loaded 2-core VM, round trip of a decode step's
rows, medians of 3 x 300): 46 vs 75 us at 4 KB, 79 vs 107 us at 32 KB. Between GPUs they go
through ``torch.distributed`` ``isend``/``irecv`` (NCCL): a receiver must post a buffer of the
exact size, and the size depends on who joined the batch, so every message travels as a
fixed-size *eager chunk* (an 8-byte length, then the first bytes of the payload); only a payload
longer than the chunk sends its tail as a second transfer, straight from the packed tensor.
Decode-sized messages thus cost one transfer, not a length word plus a payload.

Receives are bounded: a peer that died fails the wait at once, one that hangs fails it after
``timeout_s``, and either way the error names the peer.

A tensor-parallel destination receives once, at its leader, which broadcasts the raw bytes to its
group (one length vector + one payload), rather than every TP rank receiving its own copy.

Static decode steps move *rows* instead (:meth:`Transport.send_rows`, :meth:`Transport.recv_rows`):
when every request of a microbatch decodes one token and the ranks run static-shape steps, each
side knows a message's layout before it travels (the link's slots, the cut's tensors as the
warm-up saw them), so it goes without a header of its own: the rows of each tensor, back to
back, straight from the sender's step outputs into the receiver's step inputs. Nothing in it is
read on the host, so on a GPU nothing waits for the device. A rank program (:mod:`.program`)
sends and receives the same messages on the same wire from inside its compiled call.
"""

from __future__ import annotations

import select as _select
import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import OpWeaveRuntimeError
from .batch import BatchMeta, TokenBatch, byte_view, pack, unpack
from .native import NativeWire
from .schedule import Message
from .wire import MAX_MESSAGE_BYTES, PeerError, connect_pairs, group_blame

Part = TokenBatch | torch.Tensor  # a batch handed over in-process, or packed bytes off the wire
EAGER_BYTES = 4096  # fixed size of a message's first transfer: length word + payload head
_LEN = 16  # length word padded so the payload keeps pack()'s 16-byte alignment


class Transport:
    """This rank's message endpoint; accumulates the time it spends blocked in ``comm_s``.

    Between CPU ranks every message travels on the native wire (:mod:`.native`): one TCP
    connection per pair of ranks, written by the wire's C++ writer (a send never blocks) and
    read on the calling thread, busy-polling for up to ``spin_s`` of every wait before it
    blocks. Between GPUs (and, as a test seam, CPU ranks with ``torch_p2p``), through
    ``torch.distributed`` point-to-point."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        timeout_s: float,
        *,
        host: str = "127.0.0.1",
        key: bytes = b"",
        spin_s: float = 0.0,
        torch_p2p: bool = False,
    ) -> None:
        self.rank = rank
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self._pending: deque[tuple[int, object, torch.Tensor, int]] = deque()
        self.comm_s = 0.0
        self.bytes_sent = 0
        self.messages_sent = 0
        # the native wire between CPU ranks; NCCL between GPUs (and gloo under the test seam)
        self.native: NativeWire | None = None
        world = dist.get_world_size()
        if device.type == "cpu" and not torch_p2p and world > 1:
            self.native = NativeWire(
                connect_pairs(rank, world, timeout_s, host, key),
                timeout_s,
                spin_s,
            )
        self.spin_s = spin_s if self.native is not None else 0.0
        self._row_buffers: dict[tuple[int, int], torch.Tensor] = {}  # (peer, tag) -> receive
        # the peers connected before the run started (:mod:`.connect`); None: not checked
        self.connected: frozenset[int] | None = None

    def _check_peer(self, peer: int) -> None:
        """A message to or from a rank not connected beforehand would make NCCL connect
        through ports that drop new connections by then: an error now, not a hang later."""
        if self.connected is not None and peer != self.rank and peer not in self.connected:
            raise OpWeaveRuntimeError(
                f"rank {self.rank} exchanges a message with rank {peer}, which it did not "
                "connect to before the run started (an OpWeave bug: please report it)"
            )

    # -- point to point ----------------------------------------------------------------------
    def send(self, message: Message, batch: TokenBatch, epoch: int) -> None:
        """Queue ``batch`` for ``message.peer`` without blocking."""
        start = time.perf_counter()
        buf = pack(batch).to(self.device)
        if self.native is not None:
            self.native.send(message.peer, message.tag, [buf], self.native.ones)
        else:
            head = EAGER_BYTES - _LEN
            chunk = torch.zeros(EAGER_BYTES, dtype=torch.uint8, device=self.device)
            chunk[:8] = torch.tensor([buf.numel()], dtype=torch.int64).view(torch.uint8)
            chunk[_LEN : _LEN + min(head, buf.numel())] = buf[:head]
            self._isend(message, [chunk] if buf.numel() <= head else [chunk, buf[head:]], epoch)
        self._sent(buf.numel(), start)

    def _isend(self, message: Message, transfers: Sequence[torch.Tensor], epoch: int) -> None:
        """``transfers`` to ``message.peer`` through torch.distributed, reaped by epoch."""
        self._check_peer(message.peer)
        try:
            for tensor in transfers:
                work = dist.isend(tensor, dst=message.peer, tag=message.tag)
                self._pending.append((epoch, work, tensor, message.peer))
        except RuntimeError as exc:
            raise PeerError(message.peer, f"sending to rank {message.peer} failed: {exc}") from None

    def _sent(self, size: int, start: float) -> None:
        self.bytes_sent += size
        self.messages_sent += 1
        self.comm_s += time.perf_counter() - start

    def recv(self, message: Message, what: str) -> Part:
        """The next message from ``message.peer`` under ``message.tag`` (blocking, bounded)."""
        start = time.perf_counter()
        if self.native is not None:
            buf = self.native.recv_any(message.peer, message.tag, MAX_MESSAGE_BYTES, what)
            self.comm_s += time.perf_counter() - start
            return buf
        self._check_peer(message.peer)
        chunk = torch.empty(EAGER_BYTES, dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(chunk, src=message.peer, tag=message.tag), message.peer, what)
        size = int(chunk[:8].cpu().view(torch.int64).item())
        head = EAGER_BYTES - _LEN
        if size <= head:
            buf = chunk[_LEN : _LEN + size]
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            buf[:head] = chunk[_LEN:]
            self._wait(
                dist.irecv(buf[head:], src=message.peer, tag=message.tag), message.peer, what
            )
        self.comm_s += time.perf_counter() - start
        return buf

    # -- rows of static decode steps ----------------------------------------------------------
    def send_rows(self, message: Message, parts: Sequence[torch.Tensor], epoch: int) -> None:
        """Queue ``parts`` (contiguous row ranges of a step's outputs, in the order the
        receiver expects them) for ``message.peer`` as one message without a header of its
        own, without blocking. On the native wire they are copied into one buffer (the wire
        frames it with its length and tag, and copies what the socket does not take at once).
        Through ``torch.distributed`` they are copied into one buffer on the device, sent in
        one transfer."""
        start = time.perf_counter()
        raw = [byte_view(t).reshape(-1) for t in parts]
        if self.native is not None:
            self.native.send(message.peer, message.tag, raw, self.native.ones)
        else:
            self._isend(message, [torch.cat(raw) if len(raw) != 1 else raw[0].clone()], epoch)
        self._sent(sum(r.numel() for r in raw), start)

    def recv_rows(self, message: Message, into: Sequence[torch.Tensor], what: str) -> None:
        """Receive ``message`` (sent by :meth:`send_rows`) into ``into``: contiguous row ranges
        of a step's inputs, filled in order. A message of another size than ``into`` is an
        error naming the peer (its schedule differs)."""
        start = time.perf_counter()
        if not all(t.is_contiguous() for t in into):
            raise OpWeaveRuntimeError("rows are received into contiguous tensors only")
        raw = [byte_view(t).reshape(-1) for t in into]
        size = sum(r.numel() for r in raw)
        peer = message.peer
        if self.native is not None:
            buf = self.native.recv(peer, message.tag, size, what)
        else:  # one receive buffer per link: its rows' size is fixed by the plan
            self._check_peer(peer)
            key = (peer, message.tag)
            buf = self._row_buffers.get(key)
            if buf is None:
                buf = self._row_buffers[key] = torch.empty(
                    size, dtype=torch.uint8, device=self.device
                )
            try:
                work = dist.irecv(buf, src=peer, tag=message.tag)
            except RuntimeError as exc:
                raise PeerError(peer, f"lost rank {peer} while {what}: {exc}") from None
            if self.device.type == "cuda":
                assert work is not None
                work.wait()  # the device waits for the transfer, the host goes on
            else:
                self._wait(work, peer, what)
        offset = 0
        for r in raw:
            r.copy_(buf[offset : offset + r.numel()])
            offset += r.numel()
        self.comm_s += time.perf_counter() - start

    def fanout_rows(self, tensors: Sequence[torch.Tensor], leader: int, group: object) -> None:
        """Broadcast the leader's received step inputs ``tensors`` to its TP group, in place."""
        start = time.perf_counter()
        for t in tensors:
            _broadcast(t, leader, group)
        self.comm_s += time.perf_counter() - start

    def _wait(self, work: object, peer: int | None, what: str) -> None:
        try:
            ok = work.wait(self.timeout)  # type: ignore[attr-defined]
        except RuntimeError as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if "timed out" in detail.lower() or "timeout" in detail.lower():
                raise PeerError(
                    peer, f"timed out after {self.timeout_s:g} s {what} (rank {peer})"
                ) from None
            raise PeerError(peer, f"lost rank {peer} while {what}: {detail}") from None
        if ok is False:
            raise PeerError(peer, f"timed out after {self.timeout_s:g} s {what} (rank {peer})")

    def reap(self, before_epoch: int) -> None:
        """Wait for torch.distributed sends queued before ``before_epoch``: bounds memory,
        never the pipeline (the native wire's writer needs no reaping)."""
        start = time.perf_counter()
        while self._pending and self._pending[0][0] < before_epoch:
            _, work, _, peer = self._pending.popleft()
            self._wait(work, peer, f"sending to rank {peer}")
        self.comm_s += time.perf_counter() - start

    def flush(self) -> None:
        self.reap(before_epoch=1 << 62)
        if self.native is not None:
            self.native.drain()

    def wait_control(self, fileno: int) -> None:
        """Wait (without bound) until the control connection has data; the native wire's
        writer, NCCL and gloo progress their sends meanwhile on their own threads."""
        _select.select([fileno], [], [])

    def close(self) -> None:
        if self.native is not None:
            self.native.close()

    # -- tensor-parallel fan-out -------------------------------------------------------------
    def fanout(
        self, parts: Sequence[Part] | None, count: int, leader: int, group: object
    ) -> list[torch.Tensor]:
        """Broadcast the leader's received ``parts`` to its TP group; every member gets bytes."""
        start = time.perf_counter()
        bufs: list[torch.Tensor] = []
        if parts is not None:
            bufs = [
                p.to(self.device) if isinstance(p, torch.Tensor) else pack(p).to(self.device)
                for p in parts
            ]
            lengths = torch.tensor([b.numel() for b in bufs], dtype=torch.int64, device=self.device)
        else:
            lengths = torch.empty(count, dtype=torch.int64, device=self.device)
        _broadcast(lengths, leader, group)
        if parts is not None:
            payload = (
                torch.cat(bufs) if bufs else torch.empty(0, dtype=torch.uint8, device=self.device)
            )
        else:
            payload = torch.empty(int(lengths.sum()), dtype=torch.uint8, device=self.device)
        _broadcast(payload, leader, group)
        self.comm_s += time.perf_counter() - start
        return list(torch.split(payload, lengths.tolist()))


def _broadcast(tensor: torch.Tensor, leader: int, group: object) -> None:
    """``tensor`` from the TP group's ``leader`` to every rank of ``group``, in place."""
    try:
        dist.broadcast(tensor, src=leader, group=group)  # type: ignore[arg-type]
    except RuntimeError as exc:
        message = f"tensor-parallel fan-out from rank {leader} failed: {exc}"
        members = dist.get_process_group_ranks(group)  # type: ignore[arg-type]
        peer, suspects = group_blame(tuple(r for r in members if r != dist.get_rank()))
        raise PeerError(peer, message, suspects) from None


def as_batch(part: Part) -> TokenBatch:
    return unpack(part) if isinstance(part, torch.Tensor) else part


def select(batch: TokenBatch, slots: range) -> TokenBatch:
    """The requests of ``batch`` whose slot lies in ``slots`` (rows are ordered by slot).

    A tensor with one row per token is cut at the requests' row offsets, one with a row per request
    (after ``final_norm``) at their indices; when the two counts agree every request has one row
    and both cuts coincide.
    """
    meta = batch.meta
    idx = [i for i, s in enumerate(meta.slots) if s in slots]
    if len(idx) == len(meta.request_ids):
        return batch
    lo, hi = (idx[0], idx[-1] + 1) if idx else (0, 0)
    if idx and hi - lo != len(idx):
        raise OpWeaveRuntimeError("requests of a batch must be ordered by slot")
    sub = BatchMeta(
        meta.request_ids[lo:hi],
        meta.query_lens[lo:hi],
        meta.context_lens[lo:hi],
        slots=meta.slots[lo:hi],
    )
    if not idx:
        return TokenBatch(sub, {})
    n_req, n_tok = len(meta.request_ids), meta.num_tokens
    r0, r1 = meta.row_offsets[lo], meta.row_offsets[hi]
    tensors = {}
    for name, t in batch.tensors.items():
        if t.shape[0] == n_tok:
            tensors[name] = t[r0:r1]
        elif t.shape[0] == n_req:
            tensors[name] = t[lo:hi]
        else:
            raise OpWeaveRuntimeError(
                f"tensor {name!r} has {t.shape[0]} rows: not per token/request"
            )
    return TokenBatch(sub, tensors)


def merge(parts: Sequence[TokenBatch]) -> TokenBatch:
    """Concatenate the parts of one microbatch (given in slot order) into one ragged batch."""
    if len(parts) == 1:
        return parts[0]
    full = [p for p in parts if p.meta.request_ids]
    meta = BatchMeta(
        tuple(r for p in full for r in p.meta.request_ids),
        tuple(q for p in full for q in p.meta.query_lens),
        tuple(c for p in full for c in p.meta.context_lens),
        slots=tuple(s for p in full for s in p.meta.slots),
    )
    if not full:
        return TokenBatch(meta, {})
    if len(full) == 1:
        return TokenBatch(meta, full[0].tensors)
    return TokenBatch(meta, {n: torch.cat([p[n] for p in full]) for n in full[0].tensors})
