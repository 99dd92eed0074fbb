"""NVIDIA's silicon database as ``aiconfigurator-core`` ships it: where it is, which layout.

The package (PyPI, Apache-2.0) holds kernel latencies measured per GPU, engine and engine
version under ``aiconfigurator_core/systems/data/<system>/<op>/<engine>/<version>/*.parquet``,
each folder with a ``collection_meta.yaml`` naming its ``schema_version``. This module finds the
folder, checks that its layout is the one this importer was written against and reads tables
with the columns the importer needs. Reading needs ``pyarrow``; both come with the profiler's
``aiconfigurator`` extra.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import import_module, metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ProfilerError

EXTRA = "aiconfigurator"
INSTALL = f"pip install 'opweave-profiler[{EXTRA}]' (in a checkout: uv sync --extra {EXTRA})"
# The package versions whose database layout this importer was written and tested against;
# another version may lay its tables out differently, and a wrong profile is worse than none.
TESTED_VERSIONS = ((0, 12),)
TESTED_RANGE = ">=0.12,<0.13"
# ``collection_meta.yaml`` schemas of the tested releases: 0.12 ships both, version 2 adding
# only a per-table ``collections`` provenance list (its tables' columns are version 1's)
META_SCHEMA_VERSIONS = (1, 2)
ENGINES = ("vllm", "sglang", "trtllm")

# catalog GPU id -> the database's system folder (the systems of aiconfigurator-core 0.12)
SYSTEMS = {
    "a100-sxm-80gb": "a100_sxm",
    "h100-sxm": "h100_sxm",
    "h100-pcie": "h100_pcie",
    "h200-sxm": "h200_sxm",
    "l40s": "l40s",
    "l4": "l4",
    "rtx-pro-6000": "rtx_pro_6000_server",
    "b200": "b200_sxm",
    "b300": "b300_sxm",
    "gb200": "gb200",
    "gb300": "gb300",
}


def version_key(version: str) -> tuple[int, ...]:
    """Order engine versions numerically ('0.5.10' after '0.5.9', '1.3.0rc20' after 'rc5')."""
    return tuple(int(part) for part in re.findall(r"\d+", version))


def _parquet() -> Any:
    if find_spec("pyarrow") is None:
        raise ProfilerError(
            f"reading the aiconfigurator database needs pyarrow, which is not installed: {INSTALL}"
        )
    return import_module("pyarrow.parquet")


@dataclass(frozen=True)
class Database:
    """One silicon database folder (``.../systems/data``) and where it came from."""

    root: Path
    package_version: str | None  # None: a folder given by path, not the installed package

    @property
    def origin(self) -> str:
        if self.package_version is None:
            return f"database folder {self.root}"
        return f"aiconfigurator-core {self.package_version}"

    def system_dir(self, system: str) -> Path:
        folder = self.root / system
        if not folder.is_dir() or not any(folder.iterdir()):
            have = sorted(p.name for p in self.root.iterdir() if p.is_dir() and any(p.iterdir()))
            raise ProfilerError(
                f"the {self.origin} has no measurements for system {system}; it has "
                f"{', '.join(have) or 'none'}"
            )
        return folder

    def versions(self, system: str, op: str, engine: str) -> list[str]:
        """The engine versions measured for ``op`` on ``system``, oldest first."""
        folder = self.root / system / op / engine
        if not folder.is_dir():
            return []
        found = [p.name for p in folder.iterdir() if p.is_dir()]
        return sorted(found, key=version_key)

    def read(
        self,
        folder: Path,
        table: str,
        columns: tuple[str, ...],
        defaults: dict[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:
        """The ``columns`` of ``folder/table.parquet``, checked against this layout; a column in
        ``defaults`` that an older collection lacks (A100's attention has no ``window_size``)
        takes its default."""
        _check_meta(folder, self.origin)
        path = folder / f"{table}.parquet"
        pq = _parquet()
        try:
            names = set(pq.read_schema(path).names)
        except OSError as exc:
            raise ProfilerError(f"cannot read {path}: {exc}") from None
        defaults = defaults or {}
        missing = [c for c in columns if c not in names and c not in defaults]
        if missing:
            raise ProfilerError(
                f"{path} has no column {', '.join(missing)}: not the database layout this "
                f"OpWeave reads (aiconfigurator-core {TESTED_RANGE}); use a tested version"
            )
        data = pq.read_table(path, columns=[c for c in columns if c in names])
        return {
            c: data.column(c).to_numpy(zero_copy_only=False)
            if c in names
            else np.full(data.num_rows, defaults[c])
            for c in columns
        }


def _check_meta(folder: Path, origin: str) -> None:
    meta = folder / "collection_meta.yaml"
    if not meta.is_file():
        return
    # one key is read; no YAML parser needed for ``schema_version: N`` at the top level
    found = re.search(r"^schema_version:\s*(\d+)\s*$", meta.read_text(), re.MULTILINE)
    if found is not None and int(found.group(1)) not in META_SCHEMA_VERSIONS:
        read = " or ".join(str(v) for v in META_SCHEMA_VERSIONS)
        raise ProfilerError(
            f"{meta} has schema_version {found.group(1)}, not {read}: the "
            f"{origin} lays its tables out in a way this OpWeave does not read "
            f"(tested: aiconfigurator-core {TESTED_RANGE})"
        )


def open_database(path: str | Path | None = None) -> Database:
    """The installed package's database, or the folder ``path`` in its layout.

    Without ``path`` the package must be installed (the profiler's ``aiconfigurator`` extra)
    and its version among those tested: another release may lay the tables out differently.
    """
    _parquet()
    if path is not None:
        root = Path(path)
        if (root / "systems" / "data").is_dir():
            root = root / "systems" / "data"
        if not root.is_dir():
            raise ProfilerError(f"database folder {path} does not exist")
        return Database(root=root, package_version=None)
    spec = find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        raise ProfilerError(
            f"opweave profile --from aiconfigurator needs the {EXTRA} extra "
            f"(aiconfigurator-core {TESTED_RANGE}), which is not installed: {INSTALL}"
        )
    version = metadata.version("aiconfigurator-core")
    if version_key(version)[:2] not in TESTED_VERSIONS:
        raise ProfilerError(
            f"aiconfigurator-core {version} is installed, but this OpWeave reads the database "
            f"layout of aiconfigurator-core {TESTED_RANGE}; install a tested version: "
            f"pip install 'aiconfigurator-core{TESTED_RANGE}'"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "systems" / "data"
    if not root.is_dir():
        raise ProfilerError(f"aiconfigurator-core {version} has no database folder at {root}")
    return Database(root=root, package_version=version)


def system_for(gpu_id: str, database: Database) -> str:
    """The database's system folder for a catalog GPU id."""
    system = SYSTEMS.get(gpu_id)
    if system is None:
        raise ProfilerError(
            f"the aiconfigurator database has no system for {gpu_id}; it covers "
            f"{', '.join(sorted(SYSTEMS))}"
        )
    database.system_dir(system)
    return system
