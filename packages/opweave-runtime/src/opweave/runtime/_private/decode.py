"""The static-shape decode step: a segment's operators over a fixed number of rows.

A decode step (every request runs one new token after some cached ones) is where a serving
rank spends its time, and the per-request form of the operators (a Python loop over requests in
attention, the experts a batch happens to route to) makes its cost and its shapes depend on the
batch. :class:`StaticStep` runs the same operators on shapes fixed at install:

- the step has ``size`` rows (a rank: its replica's slots in the microbatch); request ``i`` sits
  at row ``place[i]`` and the other rows are padding;
- stateful operators keep their state in slabs with one row per state row (a rank: per slot of
  its replica) plus a scratch row; padding rows read and write the scratch row;
- the schedule reaches the operators as two tensors (:class:`~.batch.StepMeta`): each row's
  position and state row. Attention masks the slots past a row's position; the experts gather
  each row's own top-k weights.

The number of rows is static; how far attention reads (the largest position) and the slabs' sizes
are symbolic, so neither longer contexts nor grown slabs recompile anything.

No operator synchronises with the host inside the step, so it traces as one graph:
``compile="inductor"`` runs it through ``torch.compile(fullgraph=True)`` (a graph break is an
error, not a silent fallback) with inductor's C++ wrapper, so each segment's step is one native
program, launched once per token with no Python between its kernels. The
host does only the bookkeeping around it (:func:`~.ops.begin_static_step`): checking
each request's length, and moving a request's prefilled state into its slab row the first time
it decodes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..errors import OpWeaveRuntimeError, RequestStateError
from .batch import BatchMeta, StepMeta, TokenBatch, one_new_token_each
from .ops import Operator, SlabPool, StatefulOperator, begin_static_step
from .sequence import run_ops
from .tensor_parallel import TPComm

COMPILERS = ("inductor", "aot_eager", "eager")  # torch.compile backends a step may use
_NO_META = BatchMeta((), (), ())  # a static step's batch: the schedule is in ``batch.step``


def is_decode(meta: BatchMeta) -> bool:
    """Every request runs exactly one new token after at least one cached token."""
    return one_new_token_each(meta.query_lens, meta.context_lens)


def why_not_static(ops: Sequence[Operator]) -> str | None:
    """The first operator that cannot run a static decode step, and why (None: all can)."""
    for op in ops:
        where = f"{'' if op.layer is None else f'L{op.layer}.'}{op.name}"
        if not op.static_decode:
            return f"{where} ({type(op).__name__}) runs a kernel without a traceable form"
    return None


class StaticStep:
    """A segment's decode step on ``size`` rows, run eagerly or as one compiled graph."""

    def __init__(
        self,
        ops: Sequence[Operator],
        comm: TPComm | None,
        size: int,
        *,
        reserved_rows: int = 0,
        compile: str | None = None,
    ) -> None:
        why = why_not_static(ops)
        if why is not None:
            raise OpWeaveRuntimeError(f"no static decode step: {why}; use --kernels opweave")
        self.ops = list(ops)
        self.stateful = [op for op in self.ops if isinstance(op, StatefulOperator)]
        self.comm = comm
        self.size = size
        self.reserved_rows = reserved_rows
        self.device = self.ops[0].device if self.ops else torch.device("cpu")
        fn: Callable[..., dict[str, torch.Tensor]] = self._step
        if compile is not None:
            if compile not in COMPILERS:
                raise OpWeaveRuntimeError(
                    f"unknown compiler {compile!r}; one of {', '.join(COMPILERS)}"
                )
            _allow_many_graphs()
            _distrust_graphs()
            # one native submission per step: on CPU inductor's C++ wrapper (no Python between
            # kernels), on CUDA a CUDA-graph replay
            options: dict[str, Any] | None = None
            if compile == "inductor":
                cuda = self.device.type == "cuda"
                options = {"triton.cudagraphs": True} if cuda else {"cpp_wrapper": True}
            fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=compile, options=options)
        self._pools: list[SlabPool] | None = None  # the stateful layers' slab pools
        self._marked: dict[int, int] = {}  # id of a pool -> its version last marked dynamic
        self.native = compile == "inductor"
        self.compiled = compile is not None
        self._fn = fn

    def _step(
        self,
        tensors: dict[str, torch.Tensor],
        positions: torch.Tensor,
        rows: torch.Tensor,
        span: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        # ``span``'s length is the slots attention reads (a dynamic size when compiled)
        batch = TokenBatch(_NO_META, tensors, StepMeta(positions, rows, span.shape[0]))
        return run_ops(self.ops, batch, self.comm).tensors

    def warm_up(
        self, inputs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> dict[str, torch.Tensor]:
        """Run the step once with every row padding (nothing held changes), so a compiled step
        compiles now rather than at its first token. ``inputs``: each input tensor's dtype and
        shape past the row dimension, as the segment receives them. Returns the step's outputs
        (every row padding): what a step of this segment yields, name by name."""
        # a span of 2, the shortest a decode step has: a size of 1 would be specialised
        span = torch.empty(2, dtype=torch.uint8)
        scratch = self._begin((), (), span.shape[0])
        tensors = {
            name: torch.zeros((self.size, *shape), dtype=dtype, device=self.device)
            for name, (dtype, shape) in inputs.items()
        }
        positions = torch.zeros(self.size, dtype=torch.int64)
        state_rows = torch.full((self.size,), scratch, dtype=torch.int64)
        return self._launch(tensors, positions, state_rows, span)

    def __call__(self, batch: TokenBatch, place: Sequence[int] | None = None) -> TokenBatch:
        """Run ``batch`` (a decode step, :func:`is_decode`) with request ``i`` at row
        ``place[i]`` (default: row ``i``)."""
        meta = batch.meta
        n, size = len(meta.request_ids), self.size
        place = list(range(n)) if place is None else list(place)
        padded = n != size or place != list(range(n))
        at = torch.tensor(place, dtype=torch.int64, device=self.device) if padded else None
        schedule = self.schedule(meta.request_ids, meta.context_lens, place)
        # fresh inputs every step, padded or not: the compiled graph's guards see tensors of
        # one kind (made here, under the stage's inference mode), whatever made the batch's
        tensors = {}
        for name, t in batch.tensors.items():
            if at is None:
                tensors[name] = t.clone(memory_format=torch.contiguous_format)
            else:
                tensors[name] = t.new_zeros((size, *t.shape[1:]))
                tensors[name][at] = t
        out = self._launch(tensors, *schedule)
        if at is not None:
            out = {name: t[at] for name, t in out.items()}
        return TokenBatch(meta, out)

    def run_rows(
        self,
        tensors: dict[str, torch.Tensor],
        request_ids: Sequence[str],
        context_lens: Sequence[int],
        place: Sequence[int],
    ) -> dict[str, torch.Tensor]:
        """The step on inputs already laid out in its rows: ``tensors`` has ``size`` rows,
        request ``request_ids[i]`` (``context_lens[i]`` tokens held) in row ``place[i]`` and
        padding in the others, and so do the outputs. No copy in or out: how a rank runs a step
        whose inputs arrived straight into its buffers (``tensors`` made under inference mode,
        the same ones step after step)."""
        return self._launch(tensors, *self.schedule(request_ids, context_lens, place))

    def schedule(
        self,
        request_ids: Sequence[str],
        context_lens: Sequence[int],
        place: Sequence[int],
        *,
        also: Sequence[StaticStep] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The host side of a step with request ``i`` in row ``place[i]``: check the rows,
        bring every request's state into its slab row, and return each row's position and state
        row, and the span attention reads (no requests: every row padding, a span of 2).

        ``also``: other steps of the same stage, on as many rows, that run the same requests in
        the same rows this iteration (a rank's other segments for the microbatch): their host
        side is done here too, and the returned schedule serves them as well (a step without
        state ignores the state rows)."""
        n, size = len(request_ids), self.size
        if len(place) != n or len(set(place)) != n or not all(0 <= p < size for p in place):
            raise OpWeaveRuntimeError(f"a decode step of {size} rows cannot place rows {place}")
        if any(step.size != size for step in also):
            raise OpWeaveRuntimeError("steps sharing a schedule must have as many rows")
        stateful = [op for step in (self, *also) for op in step.stateful]
        rows = self._state_rows(request_ids, stateful)
        span = torch.empty(max(context_lens, default=1) + 1, dtype=torch.uint8)
        scratch = self._begin(request_ids, context_lens, span.shape[0], stateful)
        positions, state_rows = [0] * size, [scratch] * size
        for p, context_len in zip(place, context_lens, strict=True):
            positions[p] = context_len
        for p, row in zip(place, rows, strict=False):  # no rows: a stage without state
            state_rows[p] = row
        return (
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(state_rows, dtype=torch.int64),
            span,
        )

    def _begin(
        self,
        request_ids: Sequence[str],
        context_lens: Sequence[int],
        span: int,
        stateful: Sequence[StatefulOperator] | None = None,
    ) -> int:
        """:func:`~.ops.begin_static_step` of the stateful operators (default: the step's) for
        a step reading ``span`` slots; returns the step's scratch row, past every held
        request's row (not only this step's)."""
        stateful = self.stateful if stateful is None else stateful
        if not stateful:
            return 0
        scratch = max(stateful[0].highest_row() + 1, self.reserved_rows)
        begin_static_step(stateful, request_ids, context_lens, scratch + 1, span=span)
        return scratch

    def _launch(
        self,
        tensors: dict[str, torch.Tensor],
        positions: torch.Tensor,
        state_rows: torch.Tensor,
        span: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        args = (tensors, positions.to(self.device), state_rows.to(self.device), span)
        if self.compiled:
            self.mark_dynamic(span)
        try:
            return self._fn(*args)
        except RuntimeError as err:  # under trust, raised before the step runs anything
            if not (_trusted and _SKIP_STANCE_RECOMPILE in str(err)):
                raise
        return self._compile_trusted(args)

    def _compile_trusted(
        self, args: tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Run the step on inputs no graph was built for (a guard that can change failed: a
        dtype, a shape, an index width): compile it for them under every guard, then trust
        again (a recompilation adds the guard that failed to those a trusted call checks)."""
        inputs = ", ".join(
            f"{name} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            for name, t in args[0].items()  # the step's input tensors
        )
        print(
            f"opweave: a decode step of {self.size} rows met inputs its warm-up did not compile "
            f"it for ({inputs}); compiling it now (a run's other ranks wait up to --timeout-s)",
            file=sys.stderr,
            flush=True,
        )
        _distrust_graphs()
        try:
            return self._fn(*args)
        finally:
            trust_warm_graphs()

    def mark_dynamic(self, span: torch.Tensor | None) -> None:
        """One graph for every span and slab size: mark them symbolic, so that growing
        recompiles nothing. A slab pool's tensors are marked when it allocates them (its
        ``version`` changes), not before every step; ``span`` None: only the slabs (steps that
        share a schedule mark its span once)."""
        from torch._dynamo import maybe_mark_dynamic

        if span is not None:
            maybe_mark_dynamic(span, 0)
        if self._pools is None:  # after the first _begin every stateful layer has its pool
            pools = {id(op._slab_pool): op._slab_pool for op in self.stateful}
            self._pools = [pool for pool in pools.values() if pool is not None]
        for pool in self._pools:
            if self._marked.get(id(pool)) != pool.version:
                self._marked[id(pool)] = pool.version
                for slab in pool.tensors:
                    for dim in pool.growing_dims:
                        maybe_mark_dynamic(slab, dim)

    def _state_rows(
        self, request_ids: Sequence[str], stateful: Sequence[StatefulOperator] | None = None
    ) -> list[int]:
        """Each request's state row (every stateful operator of a stage admits alike; default:
        the step's)."""
        stateful = self.stateful if stateful is None else stateful
        if not stateful:
            return []
        first = stateful[0]
        for op in stateful[1:]:
            if op._rows != first._rows:
                raise OpWeaveRuntimeError(
                    f"L{op.layer}.{op.name} holds the requests in other state rows than "
                    f"L{first.layer}.{first.name}; admit requests through the stage"
                )
        try:
            return list(map(first._rows.__getitem__, request_ids))
        except KeyError as missing:
            raise RequestStateError(
                f"request {missing.args[0]!r} is not admitted on layer {first.layer}"
            ) from None


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def trust_warm_graphs() -> None:
    """Check only part of a compiled step's guards on each call, once the warm-up has compiled
    every step this process runs.

    A call of a compiled step first checks, in C++, every Python attribute, weight and slab the
    step was traced with: on CPU about 70 us plus 9 us per layer of host time before each launch
    (on CUDA, before each graph replay; ``tools/bench/step_host.py``). With torch's
    ``skip_guard_eval_unsafe`` stance only the guards that can tell the graphs apart still run:
    every tensor's dtype, shape and strides, and those that failed when a graph was added (which
    step is which). The ones skipped check the operators' Python attributes (layer indices,
    head counts, flags), which a rank fixes when it installs its segments: it builds and compiles
    every step at its warm-up and changes none of them after, so nothing they guard can change.
    Not for a process that compiles its steps lazily: a compiled step built after this call
    turns the full guards back on (:func:`_distrust_graphs`) before it runs. A step whose
    checked guards fail (inputs of a dtype or shape no graph was built for) compiles under the
    full guards and counts in :func:`compiled_graphs`, as without this call. What it does not
    catch: an operator's Python attribute changed after the warm-up is used as it was when
    traced, silently, and a step called with other input names than at its warm-up fails
    (``KeyError``); a rank's plan fixes both.
    """
    global _trusted
    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    _trusted = True


def _distrust_graphs() -> None:
    """Every guard of every compiled step again: a new step shares its traced function with the
    trusted ones, and only the full guards tell it apart from them."""
    global _trusted
    if _trusted:
        torch.compiler.set_stance("default")
        _trusted = False


_trusted = False  # trust_warm_graphs is in force
# the start of torch's error when a call under the skip_guard_eval_unsafe stance would compile
_SKIP_STANCE_RECOMPILE = "Recompilation triggered with skip_guard_eval_unsafe stance"


def _allow_many_graphs() -> None:
    """One compiled graph per segment and step size: a rank may hold many more than dynamo's
    default of 8 per function before it would stop compiling."""
    import torch._dynamo

    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, 256)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 1024)
    config.fail_on_recompile_limit_hit = True  # never fall back to eager unnoticed
    # no "duck" sizes: a span and a slab that happen to be equally long when a step is traced
    # (the warm-up's) would otherwise share one symbol, and every later step recompile
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
