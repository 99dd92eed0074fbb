"""Expert parallelism with data-parallel attention: the wide-EP layout of an MoE owner.

A plan replica of an owner with ``ep = dp`` (at ``tp = 1``) is ``ep`` ranks, each an attention
replica with its own slice of the replica's slots (see :mod:`.placement`) and each holding
``num_experts / ep`` consecutive routed experts of every MoE layer (it reads only theirs from the
checkpoint). Everything else of the owner (embedding, attention, router, shared expert, dense
layers, head) is replicated and runs on the rank's own rows.

At a layer's ``experts`` the group exchanges rows, in one of two forms:

- **all-to-all** (eager steps): each (row, choice) pair goes to the rank holding its expert
  (**dispatch**: :meth:`EPComm.all_to_all` after every rank learns every other's pair counts),
  that rank applies the expert and its routing weight, and the results go back the same way
  (**combine**) to be added to their rows in ascending expert order, as transformers adds them;
- **gathered** (inside a compiled or traced static decode step, whose shapes cannot depend on the
  routing): every rank's rows with their routing go to every rank (:meth:`EPComm.dispatch`), each
  adds its own experts' share, and the shares are summed back (:meth:`EPComm.combine`); the
  step's rows are equal on every rank of the group (:func:`.placement.check_expert_parallel`).

Every rank of a group runs the same form at the same step (a step is a decode step on every
rank or on none), and a rank with no requests in a step still joins with zero rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..errors import ShardingError
from .tensor_parallel import new_groups


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

    def counts(self, send: torch.Tensor) -> list[list[int]]:
        """Every rank's ``send`` (int64 rows for each rank of the group, on the rank's device),
        row ``r`` rank ``r``'s."""
        start = time.perf_counter()
        parts = [torch.empty_like(send) for _ in range(self.size)]
        dist.all_gather(parts, send, group=self.group)  # type: ignore[arg-type]
        matrix = [p.tolist() for p in parts]
        self.comm_s += time.perf_counter() - start
        return matrix

    def all_to_all(self, rows: torch.Tensor, matrix: list[list[int]]) -> torch.Tensor:
        """Send ``rows`` (``matrix[rank][r]`` of them, in order, to each rank ``r``) and
        receive from each rank ``r`` its ``matrix[r][rank]`` rows, in rank order."""
        send = matrix[self.rank]
        recv = [row[self.rank] for row in matrix]
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        if not any(any(row) for row in matrix):
            return out  # nothing moves anywhere in the group
        start = time.perf_counter()
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=self.group)  # type: ignore[arg-type]
        self.comm_s += time.perf_counter() - start
        return out

    def dispatch(self, local: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Inside a compiled step: every rank's rows of ``local`` (as many on every rank),
        concatenated in rank order, and each rank's count (the gathered form)."""
        n, group = local.shape[0], self.group
        if local.device.type != "cpu":
            return funcol.all_gather_tensor(local, 0, group), [n] * self.size  # type: ignore[arg-type]
        blocks = [torch.zeros_like(local) for _ in range(self.size - 1)]
        blocks.insert(self.rank, local)
        # an all-reduce of blocks that are zero but for each rank's own (exact): inductor's CPU
        # wrapper cannot call all_gather_into_tensor on every torch a rank may run
        full = funcol.all_reduce(torch.cat(blocks), "sum", group)  # type: ignore[arg-type]
        return full, [n] * self.size

    def combine(self, partial: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Inside a compiled step: the sum over the group of every rank's ``partial`` (rows as
        :meth:`dispatch` gave them), this rank's rows of it."""
        lo = sum(counts[: self.rank])
        summed = funcol.all_reduce(partial, "sum", self.group)  # type: ignore[arg-type]
        return summed[lo : lo + counts[self.rank]]


def join_groups(
    tp_groups: Sequence[tuple[int, ...]],
    ep_groups: Sequence[tuple[int, ...]],
    rank: int,
    timeout_s: float,
) -> tuple[object | None, EPComm | None]:
    """Create every process group of the run, TP groups then EP groups (torch.distributed
    wants every process to create every group, in one order, so every rank of either pool
    calls this); ``rank``'s TP group (or None) and its expert exchange (or None)."""
    tp = new_groups(tp_groups, rank, timeout_s)
    ep = new_groups(ep_groups, rank, timeout_s)
    mine = next((ranks for ranks in ep_groups if rank in ranks), None)
    return tp, None if mine is None else EPComm(mine.index(rank), len(mine), ep)
