"""Point-to-point messages between ranks, the TP leader fan-out, and batch routing by slot.

One message per boundary per microbatch: the sender packs the whole :class:`TokenBatch` (schedule
header and every activation) into one flat ``uint8`` tensor (:func:`pack`) and sends it.

Between CPU ranks the bytes travel over :class:`~.wire.SocketWire`: one TCP connection per pair
of ranks, read and written by the ranks' own threads (gloo's I/O threads cost a pipeline about
2 ms per message on a busy CPU; see that module). Elsewhere (NCCL between GPUs, or gloo when
``OPWEAVE_P2P=torch``) they go through ``torch.distributed`` ``isend``/``irecv``: a receiver must
post a buffer of the exact size, and the size depends on who joined the batch, so every message
travels as a fixed-size *eager chunk* (an 8-byte length, then the first bytes of the payload);
only a payload longer than the chunk sends its tail as a second transfer, straight from the
packed tensor. Decode-sized messages thus cost one transfer, not a length word plus a payload.

Receives are bounded: a peer that died fails the wait at once, one that hangs fails it after
``timeout_s``, and either way the error names the peer.

A tensor-parallel destination receives once, at its leader, which broadcasts the raw bytes to its
group (one length vector + one payload), rather than every TP rank receiving its own copy.

Static decode steps move *rows* instead (:meth:`Transport.send_rows`, :meth:`Transport.recv_rows`):
when every request of a microbatch decodes one token and the ranks run static-shape steps, each
side knows a message's layout before it travels (the link's slots, the cut's tensors as the
warm-up saw them), so it goes without a header or a length: the rows of each tensor, back to
back, straight from the sender's step outputs into the receiver's step inputs. Nothing in it is
read on the host, so on a GPU nothing waits for the device. Where ranks run rank programs
(``native``: CPU ranks compiling their steps), rows travel on the native wire instead
(:mod:`.native`: a second connection per pair, written and read by C++), whether a program or
Python sends them; a message there carries its length and tag, which the receiver checks.
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
from .wire import PeerError, SocketWire, connect_pairs

Part = TokenBatch | torch.Tensor  # a batch handed over in-process, or packed bytes off the wire
EAGER_BYTES = 4096  # fixed size of a message's first transfer: length word + payload head
_LEN = 16  # length word padded so the payload keeps pack()'s 16-byte alignment


class Transport:
    """This rank's message endpoint; accumulates the time it spends blocked in ``comm_s``.

    ``spin_s``: how long each wait on the socket wire busy-polls before it blocks (see
    :mod:`.wire`; :func:`~.wire.spin_budget` picks it)."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        timeout_s: float,
        *,
        host: str = "127.0.0.1",
        key: bytes = b"",
        spin_s: float = 0.0,
        native: bool = False,
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
        # NCCL between GPUs (and, as a test seam, gloo between CPU ranks)
        p2p = "socket" if device.type == "cpu" and not torch_p2p else "torch"
        self.p2p = p2p
        self._wire = (
            SocketWire(rank, dist.get_world_size(), timeout_s, host, key, spin_s=spin_s)
            if p2p == "socket"
            else None
        )
        # rows of static decode steps travel on a second set of connections, the native wire's,
        # which a rank program (:mod:`.program`) also sends and receives on
        self.native: NativeWire | None = None
        if native and self._wire is not None:
            self.native = NativeWire(
                connect_pairs(rank, dist.get_world_size(), timeout_s, host, key),
                timeout_s,
                spin_s,
            )
        self._wire_oldest: int | None = None  # epoch of the oldest send posted since a drain
        self._row_buffers: dict[tuple[int, int], torch.Tensor] = {}  # (peer, tag) -> receive

    @property
    def spin_s(self) -> float:
        """How long each wait busy-polls before it blocks (0 off the socket wire)."""
        return self._wire.spin_s if self._wire is not None else 0.0

    # -- point to point ----------------------------------------------------------------------
    def send(self, message: Message, batch: TokenBatch, epoch: int) -> None:
        """Queue ``batch`` for ``message.peer`` without blocking."""
        start = time.perf_counter()
        buf = pack(batch).to(self.device)
        if self._wire is not None:
            self._post(message, (buf,), epoch)
        else:
            head = EAGER_BYTES - _LEN
            chunk = torch.zeros(EAGER_BYTES, dtype=torch.uint8, device=self.device)
            chunk[:8] = torch.tensor([buf.numel()], dtype=torch.int64).view(torch.uint8)
            chunk[_LEN : _LEN + min(head, buf.numel())] = buf[:head]
            self._isend(message, [chunk] if buf.numel() <= head else [chunk, buf[head:]], epoch)
        self._sent(buf.numel(), start)

    def _post(self, message: Message, parts: Sequence[torch.Tensor], epoch: int) -> None:
        """One message of ``parts`` onto the socket wire."""
        assert self._wire is not None
        self._wire.post(message.peer, message.tag, *parts)
        if self._wire_oldest is None:
            self._wire_oldest = epoch

    def _isend(self, message: Message, transfers: Sequence[torch.Tensor], epoch: int) -> None:
        """``transfers`` to ``message.peer`` through torch.distributed, reaped by epoch."""
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
        if self._wire is not None:
            buf = self._wire.take(message.peer, message.tag, what)
            self.comm_s += time.perf_counter() - start
            return buf
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
        On the socket wire the bytes go out of the tensors themselves: leave them unchanged
        until the sends of ``epoch`` are reaped (:meth:`reap`). Through ``torch.distributed``
        they are copied into one buffer on the device, sent in one transfer."""
        start = time.perf_counter()
        raw = [byte_view(t).reshape(-1) for t in parts]
        if self.native is not None:
            self.native.send(message.peer, message.tag, raw, self.native.ones)
        elif self._wire is not None:
            self._post(message, raw, epoch)
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
        elif self._wire is not None:
            buf = self._wire.take(peer, message.tag, what)
            if buf.numel() != size:
                raise PeerError(
                    peer,
                    f"rank {peer} sent {buf.numel()} bytes while {what} expected {size}: "
                    "schedules differ",
                )
        else:  # one receive buffer per link: its rows' size is fixed by the plan
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
        """Wait for sends queued before ``before_epoch``: bounds memory, never the pipeline."""
        start = time.perf_counter()
        if self._wire is not None:
            if self._wire_oldest is not None and self._wire_oldest < before_epoch:
                self._wire.drain("sending queued messages")
                self._wire_oldest = None
            self.comm_s += time.perf_counter() - start
            return
        while self._pending and self._pending[0][0] < before_epoch:
            _, work, _, peer = self._pending.popleft()
            self._wait(work, peer, f"sending to rank {peer}")
        self.comm_s += time.perf_counter() - start

    def flush(self) -> None:
        self.reap(before_epoch=1 << 62)
        if self.native is not None:
            self.native.drain()

    def wait_control(self, fileno: int) -> None:
        """Wait (without bound) until the control connection has data, keeping this rank's
        queued sends and incoming messages moving meanwhile."""
        if self._wire is not None:
            self._wire.wait_readable(fileno)
        else:  # NCCL / gloo progress their transfers on their own
            _select.select([fileno], [], [])

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()
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
        raise PeerError(leader, message) from None


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
