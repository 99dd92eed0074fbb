"""A stage: some operators of one model, loaded from one checkpoint and run in sequence."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from opweave.costmodel import ModelSpec

from ..errors import OpWeaveRuntimeError
from .batch import TokenBatch
from .decode import StaticStep, is_decode, why_not_static
from .expert_parallel import EPComm, ExpertShard
from .graph import OpRef, compute_dtype, model_spec, operator_from, operator_sequence
from .kernels import KernelSet
from .mlp import Experts
from .ops import OpContext, Operator, StatefulOperator, share_slabs
from .sequence import run_ops
from .tensor_parallel import Shard, TPComm
from .weights import Checkpoint


class StageModule:
    """The operators a stage worker owns, e.g. a slice of :func:`operator_sequence`.

    Only the listed operators' tensors are read from disk (with ``shard``, only this
    tensor-parallel rank's slices of them), so a stage's memory and load time scale with its
    share of the model. Per-request state lives in the stateful operators (``core_attn``);
    :meth:`admit` and :meth:`free` reach all of them.

    Example (``model_dir`` from :func:`write_tiny_model`)::

        seq = operator_sequence(model_dir)
        first_half = StageModule(model_dir, seq[: len(seq) // 2])
    """

    def __init__(
        self,
        model_dir: str | Path,
        ops: Iterable[tuple[int | None, str]],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        shard: Shard | None = None,
        comm: TPComm | None = None,
        model: ModelSpec | None = None,
        kernels: KernelSet | None = None,
        ep: EPComm | None = None,
        experts: ExpertShard | None = None,
    ) -> None:
        self.model: ModelSpec = model or model_spec(model_dir)
        compute = compute_dtype(self.model, dtype)
        if kernels is not None:
            kernels.check(torch.device(device), compute)
        self.checkpoint = Checkpoint(model_dir, self.model.precision)
        ctx = OpContext(
            self.model.arch,
            self.checkpoint,
            torch.device(device),
            compute,
            shard or Shard(),
            comm,
            kernels,
            torch.float8_e4m3fn if self.model.precision.kv_fp8 else None,
            ep,
            experts,
        )
        self.comm = comm
        self.ep = ep
        self.refs: tuple[OpRef, ...] = tuple(OpRef(*ref) for ref in ops)
        self.operators: list[Operator] = [operator_from(self.model, ctx, r) for r in self.refs]
        self.checkpoint.close()
        # what runs on another library's kernels, "<layer>.<operator>[.<part>]:<kernel>" each
        self.kernels: list[str] = list(kernels.switched) if kernels is not None else []
        self._static: tuple[int, str | None] | None = None
        self._steps: dict[tuple[int | None, int | None, int], StaticStep] = {}
        self.submissions = 0  # launches from Python so far (see run)

    @classmethod
    def whole_model(cls, model_dir: str | Path, **kwargs: object) -> StageModule:
        """All operators of the model in one stage (the colocated plan)."""
        return cls(model_dir, operator_sequence(model_dir), **kwargs)  # type: ignore[arg-type]

    @property
    def arch(self):  # -> opweave.costmodel.Architecture
        return self.model.arch

    @property
    def _stateful(self) -> list[StatefulOperator]:
        return [op for op in self.operators if isinstance(op, StatefulOperator)]

    @property
    def weight_bytes(self) -> int:
        """Resident weight bytes; a tensor two operators share (tied embedding) counts once."""
        sizes: dict[str, int] = {}
        for op in self.operators:
            sizes.update(op.weight_sizes)
        return sum(sizes.values())

    @property
    def request_ids(self) -> tuple[str, ...]:
        return self._stateful[0].request_ids if self._stateful else ()

    def state_bytes(self, request_id: str | None = None) -> int:
        return sum(op.state_bytes(request_id) for op in self._stateful)

    def admit(self, request_ids: str | Sequence[str], rows: Sequence[int] | None = None) -> None:
        """Admit requests, each in state row ``rows[i]`` (default: the lowest free rows)."""
        rids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if rows is not None and len(rows) != len(rids):
            raise ValueError("rows, when given, must name one state row per request")
        for i, rid in enumerate(rids):
            row = None if rows is None else rows[i]
            for op in self._stateful:
                op.admit(rid, row)
                row = op.row_of(rid)  # every layer holds the request in the same row

    def free(self, request_ids: str | Sequence[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            for op in self._stateful:
                op.free(rid)

    def import_state(self, request_id: str, length: int, tensors: Sequence[torch.Tensor]) -> None:
        """An admitted request's state after ``length`` tokens, computed by a prefill rank: its
        stateful layers' tensors in order (:meth:`.ops.StatefulOperator.state_layout` each)."""
        at = 0
        for op in self._stateful:
            n = len(op.state_layout(length))
            op.import_state(request_id, length, tensors[at : at + n])
            at += n
        if at != len(tensors):
            raise OpWeaveRuntimeError(
                f"request {request_id!r}: {len(tensors)} state tensors came for {at}"
            )

    def use_static_decode(
        self, *, rows: int = 0, tokens: int = 0, compile: str | None = None
    ) -> None:
        """Run decode steps static-shape (:mod:`.decode`), on state slabs sized up front for
        ``rows`` requests of ``tokens`` tokens (they grow if exceeded), and compiled with the
        torch.compile backend ``compile`` (None: eagerly)."""
        why = why_not_static(self.operators)
        if why is not None:
            raise OpWeaveRuntimeError(f"no static decode step: {why}; use --kernels opweave")
        share_slabs([op for op in self._stateful if op._slab_pool is None])
        for op in self._stateful:
            op.reserve(rows, tokens)
        self._static = (rows, compile)
        self._steps = {}

    @property
    def static_decode(self) -> str | None:
        """``None`` (per-request decode), ``"eager"`` or the compiler of the static step."""
        if self._static is None:
            return None
        return self._static[1] or "eager"

    @torch.inference_mode()
    def run(
        self,
        batch: TokenBatch,
        ops: slice = slice(None),
        *,
        size: int | None = None,
        place: Sequence[int] | None = None,
    ) -> TokenBatch:
        """Run ``ops`` (default all) of this stage's operators on ``batch``.

        With :meth:`use_static_decode`, a decode step runs as one static-shape step of ``size``
        rows (default: one per request) with request ``i`` at row ``place[i]``. Each call adds
        to :attr:`submissions` what it launched from Python: 1 for a compiled (native) step,
        one per operator otherwise.
        """
        chosen = self.operators[ops]
        # under EP a packed batch runs eagerly, as the data-parallel peers' prefills run: the
        # group's exchanges must be the same collectives on every rank (a decode step whose
        # rows every rank runs goes through run_rows)
        if self._static is not None and is_decode(batch.meta) and not self.expert_parallel:
            size = len(batch.meta.request_ids) if size is None else size
            step = self.decode_step(ops, size)
            self.submissions += 1 if step.native else len(chosen)
            return step(batch, place)
        self.submissions += len(chosen)
        return run_ops(chosen, batch, self.comm)

    @property
    def expert_parallel(self) -> bool:
        """Whether this stage's experts exchange rows with an expert-parallel group."""
        return self.ep is not None and any(isinstance(op, Experts) for op in self.operators)

    def idle(self, ops: slice) -> None:
        """Join the expert exchanges of ``ops`` without rows (no requests here this step)."""
        for op in self.operators[ops]:
            if isinstance(op, Experts) and op.ep is not None:
                op.idle()

    @torch.inference_mode()
    def run_rows(
        self,
        tensors: dict[str, torch.Tensor],
        ops: slice,
        *,
        request_ids: Sequence[str],
        context_lens: Sequence[int],
        place: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        """Run ``ops`` as one static decode step on inputs laid out in its rows
        (:meth:`.decode.StaticStep.run_rows`: ``size`` rows, request ``i`` in row ``place[i]``,
        padding elsewhere); the outputs keep that layout. Counts :attr:`submissions` as
        :meth:`run`."""
        if self._static is None:
            raise OpWeaveRuntimeError("run_rows needs use_static_decode first")
        size = next(iter(tensors.values())).shape[0]
        step = self.decode_step(ops, size)
        self.submissions += 1 if step.native else len(self.operators[ops])
        return step.run_rows(tensors, request_ids, context_lens, place)

    @torch.inference_mode()
    def warm_up(
        self,
        ops: slice,
        size: int,
        inputs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    ) -> dict[str, torch.Tensor]:
        """Build the static decode step of ``ops`` on ``size`` rows and run it once on padding
        rows only (:meth:`.decode.StaticStep.warm_up`): a compiled step compiles here, ahead of
        traffic. ``inputs``: the step's input tensors (dtype, shape past the row dimension).
        Returns its outputs, every row padding."""
        if self._static is None:
            raise OpWeaveRuntimeError("warm_up needs use_static_decode first")
        return self.decode_step(ops, size).warm_up(inputs)

    def decode_step(self, ops: slice, size: int) -> StaticStep:
        """The static decode step of ``ops`` on ``size`` rows (built at its first use)."""
        key = (ops.start, ops.stop, size)
        step = self._steps.get(key)
        if step is None:
            assert self._static is not None
            rows, compile = self._static
            step = self._steps[key] = StaticStep(
                self.operators[ops], self.comm, size, reserved_rows=rows, compile=compile
            )
        return step

    def forward(self, batch: TokenBatch) -> TokenBatch:
        return self.run(batch)

    __call__ = forward
