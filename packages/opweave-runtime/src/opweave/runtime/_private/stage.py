"""A stage: some operators of one model, loaded from one checkpoint and run in sequence."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .batch import TokenBatch
from .config import ModelSpec, parse_config
from .graph import OpRef, build_operator, operator_sequence
from .ops import Operator, StatefulOperator
from .weights import Checkpoint


class StageModule:
    """The operators a stage worker owns, e.g. a slice of :func:`operator_sequence`.

    Only the listed operators' tensors are read from disk, so a stage's memory and load time scale
    with its share of the model. Per-request state lives in the stateful operators (``core_attn``);
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
    ) -> None:
        spec = parse_config(model_dir)
        if dtype is not None:
            spec = dataclasses.replace(spec, dtype=dtype)
        self.spec: ModelSpec = spec
        self.checkpoint = Checkpoint(model_dir)
        self.refs: tuple[OpRef, ...] = tuple(OpRef(*ref) for ref in ops)
        self.operators: list[Operator] = [
            build_operator(spec, self.checkpoint, ref, device) for ref in self.refs
        ]
        self.checkpoint.close()

    @classmethod
    def whole_model(cls, model_dir: str | Path, **kwargs: object) -> StageModule:
        """All operators of the model in one stage (the colocated plan)."""
        return cls(model_dir, operator_sequence(model_dir), **kwargs)  # type: ignore[arg-type]

    @property
    def _stateful(self) -> list[StatefulOperator]:
        # Derived on use: an operator may be swapped for an equivalent one (e.g. kernel-backed).
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

    def admit(self, request_ids: str | Sequence[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            for op in self._stateful:
                op.admit(rid)

    def free(self, request_ids: str | Sequence[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            for op in self._stateful:
                op.free(rid)

    @torch.inference_mode()
    def forward(self, batch: TokenBatch) -> TokenBatch:
        for op in self.operators:
            batch = op(batch)
        return batch

    __call__ = forward
