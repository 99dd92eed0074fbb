"""A step-driven engine over a plan's segments, for an external scheduler (vLLM's) to drive.

This module imports nothing from vLLM: the executor (:mod:`._executor`) translates each of vLLM's
scheduler outputs into calls on :class:`StepEngine` -- forget finished requests, register new
ones, run one ragged forward over ``(request, first token, token count)`` items -- and samples the
returned logits with each request's sampling parameters.

Two pipelines implement the same small interface (:class:`Pipeline`): :class:`PlanPipeline`
runs every segment of the plan as one :class:`~opweave.runtime.StageModule` in this process,
crossing each segment boundary through :func:`~opweave.runtime.pack` /
:func:`~opweave.runtime.unpack` (the ``inprocess`` mode, and the colocated default without a
plan), and
:class:`~._workers.WorkerPool` runs each plan owner in its own worker process (the default for a
plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from .._private.batch import BatchMeta, TokenBatch, pack, unpack
from .._private.config import ModelSpec
from .._private.graph import OpRef, operator_sequence
from .._private.stage import StageModule
from ..errors import PlanMismatchError, RequestStateError


def load_plan(plan: Any) -> Any:  # -> opweave.costmodel.Plan | None
    """A plan from a ``Plan``, its JSON dict, a path to a plan file, or ``None`` (colocated)."""
    from opweave.costmodel import ConfigError, Plan

    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.model_validate(plan)
    path = Path(plan)
    if not path.is_file():
        raise ConfigError(f"opweave plan file {path} does not exist")
    return Plan.model_validate_json(path.read_text())


@dataclass(frozen=True)
class PlanLayout:
    """A plan cut into its segments, in model order: each segment's operators and owner."""

    plan: Any  # opweave.costmodel.Plan | None
    groups: list[list[OpRef]]
    owners: list[int]
    labels: list[str]  # "L0.embed..L0.o_proj" per segment, for messages

    def owner_stages(self, owner: int) -> str:
        """``L0.attn_norm..L0.o_proj, L1.attn_norm..L1.o_proj``: what one owner runs."""
        return ", ".join(lbl for lbl, o in zip(self.labels, self.owners, strict=True) if o == owner)


def plan_layout(model_dir: str | Path, plan: Any = None) -> PlanLayout:
    """The plan's segments over the model in ``model_dir`` (one colocated segment without one)."""
    seq = operator_sequence(model_dir)
    plan = load_plan(plan)
    if plan is None:
        return PlanLayout(None, [list(seq)], [0], [_label(list(seq))])
    from opweave.costmodel import load_model

    from .._private.placement import Placement, check_plan

    model = load_model(model_dir)
    check_plan(plan, model)
    placement = Placement(plan, model)
    groups = [[OpRef(op.layer, op.name) for op in s.ops] for s in placement.segments]
    flat = [ref for g in groups for ref in g]
    if flat != list(seq):
        raise PlanMismatchError(
            "the plan's segments do not cover the model's operator sequence in order"
        )
    if groups[-1][-1].name != "sample":
        raise PlanMismatchError("the last segment must end with the sample operator")
    owners = [s.owner for s in placement.segments]
    return PlanLayout(plan, groups, owners, [_label(g) for g in groups])


def _label(group: list[OpRef]) -> str:
    def one(ref: OpRef) -> str:
        return ref.name if ref.layer is None else f"L{ref.layer}.{ref.name}"

    return one(group[0]) if len(group) == 1 else f"{one(group[0])}..{one(group[-1])}"


class Pipeline(Protocol):
    """What :class:`StepEngine` and the executor need from the stages, wherever they run."""

    spec: ModelSpec
    kernels: list[list[str]]  # per stage or worker: operators switched to vLLM kernels

    @property
    def global_batch(self) -> int | None: ...

    @property
    def num_segments(self) -> int: ...

    def admit(self, request_id: str) -> None: ...

    def free(self, request_id: str) -> None: ...

    def logits(self, batch: TokenBatch) -> torch.Tensor: ...

    def flush(self) -> None:
        """Push pending state changes (frees) to the stages now, with no forward to carry them."""

    def check(self) -> None:
        """Raise if the stages can no longer serve (a worker died)."""

    def close(self) -> None: ...


class PlanPipeline:
    """The plan's segments, in model order, as consecutive stages of one process.

    Without a plan the whole model is one stage (the colocated plan).
    """

    def __init__(
        self,
        model_dir: str | Path,
        plan: Any = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        kernels: str = "opweave",
    ) -> None:
        from ._kernels import KERNELS_KEY, apply_kernel_choice

        self.layout = plan_layout(model_dir, plan)
        self.plan = self.layout.plan
        self.owners = self.layout.owners
        self.stages = [
            StageModule(model_dir, g, dtype=dtype, device=device) for g in self.layout.groups
        ]
        # operators switched to vLLM kernels ("<layer>.<op>:<kernel>"), per stage
        self.kernels = [apply_kernel_choice(st, {KERNELS_KEY: kernels}) for st in self.stages]
        self.spec = self.stages[0].spec
        self.device = torch.device(device)

    @property
    def num_segments(self) -> int:
        return len(self.stages)

    def flush(self) -> None:
        pass  # frees took effect at once

    def check(self) -> None:
        pass  # nothing here can die on its own

    def close(self) -> None:
        for stage in self.stages:
            for rid in stage.request_ids:
                stage.free(rid)

    @property
    def global_batch(self) -> int | None:
        """Requests the plan's attention owners hold at once (``None``: no limit, no plan)."""
        return None if self.plan is None else int(self.plan.global_batch)

    def admit(self, request_id: str) -> None:
        for stage in self.stages:
            stage.admit(request_id)

    def free(self, request_id: str) -> None:
        for stage in self.stages:
            stage.free(request_id)

    @torch.inference_mode()
    def logits(self, batch: TokenBatch) -> torch.Tensor:
        """Run every segment up to (not including) ``sample``; logits of each request's last row."""
        batch = batch.replace(token_ids=batch["token_ids"].to(self.device))
        for i, stage in enumerate(self.stages):
            if i:
                batch = unpack(pack(batch))  # a segment boundary: one message on the wire
            ops = stage.operators[:-1] if i == len(self.stages) - 1 else stage.operators
            for op in ops:
                batch = op(batch)
        return batch["logits"]


@dataclass
class _Request:
    token_ids: list[int]  # prompt, then every sampled token
    params: Any  # the scheduler's sampling parameters (opaque here)
    computed: int = 0  # tokens held in the stages' per-request state
    generator: torch.Generator | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkItem:
    """Run ``count`` tokens of ``request_id`` starting at position ``start``."""

    request_id: str
    start: int
    count: int


class StepEngine:
    """Per-request token history and state on top of a :class:`PlanPipeline`.

    The external scheduler decides which tokens to run; positions it asks for that the stages do
    not yet hold (a prefix-cache hit, a resumed request) are recomputed here, positions behind
    what the stages hold (a preempted request restarted from scratch) drop the state first.
    """

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: Any = None) -> None:
        if request_id in self.requests:
            self.drop(request_id)
        if not prompt_token_ids:
            raise RequestStateError(f"request {request_id!r} has an empty prompt")
        self.requests[request_id] = _Request(list(prompt_token_ids), params)
        self.pipeline.admit(request_id)

    def drop(self, request_id: str) -> None:
        """Forget a request and free its state on every stage (unknown ids are ignored)."""
        if self.requests.pop(request_id, None) is not None:
            self.pipeline.free(request_id)

    def reset_state(self, request_id: str) -> None:
        """Keep the request's tokens but drop its cached state (it will be recomputed)."""
        req = self.requests[request_id]
        self.pipeline.free(request_id)
        self.pipeline.admit(request_id)
        req.computed = 0

    def append_token(self, request_id: str, token: int) -> None:
        self.requests[request_id].token_ids.append(int(token))

    def run(self, items: Sequence[WorkItem]) -> tuple[list[str], torch.Tensor | None]:
        """One ragged forward; returns the ids that reached their last known token, and their
        logits ``[len(ids), vocab]`` (rows for requests still mid-prompt are dropped)."""
        if not items:
            self.pipeline.flush()
            return [], None
        rids, qlens, clens, feed, sampling = [], [], [], [], []
        for item in items:
            req = self.requests.get(item.request_id)
            if req is None:
                raise RequestStateError(f"request {item.request_id!r} was never added")
            if item.start < req.computed:
                self.reset_state(item.request_id)
            end = item.start + item.count
            if end > len(req.token_ids):
                raise RequestStateError(
                    f"request {item.request_id!r}: asked to run up to token {end}, "
                    f"only {len(req.token_ids)} are known"
                )
            lo = req.computed
            rids.append(item.request_id)
            qlens.append(end - lo)
            clens.append(lo)
            feed += req.token_ids[lo:end]
            req.computed = end
            sampling.append(end == len(req.token_ids))
        meta = BatchMeta(tuple(rids), tuple(qlens), tuple(clens))
        ids = torch.tensor(feed, dtype=torch.int64)
        logits = self.pipeline.logits(TokenBatch(meta, {"token_ids": ids}))
        keep = [i for i, s in enumerate(sampling) if s]
        return [rids[i] for i in keep], logits[keep]


def sample(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> int:
    """One token from one row of logits: greedy (the runtime's argmax) at temperature 0."""
    logits = logits.float()
    if temperature <= 1e-5:
        return int(torch.argmax(logits, dim=-1))
    logits = logits / temperature
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p > top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
