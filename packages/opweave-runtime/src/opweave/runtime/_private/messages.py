"""The control channel's messages: typed, versioned, and one codec for all of them.

Every message is a frozen ``msgspec.Struct`` tagged by its kind (``t``), encoded as MessagePack
and framed by an 8-byte little-endian length (:func:`encode`, :class:`FrameReader`). A decoder
knows every kind and each kind's fields and types, so a frame of another kind, a field of the
wrong type or a missing one is refused as malformed before anything acts on it. The protocol's
version (:data:`PROTOCOL_VERSION`) is part of the connection's handshake (:mod:`.control`):
ranks and drivers of different versions do not talk.

Driver to rank: :class:`~.work.Work` (one microbatch of one iteration), :class:`Prefill` (a
prompt, to a prefill pool's ranks), :class:`Warm` (build the decode steps; the warm-up's
requests to free), :class:`Shutdown`. Rank to driver: :class:`Hello`, :class:`Loading` (a
heartbeat while weights load), :class:`Ready`, :class:`Result` (sampled tokens),
:class:`Prefilled`, :class:`Warmed`, :class:`Stats`, :class:`Error`.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from ..errors import OpWeaveRuntimeError
from .work import SamplingParams, Work

# 1: JSON frames with one-letter keys; 2: no prefill pools; 3: one prompt per Prefill frame
PROTOCOL_VERSION = 4
MAX_FRAME_BYTES = 256 << 20  # the largest control message (a long prompt's ids, a rank's stats)
_LEN = struct.Struct("<Q")
_RECV_BYTES = 64 << 10  # what one read takes from the socket (a longer frame takes several)


class _Message(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="t"):
    pass


class Warm(_Message, frozen=True, tag="warm"):
    """Build (and compile) the decode steps now; free the warm-up's requests."""

    request_ids: tuple[str, ...] = ()


class Shutdown(_Message, frozen=True, tag="shutdown"):
    """Stop after the work submitted so far; send the statistics."""


class Hello(_Message, frozen=True, tag="hello"):
    """A rank's first message: who it is, and which protocol it speaks."""

    rank: int
    pid: int
    host: str
    version: int = PROTOCOL_VERSION


class Loading(_Message, frozen=True, tag="loading"):
    """The rank is alive while its weights load."""


class Ready(_Message, frozen=True, tag="ready"):
    rank: int
    weight_bytes_read: int
    weight_bytes: int
    load_s: float
    kernels: tuple[str, ...] = ()


class Result(_Message, frozen=True, tag="result"):
    """The tokens sampled for ``request_ids`` in ``microbatch`` of ``iteration``."""

    iteration: int
    microbatch: int
    request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]


class Prefill(_Message, frozen=True, tag="prefill"):
    """Prefill ``token_ids`` of ``request_id`` (prefill number ``seq``), whose decode slot is
    ``slot``: sample its first token, hand its state to the decode ranks holding that slot."""

    seq: int
    request_id: str
    slot: int
    token_ids: tuple[int, ...]
    params: SamplingParams


class PrefillBatch(_Message, frozen=True, tag="prefill_batch"):
    """The prompts one prefill replica runs together, as one batch (those of one step)."""

    prompts: tuple[Prefill, ...]


class Prefilled(_Message, frozen=True, tag="prefilled"):
    """A prefill rank's part of prefill ``seq``: the first token (its TP leader's; -1 from the
    others), and the state bytes it sent to the decode ranks in ``messages`` messages."""

    seq: int
    request_id: str
    token_id: int
    state_bytes: int
    messages: int


class Warmed(_Message, frozen=True, tag="warmed"):
    rank: int


class Stats(_Message, frozen=True, tag="stats"):
    stats: dict[str, Any]


class Error(_Message, frozen=True, tag="error"):
    """A rank failed: ``kind`` ``peer`` (waiting for ``peer``, or for one of ``suspects``,
    failed) or ``error`` (its own)."""

    kind: str
    message: str
    peer: int | None = None
    suspects: tuple[int, ...] = ()


ToRank = Work | PrefillBatch | Warm | Shutdown
ToDriver = Hello | Loading | Ready | Result | Prefilled | Warmed | Stats | Error
Message = ToRank | ToDriver

_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    """One frame: the length, then the message."""
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise OpWeaveRuntimeError(
            f"a control message of {len(body)} bytes exceeds the limit of {MAX_FRAME_BYTES}"
        )
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Incremental reader of length-prefixed messages of ``kinds`` from a non-blocking
    socket."""

    def __init__(self, kinds: Any = Message) -> None:
        self._decoder = msgspec.msgpack.Decoder(kinds)
        self._buf = bytearray()
        self._chunk = bytearray(_RECV_BYTES)  # reused by every read
        self._view = memoryview(self._chunk)

    def read(self, sock: Any, flags: int = 0) -> list[Any] | None:
        """One read of ``sock`` (raising what ``recv`` raises): the messages it completes, or
        None at the end of the stream."""
        n = sock.recv_into(self._chunk, _RECV_BYTES, flags)
        return None if n == 0 else self.feed(self._view[:n])

    def feed(self, data: bytes | memoryview) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if size > MAX_FRAME_BYTES:
                raise OpWeaveRuntimeError(
                    f"a control frame announces {size} bytes, over the limit of {MAX_FRAME_BYTES}"
                )
            if len(self._buf) < _LEN.size + size:
                break
            body = bytes(self._buf[_LEN.size : _LEN.size + size])
            del self._buf[: _LEN.size + size]
            try:
                out.append(self._decoder.decode(body))
            except msgspec.DecodeError as exc:
                raise OpWeaveRuntimeError(
                    f"a control frame is not a control message ({exc})"
                ) from None
        return out
