"""Export the JSON Schemas of OpWeave's file formats to ``schemas/``.

``--check`` exits 1 when a checked-in schema differs from what the code exports (CI runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import TypeAdapter

from opweave.costmodel import HardwareSpec, ModelSpec, Node, Plan, Profile, Workload
from opweave.runtime import RunResult

SCHEMAS = {
    "plan.schema.json": Plan,
    "profile.schema.json": Profile,
    "hardware-gpu.schema.json": HardwareSpec,
    "model-spec.schema.json": ModelSpec,
    # `opweave deploy`'s DIR/nodes.json: a top-level list of nodes
    "nodes.schema.json": list[Node],
    # `opweave run --json` of an offline run (beside "model", "strategy" and "plan")
    "run-result.schema.json": RunResult,
    # `--workload FILE` of estimate and plan (a length may also be a bare number of tokens)
    "workload.schema.json": Workload,
}
ROOT = Path(__file__).resolve().parent.parent / "schemas"


def render(model: object) -> str:
    return json.dumps(TypeAdapter(model).json_schema(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if schemas/ is out of date")
    args = parser.parse_args()
    stale = []
    for name, model in SCHEMAS.items():
        path, text = ROOT / name, render(model)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            ROOT.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(
            f"schemas out of date: {', '.join(stale)}; run python tools/export_schemas.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
