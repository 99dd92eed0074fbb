"""The server's door (``opweave.runtime.vllm._guard``) on a stand-in ASGI app, without vLLM: the
key on every path but ``/health``, and a drain that ends (the end-to-end checks, on a real
server, are in tests/vllm/test_production.py)."""

from __future__ import annotations

import asyncio
import json
import signal

import pytest

from opweave.runtime.vllm._guard import PUBLIC, Drain, Guard


async def _events_forever(scope, receive, send) -> None:
    """A streaming completion that never finishes."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
        }
    )
    while True:
        await send({"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True})
        await asyncio.sleep(0.01)


async def _answer(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


async def _never_answers(scope, receive, send) -> None:
    await asyncio.sleep(3600)


def _scope(path: str, key: str | None = None) -> dict:
    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    return {"type": "http", "path": path, "method": "GET", "headers": headers}


async def _call(guard: Guard, scope: dict) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await guard(scope, receive, send)
    return sent


def _status(sent: list[dict]) -> int:
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_every_path_but_health_needs_the_key():
    assert {"/health"} == PUBLIC
    guard = Guard(_answer, key=["k1", "k2"], drain=Drain(1.0, []))

    async def main() -> list[int]:
        return [
            _status(await _call(guard, _scope(path, key)))
            for path, key in [
                ("/health", None),
                ("/invocations", None),
                ("/metrics", None),
                ("/docs", "wrong"),
                ("/tokenize", "k2"),
                ("/v1/completions", "k1"),
            ]
        ]

    assert asyncio.run(main()) == [200, 401, 401, 401, 200, 200]
    open_guard = Guard(_answer, key=None, drain=Drain(1.0, []))
    assert _status(asyncio.run(_call(open_guard, _scope("/metrics")))) == 200


def test_the_drain_cuts_streams_at_its_deadline_and_refuses_new_requests():
    stopped_by: list[int] = []
    drain = Drain(0.3, stopped_by)
    stream_guard = Guard(_events_forever, key=None, drain=drain)
    slow_guard = Guard(_never_answers, key=None, drain=drain)
    stops: list[str] = []

    async def main() -> tuple[list[dict], list[dict], list[dict], list[dict]]:
        stream = asyncio.ensure_future(_call(stream_guard, _scope("/v1/completions")))
        slow = asyncio.ensure_future(_call(slow_guard, _scope("/v1/completions")))
        await asyncio.sleep(0.1)
        stopped = asyncio.Event()

        def stop() -> None:
            stops.append("vLLM's stop")
            stopped.set()

        drain.on_signal(signal.SIGTERM, stop)
        during = await _call(slow_guard, _scope("/v1/completions"))
        health = await _call(slow_guard, _scope("/health"))
        await asyncio.wait_for(stopped.wait(), 60)  # only against a hang
        return await stream, await slow, during, health

    stream, slow, during, health = asyncio.run(main())
    assert stopped_by == [signal.SIGTERM] and stops == ["vLLM's stop"] and drain.cut == 2
    assert _status(during) == 503 and _status(health) == 503
    # the stream: its events, then an error event and [DONE], and its end
    tail = stream[-1]
    assert tail["more_body"] is False
    events = tail["body"].decode().split("\n\n")
    assert json.loads(events[0].removeprefix("data: "))["error"]["code"] == 503
    assert events[1] == "data: [DONE]"
    assert sum(m["type"] == "http.response.body" for m in stream) > 2
    # the request that had no answer yet: a 503
    assert _status(slow) == 503 and slow[-1]["more_body"] is False


def test_the_guard_notes_when_the_application_has_started():
    async def lifespan(scope, receive, send) -> None:
        await receive()
        await send({"type": "lifespan.startup.complete"})

    async def run() -> bool:
        started = asyncio.Event()
        guard = Guard(lifespan, key=None, drain=Drain(1.0, []), started=started)
        sent: list[dict] = []

        async def send(message) -> None:
            sent.append(message)

        async def receive() -> dict:
            return {"type": "lifespan.startup"}

        await guard({"type": "lifespan"}, receive, send)
        return started.is_set() and sent == [{"type": "lifespan.startup.complete"}]

    assert asyncio.run(run())


def test_a_server_whose_port_another_took_at_the_same_moment_stops_itself(monkeypatch):
    """Two servers bind one port at once (SO_REUSEADDR) and only the first listens: the second
    stops itself as SIGTERM does, saying why, once its application has started."""
    import os
    import socket

    from opweave.runtime.vllm import serve as serving

    first, second = socket.socket(), socket.socket()
    for sock in (first, second):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    first.bind(("127.0.0.1", 0))
    port = first.getsockname()[1]
    second.bind(("127.0.0.1", port))
    first.listen()
    with pytest.raises(OSError):  # EADDRINUSE
        second.listen()
    sent: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))

    def check(sock: socket.socket) -> list[str]:
        failures: list[str] = []

        async def run() -> None:
            started = asyncio.Event()
            started.set()
            await serving._stop_unless_listening(sock.dup(), started, failures, f"here:{port}")

        asyncio.run(run())
        return failures

    with first, second:
        assert check(first) == [] and sent == []
        assert check(second) == [
            f"here:{port} is in use by another process (a server started at the same time?); "
            "stop it or choose another --port"
        ]
    assert sent == [signal.SIGTERM]
