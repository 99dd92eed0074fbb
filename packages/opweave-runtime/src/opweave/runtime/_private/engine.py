"""Single-process greedy generation with iteration-level (continuous) batching.

Each :meth:`LocalModel.step` runs one forward over a ragged batch that mixes the prompts of newly
admitted requests with one token of every running request; requests that finish leave at once and
their per-request state is freed, so the next step's batch holds only live requests.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import RequestStateError
from .batch import BatchMeta, TokenBatch, pack, unpack
from .graph import operator_sequence
from .kernels import KernelSet
from .options import DecodeStep, Kernels
from .stage import StageModule


@dataclass
class Generation:
    """One request's progress; ``finish_reason`` becomes ``"stop"`` (stop token) or ``"length"``."""

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def context_len(self) -> int:
        """Tokens already in this request's cache (the last sampled token is not yet fed back)."""
        return len(self.prompt_token_ids) + len(self.token_ids) - 1 if self.token_ids else 0


class LocalModel:
    """Every operator of a model in one process, with a continuous-batching greedy scheduler.

    ``cuts`` (indices into :func:`operator_sequence`) split the model into consecutive stages whose
    activations cross each cut through :func:`pack`/:func:`unpack`, as a pipeline's sends would;
    the tokens must not change. ``decode_step`` is how decode steps run (see
    :data:`~.decode.DECODE_STEPS`): each stage's static step has ``max_running`` rows (one per
    running request without a limit).

    Example (``model_dir`` from :func:`write_tiny_model`)::

        model = LocalModel(model_dir)
        outputs = model.generate([[5, 6, 7], [8, 9]], max_new_tokens=8)
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        max_running: int | None = None,
        cuts: Sequence[int] = (),
        decode_step: str = "per-request",
        kernels: str = "opweave",
    ) -> None:
        if decode_step not in set(DecodeStep):
            raise ValueError(f"decode_step must be one of {', '.join(DecodeStep)}")
        step = DecodeStep(decode_step)
        seq = operator_sequence(model_dir)
        bounds = [0, *sorted(cuts), len(seq)]
        if len(set(bounds)) != len(bounds):
            raise ValueError(
                f"cuts must be distinct and inside 1..{len(seq) - 1}, got {list(cuts)}"
            )
        choice = Kernels(kernels)
        self.stages = [
            StageModule(
                model_dir,
                seq[lo:hi],
                device=device,
                dtype=dtype,
                kernels=KernelSet(choice, gemms_only=step.static),
            )
            for lo, hi in itertools.pairwise(bounds)
        ]
        # what runs on another library's kernels, "<layer>.<operator>[.<part>]:<kernel>" each
        self.kernels = [entry for stage in self.stages for entry in stage.kernels]
        if step.static:
            for stage in self.stages:
                stage.use_static_decode(rows=max_running or 0, compile=step.compiler)
        self.arch = self.stages[0].arch
        self.device = torch.device(device)
        self.max_running = max_running
        self.waiting: deque[Generation] = deque()
        self.running: dict[str, Generation] = {}
        self._ids = itertools.count()

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        request_id: str | None = None,
        stop_token_ids: Iterable[int] | None = None,
    ) -> str:
        """Queue a request; it joins the batch at the next :meth:`step`.

        Generation stops at ``max_new_tokens`` or a stop token (the config's EOS ids by default).
        """
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.running or any(g.request_id == rid for g in self.waiting):
            raise RequestStateError(f"request id {rid!r} is already in use")
        stops = frozenset(self.arch.eos_token_ids if stop_token_ids is None else stop_token_ids)
        self.waiting.append(Generation(rid, list(prompt_token_ids), max_new_tokens, stops))
        return rid

    @property
    def weight_bytes(self) -> int:
        return sum(stage.weight_bytes for stage in self.stages)

    def state_bytes(self) -> int:
        """Per-request state held across all stages (KV caches, recurrent states)."""
        return sum(stage.state_bytes() for stage in self.stages)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Generation]:
        """One iteration: prefill newly admitted requests, decode running ones; return finished."""
        while self.waiting and (self.max_running is None or len(self.running) < self.max_running):
            gen = self.waiting.popleft()
            for stage in self.stages:
                stage.admit(gen.request_id)
            self.running[gen.request_id] = gen
        if not self.running:
            return []
        gens = list(self.running.values())
        feed = [g.token_ids[-1:] if g.token_ids else g.prompt_token_ids for g in gens]
        meta = BatchMeta(
            request_ids=tuple(g.request_id for g in gens),
            query_lens=tuple(len(f) for f in feed),
            context_lens=tuple(g.context_len for g in gens),
        )
        token_ids = torch.tensor(
            [t for f in feed for t in f], dtype=torch.int64, device=self.device
        )
        # a static decode step has max_running rows (one graph however many are running)
        size = self.max_running
        batch = self.stages[0].run(TokenBatch(meta, {"token_ids": token_ids}), size=size)
        for stage in self.stages[1:]:
            batch = stage.run(unpack(pack(batch)), size=size)
        sampled = batch["token_ids"].tolist()
        finished = []
        for gen, token in zip(gens, sampled, strict=True):
            gen.token_ids.append(int(token))
            if token in gen.stop_token_ids:
                gen.finish_reason = "stop"
            elif len(gen.token_ids) >= gen.max_new_tokens:
                gen.finish_reason = "length"
            if gen.finish_reason is not None:
                for stage in self.stages:
                    stage.free(gen.request_id)
                del self.running[gen.request_id]
                finished.append(gen)
        return finished

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        stop_token_ids: Iterable[int] | None = None,
    ) -> list[list[int]]:
        """Greedy continuations of several prompts, batched together; generated ids per prompt."""
        stops = None if stop_token_ids is None else list(stop_token_ids)
        ids = [self.add_request(p, max_new_tokens, stop_token_ids=stops) for p in prompts]
        done: dict[str, Generation] = {}
        while self.has_unfinished():
            done.update((g.request_id, g) for g in self.step())
        return [done[rid].token_ids for rid in ids]
