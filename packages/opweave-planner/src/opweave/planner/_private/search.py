"""Exact search over the plan space: per-owner frontiers + branch-and-bound (paper §5.2-5.3, C.1).

A *sub-search* fixes a (template, number of owners) structure, the microbatch count ``M`` and
the GPU type of every owner; what remains is one (parallelism (TP, EP, DP), microbatch size)
configuration per owner, the product of the owners' (frontier-reduced) candidate sets.

Bounds (valid for every schedule the simulator can produce, see ``simulator.lower_bound``):

* TPOT >= ``M * W_o`` for every owner (its serialized compute per iteration), ``M *`` the
  link time of every send/receive link, and the chain of one microbatch (all segments plus all
  crossing transfers plus the token return);
* cost ∝ TPOT * sum_o rate_o, and since TPOT >= M W_o for every o also
  cost ∝ sum_o rate_o * M W_o (each owner at full occupancy).

For partial assignments, unassigned owners contribute their cheapest possible term. Sub-searches
are taken best root bound first; inside one, owner prefixes are pruned depth first and the last
two owners are bounded together in one vectorised block; complete candidates whose bound still
beats the incumbent are simulated in bound order (the simulator is authoritative). Pruning is
strict (``bound > incumbent``) and ties (equal within float rounding) are broken by a fixed key, so
the reported optimum is the same with and without either reduction.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from opweave.costmodel import (
    GROUP_GPUS,
    boundary_transfer_s,
    fits_inventory,
    intra_node_link,
    node_layout,
)

from .bounds import cost_lower_bound, full_occupancy_cost, tpot_lower_bound
from .devices import Device
from .evaluate import OwnerChoice, build_pipeline, cost_rate
from .frontier import EPS, equal_but_rounding
from .host import cools
from .owners import Job, OwnerOptions, OwnerSpace
from .simulator import cycle_time
from .space import U_GRID
from .structure import OpTables, Structure


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
class Leaf:
    """A simulated complete candidate: objective value, TPOT and tie-break key."""

    value: float
    tpot_s: float
    key: tuple[object, ...]
    job: Job = field(compare=False)
    configs: tuple[tuple[int, int, int, int], ...] = field(compare=False)  # (tp, ep, dp, u)

    def better_than(self, other: Leaf) -> bool:
        """Lower objective, then lower TPOT, then the lower key. Values within float rounding
        of each other (relative ``EPS``) tie: two plans the simulator costs alike, whose sums
        merely ran in another order, are then told apart by the key alone, with or without
        the frontiers' pruning."""
        if not equal_but_rounding(self.value, other.value):
            return self.value < other.value
        if not equal_but_rounding(self.tpot_s, other.tpot_s):
            return self.tpot_s < other.tpot_s
        return self.key < other.key


def lexmin(*leaves: Leaf | None) -> Leaf | None:
    best = None
    for leaf in leaves:
        if leaf is not None and (best is None or leaf.better_than(best)):
            best = leaf
    return best


class Searcher:
    """Runs sub-searches for one objective under one TPOT SLO and one GPU inventory.

    Objectives: ``"cost"`` (USD per token), ``"tpot"``, or ``"gpus"`` (GPUs of one replica
    set; ties go to the lower TPOT). ``inventory`` bounds the GPUs per device id (a missing id
    is unbounded): a candidate must fit as laid out on nodes (:func:`node_layout`,
    :func:`fits_inventory`). Replica counts, and so GPU counts, depend on every owner's batch
    jointly (``lcm``), so a configuration with a better rate and latencies can still need more
    GPUs: the per-owner frontiers are not applied where an inventory bounds a GPU type of the
    sub-search, nor for the ``"gpus"`` objective. Branch-and-bound bounds GPU counts instead:
    a prefix's owners need at least ``tp * dp * lcm(prefix batches) / b`` GPUs each, an
    unassigned owner at least its fewest GPUs per replica.
    """

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
        inventory: Mapping[str, int] | None = None,
        max_group_gpus: int = GROUP_GPUS[-1],
    ) -> None:
        if objective not in ("cost", "tpot", "gpus"):
            raise ValueError(f"unknown objective {objective!r}")
        self.tables = tables
        bound = inventory or {}
        self.limits = {d.id: int(bound[d.id]) for d in devices if d.id in bound}
        self.gpus_per_node = {d.id: d.hardware.gpus_per_node for d in devices}
        self.u_grid = tuple(u_grid)
        self.max_group_gpus = max_group_gpus
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
        self.owners = OwnerSpace(
            tables,
            devices,
            slo_s=slo_s,
            limits=self.limits,
            u_grid=self.u_grid,
            max_group_gpus=max_group_gpus,
            frontier=frontier and objective != "gpus",
            stats=self.stats,
            cache=self.cache,
        )

    def options(self, job: Job, j: int, prune: bool = True) -> OwnerOptions:
        """Owner ``j``'s candidates in sub-search ``job`` (:meth:`OwnerSpace.options`)."""
        return self.owners.options(job, j, prune)

    def _counts_gpus(self, job: Job) -> bool:
        return self.objective == "gpus" or any(
            self.devices[d].id in self.limits for d in job.assign
        )

    # -- bounds ---------------------------------------------------------------------------------
    def _value(
        self,
        tpot: np.ndarray | float,
        rate: np.ndarray | float,
        own: np.ndarray | float,
        gpus: np.ndarray | float = 0.0,
    ) -> np.ndarray | float:
        if self.objective == "tpot":
            return tpot
        if self.objective == "gpus":
            return np.asarray(gpus, dtype=np.float64)
        return cost_lower_bound(tpot, rate, own)

    def _gpus(
        self,
        fixed: Sequence[tuple[str, np.ndarray | int, np.ndarray | int]],
        rest: Sequence[tuple[str, int]] = (),
    ) -> tuple[np.ndarray | int, bool | np.ndarray]:
        """GPUs of the replica set (a lower bound while ``rest`` is unassigned) and whether
        they fit the inventory's counts. ``fixed``: ``(device id, GPUs per replica, u)`` of
        assigned owners (arrays broadcast); ``rest``: ``(device id, fewest GPUs per replica)``
        of the others. Replicas are ``lcm(u) / u`` each (microbatch sizes stand in for resident
        batches: scale-free)."""
        lcm: np.ndarray | int = 1
        for _, _, u in fixed:
            lcm = np.lcm(lcm, u)
        per: dict[str, np.ndarray | int] = {}
        for dev, gpus, u in fixed:
            per[dev] = per.get(dev, 0) + gpus * (lcm // u)
        for dev, gpus in rest:
            per[dev] = per.get(dev, 0) + gpus
        ok: bool | np.ndarray = True
        for dev, count in per.items():
            if dev in self.limits:
                ok = np.logical_and(ok, np.asarray(count) <= self.limits[dev])
        return sum(per.values()), ok

    def _fits_nodes(self, picks: Sequence[tuple[OwnerOptions, int]]) -> bool:
        """Exact inventory check of a complete candidate: its node layout fits."""
        if not self.limits:
            return True
        us = [int(s.u[c]) for s, c in picks]
        lcm = math.lcm(*us)
        groups = [
            (s.device.id, int(s.tp[c]))  # one TP group per DP rank of each replica
            for (s, c), u in zip(picks, us, strict=True)
            for _ in range(lcm // u * int(s.dp[c]))
        ]
        layout = node_layout(groups, self.gpus_per_node)
        return fits_inventory([(g, n) for g, _, n in layout], self.limits, self.gpus_per_node)

    def root_bound(self, job: Job, options: Sequence[OwnerOptions]) -> tuple[float, float, bool]:
        m = job.microbatches
        tpot = float(tpot_lower_bound(m, [float(s.w.min()) for s in options]))
        rate = sum(float(s.rate.min()) for s in options)
        own = sum(float(full_occupancy_cost(s.rate, m, s.w).min()) for s in options)
        gpus, ok = self._gpus([], [(s.device.id, int(s.gpus.min())) for s in options])
        return float(self._value(tpot, rate, own, gpus)), tpot, bool(ok)

    # -- driver ---------------------------------------------------------------------------------
    def run(self, jobs: Sequence[Job], seed: Leaf | None, phase: str) -> Leaf | None:
        """Lexicographic minimum of ``seed`` and every candidate of ``jobs`` meeting the SLO."""
        inc = seed
        prepared = []
        for job in jobs:
            options = [self.options(job, j, prune=False) for j in range(job.st.n)]
            if any(s.size == 0 for s in options):
                self._tick(phase, inc)
                continue
            value, tpot, fits = self.root_bound(job, options)
            if not fits:  # the smallest configurations already exceed the inventory
                self._tick(phase, inc)
                continue
            prepared.append((value, job.rank, job.microbatches, job.assign, tpot, job, options))
        prepared.sort(key=lambda x: x[:4])
        for value, _, _, _, tpot, job, options in prepared:
            self.stats.subsearches += 1
            if self.bnb and (
                tpot > self.slo * (1 + EPS) or (inc is not None and value > inc.value * (1 + EPS))
            ):
                self.stats.subsearches_pruned += 1
            else:
                options = [self.options(job, j) for j in range(job.st.n)]
                inc = self._solve(job, options, inc)
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

    def _solve(self, job: Job, options: Sequence[OwnerOptions], inc: Leaf | None) -> Leaf | None:
        n = job.st.n
        if n == 1:
            return self._block(job, [], options[0], None, inc)
        fixed_levels = n - 2

        def descend(level: int, chosen: list[int], inc: Leaf | None) -> Leaf | None:
            if level == fixed_levels:
                prefix = [(options[i], c) for i, c in enumerate(chosen)]
                return self._block(job, prefix, options[n - 2], options[n - 1], inc)
            for c in self._prefix_order(job, options, chosen, level, inc):
                inc = descend(level + 1, [*chosen, c], inc)
            return inc

        return descend(0, [], inc)

    def _prefix_order(
        self,
        job: Job,
        options: Sequence[OwnerOptions],
        chosen: list[int],
        level: int,
        inc: Leaf | None,
    ) -> list[int]:
        """Configurations of owner ``level`` whose prefix bound survives, cheapest first."""
        m = job.microbatches
        s = options[level]
        fixed = [(options[i], c) for i, c in enumerate(chosen)]
        rest = options[level + 1 :]
        works = [float(x.w[c]) for x, c in fixed] + [s.w] + [float(x.w.min()) for x in rest]
        tpot = tpot_lower_bound(m, works)
        rate = sum(float(x.rate[c]) for x, c in fixed) + s.rate
        rate = rate + sum(float(x.rate.min()) for x in rest)
        own = sum(float(full_occupancy_cost(x.rate[c], m, x.w[c])) for x, c in fixed)
        own = own + full_occupancy_cost(s.rate, m, s.w)
        own = own + sum(float(full_occupancy_cost(x.rate, m, x.w).min()) for x in rest)
        gpus: np.ndarray | int = 0
        fits: bool | np.ndarray = True
        if self._counts_gpus(job):
            gpus, fits = self._gpus(
                [(x.device.id, int(x.gpus[c]), int(x.u[c])) for x, c in fixed]
                + [(s.device.id, s.gpus, s.u)],
                [(x.device.id, int(x.gpus.min())) for x in rest],
            )
        value = self._value(tpot, rate, own, gpus)
        idx = np.arange(s.size)
        idx = idx[np.broadcast_to(fits, idx.shape)]  # over the inventory: never feasible
        if self.bnb:
            ok = np.asarray(tpot <= self.slo * (1 + EPS))[idx]
            if inc is not None:
                ok &= np.asarray(value <= inc.value * (1 + EPS))[idx]
            idx = idx[ok]
        return idx[np.argsort(np.asarray(value)[idx], kind="stable")].tolist()

    def _block(
        self,
        job: Job,
        prefix: list[tuple[OwnerOptions, int]],
        a: OwnerOptions,
        b: OwnerOptions | None,
        inc: Leaf | None,
    ) -> Leaf | None:
        """Bound every completion of ``prefix`` by owners ``a`` (rows) x ``b`` (columns)."""
        m = job.microbatches
        if self.bnb and b is not None:
            a = a.take(self._side_mask(job, prefix, a, b, inc))
            if a.size == 0:
                return inc
            b = b.take(self._side_mask(job, prefix, b, a, inc))
        shape = (a.size, b.size if b is not None else 1)
        if 0 in shape:
            return inc
        # every owner as an array broadcastable to `shape`
        cols: list[tuple[Device, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for s, c in prefix:
            cols.append(
                (
                    s.device,
                    s.tp[c : c + 1, None],
                    s.u[c : c + 1, None],
                    s.w[c : c + 1, None],
                    s.rate[c : c + 1, None],
                    s.dp[c : c + 1, None],
                )
            )
        cols.append(
            (a.device, a.tp[:, None], a.u[:, None], a.w[:, None], a.rate[:, None], a.dp[:, None])
        )
        if b is not None:
            cols.append(
                (
                    b.device,
                    b.tp[None, :],
                    b.u[None, :],
                    b.w[None, :],
                    b.rate[None, :],
                    b.dp[None, :],
                )
            )
        n = len(cols)
        send = [np.zeros(shape) for _ in range(n)]
        recv = [np.zeros(shape) for _ in range(n)]
        chain = np.zeros(shape)
        intra: dict[tuple[int, int], np.ndarray] = {}
        for g in job.st.groups:
            ds, tps, us, dps = cols[g.src][0], cols[g.src][1], cols[g.src][2], cols[g.src][5]
            dd, tpd, ud, dpd = cols[g.dst][0], cols[g.dst][1], cols[g.dst][2], cols[g.dst][5]
            pair = (min(g.src, g.dst), max(g.src, g.dst))
            if pair not in intra:
                # microbatch sizes stand in for resident batches: the pod rule is scale-free
                intra[pair] = intra_node_link(
                    ds.id == dd.id, tps * dps, us, tpd * dpd, ud, ds.hardware.gpus_per_node
                )
            kind = intra[pair]
            dur = boundary_transfer_s(
                g.beta,
                us / dps,  # each DP rank's leader moves its own slice
                ud / dpd,
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
        gpus: np.ndarray | int = 0
        fits: bool | np.ndarray = True
        if self._counts_gpus(job):
            gpus, fits = self._gpus([(c[0].id, c[1] * c[5], c[2]) for c in cols])
        value = np.broadcast_to(np.asarray(self._value(tpot, rate, own, gpus)), shape)
        self.stats.candidates += value.size
        ok = (tpot <= self.slo * (1 + EPS)) & np.broadcast_to(fits, shape)
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
            if not self._fits_nodes(picks):
                continue  # the GPU counts fit, but not as whole TP groups on nodes
            leaf = self._simulate(job, picks, inc)
            if leaf.tpot_s <= self.slo and (inc is None or leaf.better_than(inc)):
                inc = leaf
        return inc

    def _side_mask(
        self,
        job: Job,
        prefix: list[tuple[OwnerOptions, int]],
        s: OwnerOptions,
        other: OwnerOptions,
        inc: Leaf | None,
    ) -> np.ndarray:
        """Prefix bound of one of the two block owners, the other at its most optimistic."""
        m = job.microbatches
        works = [float(x.w[c]) for x, c in prefix] + [s.w, float(other.w.min())]
        tpot = tpot_lower_bound(m, works)
        gpus: np.ndarray | int = 0
        fits: bool | np.ndarray = True
        if self._counts_gpus(job):
            gpus, fits = self._gpus(
                [(x.device.id, int(x.gpus[c]), int(x.u[c])) for x, c in prefix]
                + [(s.device.id, s.gpus, s.u)],
                [(other.device.id, int(other.gpus.min()))],
            )
        rate = sum(float(x.rate[c]) for x, c in prefix) + s.rate + float(other.rate.min())
        own = (
            sum(float(full_occupancy_cost(x.rate[c], m, x.w[c])) for x, c in prefix)
            + full_occupancy_cost(s.rate, m, s.w)
            + float(full_occupancy_cost(other.rate, m, other.w).min())
        )
        ok = (tpot <= self.slo * (1 + EPS)) & np.broadcast_to(fits, s.tp.shape)
        if inc is not None:
            ok &= np.asarray(self._value(tpot, rate, own, gpus)) <= inc.value * (1 + EPS)
        return ok

    def _simulate(self, job: Job, picks: list[tuple[OwnerOptions, int]], inc: Leaf | None) -> Leaf:
        """The candidate simulated. Where a device's operators slow down after idling (cold
        caches, a fixed point of several event simulations), the hot schedule is simulated
        first: its period is a lower bound, so a candidate it already rules out stays out."""
        m = job.microbatches
        owners = [
            OwnerChoice(s.device, int(s.tp[c]), int(s.u[c]) * m, ep=int(s.ep[c]), dp=int(s.dp[c]))
            for s, c in picks
        ]
        configs = tuple((int(s.tp[c]), int(s.ep[c]), int(s.dp[c]), int(s.u[c])) for s, c in picks)
        key = (
            job.rank,
            job.st.n,
            m,
            tuple(
                (d, tp, ep, dp, -u) for d, (tp, ep, dp, u) in zip(job.assign, configs, strict=True)
            ),
        )
        rate = cost_rate(owners)

        gpus = 0
        if self.objective == "gpus":
            lcm = math.lcm(*(ch.resident_batch for ch in owners))
            gpus = sum(ch.gpus * lcm // ch.resident_batch for ch in owners)

        def leaf(cold: bool) -> Leaf:
            pipe, _ = build_pipeline(job.st, self.tables, owners, m, cold_caches=cold)
            tpot = cycle_time(pipe)
            self.stats.simulator_calls += 1
            value = {"tpot": tpot, "gpus": float(gpus)}.get(self.objective, tpot * rate)
            return Leaf(value=value, tpot_s=tpot, key=key, job=job, configs=configs)

        if not cools([ch.device.host for ch in owners]):
            return leaf(cold=True)
        hot = leaf(cold=False)
        if hot.tpot_s > self.slo or (inc is not None and not hot.better_than(inc)):
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
    """GPU type per owner: all one type, or (heterogeneous) at least two types."""
    if not heterogeneous:
        return [(d,) * n for d in range(num_devices)]
    return [a for a in itertools.product(range(num_devices), repeat=n) if len(set(a)) > 1]


def _link_coeffs(intra: np.ndarray, device: Device) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate, the (latency, s/byte) of the link ``intra`` selects on ``device``."""
    return (
        np.where(intra, device.intra.latency_s, device.network.latency_s),
        np.where(intra, device.intra.s_per_byte, device.network.s_per_byte),
    )
