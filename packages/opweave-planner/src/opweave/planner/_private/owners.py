"""Each owner's candidate configurations in a sub-search, and their Pareto frontiers (§5.2).

An owner's configurations are its parallelisms (:func:`~.space.candidate_parallelisms` whose
operators split so) times the microbatch sizes that fit one replica's memory: one
:class:`OwnerTable` per (structure, owner, GPU type), shared by every microbatch count and SLO.
A sub-search takes those that fit its microbatch count, SLO and inventory
(:meth:`OwnerSpace.feasible`), reduced to their frontier where that is exact
(:meth:`OwnerSpace.options`; dominance from :mod:`.frontier`, once per owner and partner
GPU types).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from opweave.costmodel import (
    Parallelism,
    fan_out_s,
    link_time_s,
    parallelism_problem,
    usd_per_hour_per_request,
)

from .devices import Device
from .frontier import EPS, dominated_pairs
from .space import candidate_parallelisms, u_grid_for_dp
from .structure import OpTables, Structure, owner_compute

if TYPE_CHECKING:
    from .search import SearchStats


@dataclass(frozen=True)
class Job:
    """A sub-search: a structure (its ``rank`` among them), a microbatch count and the GPU type
    (device index) of every owner."""

    rank: int
    st: Structure
    microbatches: int
    assign: tuple[int, ...]


@dataclass(frozen=True)
class OwnerTable:
    """Every configuration of one owner on one device (parallel arrays; ``lat`` is ``S x C``):
    a parallelism, a microbatch size ``u`` a multiple of its ``dp`` and within the replica's
    memory ``cap``, and the per-occurrence latencies of one microbatch."""

    tp: np.ndarray
    ep: np.ndarray
    dp: np.ndarray
    cap: np.ndarray
    u: np.ndarray
    lat: np.ndarray
    total: np.ndarray

    @property
    def gpus(self) -> np.ndarray:
        return self.tp * self.dp


@dataclass(frozen=True)
class OwnerOptions:
    """Candidate configurations of one owner in one sub-search (parallel arrays)."""

    device: Device
    tp: np.ndarray
    u: np.ndarray  # requests of a replica's microbatch (over all its DP ranks)
    w: np.ndarray  # per-microbatch work of the owner
    rate: np.ndarray  # USD/hour per request: tp * dp * price / (M * u)
    ep: np.ndarray
    dp: np.ndarray

    def take(self, mask: np.ndarray) -> OwnerOptions:
        return OwnerOptions(
            self.device,
            self.tp[mask],
            self.u[mask],
            self.w[mask],
            self.rate[mask],
            self.ep[mask],
            self.dp[mask],
        )

    @property
    def size(self) -> int:
        return int(self.tp.shape[0])

    @property
    def gpus(self) -> np.ndarray:
        """GPUs of one replica: ``tp x dp``."""
        return self.tp * self.dp


class OwnerSpace:
    """The owners' candidates of one search (one SLO, inventory, grid and group bound);
    ``cache`` is shared between searches of one plan() call, so what they have in common
    (tables, dominance, legality) is computed once. ``frontier``: apply per-owner frontiers
    where exact (never for the ``"gpus"`` objective, whose GPU counts the frontier ignores)."""

    def __init__(
        self,
        tables: OpTables,
        devices: Sequence[Device],
        *,
        slo_s: float,
        limits: dict[str, int],
        u_grid: tuple[int, ...],
        max_group_gpus: int,
        frontier: bool,
        stats: SearchStats,
        cache: dict[tuple[object, ...], object],
    ) -> None:
        self.tables = tables
        self.devices = list(devices)
        self.slo = slo_s
        self.limits = limits
        self.u_grid = u_grid
        self.max_group_gpus = max_group_gpus
        self.frontier = frontier
        self.stats = stats
        self.cache = cache

    def parallelisms(self, job: Job, j: int, d: int) -> tuple[Parallelism, ...]:
        """Owner ``j``'s parallelisms on device ``d``: those offered whose operators split."""
        # what decides them: which distinct operators the owner runs
        held = tuple(np.flatnonzero(job.st.counts[j].sum(axis=0)).tolist())
        key = ("pars", held, d, self.max_group_gpus)
        if key not in self.cache:
            dev = self.devices[d]
            ops = [self.tables.reps[k][0] for k in held]
            pars = candidate_parallelisms(dev, ops, self.max_group_gpus)

            def legal(par: Parallelism) -> bool:
                for k in held:  # per distinct operator, memoised across owners
                    lkey = ("legal", k, d, par)
                    if lkey not in self.cache:
                        op = [self.tables.reps[k][0]]
                        self.cache[lkey] = (
                            parallelism_problem(self.tables.model, par, dev.hardware, op) is None
                        )
                    if not self.cache[lkey]:
                        return False
                return True

            # plain TP at a degree the whole model splits over needs no check (devices.py)
            plain = dev.tps if dev.plain_tps is None else dev.plain_tps
            self.cache[key] = tuple(p for p in pars if (p.plain and p.tp in plain) or legal(p))
        return self.cache[key]  # type: ignore[return-value]

    def prunable(self, job: Job) -> bool:
        """Whether per-owner frontiers are exact for this sub-search: not where an inventory
        bounds one of its GPU types (see :class:`~.search.Searcher`)."""
        if not self.frontier:
            return False
        return not any(self.devices[d].id in self.limits for d in job.assign)

    def table(self, job: Job, j: int) -> OwnerTable:
        """Every configuration of owner ``j`` on its device, whatever ``M`` and the SLO."""
        d = job.assign[j]
        key = ("table", job.rank, j, d, self.u_grid, self.max_group_gpus)
        cached = self.cache.get(key)
        if cached is not None:
            return cached  # type: ignore[return-value]
        st, dev = job.st, self.devices[d]
        pars = self.parallelisms(job, j, d)
        caps = self.tables.max_resident_batches(st.counts[j].sum(axis=0), dev, pars)
        fitting: list[tuple[Parallelism, int, list[int]]] = []
        for par, cap in zip(pars, caps.tolist(), strict=True):
            grid = u_grid_for_dp(self.u_grid, par.dp)
            fits = sum(u <= cap for u in grid)  # a prefix: the grid is sorted
            if fits:
                fitting.append((par, cap, grid))
        parts: list[tuple[Parallelism, int, list[int], np.ndarray]] = []
        if dev.host.orchestration is None:
            # one product for every parallelism: each grid's operator latencies are shared by
            # every owner on this device (cached), sliced to the batches that fit
            mats = [self.tables.latency(dev, par, grid) for par, _, grid in fitting]
            comp = st.counts[j] @ np.concatenate(mats, axis=1) if mats else None
            col = 0
            for par, cap, grid in fitting:
                fits = sum(u <= cap for u in grid)
                assert comp is not None
                parts.append((par, cap, grid[:fits], comp[:, col : col + fits]))
                col += len(grid)
        else:
            for par, cap, grid in fitting:
                fits = sum(u <= cap for u in grid)
                comp = owner_compute(st, self.tables, j, dev, par, grid)[:, :fits]
                parts.append((par, cap, grid[:fits], comp))
        sizes = [len(g) for _, _, g, _ in parts]

        def per_config(values: list[int]) -> np.ndarray:
            return np.repeat(np.asarray(values, dtype=np.int64), sizes)

        lat = np.concatenate([c for *_, c in parts], axis=1) if parts else np.zeros((0, 0))
        table = OwnerTable(
            tp=per_config([p.tp for p, *_ in parts]),
            ep=per_config([p.ep for p, *_ in parts]),
            dp=per_config([p.dp for p, *_ in parts]),
            cap=per_config([c for _, c, *_ in parts]),
            u=np.asarray([u for _, _, g, _ in parts for u in g], dtype=np.int64),
            lat=lat,
            total=lat.sum(axis=0) if parts else np.zeros(0),
        )
        self.cache[key] = table
        return table

    def dominated(self, job: Job, j: int, table: OwnerTable) -> tuple[np.ndarray, np.ndarray]:
        """``(xs, ys)``: configuration ``xs[i]`` of the table dominates ``ys[i]`` (frontier.py).
        Rate per request is ``tp x dp x price / (M u)``: ``M`` and the price cancel."""
        key = ("dominated", job.rank, j, job.assign, self.u_grid, self.max_group_gpus, self.slo)
        cached = self.cache.get(key)
        if cached is None:
            # only configurations within the SLO at one microbatch can be options at all
            rows = np.flatnonzero(table.total <= self.slo * (1 + EPS))
            dev = self.devices[job.assign[j]]
            tp, u, dp = table.tp[rows], table.u[rows], table.dp[rows]
            links = self.frontier_links(job, j, dev, tp, u, dp)
            rate = tp * dp / u.astype(np.float64)
            xs, ys = dominated_pairs(tp, rate, table.lat[:, rows], *links)
            cached = (rows[xs], rows[ys])
            self.cache[key] = cached
        return cached  # type: ignore[return-value]

    def feasible(self, job: Job, j: int) -> tuple[OwnerTable, np.ndarray]:
        """Owner ``j``'s table and which configurations fit memory, the SLO and the inventory
        at the sub-search's microbatch count."""
        limit = self.limits.get(self.devices[job.assign[j]].id)
        key = (
            "feasible",
            job.rank,
            j,
            job.assign,
            job.microbatches,
            self.slo,
            limit,
            self.u_grid,
            self.max_group_gpus,
        )
        cached = self.cache.get(key)
        if cached is None:
            m, table = job.microbatches, self.table(job, j)
            mask = (table.u * m <= table.cap) & (m * table.total <= self.slo * (1 + EPS))
            if limit is not None:
                mask &= table.gpus <= limit  # one replica alone needs more GPUs than that
            self.stats.owner_configs += int(mask.sum())
            cached = self.cache[key] = (table, mask)
        return cached  # type: ignore[return-value]

    def options(self, job: Job, j: int, prune: bool = True) -> OwnerOptions:
        """Owner ``j``'s candidate configurations, reduced to its frontier where that is exact
        (``prune``). A frontier keeps the least work, rate and full-occupancy cost of the set
        (a dominating configuration is no worse in each), so sub-search root bounds are the same
        without it: :meth:`run` bounds with ``prune=False`` and reduces only the sub-searches
        it solves."""
        frontier = prune and self.prunable(job)
        limit = self.limits.get(self.devices[job.assign[j]].id)
        key = (
            "options",
            job.rank,
            j,
            job.assign,
            job.microbatches,
            self.slo,
            frontier,
            limit,
            self.u_grid,
            self.max_group_gpus,
        )
        cached = self.cache.get(key)
        if cached is not None:
            return cached  # type: ignore[return-value]
        m, dev = job.microbatches, self.devices[job.assign[j]]
        table, mask = self.feasible(job, j)
        if frontier and mask.sum() > 1:
            xs, ys = self.dominated(job, j, table)
            beaten = np.zeros_like(mask)
            beaten[ys[mask[xs] & mask[ys]]] = True
            self.stats.frontier_removed += int((beaten & mask).sum())
            mask = mask & ~beaten
        u = table.u[mask]
        gpus = table.gpus[mask]
        opts = OwnerOptions(
            dev,
            table.tp[mask],
            u,
            table.total[mask],
            np.asarray(usd_per_hour_per_request(gpus, dev.usd_per_hour, m * u.astype(np.float64))),
            table.ep[mask],
            table.dp[mask],
        )
        self.cache[key] = opts
        return opts

    def frontier_links(
        self, job: Job, j: int, dev: Device, tp: np.ndarray, u: np.ndarray, dp: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Link times of owner j's configurations, and which may be compared at all.

        A boundary's transfer takes ``max(send, recv) + fan_out``, so the owner's send, receive
        and fan-out times are compared separately; each DP rank's leader moves its own
        ``u / dp`` tokens. They are partner-independent only when the link kind is: always the
        network against a partner of another GPU type, and against one of the same type only
        when a replica's ``tp x dp >= gpus_per_node`` (no pod fits in a node). Otherwise the
        pod rule could give X and Y different link kinds, which would change the partner's side
        of the transfer too, so those configurations are left unpruned.
        """
        rows = []
        uf = u.astype(np.float64) / dp
        comparable = np.ones(tp.shape[0], dtype=bool)
        net = dev.network
        for g in job.st.groups:
            if j not in (g.src, g.dst):
                continue
            partner = self.devices[job.assign[g.dst if g.src == j else g.src]]
            if partner.id == dev.id:
                comparable &= tp * dp >= dev.hardware.gpus_per_node
            if g.src == j:
                rows.append(link_time_s(net.latency_s, net.s_per_byte, g.beta * uf))
            if g.dst == j:
                rows.append(link_time_s(net.latency_s, net.s_per_byte, g.beta * uf))
                rows.append(fan_out_s(g.beta, uf, tp, *dev.intra.coeffs))
        links = np.stack(rows) if rows else np.zeros((0, tp.shape[0]))
        return links, comparable
