"""A rank's end of the control channel: frames however the bytes arrive, never blocking in
``poll``, and a closed or malformed channel named."""

from __future__ import annotations

import json
import socket
import struct
import threading

import pytest

from opweave.runtime._private.control import (
    MAX_FRAME_BYTES,
    ChannelClosed,
    ControlClient,
    FrameReader,
    encode,
)
from opweave.runtime.errors import OpWeaveRuntimeError


def _client() -> tuple[ControlClient, socket.socket]:
    """A client on one end of a socket pair (the handshake is tested with the driver)."""
    ours, theirs = socket.socketpair()
    client = ControlClient.__new__(ControlClient)
    client._attach(ours)
    return client, theirs


def test_frames_are_decoded_whole_whatever_the_reads_cut():
    client, driver = _client()
    messages = [{"t": "work", "i": i, "x": list(range(i * 7))} for i in range(5)]
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
    big = {"t": "work", "x": list(range(60_000))}  # ~400 KB of JSON: several reads
    sender = threading.Thread(target=driver.sendall, args=(encode(big) + encode({"t": "end"}),))
    sender.start()
    assert client.recv() == big
    assert client.recv() == {"t": "end"}
    sender.join()


def test_a_closed_channel_is_named_after_the_messages_before_it():
    client, driver = _client()
    driver.sendall(encode({"t": "shutdown"}))
    driver.close()
    assert client.poll()
    assert client.recv() == {"t": "shutdown"}
    with pytest.raises(ChannelClosed, match="closed the control connection"):
        client.poll()
    with pytest.raises(ChannelClosed, match="closed the control connection"):
        client.recv()


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (struct.pack("<Q", MAX_FRAME_BYTES + 1), "over the limit"),
        (struct.pack("<Q", 3) + b"{x}", "not JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a typed message"),
        (struct.pack("<Q", 8) + json.dumps({"t": 1}).encode().ljust(8), "not a typed message"),
    ],
)
def test_a_malformed_frame_is_refused(frame: bytes, message: str):
    client, driver = _client()
    driver.sendall(frame)
    with pytest.raises(OpWeaveRuntimeError, match=message):
        client.recv()
    with pytest.raises(OpWeaveRuntimeError, match=message):
        FrameReader().feed(memoryview(frame))


def test_encode_refuses_a_message_over_the_limit(monkeypatch):
    import opweave.runtime._private.control as control

    monkeypatch.setattr(control, "MAX_FRAME_BYTES", 16)
    with pytest.raises(OpWeaveRuntimeError, match="exceeds the limit of 16"):
        encode({"t": "work", "x": list(range(10))})
