"""The decode-size TP all-reduce of a GPU from the silicon database, as the cost model's catalog
describes it: a latency floor plus a ring-equivalent bandwidth.

Decode steps run under CUDA graphs, so the all-reduce they pay is the engines' custom all-reduce
as captured in a graph (its buffers registered at capture, no copy-in, no per-call launch): the
database's ``custom_allreduce_perf`` rows of the graph backend (vLLM's and SGLang's tables name
it; TensorRT-LLM's name no backend). Each engine dispatches among its algorithms by size, so per
GPU count and message size the fastest engine's time is taken, from each engine's newest
measured version, and fitted to

    latency + 2 (t - 1) / t x bytes / bandwidth

over messages of 1 KiB to 1 MiB (a decode step's 1-64 tokens of a 4-8K hidden state) at
t = 2, 4 and 8 GPUs. ``tools/aic_allreduce.py`` prints the fit of every system; the GPU
catalog's ``allreduce_latency_s`` / ``allreduce_bandwidth_bytes_per_s`` carry it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ProfilerError
from .aic_db import ENGINES, Database
from .aic_kernels import ALLREDUCE, DEFAULTS, graph_allreduce_rows, table_version

SMALLEST_BYTES = 1 << 10
LARGEST_BYTES = 1 << 20
GPU_COUNTS = (2, 4, 8)


@dataclass(frozen=True)
class AllreduceFit:
    system: str
    latency_s: float
    bandwidth_bytes_per_s: float
    max_residual_s: float
    points: int
    sources: tuple[str, ...]  # "engine version" of each table taken


def _fastest_graph_rows(db: Database, system: str) -> tuple[dict[tuple[int, int], float], list]:
    fastest: dict[tuple[int, int], float] = {}
    sources = []
    op, table, columns = ALLREDUCE
    for engine in ENGINES:
        version = table_version(db, system, op, engine, table)
        if version is None:
            continue
        rows = db.read(db.root / system / op / engine / version, table, columns, DEFAULTS[table])
        keep = graph_allreduce_rows(rows)
        sources.append(f"{engine} {version}")
        for gpus, elements, seconds in zip(
            rows["num_gpus"][keep], rows["message_size"][keep], rows["latency"][keep], strict=True
        ):
            key = (int(gpus), int(elements) * 2)  # message_size counts 16-bit elements
            fastest[key] = min(fastest.get(key, np.inf), float(seconds) * 1e-3)
    return fastest, sources


def allreduce_fit(db: Database, system: str) -> AllreduceFit:
    """The fit of ``system``'s fastest CUDA-graph all-reduce (module doc)."""
    fastest, sources = _fastest_graph_rows(db, system)
    cells = [
        (gpus, size, seconds)
        for (gpus, size), seconds in fastest.items()
        if gpus in GPU_COUNTS and SMALLEST_BYTES <= size <= LARGEST_BYTES
    ]
    if len(cells) < 3:
        raise ProfilerError(
            f"the {db.origin} has too few all-reduce measurements for {system} to fit "
            f"({len(cells)} in 1 KiB-1 MiB at {', '.join(map(str, GPU_COUNTS))} GPUs)"
        )
    gpus, size, seconds = (np.array(c, dtype=np.float64) for c in zip(*cells, strict=True))
    design = np.column_stack([np.ones_like(size), 2 * (gpus - 1) / gpus * size])
    (latency, per_byte), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    residual = float(np.abs(design @ np.array([latency, per_byte]) - seconds).max())
    return AllreduceFit(
        system=system,
        latency_s=float(latency),
        bandwidth_bytes_per_s=float(1.0 / per_byte),
        max_residual_s=residual,
        points=len(cells),
        sources=tuple(sources),
    )
