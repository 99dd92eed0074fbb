"""Measure a profile: every distinct operator over a batch x context grid, plus transfers.

The flow: resolve the device and model, pick one runtime operator per profile key, build the
layers that hold them (in chain mode, more layers, up to a stage-sized working set), time every
operator on the input its predecessor produced over the batch grid, and ``core_attn`` over the
context grid too with synthetic state, measure point-to-point transfers in two processes,
describe the device, and fit the roofline's efficiency factors to the result. Everything lands
in one :class:`Profile` with provenance.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError

from opweave.costmodel import (
    MAX_STALL_OVERHEAD,
    EfficiencyFit,
    OpLatencyTable,
    Profile,
    Provenance,
    fit_efficiency_report,
    weight_bytes_per_rank,
)
from opweave.costmodel.errors import ConfigError, not_a_file, validation_message
from opweave.runtime import (
    BatchMeta,
    DecodeStep,
    Operator,
    StatefulOperator,
    StaticStep,
    TokenBatch,
)

from ..errors import ProfilerError
from .device import (
    cache_bytes,
    describe_device,
    device_name,
    resolve_device,
    state_budget_bytes,
)
from .idle import PROBE_BYTES, IdleFit, measure_idle_slowdown
from .operators import (
    Chain,
    ModelSource,
    OpTarget,
    build_chains,
    check_kernels,
    decode_batch,
    plan_block,
    plan_chains,
    request_ids,
    resolve_model,
    select_targets,
)
from .orchestration import OrchestrationFit, measure_orchestration
from .progress import Progress
from .state import StateWriter
from .timing import (
    Measurement,
    Timer,
    TimingSettings,
    available_cores,
    make_timer,
    pinned_cpu,
    stall_overhead,
    summarize,
)
from .transfer import TransferFit, measure_transfer, unavailable_reason

CPU_BATCHES = (1, 2, 4, 8, 16, 32, 64)
CPU_CONTEXTS = (64, 256, 1024, 4096)
CUDA_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CUDA_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

# Assumed when the device reports no cache size: a large server CPU's last-level cache.
DEFAULT_CACHE_BYTES = 128 * 2**20
Grid = dict[int, dict[int, list[Measurement]]]  # batch -> context column -> one per pass
TIMING_MODES = ("chain", "isolated")


@dataclass(frozen=True)
class ProfileRun:
    """A measured profile and what it took."""

    profile: Profile
    fit: EfficiencyFit | None
    transfer: TransferFit | None
    cells: int
    wall_s: float
    orchestration: OrchestrationFit | None = None
    idle: IdleFit | None = None


# A CPU rank of the runtime runs one torch thread on a core of its own (see opweave.runtime).
CPU_RANK_THREADS = 1


def default_grid(device: str | torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Log-spaced (batches, contexts): decode-sized on CPU, 1-256 x 1K-128K on CUDA."""
    if torch.device(device).type == "cuda":
        return CUDA_BATCHES, CUDA_CONTEXTS
    return CPU_BATCHES, CPU_CONTEXTS


def _grid(values: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(sorted({int(v) for v in values}))
    if not out or out[0] < 1:
        raise ProfilerError(f"{what} must be positive integers, got {list(values)}")
    return out


def _versions(device: torch.device) -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    if device.type == "cuda" and torch.version.cuda:
        out["cuda"] = torch.version.cuda
    for dist in ("opweave-profiler", "opweave-runtime", "opweave-costmodel"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "source"
    return out


class _Runner:
    """Walks the chains of one model and fills ``grids`` (profile key -> batch -> columns)."""

    def __init__(
        self,
        source: ModelSource,
        device: torch.device,
        timer: Timer,
        batches: tuple[int, ...],
        contexts: tuple[int, ...],
        progress: Progress,
        seed: int,
        decode_step: str = "per-request",
    ) -> None:
        self.source, self.device, self.timer = source, device, timer
        # over static decode steps each operator runs as a rank's rows runner runs a segment's
        # step (StaticStep.run_rows), built (and compiled) once per operator and batch
        self.decode_step = DecodeStep(decode_step)
        self._steps: dict[tuple[int, int], StaticStep] = {}
        self.batches, self.contexts = batches, contexts
        self.progress = progress
        self.seed = seed
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.grids: dict[str, Grid] = {}
        self.aliased: set[tuple[str, int]] = set()  # (key, context) with shared KV buffers
        self.state_fill = "direct"

    def _time(self, op: Operator, batch: TokenBatch) -> Measurement:
        return self.timer.measure(lambda _: op(batch))

    def _time_stateful(
        self, writer: StateWriter, rids: tuple[str, ...], tensors: dict, context: int
    ) -> Measurement:
        op = writer.op
        if writer.direct:
            meta = BatchMeta(rids, (1,) * len(rids), (context,) * len(rids))
            batch = TokenBatch(meta, tensors)
            return self.timer.measure(
                lambda _: op(batch), setup=lambda _: writer.rewind(rids, context)
            )
        make = writer.step_batch(rids, tensors)
        holder: list[TokenBatch] = []

        def setup(i: int) -> None:
            if holder:
                writer.advanced(rids)
                holder.clear()
            holder.append(make())

        result = self.timer.measure(lambda _: op(holder[0]), setup=setup)
        writer.advanced(rids)
        return result

    def run(self, chain: Chain) -> None:
        c0 = self.contexts[0]
        writers: dict[int, StateWriter] = {}
        budget = state_budget_bytes(self.device)
        for idx, op in enumerate(chain.ops):
            if isinstance(op, StatefulOperator):
                writers[idx] = StateWriter(op, chain.ops[:idx], budget_bytes=budget, seed=self.seed)
                if not writers[idx].direct:
                    self.state_fill = "prefill (runtime state layout not recognised)"
        saved: dict[int, dict[int, dict[str, torch.Tensor]]] = {i: {} for i in writers}
        for b in self.batches:
            batch = decode_batch(chain, self.source, b, c0, self.device, self.gen)
            for idx, op in enumerate(chain.ops):
                target = chain.timed.get(idx)
                writer = writers.get(idx)
                label = f"{target.key if target else op.name} b={b}"
                if writer is None:
                    if target is not None:
                        self._record(target.key, b, 0, self._time(op, batch), label)
                    batch = op(batch)
                    continue
                rids = request_ids(b)
                writer.fill(rids, c0)
                if target is not None and target.context_dependent:
                    saved[idx][b] = dict(batch.tensors)
                elif target is not None:
                    m = self._time_stateful(writer, rids, batch.tensors, c0)
                    self._record(target.key, b, 0, m, label)
                    writer.fill(rids, c0)
                batch = op(writer.step_batch(rids, batch.tensors)())
                writer.release()
        for idx, writer in writers.items():
            target = chain.timed.get(idx)
            if target is None or not target.context_dependent:
                continue
            for col, s in enumerate(self.contexts):
                writer.fill(request_ids(self.batches[-1]), s)
                if writer.aliased:
                    self.aliased.add((target.key, s))
                for b in self.batches:
                    m = self._time_stateful(writer, request_ids(b), saved[idx][b], s)
                    self._record(target.key, b, col, m, f"{target.key} b={b} s={s}")
                writer.release()

    def run_in_order(self, chain: Chain) -> None:
        """Decode-order timing: per (batch, context) cell the whole chain runs, each operator on
        its predecessor's output, with a clock around every call; per key, the median over
        repeats and over the chain's layers that hold it.

        Context-free operators are recorded from the first context's runs only (their tables
        have one column); stateful ones get state as in :meth:`run`, rewound before each repeat.
        """
        s = self.timer.settings
        writers = self._writers(chain)
        targets = {t.key: t for t in chain.timed.values()}
        has_context = any(t.context_dependent for t in targets.values())
        n_timed = max(len(targets), 1)
        for b in self.batches:
            rids = request_ids(b)
            for col, ctx in enumerate(self.contexts):
                if col > 0 and not has_context:
                    break
                for idx, writer in writers.items():
                    writer.fill(rids, ctx)
                    if writer.aliased and idx in chain.timed:
                        self.aliased.add((chain.timed[idx].key, ctx))
                first = decode_batch(chain, self.source, b, ctx, self.device, self.gen)

                def step(
                    rows: dict[str, list[float]] | None,
                    first: TokenBatch = first,
                    rids: tuple[str, ...] = rids,
                    ctx: int = ctx,
                ) -> None:
                    self._chain_step(chain, writers, first, rids, ctx, rows)

                gc_was_enabled = gc.isenabled()
                gc.disable()
                try:
                    started = time.perf_counter()
                    for _ in range(s.warmup):
                        step(None)
                    per_run = (time.perf_counter() - started) / max(s.warmup, 1)
                    extra = (
                        math.floor(s.cell_budget_s * n_timed / per_run)
                        if per_run > 0
                        else s.max_repeats
                    )
                    repeats = max(s.repeats, min(s.max_repeats, extra))
                    rows: dict[str, list[float]] = {key: [] for key in targets}
                    for _ in range(repeats):
                        step(rows)
                finally:
                    if gc_was_enabled:
                        gc.enable()
                for key, target in targets.items():
                    if col > 0 and not target.context_dependent:
                        continue
                    label = f"{key} b={b}" + (f" s={ctx}" if target.context_dependent else "")
                    self._record(key, b, col, summarize(rows[key]), label)
                for writer in writers.values():
                    writer.release()

    def _writers(self, chain: Chain) -> dict[int, StateWriter]:
        """A state writer for every stateful operator of ``chain``, sharing the state budget."""
        stateful = [i for i, op in enumerate(chain.ops) if isinstance(op, StatefulOperator)]
        budget = state_budget_bytes(self.device) / max(len(stateful), 1)
        writers: dict[int, StateWriter] = {}
        for idx in stateful:
            start = idx
            while start > 0 and chain.refs[start - 1].layer == chain.refs[idx].layer:
                start -= 1
            op = chain.ops[idx]
            assert isinstance(op, StatefulOperator)
            writers[idx] = StateWriter(
                op, chain.ops[start:idx], budget_bytes=budget, seed=self.seed
            )
            if not writers[idx].direct:
                self.state_fill = "prefill (runtime state layout not recognised)"
        return writers

    def _chain_step(
        self,
        chain: Chain,
        writers: dict[int, StateWriter],
        first: TokenBatch,
        rids: tuple[str, ...],
        ctx: int,
        rows: dict[str, list[float]] | None,
    ) -> None:
        """One decode step through ``chain``; appends each timed operator's latency to ``rows``
        under its key."""
        cuda = self.device.type == "cuda"
        batch = first
        for idx, op in enumerate(chain.ops):
            writer = writers.get(idx)
            if writer is not None:
                if writer.direct:
                    writer.rewind(rids, ctx)
                else:
                    batch = writer.step_batch(rids, batch.tensors)()
            step = self._static_step(idx, op, len(rids))
            if cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter_ns()
            if step is None:
                batch = op(batch)
            else:  # the rows runner's call: inputs in the step's rows, outputs likewise
                held = list(batch.meta.context_lens)
                out = step.run_rows(dict(batch.tensors), rids, held, range(len(rids)))
                batch = TokenBatch(batch.meta, out)
            if cuda:
                torch.cuda.synchronize(self.device)
            dt = (time.perf_counter_ns() - t0) * 1e-9
            if writer is not None and not writer.direct:
                writer.advanced(rids)
            if rows is not None and idx in chain.timed:
                rows[chain.timed[idx].key].append(dt)

    def _static_step(self, idx: int, op: Operator, rows: int) -> StaticStep | None:
        """Operator ``idx`` of the chain as a static decode step of ``rows`` rows (None: the
        per-request form), as a rank under ``--decode-step`` runs it."""
        if not self.decode_step.static:
            return None
        key = (idx, rows)
        built = self._steps.get(key)
        if built is None:
            compiler = self.decode_step.compiler
            built = self._steps[key] = StaticStep([op], None, rows, compile=compiler)
        return built

    def _record(self, key: str, batch: int, col: int, m: Measurement, label: str) -> None:
        self.grids.setdefault(key, {}).setdefault(batch, {}).setdefault(col, []).append(m)
        self.progress.update(label)


def _flat(cells: dict[int, list[Measurement]]) -> list[Measurement]:
    """Every pass's measurement of a batch's cells."""
    return [m for passes in cells.values() for m in passes]


def _passes(ms: list[Measurement]) -> tuple[float, float]:
    """A cell's latency and spread over its passes: the median of the passes' medians (two
    passes: their mean). Not the lower one: on a shared VM the machine's own speed drifts by up
    to 2-3x within seconds (a fixed GEMM, timed again and again, shows it), and the lower pass
    would describe the fast moments only, which a serving run does not get."""
    return (
        float(np.median([m.median_s for m in ms])),
        float(np.median([m.iqr_s for m in ms])),
    )


def _tables(
    targets: Sequence[OpTarget],
    grids: dict[str, Grid],
    batches: tuple[int, ...],
    contexts: tuple[int, ...],
) -> tuple[OpLatencyTable, ...]:
    """One table per target; a target timed under another key copies that key's grid."""
    tables = []
    for t in targets:
        grid = grids[t.same_as or t.key]
        cols = range(len(contexts) if t.context_dependent else 1)
        tables.append(
            OpLatencyTable(
                op=t.key,
                tp=1,
                batches=batches,
                contexts=contexts[: len(cols)],
                latency_s=tuple(tuple(_passes(grid[b][c])[0] for c in cols) for b in batches),
                spread_s=tuple(tuple(_passes(grid[b][c])[1] for c in cols) for b in batches),
            )
        )
    return tuple(tables)


def profile_model(
    model: str | Path,
    *,
    device: str = "cpu",
    dtype: str | None = None,
    tp: Sequence[int] = (1,),
    batches: Sequence[int] | None = None,
    contexts: Sequence[int] | None = None,
    ops: Sequence[str] | None = None,
    timing: TimingSettings | None = None,
    timing_mode: str | None = None,
    working_set_bytes: float | None = None,
    threads: int | None = None,
    transfer: bool = True,
    orchestration: bool = True,
    idle: bool = True,
    fit: bool = True,
    usd_per_hour: float | None = None,
    random_weights: bool = False,
    kernels: str = "opweave",
    decode_step: str = "per-request",
    seed: int = 0,
    progress: bool = True,
) -> ProfileRun:
    """Time the runtime's operators of ``model`` on ``device`` and return the profile.

    ``model`` is a built-in name, a ``config.json`` or a model folder; without weights in it
    (or with ``random_weights``), operators get random weights of the right shapes.

    ``timing_mode`` is ``"chain"`` (each operator timed inside the block's operator chain, run
    in decode order; the default on CPU) or ``"isolated"`` (one operator called back to back
    with hot caches; the default on CUDA, timed with CUDA events).

    ``threads``: torch's intra-op threads while timing. On CPU it defaults to one, as every CPU
    rank of the runtime runs (one thread, pinned to a core); elsewhere to every core.

    In the chain, layers are added until their weights reach ``working_set_bytes`` (default:
    twice the device's largest cache, so that no operator finds its weights still cached, as
    in a stage of the model; see :func:`plan_block`).

    ``kernels``: which kernels the timed operators run, as ``opweave run --kernels`` chooses
    them: ``"opweave"`` (the runtime's own), ``"vllm"`` or ``"vllm-all"`` (vLLM's CPU kernels
    where they apply: only the exact ones, or all); the profile's provenance lists what ran.

    ``decode_step``: how the timed operators run decode steps, as ``opweave run
    --decode-step`` runs them on a rank: ``"per-request"`` (each operator's per-request form),
    ``"static"``, ``"compiled"`` or ``"traced"`` (each operator as a static decode step of the
    batch's rows, the step a rank's rows runner calls, compiled alike; a rank fuses a segment's
    operators into one such step, which the profile's per-operator tables split at operator
    boundaries). Decode-order chain timing only; the provenance records it.

    On CPU, with the model's weights at hand, ``orchestration`` also measures the serving loop's
    host time per stage and per driven microbatch in two short colocated runs of the runtime
    (see :mod:`.orchestration`), and ``idle`` how much slower data the caches held is read
    after idling, as a waiting pipeline stage does (see :mod:`.idle`).
    """
    started = time.perf_counter()
    dev = resolve_device(device)
    if sorted(set(tp)) != [1]:
        raise ProfilerError(
            f"--tp {','.join(map(str, tp))}: the profiler measures the runtime's operators on "
            f"one {dev.type} rank only, so only --tp 1 can be measured for now"
        )
    check_kernels(kernels, dev)
    if decode_step not in set(DecodeStep):
        raise ProfilerError(f"--decode-step {decode_step}: choose one of {', '.join(DecodeStep)}")
    default_b, default_s = default_grid(dev)
    grid_b = _grid(batches or default_b, "batches")
    grid_s = _grid(contexts or default_s, "contexts")
    if threads is not None and threads < 1:
        raise ProfilerError(f"--threads must be at least 1, got {threads}")
    if threads is None and dev.type == "cpu":
        threads = CPU_RANK_THREADS
    mode = timing_mode or ("isolated" if dev.type == "cuda" else "chain")
    if mode not in TIMING_MODES:
        raise ProfilerError(f"--timing {mode}: choose one of {', '.join(TIMING_MODES)}")
    if decode_step != "per-request" and mode != "chain":
        raise ProfilerError(
            f"--decode-step {decode_step} is timed in decode order only: use --timing chain"
        )
    settings = timing or (
        TimingSettings(cell_budget_s=0.02, passes=1) if dev.type == "cuda" else TimingSettings()
    )
    source = resolve_model(model, dtype=dtype, random_weights=random_weights)
    targets = select_targets(source, ops)
    if working_set_bytes is None:
        working_set_bytes = 2.0 * (cache_bytes(dev) or DEFAULT_CACHE_BYTES)
    if working_set_bytes < 0:
        raise ProfilerError(f"the working set must not be negative, got {working_set_bytes}")
    chains = (
        plan_block(source, targets, working_set_bytes)
        if mode == "chain"
        else plan_chains(source, targets)
    )
    chain_layers = sorted({r.layer for c in chains for r in c.refs if r.layer is not None})
    measured = [t for t in targets if t.same_as is None]
    cells = sum(len(grid_b) * (len(grid_s) if t.context_dependent else 1) for t in measured)
    total = cells * settings.passes
    bar = Progress(total, enabled=progress)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    name = device_name(dev)
    bar.note(
        f"{source.name} ({source.dtype}) on {name}: {len(targets)} operators, "
        f"{len(measured)} timed, {cells} cells"
    )
    spin = ranks_spin(dev)  # before pinning: ranks get the machine's cores, one each
    with pinned_cpu(threads) as cores, torch.inference_mode():
        n_threads = torch.get_num_threads()
        weights, kernel_ops = build_chains(
            source, chains, dev, seed=seed, kernels=kernels, static=decode_step != "per-request"
        )
        runner = _Runner(
            source, dev, make_timer(dev, settings), grid_b, grid_s, bar, seed, decode_step
        )
        for _ in range(settings.passes):
            for chain in chains:
                if mode == "chain":
                    runner.run_in_order(chain)
                else:
                    runner.run(chain)
        chain_bytes = weight_bytes_per_rank(
            [op for op in source.cost.operators if op.layer is None or op.layer in chain_layers],
            1,
        )
        idle_fit: IdleFit | None = None
        why_no_idle = _idle_unavailable(dev, chain_bytes) if idle else "skipped"
        if why_no_idle is None:
            bar.note("timing reads of a buffer after idle gaps")
            idle_fit = measure_idle_slowdown(int(min(chain_bytes, PROBE_BYTES)), spin=spin)
        del chains
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    link: TransferFit | None = None
    why_not = unavailable_reason(dev) if transfer else "skipped (--no-transfer)"
    if why_not is None:
        bar.note("measuring point-to-point transfers between two processes")
        link = measure_transfer(dev)
    loop: OrchestrationFit | None = None
    why_no_loop = _orchestration_unavailable(dev, source) if orchestration else "skipped"
    if why_no_loop is None:
        assert source.weights_dir is not None
        bar.note("measuring the serving loop's host time (two short colocated runs)")
        loop = measure_orchestration(source.weights_dir, seed=seed)
    with pinned_cpu(threads):
        hardware, peaks_measured = describe_device(
            dev,
            source.torch_dtype,
            threads=n_threads,
            usd_per_hour=usd_per_hour,
            link=(link.latency_s, link.bandwidth_bytes_per_s) if link else None,
        )
    tables = _tables(targets, runner.grids, grid_b, grid_s)
    timed = [m for grid in runner.grids.values() for cells in grid.values() for m in _flat(cells)]
    stalls = stall_overhead(timed)
    if stalls > MAX_STALL_OVERHEAD:
        raise ConfigError(
            f"the timed calls' mean is {1 + stalls:.0f} times their median: the machine stalled "
            "the measurement (other work, throttling); profile on a quiet machine"
        )
    settings_doc: dict[str, str | int | float | list[int] | list[str]] = {
        "device": str(dev),
        "timing": mode,
        "chain_layers": chain_layers,
        "working_set_bytes": round(working_set_bytes),
        "timer": (
            "decode-order chain: time.perf_counter_ns around each operator"
            + (" (synchronised)" if dev.type == "cuda" else ", pinned threads")
            if mode == "chain"
            else runner.timer.name
        ),
        "threads": n_threads,
        "cores": list(cores),
        "warmup": settings.warmup,
        "repeats": settings.repeats,
        "cell_budget_s": settings.cell_budget_s,
        "passes": settings.passes,
        "batches": list(grid_b),
        "contexts": list(grid_s),
        "tp": [1],
        "weights": weights,
        "kernels": kernels,
        "kernel_ops": kernel_ops,
        "decode_step": decode_step,
        "seed": seed,
        "state_fill": runner.state_fill,
        "aliased_state": sorted(f"{k} s={c}" for k, c in runner.aliased),
        "shared_tables": [f"{t.key}={t.same_as}" for t in targets if t.same_as],
        "load_average_at_start": round(load, 2),
        "transfer": f"{link.backend} ping-pong: {link.protocol}" if link else str(why_not),
    }
    if link is not None:
        settings_doc["transfer_points"] = [f"{n}B:{s:.3e}s" for n, s in link.points]
    settings_doc["orchestration"] = loop.describe() if loop else f"not measured ({why_no_loop})"
    settings_doc["stalls"] = (
        f"the mean of the timed calls is {stalls:.1%} above their median, pooled over "
        f"{len(timed)} cells and passes (sum of means / sum of medians): operator latencies "
        "from this profile are scaled by that (stall_overhead; the tables hold medians)"
    )
    settings_doc["idle_slowdown"] = (
        idle_fit.describe() if idle_fit else f"not measured ({why_no_idle})"
    )
    if link is not None and link.busy is not None:
        settings_doc["transfer_busy"] = (
            f"{link.busy['bytes']:.0f} B messages after {link.busy['work_alone_s'] * 1e3:.2f} ms "
            f"of GEMMs on both ranks: round {link.busy['round_s'] * 1e3:.3f} ms; send call "
            f"(host_send) {link.host_send_s * 1e6:.0f} us, arrived message to operators "
            f"(host_recv) {link.host_recv_s * 1e6:.0f} us"
        )
    draft = Profile(
        device=hardware,
        model=source.name,
        config_sha256=source.cost.config_sha256,
        dtype=source.dtype,
        ops=tables,
        transfers=(link.profile(),) if link else (),
        orchestration=loop.profile if loop else None,
        idle_slowdown=idle_fit.slowdown if idle_fit else None,
        stall_overhead=stalls,
        provenance=Provenance(
            source="measured",
            device_name=name,
            versions=_versions(dev),
            settings=settings_doc,
        ),
    )
    report = fit_efficiency_report(draft, source.cost) if fit else None
    profile = draft
    if report is not None and peaks_measured:
        note = (
            "device peaks measured by the profiler; efficiencies fitted to these tables "
            f"(median error x{report.median_error_factor:.2f})"
        )
        profile = draft.model_copy(
            update={
                "device": report.hardware,
                "provenance": draft.provenance.model_copy(update={"note": note}),
            }
        )
    profile = Profile.model_validate(profile.model_dump())
    return ProfileRun(profile, report, link, cells, time.perf_counter() - started, loop, idle_fit)


def ranks_spin(dev: torch.device, wait: str = "auto") -> bool:
    """Whether the runtime's ranks busy-poll while they wait on this machine, run with
    ``RunOptions(wait=wait)``: by default CPU ranks with a core each (a plan's ranks here get
    one per core when there are enough; see ``opweave.runtime``'s wire)."""
    from opweave.runtime import RunOptions, Wait

    options = RunOptions(device="cpu", wait=Wait(wait))
    return dev.type == "cpu" and options.spin_s(len(available_cores()) >= 2) > 0


def _idle_unavailable(dev: torch.device, chain_bytes: float) -> str | None:
    """Why the slowdown after idling cannot be measured here, or None."""
    if dev.type != "cpu":
        return "measured on CPU ranks only, whose caches other work shares"
    cache = cache_bytes(dev) or DEFAULT_CACHE_BYTES
    if chain_bytes > cache:
        return (
            f"the profiled operators' weights ({chain_bytes / 2**20:.0f} MiB) exceed the caches "
            f"({cache / 2**20:.0f} MiB): they were timed cold already"
        )
    return None


def _orchestration_unavailable(dev: torch.device, source: ModelSource) -> str | None:
    """Why the serving loop's host time cannot be measured here, or None."""
    if dev.type != "cpu":
        return "measured on CPU ranks only, whose one thread runs both loop and operators"
    if source.weights_dir is None:
        return (
            "the runtime's loop runs the model, which needs its weights: a model folder with "
            "safetensors, without --random-weights"
        )
    return None


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON (the cost model's Profile schema)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.model_dump_json(indent=2) + "\n")
    return path


def load_profile(path: str | Path) -> Profile:
    """Read a profile file, with one-line errors for a missing, corrupt or foreign file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"profile file {path} {not_a_file(path)}")
    try:
        return Profile.from_json(path.read_bytes())
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "file"
        raise ConfigError(
            f"profile file {path} is not a valid profile ({where}: "
            f"{validation_message(err)}); "
            "re-run opweave profile"
        ) from None
