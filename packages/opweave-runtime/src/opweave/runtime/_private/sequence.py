"""A segment's operators run in order, with tensor parallelism's layouts kept track of."""

from __future__ import annotations

from collections.abc import Sequence

from .batch import TokenBatch
from .ops import Operator
from .tensor_parallel import Layout, TPComm


def run_ops(ops: Sequence[Operator], batch: TokenBatch, comm: TPComm | None) -> TokenBatch:
    """Run a segment's operators in order; with TP, keep track of which tensors are sharded
    and return full tensors."""
    if comm is None:
        for op in ops:
            batch = op(batch)
        return batch
    layouts: dict[str, Layout] = {}
    for op in ops:
        tensors = dict(batch.tensors)
        for name in [n for n in layouts if n not in op.tp_in and n not in op.tp_pass]:
            tensors[name] = comm.gather(tensors[name], layouts.pop(name))
        for name, lay in op.tp_in.items():
            if name in tensors and name not in layouts:
                tensors[name] = lay.local(tensors[name], comm.shard)
                layouts[name] = lay
        batch = op(TokenBatch(batch.meta, tensors, batch.step))
        kept = {n: lay for n, lay in layouts.items() if n in op.tp_pass}
        layouts = {n: op.tp_out[n] for n in batch.tensors if n in op.tp_out}
        layouts.update((n, lay) for n, lay in kept.items() if n in batch.tensors)
    if layouts:
        tensors = dict(batch.tensors)
        for name, lay in layouts.items():
            tensors[name] = comm.gather(tensors[name], lay)
        batch = TokenBatch(batch.meta, tensors, batch.step)
    return batch
