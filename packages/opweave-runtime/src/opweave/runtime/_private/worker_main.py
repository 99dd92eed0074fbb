"""Process entry of one rank: run it, leave a result or a one-line error report in the run folder.

Used by forked workers (:func:`child_main`) and as ``python -m`` for spawned ones. The report
(``rankN.error.json``: message, kind ``peer`` or ``error``, the peer waited on) is what lets the
coordinator name the rank that caused a failure rather than the first one to notice it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import sys
import traceback
from pathlib import Path

from .transport import PeerError
from .worker import WorkerSpec, run_worker


def child_main(spec: WorkerSpec) -> int:
    """Run one rank; 0 on success, 1 after writing an error report."""
    assert spec.run_dir is not None
    run_dir = Path(spec.run_dir)
    try:
        result = run_worker(spec)
        if result is not None:
            tmp = run_dir / "result.json.tmp"
            tmp.write_text(json.dumps(result))
            tmp.rename(run_dir / "result.json")
        return 0
    except BaseException as exc:
        traceback.print_exc()
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        report = {
            "kind": "peer" if isinstance(exc, PeerError) else "error",
            "peer": exc.peer if isinstance(exc, PeerError) else None,
            "message": message
            if isinstance(exc, PeerError)
            else f"{type(exc).__name__}: {message}",
        }
        tmp = run_dir / f"rank{spec.rank}.error.json.tmp"
        tmp.write_text(json.dumps(report))
        tmp.rename(run_dir / f"rank{spec.rank}.error.json")
        sys.stdout.flush()
        return 1


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its coordinator dies (no orphans)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> int:
    import torch

    die_with_parent()
    spec = WorkerSpec.from_json(Path(argv[0]).read_text())
    if spec.device == "cpu":
        torch.set_num_threads(1)
    return child_main(spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
