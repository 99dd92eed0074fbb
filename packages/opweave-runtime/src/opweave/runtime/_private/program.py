"""A CPU rank's whole decode iteration as one native call: the rank program.

Between static decode steps a rank's per-iteration schedule (:mod:`.schedule`) is fixed: which
segment runs for which microbatch, on how many rows, receiving which rows from which leaders and
sending which to whom. :class:`RankProgram` traces that schedule once, every action in order,
into one graph: per action the receives (``torch.ops.opweave.recv`` off the native wire,
:mod:`.native`), the TP fan-out of what the leader received (a sum over the group, to which the
others add zeros), the segment's decode step, its sends (``opweave.send``) and, at the last
segment, the sampled tokens forwarded to the first segment's leaders. Compiled by inductor with
its C++ wrapper, the iteration is one call from Python with nothing of Python between its
actions, as a CUDA-graph replay is on a GPU.

What stays on the host, before the call: each microbatch's schedule (its requests' rows,
positions and state rows, one for all its actions: :meth:`.decode.StaticStep.schedule`), the
tokens the driver sent and those the previous iteration forwarded; after it: the tokens to the
driver, and tokens forwarded from the host (a request sampled with a temperature: the host
samples it).

The communication keeps the schedule's order whatever inductor reorders: each receive and send
takes the previous one's output as a dependency (``after``), and so does each action's input,
so the wire's operators and the actions' starts form one chain. Within an action, operators and
TP collectives follow their data, as in a segment's own compiled step.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol

from ..errors import OpWeaveRuntimeError
from . import decode
from .decode import StaticStep, _allow_many_graphs, _distrust_graphs
from .native import load
from .schedule import Compute

Inputs = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]  # a step's inputs past the row dim
Schedule = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # positions, state rows, span


class RankProgram:
    """Every action of one rank's iteration, traced as one graph.

    ``steps[a]`` is action ``a``'s decode step and ``inputs[a]`` its input tensors; ``wire``
    the native wire's id (None: a rank without peers); ``leader``: this rank receives and sends
    for its TP group ``group``; ``compile``: the torch.compile backend (``"inductor"``: the C++
    wrapper, one native call)."""

    def __init__(
        self,
        rank: int,
        actions: Sequence[Compute],
        steps: Sequence[StaticStep],
        inputs: Sequence[Inputs],
        *,
        wire: int | None,
        leader: bool,
        group: object = None,
        compile: str | None = "inductor",
    ) -> None:
        for action, inp in zip(actions, inputs, strict=True):
            if not action.first:
                covered = sorted((m.slots.start, m.slots.stop) for m in action.sources)
                edges = [action.slots.start] + [hi for _, hi in covered]
                if [lo for lo, _ in covered] != edges[:-1] or edges[-1] != action.slots.stop:
                    raise OpWeaveRuntimeError(
                        f"rank {rank}: segment {action.segment} microbatch {action.microbatch} "
                        "receives rows that do not tile its slots"
                    )
            if not inp:
                raise OpWeaveRuntimeError(f"rank {rank}: an action without inputs")
        load()  # the torch.ops.opweave operators
        self.rank = rank
        self.actions = list(actions)
        self.steps = list(steps)
        self.inputs = [dict(i) for i in inputs]
        self.wire = wire
        self.leader = leader
        self.group = group
        self.native = compile == "inductor"
        # launches from Python per call: one native call, else each operator of each step
        self.submissions = 1 if self.native else sum(len(s.ops) for s in self.steps)
        self.microbatches = sorted({a.microbatch for a in self.actions})
        # each microbatch's steps, in the order of its actions, and the slots they share (a
        # rank holds one replica's slots of each microbatch: its requests sit in the same rows
        # at every action)
        self.microbatch_steps = {
            k: [s for a, s in zip(self.actions, self.steps, strict=True) if a.microbatch == k]
            for k in self.microbatches
        }
        self.slots: dict[int, range] = {}
        for a in self.actions:
            if self.slots.setdefault(a.microbatch, a.slots) != a.slots:
                raise OpWeaveRuntimeError(
                    f"rank {rank}: microbatch {a.microbatch}'s actions hold different slots"
                )
        self.first_actions = [a for a in self.actions if a.first]
        self.what = {  # a message's tag -> what receiving it is, for errors
            m.tag: f"receiving segment {a.segment} microbatch {a.microbatch}"
            for a in self.actions
            for m in a.sources
        }
        self._ones = torch.ones(1, dtype=torch.int64)
        fn: Callable[..., Any] = self._iteration
        if compile is not None:
            _allow_many_graphs()
            _distrust_graphs()
            options: dict[str, Any] | None = {"cpp_wrapper": True} if self.native else None
            fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=compile, options=options)
        self._fn = fn

    # -- the traced iteration -----------------------------------------------------------------
    def _iteration(
        self,
        first_inputs: list[dict[str, torch.Tensor]],
        schedules: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        forward: torch.Tensor,
        token: torch.Tensor,
    ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        ops = torch.ops.opweave
        firsts = iter(first_inputs)
        last_outputs: list[dict[str, torch.Tensor]] = []
        for a, action in enumerate(self.actions):
            spec = self.inputs[a]
            size = len(action.slots)
            if action.first:
                tensors = {name: ops.after(t, token) for name, t in next(firsts).items()}
            else:
                tensors = self._receive(action, spec, size, token)
                if self.group is not None:  # the leader's rows to its TP group
                    # a sum to which the others add zeros (exact), not a broadcast: inductor's
                    # C++ wrapper cannot call broadcast_ on every torch a rank may run (2.13)
                    tensors = {
                        name: funcol.all_reduce(t, "sum", self.group)  # type: ignore[arg-type]
                        for name, t in tensors.items()
                    }
            out = self.steps[a]._step(tensors, *schedules[a])
            names = sorted(out)
            token = out[names[0]]
            if action.last:
                last_outputs.append(out)
                if self.leader and self.wire is not None:
                    ids = out["token_ids"]
                    k = self.microbatches.index(action.microbatch)
                    when = forward[k : k + 1]
                    for link in action.feeds:
                        if link.peer != self.rank:
                            rows = self._rows(ids, action, link.slots)
                            token = ops.send(rows, token, when, self.wire, link.peer, link.tag)
            elif self.leader:
                assert self.wire is not None
                for link in action.dests:
                    data = torch.cat([self._rows(out[n], action, link.slots) for n in names])
                    token = ops.send(data, token, self._ones, self.wire, link.peer, link.tag)
        return last_outputs, token

    def _receive(
        self, action: Compute, spec: Inputs, size: int, token: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The action's input rows: received from each source leader (the leader), or zeros a
        TP group's sum fills (the others)."""
        ops = torch.ops.opweave
        names = sorted(spec)  # the order the sender sends in
        if not self.leader:
            return {
                name: ops.after(torch.zeros((size, *shape), dtype=dtype), token)
                for name, (dtype, shape) in spec.items()
            }
        assert self.wire is not None
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        for link in sorted(action.sources, key=lambda m: m.slots.start):
            rows = len(link.slots)
            sizes = [rows * math.prod(spec[n][1]) * spec[n][0].itemsize for n in names]
            raw = ops.recv(token, self.wire, link.peer, link.tag, sum(sizes))
            token = raw
            offset = 0
            for name, nbytes in zip(names, sizes, strict=True):
                dtype, shape = spec[name]
                piece = raw[offset : offset + nbytes]
                if offset % dtype.itemsize:  # a view needs the element's alignment
                    piece = piece.clone()
                piece = piece.view(dtype).view(rows, *shape)
                parts[name].append(piece)
                offset += nbytes
        return {  # in the warm-up's order, as the step was compiled
            name: parts[name][0] if len(parts[name]) == 1 else torch.cat(parts[name])
            for name in spec
        }

    @staticmethod
    def _rows(t: torch.Tensor, action: Compute, slots: range) -> torch.Tensor:
        lo, hi = slots.start - action.slots.start, slots.stop - action.slots.start
        return t[lo:hi].contiguous().view(-1).view(torch.uint8)

    # -- running it -----------------------------------------------------------------------------
    def __call__(
        self,
        first_inputs: list[dict[str, torch.Tensor]],
        schedules: list[Schedule],
        forward: Sequence[bool],
    ) -> list[dict[str, torch.Tensor]]:
        """Run the iteration: ``first_inputs`` per first-segment action (in order), each
        action's schedule (the same object for a microbatch's actions, as :meth:`padding`
        makes them), and per microbatch (in order) whether its tokens go forward from inside
        the program. Returns the last segment's outputs per last-segment action."""
        if len(schedules) != len(self.actions):
            raise OpWeaveRuntimeError("a rank program needs a schedule per action")
        marked: set[int] = set()  # a microbatch's steps share one schedule: mark its span once
        for step, schedule in zip(self.steps, schedules, strict=True):
            span = None if id(schedule) in marked else schedule[2]
            marked.add(id(schedule))
            step.mark_dynamic(span)  # one graph for every span and slab size
        flags = torch.tensor([1 if f else 0 for f in forward], dtype=torch.int64)
        args = (first_inputs, schedules, flags, self._ones)
        try:
            outputs, _ = self._fn(*args)
        except RuntimeError as err:  # under trust, raised before the program runs anything
            if not (decode._trusted and decode._SKIP_STANCE_RECOMPILE in str(err)):
                raise
            print(
                f"opweave: rank {self.rank}'s program met inputs its warm-up did not compile it "
                "for; compiling it now (a run's other ranks wait up to --timeout-s)",
                file=sys.stderr,
                flush=True,
            )
            _distrust_graphs()
            try:
                outputs, _ = self._fn(*args)
            finally:
                decode.trust_warm_graphs()
        return outputs

    def padding(self) -> tuple[list[dict[str, torch.Tensor]], list[Schedule]]:
        """First inputs and schedules of an iteration where every row is padding."""
        firsts = [
            {name: torch.zeros((len(a.slots), *shape), dtype=dt) for name, (dt, shape) in i.items()}
            for a, i in zip(self.actions, self.inputs, strict=True)
            if a.first
        ]
        # one schedule per microbatch, shared by its actions as in traffic (the graph is traced
        # for inputs that alias alike)
        shared = {k: steps[0].schedule((), (), ()) for k, steps in self.microbatch_steps.items()}
        return firsts, [shared[a.microbatch] for a in self.actions]
