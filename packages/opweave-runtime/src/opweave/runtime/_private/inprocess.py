"""A plan's ranks without processes: one rank, in this process, that runs every segment.

:class:`InProcessCluster` is what the driver (:class:`~.stepping.StepDriver`) stands on for the
single-process model (:class:`~.engine.LocalModel`): it takes each :class:`~.work.Work` and
runs it at once, through the same request sync, iteration runners (per-request, static rows;
chosen at the warm-up as a rank chooses) and token forwarding a rank uses. Its segments are the
operator sequence cut anywhere (``cuts``); the activations between them cross a loopback
transport that packs them as a send would (:class:`LoopbackTransport`), so a pipeline's cuts
are checked in one process.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import OpWeaveRuntimeError, RequestStateError
from .batch import TokenBatch, byte_view, pack
from .graph import operator_sequence
from .kernels import KernelSet
from .messages import Prefill, Result
from .options import DecodeStep, Kernels
from .placement import RankInfo
from .rankcore import Clock, RankCore, RankRequest, Rows
from .runners import IterationRunner, PerRequestRunner, RowsRunner
from .schedule import Compute, Message, tag
from .stage import StageModule
from .stepping import submit_warm_up
from .work import GREEDY, Work


class LoopbackTransport:
    """Messages from a rank to itself: packed batches and rows, copied as a wire would."""

    native = None
    spin_s = 0.0

    def __init__(self) -> None:
        self._queues: dict[int, deque[torch.Tensor]] = {}
        self.comm_s = 0.0
        self.bytes_sent = 0
        self.messages_sent = 0

    def _put(self, message: Message, data: torch.Tensor) -> None:
        self._queues.setdefault(message.tag, deque()).append(data)
        self.bytes_sent += data.numel()
        self.messages_sent += 1

    def _take(self, message: Message, what: str) -> torch.Tensor:
        queue = self._queues.get(message.tag)
        if not queue:
            raise OpWeaveRuntimeError(f"nothing was sent for {what}")
        return queue.popleft()

    def send(self, message: Message, batch: TokenBatch, epoch: int) -> None:
        self._put(message, pack(batch))

    def recv(self, message: Message, what: str) -> torch.Tensor:
        return self._take(message, what)

    def send_rows(self, message: Message, parts: Sequence[torch.Tensor], epoch: int) -> None:
        self._put(message, torch.cat([byte_view(t).reshape(-1) for t in parts]))

    def recv_rows(self, message: Message, into: Sequence[torch.Tensor], what: str) -> None:
        buf, offset = self._take(message, what), 0
        for t in into:
            raw = byte_view(t).reshape(-1)
            raw.copy_(buf[offset : offset + raw.numel()])
            offset += raw.numel()

    def reap(self, before_epoch: int) -> None:
        pass

    def flush(self) -> None:
        pass


class _Replies:
    """The in-process rank's control channel: its results, straight to the cluster."""

    def __init__(self, results: deque[Result]) -> None:
        self.results = results

    def send_all(self, messages: Sequence[Result]) -> None:
        self.results.extend(messages)

    def send(self, message: Result) -> None:
        self.results.append(message)


class _Placement:
    """One microbatch of ``slots`` slots (what the driver asks of a placement)."""

    def __init__(self, slots: int) -> None:
        self.global_batch = slots
        self.microbatches = 1
        self.prefill_replicas = 0  # no prefill pool: the rank prefills

    def microbatch_slots(self, k: int) -> range:
        return range(self.global_batch)


class InProcessRank(RankCore):
    """One rank holding every segment of ``cuts``, run by :class:`InProcessCluster`."""

    def __init__(
        self,
        model_dir: str | Path,
        cuts: Sequence[int],
        slots: int,
        *,
        device: torch.device,
        dtype: torch.dtype | None,
        decode_step: DecodeStep,
        kernels: Kernels,
    ) -> None:
        seq = operator_sequence(model_dir)
        bounds = [0, *sorted(cuts), len(seq)]
        if len(set(bounds)) != len(bounds) or bounds != sorted(bounds):
            raise ValueError(
                f"cuts must be distinct and inside 1..{len(seq) - 1}, got {list(cuts)}"
            )
        self.rank = 0
        self.info = RankInfo(0, 0, 0, 0, 1, 0, (0,))
        self.device = device
        self.group = None
        self.comm = None
        self.ep = None
        self.transport = LoopbackTransport()  # type: ignore[assignment]
        self.module = StageModule(
            model_dir,
            seq,
            device=device,
            dtype=dtype,
            kernels=KernelSet(kernels, gemms_only=decode_step.static),
        )
        if decode_step.static:
            self.module.use_static_decode(rows=slots, compile=decode_step.compiler)
        self.segments = [range(lo, hi) for lo, hi in itertools.pairwise(bounds)]
        self.actions = _actions(self.segments, range(slots))
        self.mine = range(slots)
        self.results: deque[Result] = deque()
        self.control = _Replies(self.results)  # type: ignore[assignment]
        self.held: dict[str, RankRequest] = {}
        self.clock = Clock()
        self.inputs = {}
        self.runner: IterationRunner = PerRequestRunner(self)
        self.works: dict[int, Work] = {}
        self._synced: set[int] = set()

    def work(self, i: int, k: int) -> Work:
        work = self.works[i]
        if i in self._synced:
            return work
        self._synced.add(i)
        for rid in work.free:
            if rid in self.held:
                self.module.free(rid)
                del self.held[rid]
        for j in work.requests_in(self.mine):
            rid, ctx = work.request_ids[j], work.context_lens[j]
            if ctx == 0:
                if rid in self.held:
                    self.module.free(rid)
                self.module.admit(rid, rows=[work.slots[j]])
                self.held[rid] = RankRequest(work.params.get(rid, GREEDY))
            elif rid not in self.held:
                raise RequestStateError(f"no state for request {rid!r} at context {ctx}")
        return work

    @torch.inference_mode()
    def warm(self, request_ids: Sequence[str]) -> None:
        """The rows of each segment's static decode step, laid out from the warm-up's inputs,
        and the runner that uses them (as a rank's warm-up, without a program)."""
        rows_in: dict[tuple[int, int], tuple[Rows, Rows]] = {}
        rows_pad: dict[tuple[int, int], Rows] = {}
        for action in self.actions:
            key = (action.segment, action.microbatch)
            inputs = self.inputs[key]
            size = len(action.slots)
            outputs = self.module.warm_up(self.ops(action, sample=action.last), size, inputs)
            rows_pad[key] = {name: torch.zeros_like(t) for name, t in outputs.items()}
            rows_in[key] = tuple(  # type: ignore[assignment]
                {
                    name: torch.zeros((size, *shape), dtype=dt, device=self.device)
                    for name, (dt, shape) in inputs.items()
                }
                for _ in range(2)
            )
        self.runner = RowsRunner(self, rows_in, rows_pad)
        for rid in request_ids:
            if rid in self.held:
                self.module.free(rid)
                del self.held[rid]


def _actions(segments: Sequence[range], slots: range) -> list[Compute]:
    """The schedule of one rank running every segment for one microbatch: each segment's
    outputs go to the next (itself), the last one's sampled tokens to the first."""
    n = len(segments)
    out = []
    for s, ops in enumerate(segments):
        first, last = s == 0, s == n - 1
        into = Message(0, slots, tag(s, 0, 1))
        onward = Message(0, slots, tag(s + 1, 0, 1))
        feed = Message(0, slots, tag(0, 0, 1))
        out.append(
            Compute(
                s,
                0,
                slots,
                ops,
                () if first else (into,),
                () if last else (onward,),
                first,
                last,
                (feed,) if last else (),
                (feed,) if first else (),
            )
        )
    return out


class InProcessCluster:
    """The driver's view of :class:`InProcessRank`: each work runs when it is submitted."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        slots: int,
        cuts: Sequence[int] = (),
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        decode_step: DecodeStep = DecodeStep.PER_REQUEST,
        kernels: Kernels = Kernels.OPWEAVE,
    ) -> None:
        self.rank = InProcessRank(
            model_dir,
            cuts,
            slots,
            device=torch.device(device),
            dtype=dtype,
            decode_step=decode_step,
            kernels=kernels,
        )
        self.placement = _Placement(slots)
        self.first_iteration = 0
        self.static_decode = decode_step.static
        self._iteration = 0
        if self.static_decode:
            rids = submit_warm_up(self)
            self.rank.warm(rids)
            self.first_iteration = 1

    @property
    def global_batch(self) -> int:
        return self.placement.global_batch

    @property
    def microbatches(self) -> int:
        return 1

    def result_parts(self, microbatch: int) -> int:
        return 1

    prefill_parts = 0  # no prefill pool

    def prefill(self, replica: int, prompts: Sequence[Prefill]) -> None:
        raise OpWeaveRuntimeError("an in-process run has no prefill pool")

    def submit(self, work: Work) -> None:
        rank, i = self.rank, work.iteration
        rank.works[i] = work
        try:
            rank.runner.run(i, set())
        finally:
            del rank.works[i]
            rank._synced.discard(i)

    def result(self, timeout_s: float | None = None) -> Result:
        return self.rank.results.popleft()
