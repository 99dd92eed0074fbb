"""Options and output helpers shared by every command."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document, nothing else.")]
HardwareOpt = Annotated[
    Path | None,
    typer.Option("--hardware", help="TOML/JSON file adding or overriding GPUs ([[gpus]] entries)."),
]
ModelArg = Annotated[
    str,
    typer.Argument(help="Built-in model name, or a path to a Hugging Face config.json or folder."),
]


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


def parse_list(text: str, kind: type = str) -> list[Any]:
    """Split ``"a,b"`` into items; a bad item is a one-line usage error."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise typer.BadParameter(f"expected a comma-separated list, got {text!r}")
    try:
        return [kind(_parse_size(t) if kind is int else t) for t in items]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a list of {kind.__name__}s") from None


def _parse_size(token: str) -> int:
    """``8K`` -> 8192, ``128k`` -> 131072, ``1M`` -> 1048576, plain integers as they are."""
    units = {"k": 1024, "m": 1024 * 1024}
    suffix = token[-1].lower()
    if suffix in units:
        return int(float(token[:-1]) * units[suffix])
    return int(token)


def parse_size(token: str) -> int:
    try:
        value = _parse_size(token.strip())
    except (ValueError, IndexError):
        raise typer.BadParameter(f"{token!r} is not a token count (e.g. 8192 or 8K)") from None
    if value < 1:
        raise typer.BadParameter(f"{token!r} must be at least 1")
    return value


def human_bytes(num: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(num) < 1000 or unit == "TB":
            return f"{num:.1f} {unit}" if unit != "B" else f"{num:.0f} B"
        num /= 1000
    return f"{num:.1f} TB"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += [
        "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return "\n".join(out)
