"""Helpers shared by every command: parsing values, checking paths, printing results.

The option declarations are in :mod:`._options` and tables in :mod:`._console`; the names
re-exported here keep ``from ._common import ...`` working for every command module.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer

from ._console import table
from ._options import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_GROUP,
    MAX_TOKENS,
    ConcurrencyOpt,
    EngineOpt,
    HardwareOpt,
    IslOpt,
    JsonOpt,
    KvCacheOpt,
    MemoryFractionOpt,
    ModelArg,
    OslOpt,
    QuantOpt,
    RateOpt,
    RecvIntervalOpt,
    SchedulingOpt,
    WorkloadFileOpt,
    finite,
    positive_price,
)

__all__ = [
    "MAX_BATCH",
    "MAX_COUNT",
    "MAX_GROUP",
    "MAX_TOKENS",
    "PLOT_SUFFIXES",
    "ConcurrencyOpt",
    "EngineOpt",
    "HardwareOpt",
    "Interrupted",
    "IslOpt",
    "JsonOpt",
    "KvCacheOpt",
    "MemoryFractionOpt",
    "ModelArg",
    "OslOpt",
    "QuantOpt",
    "RateOpt",
    "RecvIntervalOpt",
    "SchedulingOpt",
    "Terminated",
    "WorkloadFileOpt",
    "catalog",
    "check_context",
    "emit_json",
    "finite",
    "human_bytes",
    "load_spec",
    "output_file",
    "parse_list",
    "parse_size",
    "positive_price",
    "table",
    "workload_from_flags",
]


class Interrupted(BaseException):
    """Ctrl-C (SIGINT) arrived: unwind, so every ``finally`` (a run's ranks, its folder) runs
    before the process exits with status 130. A ``BaseException``, so no ``except Exception``
    on the way swallows it, and not a ``KeyboardInterrupt``: vLLM's engine start-up catches
    and drops that one (its ZMQ socket context, around the engine handshake), which left a
    server interrupted there waiting for an engine that never came."""


class Terminated(BaseException):
    """SIGTERM arrived: unwind as on Ctrl-C (:class:`Interrupted`), with status 143; its
    message, if any, follows the error line's "terminated (SIGTERM)"."""


class HungUp(Terminated):
    """SIGHUP arrived (the terminal or the session that started the command closed): stop as
    on SIGTERM, with status 129 and "hung up (SIGHUP)". Under ``nohup`` SIGHUP stays ignored."""


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def emit_json(document: Any) -> None:
    sys.stdout.write(json.dumps(_clean(document), indent=2, allow_nan=False) + "\n")


def catalog(hardware: Path | None):  # -> HardwareCatalog
    from opweave.costmodel import default_catalog, load_hardware_file

    return default_catalog() if hardware is None else load_hardware_file(hardware)


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def output_file(path: Path | None, flag: str, suffixes: tuple[str, ...] = ()) -> Path | None:
    """Check a file a command will write, before any work: its folder exists, it is not a
    folder itself, and (for figures) its extension is a format the plot can be written in."""
    if path is None:
        return None
    from opweave.costmodel import ConfigError

    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file name")
    if path.is_fifo() or path.is_socket():
        # writing would wait for a reader that may never come
        raise ConfigError(
            f"{flag} {path} is not a regular file (a pipe or socket); give a file name"
        )
    if suffixes and path.suffix.lower() not in suffixes:
        raise ConfigError(
            f"{flag} {path}: unsupported file type {path.suffix or '(none)'!r}; "
            f"end the name in {', '.join(suffixes)}"
        )
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable (permission denied)")
    return path


def check_context(spec: Any, tokens: int, flag: str) -> int:
    """Refuse a token count beyond the model's positions (``max_position_embeddings``)."""
    from opweave.costmodel import ConfigError

    if tokens > spec.max_context_tokens:
        raise ConfigError(
            f"{flag} {tokens} is beyond {spec.name}'s context of {spec.max_context_tokens} "
            "tokens (max_position_embeddings)"
        )
    return tokens


def parse_list(text: str, kind: type = str, what: str = "") -> list[Any]:
    """Split ``"a,b"`` (the value of option ``what``) into items; a bad, empty or repeated item
    is a one-line usage error."""
    text_ = f"{what} {text!r}" if what else repr(text)
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        raise typer.BadParameter(f"expected a comma-separated list, got {text!r}")
    if not all(items):
        raise typer.BadParameter(f"{text_} has an empty item; separate items by one comma")
    try:
        values = [kind(_parse_size(t) if kind is int else t) for t in items]
    except ValueError:
        raise typer.BadParameter(f"{text_} is not a list of {kind.__name__}s") from None
    seen: set[Any] = set()
    for raw, value in zip(items, values, strict=True):
        if value in seen:
            raise typer.BadParameter(f"{text_} names {raw} more than once; give each once")
        seen.add(value)
    return values


# ASCII digits, a decimal part only before a unit: "8192", "8K", "1.5k", "1M" (int() and
# float() would also take "٣٢", "1_000", " 8", "1e1" and ".5")
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kKmM]?)")


def _parse_size(token: str) -> int:
    """``8K`` -> 8192, ``128k`` -> 131072, ``1M`` -> 1048576, plain integers as they are.

    At most 20 characters: a 400-digit count is a typo, and Python's ``int`` of a long enough
    string takes quadratic time.
    """
    match = _SIZE.fullmatch(token)
    if len(token) > 20 or match is None:
        raise ValueError(token)
    number, unit = match.groups()
    if not unit:
        return int(number)  # "8.5" has no unit to make it whole: refused below
    scaled = float(number) * {"k": 1024, "m": 1024 * 1024}[unit.lower()]
    if not scaled.is_integer():
        raise ValueError(token)  # 1.0001K
    return int(scaled)


def parse_size(token: str, flag: str) -> int:
    """The token count option ``flag`` was given as ``token``."""
    try:
        value = _parse_size(token)
    except ValueError:
        raise typer.BadParameter(
            f"{flag} {token!r} is not a token count (e.g. 8192 or 8K)"
        ) from None
    if value < 1:
        raise typer.BadParameter(f"{flag} {token!r} must be at least 1")
    if value > MAX_TOKENS:
        raise typer.BadParameter(f"{flag} {token!r} is more than {MAX_TOKENS} tokens")
    return value


def human_bytes(num: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(num) < 1000 or unit == "TB":
            return f"{num:.1f} {unit}" if unit != "B" else f"{num:.0f} B"
        num /= 1000
    return f"{num:.1f} TB"


def load_spec(
    model: str, quant: str | None, kv_cache_dtype: str, profiles: Sequence[Any] = ()
):  # -> ModelSpec
    """The model a command costs, in the precision ``--quant``/``--kv-cache-dtype`` ask for
    (their values are checked first, so a bad one is named before the model is read).

    Without ``--quant``, an unquantised float32 checkpoint is costed as engines serve it:
    vLLM's and SGLang's default ``--dtype auto`` casts float32 weights down to bfloat16 on
    every GPU with BF16 tensor cores (vLLM ``_resolve_auto_dtype``: the platform's first
    supported dtype), which every catalog GPU has. Given measured ``profiles``, their dtype
    instead: it is what was run (a CPU profile of a float32 model, in float32).
    """
    from opweave.costmodel import KV_CACHE_CHOICES, QUANT_CHOICES, load_model

    if quant is not None and quant not in QUANT_CHOICES:
        raise typer.BadParameter(f"--quant {quant!r}: use one of {', '.join(QUANT_CHOICES)}")
    if kv_cache_dtype not in KV_CACHE_CHOICES:
        raise typer.BadParameter(
            f"--kv-cache-dtype {kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_CHOICES)}"
        )
    spec = load_model(model, quant=quant, kv_cache_dtype=kv_cache_dtype)
    if quant is not None or spec.precision.quantized or spec.dtype != "float32":
        return spec
    # profiles measured in one dtype: that one (each profile's own check refuses a mix)
    measured = {p.dtype for p in profiles}
    label = {"bfloat16": "bf16", "float16": "fp16"}.get(
        measured.pop() if len(measured) == 1 else "bfloat16"
    )
    if label is None:  # float32 profiles
        return spec
    spec = load_model(model, quant=label, kv_cache_dtype=kv_cache_dtype)
    why = (
        "the profiles' dtype"
        if profiles
        else "as vLLM's and SGLang's default --dtype auto serves it; --quant fp32 keeps float32"
    )
    source = f"a float32 checkpoint served in {label}: {why}"
    return spec.model_copy(
        update={"precision": spec.precision.model_copy(update={"source": source})}
    )


def workload_from_flags(
    spec: Any,
    isl: str | None,
    osl: str | None,
    concurrency: int | None,
    rate: float | None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    workload_file: Path | None = None,
    scheduling: str | None = None,
    scheduler_recv_interval: int | None = None,
    engine: str | None = None,
    memory_fraction: float | None = None,
):  # -> Workload
    """The workload ``--isl --osl (--concurrency | --rate)`` or ``--workload FILE`` describe,
    checked against the model's context, with the engine and its step limits where given."""
    from opweave.costmodel import Lengths, Workload, load_workload_file, parse_engine

    if scheduling is not None and scheduling not in ("mixed", "prefill-first"):
        raise typer.BadParameter(f"--scheduling takes mixed or prefill-first, got {scheduling!r}")
    if engine is not None:
        engine = parse_engine(engine)
    if workload_file is not None:
        both = [f for f, v in (("--isl", isl), ("--osl", osl)) if v is not None]
        if both:
            raise typer.BadParameter(
                f"--workload gives the lengths; drop {' and '.join(both)} or the file"
            )
        if concurrency is not None and rate is not None:
            raise typer.BadParameter("give one of --concurrency C or --rate R, not both")
        if rate is not None and not 1e-6 <= rate <= 1e6:
            raise typer.BadParameter(f"--rate must be from 1e-6 to 1e6 requests/s, got {rate}")
        workload = load_workload_file(
            workload_file,
            concurrency=concurrency,
            rate_per_s=rate,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            scheduling=scheduling,
            scheduler_recv_interval=scheduler_recv_interval,
            engine=engine,
            memory_fraction=memory_fraction,
        )
        check_context(spec, workload.max_context_tokens, "the workload's longest isl + osl")
        return workload
    missing = [f for f, v in (("--isl", isl), ("--osl", osl)) if v is None]
    if missing:
        raise typer.BadParameter(f"serving needs {' and '.join(missing)} (tokens per request)")
    if concurrency is not None and rate is not None:
        raise typer.BadParameter("give one of --concurrency C or --rate R, not both")
    if concurrency is None and rate is None:
        raise typer.BadParameter(
            "serving needs the arrivals: --concurrency C (clients, each sending its next request "
            "when one completes) or --rate R (requests per second)"
        )
    if rate is not None and not 1e-6 <= rate <= 1e6:
        raise typer.BadParameter(f"--rate must be from 1e-6 to 1e6 requests/s, got {rate}")
    assert isl is not None and osl is not None
    prompt, answer = parse_size(isl, "--isl"), parse_size(osl, "--osl")
    check_context(spec, prompt + answer, "--isl + --osl")
    return Workload(
        isl=Lengths.fixed(prompt),
        osl=Lengths.fixed(answer),
        concurrency=concurrency,
        rate_per_s=rate,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        scheduling=scheduling,
        scheduler_recv_interval=scheduler_recv_interval or 1,
        engine=engine or "vllm",
        memory_fraction=memory_fraction,
    )
