"""The server's door: the API key on every route, and a stop that ends.

vLLM's own key check guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``,
so ``/invocations``, ``/tokenize``, ``/metrics``, ``/docs`` and the rest answered anyone;
:class:`Guard`, an ASGI middleware in front of vLLM's app, asks every request for the key but
``/health`` (:data:`PUBLIC`: load balancers probe it, and it neither runs nor reveals the model).

A signal stops the server in order (:class:`Drain`): new requests, and ``/health``, get 503 at
once; the requests in flight get until the drain deadline (``--shutdown-timeout``) to finish;
at the deadline each unfinished stream gets an error event and ``data: [DONE]`` and ends (a
request whose response had not started gets a 503), which also aborts it in vLLM's engine;
only then is vLLM's own stop called (engine, ranks, HTTP server), with nothing left to wait
for. A second signal ends every request in flight the same way at once and exits within a
second. Pure ASGI and asyncio: no vLLM here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC = frozenset({"/health"})  # answered without the key (documented in the README)
_CUT_GRACE_S = 2.0  # after the deadline: how long cut requests get to end their responses
_SECOND_GRACE_S = 0.5  # after a second signal: how long they get to write their error events


class Drain:
    """What a stopping signal does to the server. :meth:`on_signal` is called by the event
    loop's signal handler with vLLM's own stop (``stop``)."""

    def __init__(self, deadline_s: float, stopped_by: list[int]) -> None:
        self.deadline_s = deadline_s
        self.stopped_by = stopped_by
        self.draining = False
        self.cut = 0  # requests the deadline cut
        self.active: set[_Exchange] = set()

    def on_signal(self, sig: int, stop: Callable[[], Any]) -> None:
        if self.draining:
            self._exit_now(sig)
        self.stopped_by.append(sig)
        self.draining = True
        asyncio.get_running_loop().create_task(self._drain(stop))

    async def _drain(self, stop: Callable[[], Any]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            self.cut = len(self.active)
            for exchange in list(self.active):
                exchange.cut()
            end = loop.time() + _CUT_GRACE_S
            while self.active and loop.time() < end:
                await asyncio.sleep(0.02)
        stop()

    def _exit_now(self, sig: int) -> None:
        """A second signal: no more waiting. Each request in flight ends at once (an error
        event on a stream, a 503 where no response had started), given at most
        :data:`_SECOND_GRACE_S` to be written; then the process exits, and the engine, the
        ranks and the run's folders go with it (parent-death signals and the run's reapers)."""
        name = signal.Signals(sig).name
        words: dict[int, str] = {signal.SIGINT: "interrupted", signal.SIGHUP: "hung up"}
        what = words.get(sig, "terminated")
        cut = len(self.active)
        detail = f", cutting {cut} request{'s' if cut != 1 else ''}" if cut else ""

        def leave() -> None:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.write(f"error: {what} ({name}) again: stopped at once{detail}\n")
                sys.stderr.flush()
            os._exit(128 + sig)

        if not cut:
            leave()
        for exchange in list(self.active):
            exchange.cut()
        # a loop too busy to write the error events must not keep the process alive
        threading.Timer(2 * _SECOND_GRACE_S, leave).start()
        asyncio.get_running_loop().create_task(self._leave_when_written(leave))

    async def _leave_when_written(self, leave: Callable[[], None]) -> None:
        end = asyncio.get_running_loop().time() + _SECOND_GRACE_S
        while self.active and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.01)
        leave()


class Guard:
    """ASGI middleware: the key on every route but :data:`PUBLIC`, 503 while draining, and
    every HTTP request in flight known to the :class:`Drain`; ``started`` is set when the
    application has started (the server listens next)."""

    def __init__(
        self,
        app: App,
        *,
        key: str | list[str] | tuple[str, ...] | None,
        drain: Drain,
        started: asyncio.Event | None = None,
    ) -> None:
        """``key``: the key, or several (vLLM's ``--api-key`` takes a list); None: no key."""
        self.app = app
        keys = [key] if isinstance(key, str) else list(key or ())
        self.keys = [f"Bearer {k}".encode() for k in keys]
        self.drain = drain
        self.started = started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, self._noting_start(send))
            return
        if self.drain.draining:
            await _refuse(scope, send, 503, "the server is shutting down", "ServiceUnavailable")
            return
        if self.keys and scope.get("path") not in PUBLIC and not self._authorized(scope):
            await _refuse(scope, send, 401, "Unauthorized: send 'Authorization: Bearer KEY'")
            return
        if kind == "websocket":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(send)
        self.drain.active.add(exchange)
        try:
            await exchange.run(self.app(scope, receive, exchange.send))
        finally:
            self.drain.active.discard(exchange)

    def _noting_start(self, send: Send) -> Send:
        started = self.started
        if started is None:
            return send

        async def noted(message: Message) -> None:
            await send(message)
            if message["type"] == "lifespan.startup.complete":
                started.set()

        return noted

    def _authorized(self, scope: Scope) -> bool:
        given = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        if len(given) != 1:
            return False
        # every key compared, in constant time each: the answer's timing tells nothing
        return any([hmac.compare_digest(given[0], key) for key in self.keys])


class _Exchange:
    """One HTTP request in flight: its response as sent so far, and how to cut it short."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.ended = False
        self.events = False  # a server-sent-event stream (a streaming completion)
        self._cut = asyncio.Event()

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            headers = message.get("headers", ())
            self.events = any(
                k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                for k, v in headers
            )
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    def cut(self) -> None:
        self._cut.set()

    async def run(self, call: Awaitable[None]) -> None:
        task = asyncio.ensure_future(call)
        cutter = asyncio.ensure_future(self._cut.wait())
        try:
            await asyncio.wait({task, cutter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()  # vLLM aborts the request in its engine
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            cutter.cancel()
        if self._cut.is_set():
            if not self.ended:
                await self._end()  # whatever the cancelled call left unsent
            return
        task.result()  # finished on its own; an exception in it is uvicorn's to report

    async def _end(self) -> None:
        """The end of a response the drain deadline cut."""
        error = {
            "error": {
                "message": "the server stopped before this request finished (drain deadline)",
                "type": "ServiceUnavailable",
                "code": 503,
            }
        }
        with contextlib.suppress(Exception):
            if not self.started:
                await _respond(self._send, 503, error)
            elif not self.ended:
                body = b""
                if self.events:
                    body = f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
                await self._send({"type": "http.response.body", "body": body, "more_body": False})
            self.ended = True


async def _refuse(scope: Scope, send: Send, status: int, message: str, kind: str = "") -> None:
    if scope["type"] == "websocket":
        # 1008: policy violation (no key); 1001: going away (shutting down)
        await send({"type": "websocket.close", "code": 1008 if status == 401 else 1001})
        return
    error = {"error": {"message": message, "type": kind or "Unauthorized", "code": status}}
    await _respond(send, status, error)


async def _respond(send: Send, status: int, doc: dict[str, Any]) -> None:
    body = json.dumps(doc).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if status == 503:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
