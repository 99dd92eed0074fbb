"""Host time of one compiled static decode step, by depth: dynamo's guard check vs the program.

A compiled decode step (``--decode-step compiled``) is one native program per segment and
token, but every call first passes torch.compile's guards: checks, in C++, that the operators'
attributes, weights and state slabs the step was traced with are unchanged. This measures, for
tiny random Llamas of several depths run in one process (one thread, 8 requests, CPU), how long
each call spends in the guard check ("TorchDynamo Cache Lookup" in ``torch.profiler``), in the
compiled program itself, and in the whole call (guards, program and dynamo's wrappers), and fits
the guard time as ``a + b x layers``. Then the same once the steps are trusted as a serving rank
trusts them after its warm-up (:func:`~opweave.runtime._private.decode.trust_warm_graphs`: only
the guards that tell the graphs apart are checked), side by side in the same process.
On a GPU the program is a CUDA-graph replay, but the guard check stays host time before it.

Run: ``uv run python tools/bench/step_host.py [--layers 2,8,24] [--hidden 64]``. Prints
figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from opweave.runtime import LocalModel, write_tiny_model
from opweave.runtime._private.decode import trust_warm_graphs

PROMPTS = [[5, 6, 7, 8 + i] for i in range(8)]


def measure(model: LocalModel, tokens: int) -> dict[str, float]:
    """Per decode-step call: microseconds in the guard check, the program and the rest."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.generate(PROMPTS, tokens)
    events = {e.key: e for e in prof.key_averages()}
    lookup = events["TorchDynamo Cache Lookup"]
    region = sum(e.cpu_time_total for k, e in events.items() if k.startswith("Torch-Compiled"))
    program = sum(e.self_cpu_time_total for k, e in events.items() if "CompiledFxGraph" in k)
    calls = lookup.count
    return {
        "calls": calls,
        "guards_us": lookup.self_cpu_time_total / calls,
        "program_us": program / calls,
        "call_us": (lookup.self_cpu_time_total + region) / calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--layers", default="2,8,24", help="comma-separated depths")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    depths = [int(x) for x in args.layers.split(",")]
    print(
        f"llama hidden {args.hidden}, {len(PROMPTS)} requests, {args.tokens} tokens; "
        "microseconds per compiled decode-step call"
    )
    print(
        f"{'layers':>6} {'guard check':>11} {'program':>9} {'whole call':>10} {'guards':>7}"
        f" {'trusted: guards':>15} {'whole call':>10}"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="opweave-step-host-") as tmp:
        for layers in depths:
            model_dir = write_tiny_model(
                "llama",
                Path(tmp) / f"llama-{layers}",
                hidden_size=args.hidden,
                intermediate_size=4 * args.hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
            model = LocalModel(model_dir, decode_step="compiled", max_running=len(PROMPTS))
            model.generate(PROMPTS, 8)  # compiles the step
            m = measure(model, args.tokens)
            try:
                trust_warm_graphs()
                trusted = measure(model, args.tokens)
            finally:
                torch.compiler.set_stance("default")
            rows.append((layers, m["guards_us"]))
            share = m["guards_us"] / m["call_us"]
            print(
                f"{layers:>6} {m['guards_us']:>11.1f} {m['program_us']:>9.1f} "
                f"{m['call_us']:>10.1f} {100 * share:>6.1f}% {trusted['guards_us']:>15.1f} "
                f"{trusted['call_us']:>10.1f}"
            )
    if len(rows) > 1:
        slope, intercept = np.polyfit([r[0] for r in rows], [r[1] for r in rows], 1)
        print(f"guard check ~ {intercept:.0f} us + {slope:.1f} us per layer per call")


if __name__ == "__main__":
    main()
