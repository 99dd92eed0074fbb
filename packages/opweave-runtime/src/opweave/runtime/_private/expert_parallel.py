"""Expert parallelism and data-parallel attention: how an MoE owner's replica shares its experts.

A plan replica of an owner spans ``tp x dp`` GPUs (the cost model's ``Parallelism``): ``dp``
attention replicas, each a tensor-parallel group of ``tp`` ranks with its own slice of the
replica's slots (see :mod:`.placement`). Each MoE layer's routed experts are sharded over the
whole replica: ``ep`` sets of ``tp x dp / ep`` GPUs, set ``s`` holding the consecutive experts
``[s E / ep, (s + 1) E / ep)`` (rounded down; where ``ep`` does not divide the ``E`` experts
some sets hold one fewer), each expert's intermediate channels split over the GPUs
of its set (:class:`ExpertShard`; each rank reads only its experts' channels from the
checkpoint). Everything else of the owner (embedding, attention, router, shared expert, dense
layers, head) runs in the attention replica, tensor-parallel over its ``tp`` ranks.

With ``dp = 1`` every rank of the replica already holds every row: each adds its experts' share
and the tensor-parallel all-reduce that ends the layer sums them (vLLM's expert parallelism without
data parallelism). With ``dp > 1`` the replica's ranks exchange rows at a layer's ``experts``, in
one of two forms (:class:`EPComm`):

- **all-to-all** (``ep = tp x dp``: one whole expert set per GPU, eager steps): an attention
  replica's rows are shared out over its TP ranks, each (row, choice) pair goes to the rank
  holding its expert (**dispatch**, after every rank learns
  every other's pair counts), that rank applies the expert and its routing weight, and the
  results go back the same way (**combine**) to be added to their rows in ascending expert order,
  as transformers adds them, and the TP ranks gather their rows back (each row leaves the
  attention replica once);
- **gathered** (every other layout, and inside a compiled or traced static decode step, whose
  shapes cannot depend on the routing): every attention replica's rows with their routing go to
  every rank of the replica (its TP ranks each sending their share), each rank adds its own
  experts' share, and an all-reduce over the replica sums the shares, each attention replica
  keeping its own rows (as vLLM's default all-gather / reduce-scatter exchange); in a
  static step the rows are equal on every attention replica
  (:func:`.placement.check_expert_parallel`).

Every rank of a replica runs the same form at the same step (a step is a decode step on every
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


@dataclass(frozen=True)
class ExpertShard:
    """The routed experts, and their intermediate channels, that GPU ``index`` of a replica's
    ``size`` holds, its experts sharded over ``ep`` sets of ``size / ep`` GPUs.

    >>> s = ExpertShard(index=5, size=8, ep=4)  # 4 sets of 2 GPUs
    >>> s.experts(16, "L0.experts"), s.channels(64, "L0.experts")
    ((8, 12), (32, 64))
    """

    index: int = 0
    size: int = 1
    ep: int = 1

    @property
    def expert_tp(self) -> int:
        """GPUs that split each expert's channels: those of one expert set."""
        return self.size // self.ep

    def experts(self, num_experts: int, what: str) -> tuple[int, int]:
        """``[lo, hi)``: the routed experts this GPU holds (all of them at ``ep = 1``); where
        ``ep`` does not divide them, sets hold ``floor`` or ``ceil(num_experts / ep)``."""
        if num_experts < self.ep:
            raise ShardingError(
                f"{what}: {num_experts} experts are fewer than ep {self.ep}; choose a smaller ep"
            )
        s = self.index // self.expert_tp
        return s * num_experts // self.ep, (s + 1) * num_experts // self.ep

    def channels(self, intermediate: int, what: str) -> tuple[int, int] | None:
        """``[lo, hi)`` of each held expert's intermediate channels (None: all of them)."""
        n = self.expert_tp
        if n == 1:
            return None
        if intermediate % n:
            raise ShardingError(
                f"{what}: expert intermediate size {intermediate} does not split over the "
                f"{n} GPUs of each expert set (tp x dp / ep); choose a larger ep"
            )
        c = self.index % n
        return c * intermediate // n, (c + 1) * intermediate // n


def expert_sets(num_experts: int, ep: int) -> torch.Tensor:
    """The set holding each routed expert, as :meth:`ExpertShard.experts` deals them out.

    >>> expert_sets(8, 3).tolist()
    [0, 0, 1, 1, 1, 2, 2, 2]
    """
    e = torch.arange(num_experts)
    return ((e + 1) * ep + num_experts - 1) // num_experts - 1


@dataclass
class EPComm:
    """This rank's place in its replica of ``size`` ranks (``tp`` per attention replica, the
    first of each sending that replica's rows) and the replica's row exchanges; time spent in
    them adds to ``comm_s``."""

    rank: int
    size: int
    group: object
    tp: int = 1
    shard: ExpertShard = field(default_factory=ExpertShard)
    tp_group: object | None = None  # this rank's attention replica's TP group (tp > 1)
    comm_s: float = field(default=0.0)

    @property
    def dp_rank(self) -> int:
        """This rank's attention replica within the plan replica."""
        return self.rank // self.tp

    @property
    def all_to_all_form(self) -> bool:
        """Whether eager steps dispatch pairs by all-to-all: one whole expert set per rank."""
        return self.shard.ep == self.size

    def tp_rows(self, n: int) -> tuple[int, int]:
        """``[lo, hi)`` of an attention replica's ``n`` rows this rank dispatches: its TP
        ranks share them out (each row leaves the replica once)."""
        t = self.rank % self.tp
        return t * n // self.tp, (t + 1) * n // self.tp

    def tp_sizes(self, n: int) -> list[int]:
        """How many of ``n`` rows each TP rank of an attention replica has (:meth:`tp_rows`)."""
        return [(t + 1) * n // self.tp - t * n // self.tp for t in range(self.tp)]

    def tp_assemble(self, part: torch.Tensor, n: int) -> torch.Tensor:
        """The attention replica's ``n`` rows from each TP rank's :meth:`tp_rows` ``part``."""
        if self.tp == 1 or n == 0:
            return part
        return self._all_gather_rows(part, self.tp_sizes(n), self.tp_group)

    def _all_gather_rows(self, part: torch.Tensor, sizes: list[int], group: object) -> torch.Tensor:
        """Every member's ``part`` of ``group`` (``sizes[r]`` rows from member ``r``),
        concatenated in member order: one all-gather of parts padded to the largest."""
        start = time.perf_counter()
        top = max(sizes)
        padded = torch.cat([part, part.new_zeros((top - part.shape[0], *part.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)  # type: ignore[arg-type]
        full = torch.cat([p[:c] for p, c in zip(parts, sizes, strict=True)])
        self.comm_s += time.perf_counter() - start
        return full

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

    def gather(self, local: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Eager steps: every attention replica's rows of ``local`` (any number each; each TP
        rank sends its :meth:`tp_rows`), concatenated in replica order, and each replica's
        count."""
        lo, hi = self.tp_rows(local.shape[0])
        part = local[lo:hi]
        sizes = [row[0] for row in self.counts(torch.tensor([hi - lo], device=local.device))]
        counts = [sum(sizes[d : d + self.tp]) for d in range(0, self.size, self.tp)]
        if max(sizes) == 0:
            return part, counts  # no rows anywhere in the replica
        return self._all_gather_rows(part, sizes, self.group), counts

    def dispatch(self, local: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Inside a compiled step: every attention replica's rows of ``local`` (as many on
        every rank; each TP rank sends its :meth:`tp_rows`, padded to one size), concatenated
        in replica order, and each replica's count."""
        n, group = local.shape[0], self.group
        lo, hi = self.tp_rows(n)
        top = -(-n // self.tp)
        part = local[lo:hi]
        if hi - lo < top:
            part = torch.cat([part, part.new_zeros((top - (hi - lo), *part.shape[1:]))])
        if part.device.type != "cpu":
            full = funcol.all_gather_tensor(part, 0, group)  # type: ignore[arg-type]
        else:
            blocks = [torch.zeros_like(part) for _ in range(self.size - 1)]
            blocks.insert(self.rank, part)
            # an all-reduce of blocks that are zero but for each rank's own (exact): inductor's
            # CPU wrapper cannot call all_gather_into_tensor on every torch a rank may run
            full = funcol.all_reduce(torch.cat(blocks), "sum", group)  # type: ignore[arg-type]
        if self.tp > 1:  # each TP rank's share of its replica's rows, without the padding
            blocks = full.view(self.size, top, *local.shape[1:])
            sizes = self.tp_sizes(n)
            full = torch.cat([blocks[r, : sizes[r % self.tp]] for r in range(self.size)])
        return full, [n] * (self.size // self.tp)

    def combine(self, partial: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The sum over the replica of every rank's ``partial`` (rows as :meth:`gather` or
        :meth:`dispatch` gave them), this attention replica's rows of it."""
        lo = sum(counts[: self.dp_rank])
        if torch.compiler.is_compiling():
            summed = funcol.all_reduce(partial, "sum", self.group)  # type: ignore[arg-type]
        elif partial.shape[0]:
            start = time.perf_counter()
            summed = partial.contiguous()
            dist.all_reduce(summed, group=self.group)  # type: ignore[arg-type]
            self.comm_s += time.perf_counter() - start
        else:
            summed = partial
        return summed[lo : lo + counts[self.dp_rank]]


def join_groups(
    tp_groups: Sequence[tuple[int, ...]],
    ep_groups: Sequence[tuple[int, ...]],
    rank: int,
    timeout_s: float,
) -> tuple[object | None, object | None]:
    """Create every process group of the run, TP groups then the data-parallel replicas'
    groups (torch.distributed wants every process to create every group, in one order, so every
    rank of either pool calls this); ``rank``'s TP group and replica group (or None)."""
    return new_groups(tp_groups, rank, timeout_s), new_groups(ep_groups, rank, timeout_s)
