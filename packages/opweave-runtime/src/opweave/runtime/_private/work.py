"""What the driver tells the ranks: one microbatch of one iteration (:class:`Work`).

The driver owns the requests (token history, admission into the plan's slots, stop rules); every
rank that serves microbatch ``k`` receives its :class:`Work` for each iteration over the control
channel: which requests it holds (slot, tokens already cached, tokens to run), which requests to
free, the sampling parameters of newly admitted ones, and, for the first segment's ranks, the
token ids to embed. Admission and prefill are one thing: a request at context 0 is admitted by
every rank whose replica holds its slot, and its prompt runs in the same iteration as the other
requests' decode steps.

Tokens may also stay on the ranks (offline generation over static decode steps): a *forward*
work asks the last segment's leaders to send the tokens they sample to the first segment's
leaders as well, who take them at the start of the microbatch's next iteration; a *carried*
work then names no token ids at all (each request's input is the token sampled for it in the
microbatch's previous iteration), so the driver can submit it before that iteration's result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

from ..errors import RequestStateError
from .batch import BatchMeta, TokenBatch, one_new_token_each


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """How a request's next token is chosen; temperature 0 is greedy (the ``sample`` operator)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5


GREEDY = SamplingParams()


class Work(msgspec.Struct, frozen=True, omit_defaults=True, tag="work", tag_field="t"):
    """Microbatch ``microbatch`` of iteration ``iteration``, as every rank serving it sees it.

    Requests are listed in slot order. ``sample[i]`` says whether request ``i``'s last token this
    iteration yields an output (not for a chunk of a prompt that continues next iteration; the
    driver's own bookkeeping, not sent). ``final``: no iteration of this microbatch follows.
    ``forward``: the sampled tokens also go to the first segment's leaders (a decode step's
    only). ``carried``: every request's input is the token the ranks sampled for it in the
    microbatch's previous iteration, which was a forward work; ``token_ids`` is then ``None``.
    ``imports``: requests a prefill pool prefilled (request -> (prefill replica, prefill
    number)), admitted here at their prompt's length, their state received from that replica;
    ``discard``: (slot, prefill replica, prefill number) of prefills whose request left before
    it was imported, whose state the decode ranks receive and drop.

    It is also the control message that carries it (:mod:`.messages`): validated again when a
    rank decodes it.
    """

    iteration: int
    microbatch: int
    request_ids: tuple[str, ...] = ()
    slots: tuple[int, ...] = ()
    context_lens: tuple[int, ...] = ()
    query_lens: tuple[int, ...] = ()
    sample: tuple[bool, ...] = ()
    token_ids: tuple[int, ...] | None = None
    free: tuple[str, ...] = ()
    params: dict[str, SamplingParams] = msgspec.field(default_factory=dict)
    final: bool = False
    forward: bool = False
    carried: bool = False
    imports: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)
    discard: tuple[tuple[int, int, int], ...] = ()

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if not len(self.slots) == len(self.context_lens) == len(self.query_lens) == n:
            raise RequestStateError("work: one slot, context and query length per request")
        if self.token_ids is not None and len(self.token_ids) != sum(self.query_lens):
            raise RequestStateError("work: token ids do not add up to the query lengths")
        if (self.forward or self.carried) and not self.decode:
            raise RequestStateError("work: only a decode step forwards or carries its tokens")
        if self.carried and self.token_ids is not None:
            raise RequestStateError("work: a carried work names no token ids")

    def for_rank(self, *, tokens: bool, params: bool) -> Work:
        """What one rank is sent: the token ids only if it embeds them (the first segment),
        the sampling parameters only if it samples (the last)."""
        return msgspec.structs.replace(
            self,
            sample=(),
            token_ids=self.token_ids if tokens else None,
            params=self.params if params else {},
        )

    def slot_of(self, request_id: str) -> int:
        return self.slots[self.request_ids.index(request_id)]

    @property
    def decode(self) -> bool:
        """Every request of the microbatch runs one new token after cached ones (what a static
        decode step runs; every rank serving the microbatch sees the same answer)."""
        return one_new_token_each(self.query_lens, self.context_lens)

    def requests_in(self, slots: range) -> list[int]:
        """Indices of the requests whose slot lies in ``slots``."""
        return [i for i, s in enumerate(self.slots) if s in slots]

    def batch_for(self, slots: range, device: torch.device) -> TokenBatch:
        """The first segment's input for a replica holding ``slots``: its requests' token ids."""
        if self.token_ids is None:
            raise RequestStateError("work without token ids reached the first segment")
        idx = self.requests_in(slots)
        if len(idx) == len(self.slots):  # every request is this replica's (one replica)
            ids: Sequence[int] = self.token_ids
            meta = BatchMeta(self.request_ids, self.query_lens, self.context_lens, self.slots)
        else:
            offsets = [0]
            for q in self.query_lens:
                offsets.append(offsets[-1] + q)
            ids = [t for i in idx for t in self.token_ids[offsets[i] : offsets[i + 1]]]
            meta = BatchMeta(
                tuple(self.request_ids[i] for i in idx),
                tuple(self.query_lens[i] for i in idx),
                tuple(self.context_lens[i] for i in idx),
                slots=tuple(self.slots[i] for i in idx),
            )
        return TokenBatch(meta, {"token_ids": torch.tensor(ids, dtype=torch.int64, device=device)})


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits``: greedy rows by argmax (as the ``sample`` operator),
    others by temperature, top-k, top-p and min-p with the request's own generator."""
    logits = logits.float()
    out = torch.argmax(logits, dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            out[row] = _sample_one(logits[row], p, gen)
    return [int(t) for t in out]


def skip_draw(params: SamplingParams, generator: torch.Generator, vocab_size: int) -> None:
    """Advance ``generator`` past one token's draw (what :func:`sample_rows` takes of it does
    not depend on the logits, only on their width): a request whose first token was sampled
    elsewhere (a prefill pool) then draws its next ones as if it had been sampled here."""
    sample_rows(torch.zeros(1, vocab_size), [params], [generator])


def _sample_one(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    row = row / p.temperature
    if p.top_k and 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, -math.inf)
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p > p.top_p  # smallest prefix >= top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
