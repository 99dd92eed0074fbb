"""Cost-model speed: CLI cold start of ``opweave estimate`` and in-process ``analyze``.

Targets: ``opweave estimate`` cold start under 1.5 s (no torch import); ``analyze`` over 1,000
context points under 50 ms in-process. Prints measured figures; asserts nothing.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import numpy as np

from opweave.costmodel import analyze, default_catalog, load_model


def cold_start_s(repeats: int = 5) -> list[float]:
    cmd = [
        sys.executable,
        "-m",
        "opweave.cli",
        "estimate",
        "gemma-3-27b",
        "--gpu",
        "h100",
        "--tp",
        "1",
        "--batch",
        "32",
        "--context",
        "32K",
        "--json",
    ]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def torch_imported() -> bool:
    code = (
        "import sys; from opweave.cli.app import main; "
        "main(['estimate','qwen3-32b','--gpu','h100','--json']); "
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return proc.stderr.strip().endswith("True")


def analyze_ms(repeats: int = 20) -> tuple[list[float], list[float]]:
    cat = default_catalog()
    contexts = np.linspace(256, 131072, 1000).astype(int)
    one, two = [], []
    for name in ("gemma-3-27b", "qwen3-next-80b-a3b"):
        spec = load_model(name)
        analyze(spec, [cat.get("h100")], contexts)  # warm caches
        for _ in range(repeats):
            t0 = time.perf_counter()
            analyze(spec, [cat.get("h100")], contexts)
            t1 = time.perf_counter()
            analyze(spec, [cat.get("h100"), cat.get("a100")], contexts)
            t2 = time.perf_counter()
            one.append((t1 - t0) * 1e3)
            two.append((t2 - t1) * 1e3)
    return one, two


def main() -> None:
    cold = cold_start_s()
    print(
        f"opweave estimate cold start: median {statistics.median(cold):.3f} s, "
        f"max {max(cold):.3f} s over {len(cold)} runs (target < 1.5 s)"
    )
    print(f"torch imported by estimate: {torch_imported()} (target: False)")
    one, two = analyze_ms()
    print(
        f"analyze, 1,000 contexts, one GPU:  median {statistics.median(one):.2f} ms, "
        f"max {max(one):.2f} ms (target < 50 ms)"
    )
    print(
        f"analyze, 1,000 contexts, two GPUs: median {statistics.median(two):.2f} ms, "
        f"max {max(two):.2f} ms (target < 50 ms)"
    )


if __name__ == "__main__":
    main()
