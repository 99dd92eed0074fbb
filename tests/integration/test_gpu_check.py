"""tools/gpu/check.py, the device check, rehearsed on CPU (--quick): its figures and profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from opweave.costmodel import Profile

ROOT = Path(__file__).resolve().parents[2]


def test_the_device_check_rehearses_on_cpu(tmp_path):
    out, scratch = tmp_path / "check", tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.run(
        [sys.executable, "tools/gpu/check.py", "--out", str(out), "--device", "cpu", "--quick"],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((out / "figures.json").read_text())
    assert figures["environment"]["device"] == "cpu"
    rows = figures["tokens"]["rows"] + figures["tokens_compiled"]["rows"]
    # two families, one stage and three, per-request and traced steps
    assert len(rows) == 8 and all(r["equal_to_transformers"] for r in rows)
    # a rank process serves transformers' tokens after a flood of its ports took nothing
    ranks = figures["ranks"]
    assert ranks["ok"] and ranks["equal_to_transformers"] and ranks["descriptors_added"] == 0
    assert all(f["made"] == 0 for f in ranks["flood"])
    # the guarded pair of ranks (gloo here) refuses the flood and keeps answering
    guarded = figures["nccl_sockets"]["scenarios"]["guarded"]
    assert figures["nccl_sockets"]["ok"] and guarded["ok"]["flood_refused"]
    assert all(guarded["ok"].values()) and guarded["hung_in"] is None
    sub = figures["submission"]
    assert sub["ok"] and sub["traced_tokens_equal"] and sub["per-request_ms_per_token"] > 0
    (row,) = figures["profiles"]["rows"]
    assert row["ok"] and row["tables"] > 0
    profile = Profile.model_validate_json(Path(row["profile"]).read_text())
    assert profile.ops
    # the tiny models it built are gone (torch's own compile cache may stay); what it measured
    # stays under --out
    assert not list(scratch.glob("opweave-*")), sorted(p.name for p in scratch.iterdir())
