"""A rank's end of the control channel: frames however the bytes arrive, never blocking in
``poll``, and a closed or malformed channel named."""

from __future__ import annotations

import socket
import struct
import threading

import msgspec
import pytest

from opweave.runtime import Work
from opweave.runtime._private.control import ChannelClosed, ControlClient
from opweave.runtime._private.messages import (
    MAX_FRAME_BYTES,
    FrameReader,
    Result,
    Shutdown,
    ToRank,
    encode,
)
from opweave.runtime.errors import OpWeaveRuntimeError


def _client() -> tuple[ControlClient, socket.socket]:
    """A client on one end of a socket pair (the handshake is tested with the driver)."""
    ours, theirs = socket.socketpair()
    client = ControlClient.__new__(ControlClient)
    client._attach(ours)
    return client, theirs


def _work(iteration: int, tokens: int) -> Work:
    return Work(iteration, 0, ("r",), (0,), (0,), (tokens,), token_ids=tuple(range(tokens)))


def test_frames_are_decoded_whole_whatever_the_reads_cut():
    client, driver = _client()
    messages = [_work(i, i * 7 + 1) for i in range(5)]
    stream = b"".join(encode(m) for m in messages)
    assert not client.poll()  # nothing sent yet: returns at once
    for cut in (3, 8, 9, 40, len(stream) - 1):  # inside a length, at its end, inside a body
        driver.sendall(stream[:cut])
        got = []
        while client.poll():
            got.append(client.recv())
        driver.sendall(stream[cut:])
        while len(got) < len(messages):
            got.append(client.recv())
        assert got == messages
        assert not client.poll()


def test_a_frame_longer_than_one_read_arrives_whole():
    client, driver = _client()
    big = _work(0, 60_000)  # ~170 KB: several reads
    sender = threading.Thread(target=driver.sendall, args=(encode(big) + encode(Shutdown()),))
    sender.start()
    assert client.recv() == big
    assert client.recv() == Shutdown()
    sender.join()


def test_a_closed_channel_is_named_after_the_messages_before_it():
    client, driver = _client()
    driver.sendall(encode(Shutdown()))
    driver.close()
    assert client.poll()
    assert client.recv() == Shutdown()
    with pytest.raises(ChannelClosed, match="closed the control connection"):
        client.poll()
    with pytest.raises(ChannelClosed, match="closed the control connection"):
        client.recv()


def _frame(body: object) -> bytes:
    raw = msgspec.msgpack.encode(body)
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (struct.pack("<Q", MAX_FRAME_BYTES + 1), "over the limit"),
        (struct.pack("<Q", 3) + b"\xc1\xc1\xc1", "not a control message"),  # not MessagePack
        (_frame([]), "not a control message"),
        (_frame({"t": 1}), "not a control message"),
        (_frame({"t": "unknown"}), "not a control message"),
        (_frame({"t": "work", "iteration": "one", "microbatch": 0}), "not a control message"),
        # a message ranks send the driver, not one a rank takes from it
        (_frame(msgspec.to_builtins(Result(0, 0, ("r",), (1,)))), "not a control message"),
    ],
)
def test_a_malformed_frame_is_refused(frame: bytes, message: str):
    client, driver = _client()
    driver.sendall(frame)
    with pytest.raises(OpWeaveRuntimeError, match=message):
        client.recv()
    with pytest.raises(OpWeaveRuntimeError, match=message):
        FrameReader(ToRank).feed(memoryview(frame))


def test_encode_refuses_a_message_over_the_limit(monkeypatch):
    import opweave.runtime._private.messages as messages

    monkeypatch.setattr(messages, "MAX_FRAME_BYTES", 16)
    with pytest.raises(OpWeaveRuntimeError, match="exceeds the limit of 16"):
        encode(_work(0, 10))
