"""The caller-facing side of a run, on global rank 0: token history and slot admission.

Only this rank keeps token history. Each iteration, per microbatch, it takes the tokens the last
segment sampled for the microbatch's slots, retires finished requests (their ids ride in the next
message's ``free`` list so every stage holding their state drops it), admits waiting requests into
the free slots, and sends the next ragged batch to the first segment: running requests feed their
last token, new ones their whole prompt, so prefill and decode mix in one iteration.

A microbatch whose slots are all empty while nobody waits is sent once more with ``final`` set and
then never again; workers stop when every microbatch they serve has gone final.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..errors import RequestStateError
from .batch import BatchMeta, TokenBatch
from .engine import Generation
from .placement import Placement
from .schedule import Drive
from .transport import Transport, as_batch, merge


@dataclass(frozen=True)
class Request:
    """One generation request: prompt ids, a token budget, optional id and stop tokens."""

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    request_id: str | None = None
    stop_token_ids: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "prompt_token_ids": list(self.prompt_token_ids),
            "max_new_tokens": self.max_new_tokens,
            "request_id": self.request_id,
            "stop_token_ids": None if self.stop_token_ids is None else list(self.stop_token_ids),
        }

    @classmethod
    def from_json(cls, data: dict) -> Request:
        stops = data.get("stop_token_ids")
        return cls(
            tuple(data["prompt_token_ids"]),
            int(data["max_new_tokens"]),
            data.get("request_id"),
            None if stops is None else tuple(stops),
        )


def check_requests(requests: Sequence[Request]) -> None:
    seen: set[str] = set()
    for i, req in enumerate(requests):
        if not req.prompt_token_ids:
            raise RequestStateError(f"request {i} has an empty prompt")
        if req.max_new_tokens < 1:
            raise RequestStateError(f"request {i}: max_new_tokens must be at least 1")
        rid = req.request_id or f"req-{i}"
        if rid in seen:
            raise RequestStateError(f"request id {rid!r} is used twice")
        seen.add(rid)


class Driver:
    """Admission, token history and per-request timing for one run (lives on rank 0)."""

    def __init__(
        self,
        placement: Placement,
        requests: Sequence[Request],
        default_stops: Iterable[int],
        device: torch.device,
    ) -> None:
        check_requests(requests)
        stops = frozenset(default_stops)
        self.placement = placement
        self.device = device
        self.generations = [
            Generation(
                r.request_id or f"req-{i}",
                list(r.prompt_token_ids),
                r.max_new_tokens,
                stops if r.stop_token_ids is None else frozenset(r.stop_token_ids),
            )
            for i, r in enumerate(requests)
        ]
        self.waiting: deque[Generation] = deque(self.generations)
        self.slots: list[Generation | None] = [None] * placement.global_batch
        self._free: dict[int, list[str]] = {}
        self.token_times: dict[str, list[float]] = {g.request_id: [] for g in self.generations}
        self.started: float | None = None  # when the first iteration began
        self.max_active = 0

    def drive(self, action: Drive, iteration: int, transport: Transport) -> bool:
        """Run one :class:`Drive`; returns whether the microbatch went final."""
        k = action.microbatch
        if self.started is None:
            self.started = time.perf_counter()
        if iteration > 0:
            self._collect(k, action, transport)
        mb = self.placement.microbatch_slots(k)
        for slot in mb:
            if self.slots[slot] is None and self.waiting:
                self.slots[slot] = self.waiting.popleft()
        active = [(s, g) for s in mb if (g := self.slots[s]) is not None]
        self.max_active = max(self.max_active, sum(g is not None for g in self.slots))
        final = not active and not self.waiting
        free = tuple(self._free.pop(k, ()))
        for link in action.inputs_to:
            chosen = [(s, g) for s, g in active if s in link.slots]
            feeds = [g.token_ids[-1:] if g.token_ids else g.prompt_token_ids for _, g in chosen]
            meta = BatchMeta(
                tuple(g.request_id for _, g in chosen),
                tuple(len(f) for f in feeds),
                tuple(g.context_len for _, g in chosen),
                slots=tuple(s for s, _ in chosen),
                free=free,
                final=final,
            )
            ids = torch.tensor([t for f in feeds for t in f], dtype=torch.int64, device=self.device)
            transport.send(link, TokenBatch(meta, {"token_ids": ids}), iteration)
        return final

    def _collect(self, k: int, action: Drive, transport: Transport) -> None:
        parts = [
            as_batch(transport.recv(link, f"receiving sampled tokens of microbatch {k}"))
            for link in action.tokens_from
        ]
        got = merge(parts)
        now = time.perf_counter()
        tokens = got["token_ids"].tolist() if got.meta.request_ids else []
        for rid, slot, token in zip(got.meta.request_ids, got.meta.slots, tokens, strict=True):
            gen = self.slots[slot]
            if gen is None or gen.request_id != rid:
                raise RequestStateError(f"slot {slot} returned a token for unknown request {rid!r}")
            gen.token_ids.append(int(token))
            self.token_times[rid].append(now)
            if token in gen.stop_token_ids:
                gen.finish_reason = "stop"
            elif len(gen.token_ids) >= gen.max_new_tokens:
                gen.finish_reason = "length"
            if gen.finish_reason is not None:
                self.slots[slot] = None
                self._free.setdefault(k, []).append(rid)

    def tpot_s(self) -> float | None:
        """Mean over requests of (last token time - first token time) / (tokens - 1)."""
        per_request = [
            (times[-1] - times[0]) / (len(times) - 1)
            for times in self.token_times.values()
            if len(times) > 1
        ]
        return sum(per_request) / len(per_request) if per_request else None

    def outputs(self) -> list[dict[str, object]]:
        return [
            {
                "request_id": g.request_id,
                "prompt_token_ids": g.prompt_token_ids,
                "token_ids": g.token_ids,
                "finish_reason": g.finish_reason,
                # when each token reached the driver, in seconds since the first iteration began
                "token_times_s": [t - (self.started or t) for t in self.token_times[g.request_id]],
            }
            for g in self.generations
        ]
