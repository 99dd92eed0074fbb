"""What a rank's iteration runners share: its request state, sampling, replies and clock."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .control import ControlClient
from .expert_parallel import EPComm
from .messages import Result
from .placement import RankInfo
from .schedule import Compute
from .stage import StageModule
from .tensor_parallel import TPComm
from .transport import Transport
from .work import GREEDY, SamplingParams, Work, sample_rows

Rows = dict[str, torch.Tensor]


@dataclass
class RankRequest:
    """A request a rank holds state for: how its tokens are sampled."""

    params: SamplingParams = GREEDY
    generator: torch.Generator | None = None


@dataclass
class Clock:
    """Where a rank's loop time went, from its first work on."""

    compute_s: float = 0.0
    started: float | None = None
    runq_at_start: float = 0.0
    # decode iterations (every microbatch the rank ran was a decode step, and it launched
    # something): how many, their launches from Python and their host time
    decode_iterations: int = 0
    decode_submissions: int = 0
    decode_host_s: float = 0.0
    timeline: dict[str, list[float]] = field(
        default_factory=lambda: {"end_s": [], "busy_s": [], "comm_s": [], "runq_s": []}
    )


class RankCore:
    """A rank's operators, transport, requests and clock (set up by
    :class:`~.rank.StageWorker`), and what every :class:`~.runners.IterationRunner` does with
    them alike."""

    rank: int
    info: RankInfo
    device: torch.device
    actions: list[Compute]
    group: Any
    comm: TPComm | None
    ep: EPComm | None
    transport: Transport
    module: StageModule
    control: ControlClient
    held: dict[str, RankRequest]
    clock: Clock
    # (segment, microbatch) -> each input tensor's dtype and shape past the token dimension,
    # as the first batch brought them (what the warm-up builds its padding from)
    inputs: dict[tuple[int, int], dict[str, tuple[torch.dtype, tuple[int, ...]]]]

    def work(self, i: int, k: int) -> Work:
        """Microbatch ``k``'s work of iteration ``i`` (waiting for it), its requests in sync."""
        raise NotImplementedError

    # -- what every runner shares ----------------------------------------------------------------
    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        """Time the operators run inside as compute, less their TP and EP collectives, which
        count as communication."""
        start = time.perf_counter()
        before = self._collective_s()
        yield
        collective = self._collective_s() - before
        self.transport.comm_s += collective
        self.clock.compute_s += time.perf_counter() - start - collective

    def _collective_s(self) -> float:
        return sum(c.comm_s for c in (self.comm, self.ep) if c is not None)

    @staticmethod
    def ops(action: Compute, *, sample: bool) -> slice:
        """The action's operators; the last one's ``sample`` only if ``sample`` (otherwise its
        tokens are sampled on the host, or, on a TP follower, not at all)."""
        stop = action.ops.stop - (1 if action.last and not sample else 0)
        return slice(action.ops.start, stop)

    def all_greedy(self, rids: Sequence[str]) -> bool:
        return all(self.held[rid].params.greedy for rid in rids)

    def sample_tokens(self, rids: Sequence[str], logits: torch.Tensor) -> list[int]:
        """A token per row of ``logits`` under each request's sampling parameters."""
        params = [self.held[rid].params for rid in rids]
        gens = [self.held[rid].generator for rid in rids]
        return sample_rows(logits, params, gens)

    def tokens_of(self, rids: list[str], out: Rows, place: list[int]) -> list[int]:
        """The sampled tokens of a static step's requests, from their rows: the step's own
        (greedy), or sampled here from their logits."""
        if not rids:
            return []
        if self.all_greedy(rids):
            ids = out["token_ids"].tolist()  # a row per slot: a few integers
            return [ids[p] for p in place]
        rows = torch.tensor(place, dtype=torch.int64, device=out["token_ids"].device)
        return self.sample_tokens(rids, out["logits"][rows])

    def reply(self, work: Work, rids: list[str], tokens: list[int]) -> None:
        """The tokens sampled for ``rids`` to the driver."""
        self.reply_all([(work, rids, tokens)])

    def reply_all(self, results: Sequence[tuple[Work, list[str], list[int]]]) -> None:
        """Several works' tokens to the driver in one write."""
        self.control.send_all(
            [Result(w.iteration, w.microbatch, tuple(r), tuple(t)) for w, r, t in results]
        )
