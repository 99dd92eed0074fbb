"""Exact search over the plan space: per-owner frontiers + branch-and-bound (paper §5.2-5.3, C.1).

A *sub-search* fixes a (template, number of owners) structure, the microbatch count ``M`` and
the GPU type of every owner slot; what remains is one (TP, microbatch size) configuration per
slot, the product of the slots' (frontier-reduced) candidate sets.

Bounds (valid for every schedule the simulator can produce, see ``simulator.lower_bound``):

* TPOT >= ``M * W_o`` for every owner (its serialized compute per iteration), ``M *`` the
  link time of every send/receive link, and the chain of one microbatch (all segments plus all
  crossing transfers plus the token return);
* cost ∝ TPOT * sum_o rate_o, and since TPOT >= M W_o for every o also
  cost ∝ sum_o rate_o * M W_o (each owner at full occupancy).

For partial assignments, unassigned slots contribute their cheapest possible term. Sub-searches
are taken best root bound first; inside one, slot prefixes are pruned depth first and the last
two slots are bounded together in one vectorised block; complete candidates whose bound still
beats the incumbent are simulated in bound order (the simulator is authoritative). Pruning is
strict (``bound > incumbent``) and ties are broken by a fixed key, so the reported optimum is the
same with and without either reduction.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from opweave.costmodel import (
    boundary_transfer_s,
    fan_out_s,
    intra_node_link,
    link_time_s,
    usd_per_hour_per_request,
)

from .bounds import cost_lower_bound, full_occupancy_cost, tpot_lower_bound
from .devices import Device
from .evaluate import OwnerChoice, build_pipeline, cost_rate
from .frontier import pareto_mask
from .simulator import cycle_time
from .space import U_GRID
from .structure import OpTables, Structure, slot_compute

EPS = 1e-9  # relative slack: float rounding never prunes a candidate the simulator would keep


@dataclass
class SearchStats:
    """Work done by the search (summed over all its phases)."""

    simulator_calls: int = 0
    candidates: int = 0
    wall_s: float = 0.0
    subsearches: int = 0
    subsearches_pruned: int = 0
    owner_configs: int = 0
    frontier_removed: int = 0


@dataclass(frozen=True)
class SearchProgress:
    """Passed to the progress callback after every sub-search."""

    phase: str
    done: int
    total: int
    simulator_calls: int
    candidates: int
    best_usd_per_million_tokens: float | None
    elapsed_s: float


@dataclass(frozen=True)
class Job:
    rank: int
    st: Structure
    microbatches: int
    assign: tuple[int, ...]


@dataclass(frozen=True)
class Leaf:
    """A simulated complete candidate: objective value, TPOT and tie-break key."""

    value: float
    tpot_s: float
    key: tuple[object, ...]
    job: Job = field(compare=False)
    configs: tuple[tuple[int, int], ...] = field(compare=False)  # (tp, u) per slot

    def order(self) -> tuple[object, ...]:
        return (self.value, self.tpot_s, self.key)


def lexmin(*leaves: Leaf | None) -> Leaf | None:
    found = [x for x in leaves if x is not None]
    return min(found, key=Leaf.order) if found else None


@dataclass(frozen=True)
class Slot:
    """Candidate configurations of one owner slot in one sub-search (parallel arrays)."""

    device: Device
    tp: np.ndarray
    u: np.ndarray
    w: np.ndarray  # per-microbatch work of the slot
    rate: np.ndarray  # USD/hour per request: tp * price / (M * u)

    def take(self, mask: np.ndarray) -> Slot:
        return Slot(self.device, self.tp[mask], self.u[mask], self.w[mask], self.rate[mask])

    @property
    def size(self) -> int:
        return int(self.tp.shape[0])


class Searcher:
    """Runs sub-searches for one objective (``"cost"`` or ``"tpot"``) under one TPOT SLO."""

    def __init__(
        self,
        tables: OpTables,
        devices: Sequence[Device],
        *,
        slo_s: float,
        objective: str = "cost",
        frontier: bool = True,
        bnb: bool = True,
        stats: SearchStats | None = None,
        progress: Callable[[SearchProgress], None] | None = None,
        cache: dict[tuple[object, ...], object] | None = None,
        u_grid: Sequence[int] = U_GRID,
    ) -> None:
        self.tables = tables
        self.u_grid = tuple(u_grid)
        self.devices = list(devices)
        self.slo = slo_s
        self.objective = objective
        self.frontier = frontier
        self.bnb = bnb
        self.stats = stats if stats is not None else SearchStats()
        self.progress = progress
        self.cache = cache if cache is not None else {}
        self.started = time.perf_counter()
        self.done = 0
        self.total = 0

    # -- per-slot candidates ----------------------------------------------------------------
    def _comp(self, job: Job, j: int, d: int, tp: int) -> np.ndarray:
        key = ("comp", job.rank, j, d, tp, self.u_grid)
        if key not in self.cache:
            self.cache[key] = slot_compute(job.st, self.tables, j, self.devices[d], tp, self.u_grid)
        return self.cache[key]  # type: ignore[return-value]

    def slot(self, job: Job, j: int) -> Slot:
        key = (
            "slot",
            job.rank,
            j,
            job.assign,
            job.microbatches,
            self.slo,
            self.frontier,
            self.u_grid,
        )
        cached = self.cache.get(key)
        if cached is not None:
            return cached  # type: ignore[return-value]
        st, m, d = job.st, job.microbatches, job.assign[j]
        dev = self.devices[d]
        tps, us, ws, lats = [], [], [], []
        for tp in dev.tps:
            cap = self.tables.max_resident_batch(st.slot_ops[j], dev, tp, st.slot_key(j))
            comp = self._comp(job, j, d, tp)
            total = comp.sum(axis=0)
            for ui, u in enumerate(self.u_grid):
                if u * m > cap or m * total[ui] > self.slo * (1 + EPS):
                    continue
                tps.append(tp)
                us.append(u)
                ws.append(total[ui])
                lats.append(comp[:, ui])
        tp_a = np.array(tps, dtype=np.int64)
        u_a = np.array(us, dtype=np.int64)
        slot = Slot(
            dev,
            tp_a,
            u_a,
            np.array(ws, dtype=np.float64),
            np.asarray(
                usd_per_hour_per_request(tp_a, dev.usd_per_hour, m * u_a.astype(np.float64))
            ),
        )
        self.stats.owner_configs += slot.size
        if self.frontier and slot.size > 1:
            keep = pareto_mask(
                tp_a,
                slot.rate,
                np.stack(lats, axis=1),
                *self._frontier_links(job, j, dev, tp_a, u_a),
            )
            self.stats.frontier_removed += int(slot.size - keep.sum())
            slot = slot.take(keep)
        self.cache[key] = slot
        return slot

    def _frontier_links(
        self, job: Job, j: int, dev: Device, tp: np.ndarray, u: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Link times of slot j's configurations, and which may be compared at all.

        A boundary's transfer takes ``max(send, recv) + fan_out``, so the slot's send, receive
        and fan-out times are compared separately. They are partner-independent only when the
        link kind is: always the network against a partner of another GPU type, and against
        one of the same type only when ``tp >= gpus_per_node`` (no pod fits in a node).
        Otherwise the pod rule could give X and Y different link kinds, which would change the
        partner's side of the transfer too, so those TP degrees are left unpruned.
        """
        rows = []
        uf = u.astype(np.float64)
        comparable = np.ones(tp.shape[0], dtype=bool)
        net = dev.network
        for g in job.st.groups:
            if j not in (g.src, g.dst):
                continue
            partner = self.devices[job.assign[g.dst if g.src == j else g.src]]
            if partner.id == dev.id:
                comparable &= tp >= dev.hardware.gpus_per_node
            if g.src == j:
                rows.append(link_time_s(net.latency_s, net.s_per_byte, g.beta * uf))
            if g.dst == j:
                rows.append(link_time_s(net.latency_s, net.s_per_byte, g.beta * uf))
                rows.append(fan_out_s(g.beta, uf, tp, *dev.intra.coeffs))
        links = np.stack(rows) if rows else np.zeros((0, tp.shape[0]))
        return links, comparable

    # -- bounds ---------------------------------------------------------------------------------
    def _value(
        self, tpot: np.ndarray | float, rate: np.ndarray | float, own: np.ndarray | float
    ) -> np.ndarray | float:
        if self.objective == "tpot":
            return tpot
        return cost_lower_bound(tpot, rate, own)

    def root_bound(self, job: Job, slots: Sequence[Slot]) -> tuple[float, float]:
        m = job.microbatches
        tpot = float(tpot_lower_bound(m, [float(s.w.min()) for s in slots]))
        rate = sum(float(s.rate.min()) for s in slots)
        own = sum(float(full_occupancy_cost(s.rate, m, s.w).min()) for s in slots)
        return float(self._value(tpot, rate, own)), tpot

    # -- driver ---------------------------------------------------------------------------------
    def run(self, jobs: Sequence[Job], seed: Leaf | None, phase: str) -> Leaf | None:
        """Lexicographic minimum of ``seed`` and every candidate of ``jobs`` meeting the SLO."""
        inc = seed
        prepared = []
        for job in jobs:
            slots = [self.slot(job, j) for j in range(job.st.n)]
            if any(s.size == 0 for s in slots):
                self._tick(phase, inc)
                continue
            value, tpot = self.root_bound(job, slots)
            prepared.append((value, job.rank, job.microbatches, job.assign, tpot, job, slots))
        prepared.sort(key=lambda x: x[:4])
        for value, _, _, _, tpot, job, slots in prepared:
            self.stats.subsearches += 1
            if self.bnb and (
                tpot > self.slo * (1 + EPS) or (inc is not None and value > inc.value * (1 + EPS))
            ):
                self.stats.subsearches_pruned += 1
            else:
                inc = self._solve(job, slots, inc)
            self._tick(phase, inc)
        return inc

    def _tick(self, phase: str, inc: Leaf | None) -> None:
        self.done += 1
        if self.progress is None:
            return
        usd = None
        if inc is not None:
            usd = inc.value / 3600 * 1e6 if self.objective == "cost" else None
        self.progress(
            SearchProgress(
                phase,
                self.done,
                max(self.total, self.done),
                self.stats.simulator_calls,
                self.stats.candidates,
                usd,
                time.perf_counter() - self.started,
            )
        )

    def _solve(self, job: Job, slots: Sequence[Slot], inc: Leaf | None) -> Leaf | None:
        n = job.st.n
        if n == 1:
            return self._block(job, [], slots[0], None, inc)
        fixed_levels = n - 2

        def descend(level: int, chosen: list[int], inc: Leaf | None) -> Leaf | None:
            if level == fixed_levels:
                prefix = [(slots[i], c) for i, c in enumerate(chosen)]
                return self._block(job, prefix, slots[n - 2], slots[n - 1], inc)
            for c in self._prefix_order(job, slots, chosen, level, inc):
                inc = descend(level + 1, [*chosen, c], inc)
            return inc

        return descend(0, [], inc)

    def _prefix_order(
        self, job: Job, slots: Sequence[Slot], chosen: list[int], level: int, inc: Leaf | None
    ) -> list[int]:
        """Configurations of slot ``level`` whose prefix bound survives, cheapest first."""
        m = job.microbatches
        s = slots[level]
        fixed = [(slots[i], c) for i, c in enumerate(chosen)]
        rest = slots[level + 1 :]
        works = [float(x.w[c]) for x, c in fixed] + [s.w] + [float(x.w.min()) for x in rest]
        tpot = tpot_lower_bound(m, works)
        rate = sum(float(x.rate[c]) for x, c in fixed) + s.rate
        rate = rate + sum(float(x.rate.min()) for x in rest)
        own = sum(float(full_occupancy_cost(x.rate[c], m, x.w[c])) for x, c in fixed)
        own = own + full_occupancy_cost(s.rate, m, s.w)
        own = own + sum(float(full_occupancy_cost(x.rate, m, x.w).min()) for x in rest)
        value = self._value(tpot, rate, own)
        idx = np.arange(s.size)
        if self.bnb:
            ok = tpot <= self.slo * (1 + EPS)
            if inc is not None:
                ok &= value <= inc.value * (1 + EPS)
            idx = idx[ok]
        return idx[np.argsort(np.asarray(value)[idx], kind="stable")].tolist()

    def _block(
        self, job: Job, prefix: list[tuple[Slot, int]], a: Slot, b: Slot | None, inc: Leaf | None
    ) -> Leaf | None:
        """Bound every completion of ``prefix`` by slots ``a`` (rows) x ``b`` (columns)."""
        m = job.microbatches
        if self.bnb and b is not None:
            a = a.take(self._side_mask(job, prefix, a, b, inc))
            if a.size == 0:
                return inc
            b = b.take(self._side_mask(job, prefix, b, a, inc))
        shape = (a.size, b.size if b is not None else 1)
        if 0 in shape:
            return inc
        # every slot as an array broadcastable to `shape`
        cols: list[tuple[Device, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for s, c in prefix:
            cols.append(
                (
                    s.device,
                    s.tp[c : c + 1, None],
                    s.u[c : c + 1, None],
                    s.w[c : c + 1, None],
                    s.rate[c : c + 1, None],
                )
            )
        cols.append((a.device, a.tp[:, None], a.u[:, None], a.w[:, None], a.rate[:, None]))
        if b is not None:
            cols.append((b.device, b.tp[None, :], b.u[None, :], b.w[None, :], b.rate[None, :]))
        n = len(cols)
        send = [np.zeros(shape) for _ in range(n)]
        recv = [np.zeros(shape) for _ in range(n)]
        chain = np.zeros(shape)
        intra: dict[tuple[int, int], np.ndarray] = {}
        for g in job.st.groups:
            ds, tps, us = cols[g.src][0], cols[g.src][1], cols[g.src][2]
            dd, tpd, ud = cols[g.dst][0], cols[g.dst][1], cols[g.dst][2]
            pair = (min(g.src, g.dst), max(g.src, g.dst))
            if pair not in intra:
                # microbatch sizes stand in for resident batches: the pod rule is scale-free
                intra[pair] = intra_node_link(
                    ds.id == dd.id, tps, us, tpd, ud, ds.hardware.gpus_per_node
                )
            kind = intra[pair]
            dur = boundary_transfer_s(
                g.beta,
                us.astype(np.float64),
                ud.astype(np.float64),
                tpd,
                _link_coeffs(kind, ds),
                _link_coeffs(kind, dd),
                dd.intra.coeffs,
            )
            dur = dur * g.count
            send[g.src] = send[g.src] + dur
            recv[g.dst] = recv[g.dst] + dur
            chain = chain + dur
        tpot = tpot_lower_bound(m, [c[3] for c in cols], [*send, *recv], chain)
        tpot = np.broadcast_to(tpot, shape)
        rate = np.broadcast_to(sum(c[4] for c in cols), shape)
        own = np.broadcast_to(sum(full_occupancy_cost(c[4], m, c[3]) for c in cols), shape)
        value = np.asarray(self._value(tpot, rate, own))
        self.stats.candidates += value.size
        ok = tpot <= self.slo * (1 + EPS)
        if inc is not None:
            ok &= value <= inc.value * (1 + EPS)
        flat = np.flatnonzero(ok)
        order = flat[np.argsort(value.ravel()[flat], kind="stable")]
        for f in order.tolist():
            if inc is not None and value.flat[f] > inc.value * (1 + EPS):
                break
            ia, ib = divmod(f, shape[1])
            picks = [(s, c) for s, c in prefix] + [(a, ia)]
            if b is not None:
                picks.append((b, ib))
            leaf = self._simulate(job, picks, inc)
            if leaf.tpot_s <= self.slo and (inc is None or leaf.order() < inc.order()):
                inc = leaf
        return inc

    def _side_mask(
        self, job: Job, prefix: list[tuple[Slot, int]], s: Slot, other: Slot, inc: Leaf | None
    ) -> np.ndarray:
        """Prefix bound of one of the two block slots, the other at its most optimistic."""
        m = job.microbatches
        works = [float(x.w[c]) for x, c in prefix] + [s.w, float(other.w.min())]
        tpot = tpot_lower_bound(m, works)
        rate = sum(float(x.rate[c]) for x, c in prefix) + s.rate + float(other.rate.min())
        own = (
            sum(float(full_occupancy_cost(x.rate[c], m, x.w[c])) for x, c in prefix)
            + full_occupancy_cost(s.rate, m, s.w)
            + float(full_occupancy_cost(other.rate, m, other.w).min())
        )
        ok = tpot <= self.slo * (1 + EPS)
        if inc is not None:
            ok &= np.asarray(self._value(tpot, rate, own)) <= inc.value * (1 + EPS)
        return ok

    def _simulate(self, job: Job, picks: list[tuple[Slot, int]], inc: Leaf | None) -> Leaf:
        """The candidate simulated. Where a device's operators slow down after idling (cold
        caches, a fixed point of several event simulations), the hot schedule is simulated
        first: its period is a lower bound, so a candidate it already rules out stays out."""
        m = job.microbatches
        owners = [OwnerChoice(s.device, int(s.tp[c]), int(s.u[c]) * m) for s, c in picks]
        configs = tuple((int(s.tp[c]), int(s.u[c])) for s, c in picks)
        key = (
            job.rank,
            job.st.n,
            m,
            tuple((d, tp, -u) for d, (tp, u) in zip(job.assign, configs, strict=True)),
        )
        rate = cost_rate(owners)

        def leaf(cold: bool) -> Leaf:
            pipe, _ = build_pipeline(job.st, self.tables, owners, m, cold_caches=cold)
            tpot = cycle_time(pipe)
            self.stats.simulator_calls += 1
            value = tpot if self.objective == "tpot" else tpot * rate
            return Leaf(value=value, tpot_s=tpot, key=key, job=job, configs=configs)

        if all(ch.device.idle_slowdown is None for ch in owners):
            return leaf(cold=True)
        hot = leaf(cold=False)
        if hot.tpot_s > self.slo or (inc is not None and not hot.order() < inc.order()):
            return hot  # rejected either way
        return leaf(cold=True)


def make_jobs(
    ranked: Sequence[tuple[int, Structure]],
    assigns: Sequence[tuple[int, ...]],
    microbatches: Sequence[int],
) -> list[Job]:
    return [
        Job(rank, st, mb, a)
        for rank, st in ranked
        for a in assigns
        if len(a) == st.n
        for mb in microbatches
    ]


def assignments(num_devices: int, n: int, *, heterogeneous: bool) -> list[tuple[int, ...]]:
    """GPU type per owner slot: all one type, or (heterogeneous) at least two types."""
    if not heterogeneous:
        return [(d,) * n for d in range(num_devices)]
    return [a for a in itertools.product(range(num_devices), repeat=n) if len(set(a)) > 1]


def _link_coeffs(intra: np.ndarray, device: Device) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate, the (latency, s/byte) of the link ``intra`` selects on ``device``."""
    return (
        np.where(intra, device.intra.latency_s, device.network.latency_s),
        np.where(intra, device.intra.s_per_byte, device.network.s_per_byte),
    )
