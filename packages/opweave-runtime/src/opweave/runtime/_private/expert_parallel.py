"""Expert parallelism with data-parallel attention: the wide-EP layout of an MoE owner.

A plan replica of an owner with ``ep = dp`` (at ``tp = 1``) is ``ep`` ranks, each an attention
replica with its own slice of the replica's slots (see :mod:`.placement`) and each holding
``num_experts / ep`` consecutive routed experts of every MoE layer (it reads only theirs from the
checkpoint). Everything else of the owner (embedding, attention, router, shared expert, dense
layers, head) is replicated and runs on the rank's own rows.

At a layer's ``experts`` the group exchanges rows: **dispatch** gives every rank every rank's rows
with their routing (an all-gather, in rank order), each rank computes what its own experts add to
each row, and **combine** sums those partial outputs over the group and hands each rank back its
own rows (an all-reduce of the gathered rows, of which a rank keeps its part). A rank with no
requests in a step still joins with zero rows, and the row counts travel first, so ranks of one
group may run different numbers of rows; inside a compiled static decode step the counts are the
step's rows, equal on every rank of the group (:func:`.placement.check_expert_parallel`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..errors import ShardingError


@dataclass
class EPComm:
    """This rank's place in its expert-parallel group and the group's row exchanges; time
    spent in them adds to ``comm_s``."""

    rank: int
    size: int
    group: object
    comm_s: float = field(default=0.0)

    def experts(self, num_experts: int, what: str) -> tuple[int, int]:
        """``[lo, hi)``: the routed experts this rank holds."""
        if num_experts % self.size:
            raise ShardingError(f"{what}: {num_experts} experts do not split over ep {self.size}")
        per = num_experts // self.size
        return self.rank * per, (self.rank + 1) * per

    def dispatch(self, local: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Every rank's rows of ``local`` (``[n_r, ...]``), concatenated in rank order, and
        each rank's ``n_r``."""
        if torch.compiler.is_compiling():  # a static step: every rank has as many rows
            n = local.shape[0]
            blocks = [torch.zeros_like(local) for _ in range(self.size - 1)]
            blocks.insert(self.rank, local)
            # an all-reduce of blocks that are zero but for each rank's own (exact): inductor's
            # CPU wrapper cannot call all_gather_into_tensor on every torch a rank may run
            full = funcol.all_reduce(torch.cat(blocks), "sum", self.group)  # type: ignore[arg-type]
            return full, [n] * self.size
        start = time.perf_counter()
        count = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
        counts_t = [torch.empty_like(count) for _ in range(self.size)]
        dist.all_gather(counts_t, count, group=self.group)  # type: ignore[arg-type]
        counts = [int(c.item()) for c in counts_t]
        most = max(counts)
        if most == 0:
            self.comm_s += time.perf_counter() - start
            return local, counts
        padded = local.new_zeros((most, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)  # type: ignore[arg-type]
        full = torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])
        self.comm_s += time.perf_counter() - start
        return full, counts

    def combine(self, partial: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The sum over the group of every rank's ``partial`` (rows as :meth:`dispatch` gave
        them), this rank's rows of it."""
        lo = sum(counts[: self.rank])
        hi = lo + counts[self.rank]
        if torch.compiler.is_compiling():
            return funcol.all_reduce(partial, "sum", self.group)[lo:hi]  # type: ignore[arg-type]
        if not partial.shape[0]:
            return partial
        start = time.perf_counter()
        partial = partial.contiguous()
        dist.all_reduce(partial, group=self.group)  # type: ignore[arg-type]
        self.comm_s += time.perf_counter() - start
        return partial[lo:hi]
