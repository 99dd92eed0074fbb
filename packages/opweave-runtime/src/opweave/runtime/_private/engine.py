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
from .inprocess import InProcessCluster
from .options import DecodeStep, Kernels
from .stepping import StepDriver, StepItem
from .stop_tokens import stop_token_ids

UNBOUNDED_RUNNING = 256  # slots of a LocalModel without max_running: requests past it wait


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

    The scheduler feeds the runtime's one driver (:class:`~.stepping.StepDriver`) over an
    in-process cluster (:class:`~.inprocess.InProcessCluster`): one rank that runs every
    segment with the same request sync and iteration runners as a plan's ranks. ``cuts``
    (indices into :func:`operator_sequence`) split the model into consecutive segments whose
    activations cross each cut packed, as a pipeline's sends would; the tokens must not change.
    ``decode_step`` is how decode steps run (:class:`~.options.DecodeStep`); a static one has
    ``max_running`` rows, which it then needs. ``kernels``: the runtime's own, or vLLM's
    (:class:`~.options.Kernels`).

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
        if step.static and max_running is None:
            raise ValueError(f"decode_step {step} has a row per request: give max_running")
        self.cluster = InProcessCluster(
            model_dir,
            slots=max_running or UNBOUNDED_RUNNING,
            cuts=cuts,
            device=device,
            dtype=dtype,
            decode_step=step,
            kernels=Kernels(kernels),
        )
        self.driver = StepDriver(self.cluster)
        self.module = self.cluster.rank.module  # every operator, one segment per cut
        self.segments = self.cluster.rank.segments  # each segment's operators
        # what runs on another library's kernels, "<layer>.<operator>[.<part>]:<kernel>" each
        self.kernels = self.module.kernels
        self.arch = self.module.arch
        self.stop_token_ids = stop_token_ids(self.arch, model_dir)
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

        Generation stops at ``max_new_tokens`` or a stop token (by default the config's EOS ids
        and those of its ``generation_config.json``).
        """
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.running or any(g.request_id == rid for g in self.waiting):
            raise RequestStateError(f"request id {rid!r} is already in use")
        stops = frozenset(self.stop_token_ids if stop_token_ids is None else stop_token_ids)
        self.waiting.append(Generation(rid, list(prompt_token_ids), max_new_tokens, stops))
        return rid

    def abort(self, request_id: str) -> Generation:
        """Stop a running request now and free its state; returns it as it stands."""
        gen = self.running.pop(request_id)
        self.driver.drop(request_id)
        self.driver.flush()
        return gen

    @property
    def weight_bytes(self) -> int:
        return self.module.weight_bytes

    def state_bytes(self) -> int:
        """Per-request state held across all segments (KV caches, recurrent states)."""
        return self.module.state_bytes()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[Generation]:
        """One iteration: prefill newly admitted requests, decode running ones; return finished
        (their state freed)."""
        driver = self.driver
        while self.waiting and len(self.running) < driver.capacity:
            gen = self.waiting.popleft()
            driver.add(gen.request_id, gen.prompt_token_ids)
            self.running[gen.request_id] = gen
        if not self.running:
            return []
        items = []
        for rid, gen in self.running.items():
            known = len(driver.requests[rid].token_ids)
            start = 0 if not gen.token_ids else known - 1  # the prompt, or the last token
            items.append(StepItem(rid, start, known - start))
        sampled = driver.step(items)
        finished = []
        for rid, gen in list(self.running.items()):
            token = sampled[rid]
            gen.token_ids.append(token)
            if token in gen.stop_token_ids:
                gen.finish_reason = "stop"
            elif len(gen.token_ids) >= gen.max_new_tokens:
                gen.finish_reason = "length"
            if gen.finish_reason is not None:
                driver.drop(rid)
                del self.running[rid]
                finished.append(gen)
        if finished:
            driver.flush()  # their state, now
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
