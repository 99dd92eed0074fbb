"""The device check: what a lent GPU machine runs, in one go, within about 8 minutes.

1. **Tokens.** Every family's tiny random model on the device: greedy tokens of the runtime
   (whole model in one stage, and cut into three stages around layer 0's ``core_attn``, as CAD
   cuts it) with each decode step (per-request, static, compiled) against transformers' greedy
   tokens on the same device. Compiled steps run last, as far as ``--deadline-s`` allows; the
   rows it leaves out are listed.
2. **Ranks.** ``opweave run``'s path: a colocated plan served by a rank process on the device
   (NCCL's process group); every port the rank listens on is flooded with connect-and-close
   attempts, then its tokens must be transformers', with no descriptor left behind.
3. **Native submission.** The compiled decode step's time per token against the per-request
   one's, and whether inductor captured it as a CUDA graph (its ``cudagraph_skips`` counter).
4. **NCCL's sockets.** ``nccl_sockets.py``: two ranks on the one GPU, their listening ports
   flooded and held, with and without the guard ``opweave run`` puts on them.
5. **Two nodes** (not in ``--quick``). ``two_nodes.py``: an AFD plan's two ranks on the one GPU
   as two nodes joined by NCCL, their ports flooded and held while the plan generates.
6. **Profiles.** ``opweave profile`` of gemma-3-27b and qwen3-next-80b-a3b layers at random
   weights on a small grid, written as profiles with their provenance.

Everything lands in ``--out``: ``figures.json`` (each section's figures, pass/fail and wall
time, the device and library versions), ``nccl_sockets.json``, ``two_nodes.json`` and
``profiles/*.json``. A section that fails is recorded with its error and the next one still
runs; the exit status is 1 if any failed.

Run: ``python tools/gpu/check.py --out gpu-check`` (``--device cpu --quick`` rehearses the
same code on a CPU machine in about a minute).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_NEW_TOKENS = 12
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [16, 17]]
PROFILED = ("gemma-3-27b", "qwen3-next-80b-a3b")


def _cuts(model_dir: Path) -> list[int]:
    from opweave.runtime import operator_sequence

    seq = operator_sequence(model_dir)
    attn = next(i for i, ref in enumerate(seq) if ref[1] == "core_attn")
    return [attn, attn + 1]


def _hf_greedy(model_dir: Path, device: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device)
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p], device=device)
        gen = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        out.append(gen[0, len(p) :].tolist())
    return out


def tokens(
    device: str, families: list[str], steps: list[str], root: Path, deadline: float
) -> dict[str, Any]:
    from opweave.runtime import LocalModel, write_tiny_model

    rows, ok, skipped = [], True, []
    expected: dict[str, list[list[int]]] = {}
    for step in steps:
        for family in families:
            model_dir = root / family
            if family not in expected:
                write_tiny_model(family, model_dir)
                expected[family] = _hf_greedy(model_dir, device)
            for cuts in ([], _cuts(model_dir)):
                if time.monotonic() > deadline:
                    skipped.append(f"{family} stages {len(cuts) + 1} {step}")
                    continue
                start = time.perf_counter()
                model = LocalModel(
                    model_dir,
                    device=device,
                    cuts=cuts,
                    decode_step=step,
                    max_running=len(PROMPTS),
                )
                got = model.generate(PROMPTS, MAX_NEW_TOKENS)
                equal = got == expected[family]
                ok &= equal
                rows.append(
                    {
                        "family": family,
                        "stages": len(cuts) + 1,
                        "decode_step": step,
                        "equal_to_transformers": equal,
                        "wall_s": round(time.perf_counter() - start, 3),
                    }
                )
                print(f"  {family:<12} stages {len(cuts) + 1} {step:<12} equal={equal}")
    return {"ok": ok, "rows": rows, "skipped_for_time": skipped}


def ranks(device: str, root: Path) -> dict[str, Any]:
    """A colocated plan served by a rank process: a flood of its ports, then its tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sockets import descriptors, flood, listening

    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import Cluster, OfflineDriver, Request, RunOptions, write_tiny_model

    model_dir = write_tiny_model("llama", root / "ranks")
    expected = _hf_greedy(model_dir, device)
    model = load_model(model_dir)
    plan = canonical_plan(model, "colocated", gpu="cpu", batch=len(PROMPTS))
    figures: dict[str, Any] = {}
    start = time.perf_counter()
    cluster = Cluster(plan, model, model_dir, RunOptions(device=device, timeout_s=30))
    try:
        figures["start_s"] = round(time.perf_counter() - start, 1)
        pids = cluster.pids
        ports = [(addr, port) for addr, port, _ in listening(pids)]
        figures["listening_ports"] = len(ports)
        before = {pid: descriptors(pid) for pid in pids}
        figures["flood"] = flood(ports, 1.0)
        figures["descriptors_added"] = sum(descriptors(pid) - before[pid] for pid in pids)
        requests = [Request(tuple(p), MAX_NEW_TOKENS) for p in PROMPTS]
        driver = OfflineDriver(cluster, requests, model.arch.eos_token_ids)
        driver.run()
        got = [list(out.token_ids) for out in driver.outputs()]
        figures["equal_to_transformers"] = got == expected
        cluster.shutdown()
    finally:
        cluster.close()
    ok = figures["equal_to_transformers"] and figures["descriptors_added"] == 0
    print(f"  {figures}")
    return {"ok": ok, **figures}


def submission(device: str, compiled: str, root: Path) -> dict[str, Any]:
    """Time per decode token, per-request vs the compiled step, after a warm-up run each."""
    import torch
    from torch._dynamo.utils import counters

    from opweave.runtime import LocalModel, write_tiny_model

    model_dir = write_tiny_model("llama", root / "submission")
    figures: dict[str, Any] = {}
    reference = None
    for step in ("per-request", compiled):
        model = LocalModel(model_dir, device=device, decode_step=step, max_running=len(PROMPTS))
        model.generate(PROMPTS, MAX_NEW_TOKENS)  # compiles and captures, if it does
        tokens = 4 * MAX_NEW_TOKENS
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(PROMPTS, tokens)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        figures[f"{step}_ms_per_token"] = round((time.perf_counter() - start) / tokens * 1e3, 4)
        reference = reference or out
        figures[f"{step}_tokens_equal"] = out == reference
        launches = model.module.submissions
        figures[f"{step}_launches"] = launches
    figures["speedup"] = round(
        figures["per-request_ms_per_token"] / figures[f"{compiled}_ms_per_token"], 3
    )
    figures["cudagraph_skips"] = dict(counters.get("inductor", {})).get("cudagraph_skips", 0)
    ok = all(v for k, v in figures.items() if k.endswith("_tokens_equal"))
    print(f"  {figures}")
    return {"ok": ok, **figures}


def nccl_sockets(device: str, out: Path) -> dict[str, Any]:
    """tools/gpu/nccl_sockets.py in a process of its own (gloo on a CPU rehearsal)."""
    script = Path(__file__).resolve().parent / "nccl_sockets.py"
    path = out / "nccl_sockets.json"
    rank_device = "cuda:0" if device == "cuda" else device
    cmd = [sys.executable, str(script), "--out", str(path), "--device", rank_device]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    scenarios = json.loads(path.read_text()) if path.exists() else []
    summary = {s["scenario"]: {"ok": s.get("ok"), "hung_in": s.get("hung_in")} for s in scenarios}
    print(f"  {summary}")
    return {"ok": proc.returncode == 0, "scenarios": summary, "file": str(path)}


def two_nodes(device: str, out: Path) -> dict[str, Any]:
    """tools/gpu/two_nodes.py in a process of its own."""
    script = Path(__file__).resolve().parent / "two_nodes.py"
    path = out / "two_nodes.json"
    cmd = [sys.executable, str(script), "--out", str(path), "--device", device]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    found = json.loads(path.read_text()) if path.exists() else {}
    if not found:
        found["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
    print(f"  {found}")
    return {**found, "ok": proc.returncode == 0}


def profiles(device: str, models: list[str], grid: dict[str, str], out: Path) -> dict[str, Any]:
    folder = out / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    rows, ok = [], True
    for model in models:
        path = folder / f"{Path(model).name}-{device.replace(':', '')}.json"
        cmd = [sys.executable, "-m", "opweave.cli", "profile", "-m", model, "--device", device]
        cmd += ["-o", str(path), "--random-weights", "--no-transfer"]
        for flag, value in grid.items():
            cmd += [flag, value]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        wall = round(time.perf_counter() - start, 1)
        done = proc.returncode == 0 and path.exists()
        ok &= done
        row: dict[str, Any] = {"model": model, "profile": str(path), "wall_s": wall, "ok": done}
        if not done:
            row["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        else:
            row["tables"] = len(json.loads(path.read_text())["ops"])
        rows.append(row)
        print(f"  {model}: {row}")
    return {"ok": ok, "rows": rows}


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = torch.version.cuda
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except ImportError:
        env["vllm"] = None
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for figures and profiles.")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--quick", action="store_true", help="Two families, traced steps, a tiny profile grid."
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=420.0,
        help="Compiled token rows start only this long after the check began.",
    )
    args = parser.parse_args()
    deadline = time.monotonic() + args.deadline_s

    from opweave.runtime import TINY_CONFIGS

    args.out.mkdir(parents=True, exist_ok=True)
    # the tiny models live only as long as the run; figures and profiles go under --out
    with tempfile.TemporaryDirectory(prefix="opweave-gpu-check-") as tmp:
        root = Path(tmp)
        if args.quick:  # a rehearsal: no code generation, so no compile time
            families, steps, compiled = ["llama", "qwen3_next"], ["per-request", "traced"], "traced"
            models = [str(root / "llama")]
            grid = {"--batches": "1,2", "--contexts": "64", "--repeats": "3", "--warmup": "1"}
        else:
            families, steps = list(TINY_CONFIGS), ["per-request", "static", "compiled"]
            compiled = "compiled"
            models = list(PROFILED)
            grid = {"--batches": "1,8,32", "--contexts": "1K,8K", "--repeats": "10"}
        eager, compiling = steps[:-1], steps[-1:]
        sections: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("tokens", lambda: tokens(args.device, families, eager, root, deadline)),
            ("ranks", lambda: ranks(args.device, root)),
            ("submission", lambda: submission(args.device, compiled, root)),
            ("nccl_sockets", lambda: nccl_sockets(args.device, args.out)),
            *([] if args.quick else [("two_nodes", lambda: two_nodes(args.device, args.out))]),
            ("profiles", lambda: profiles(args.device, models, grid, args.out)),
            ("tokens_compiled", lambda: tokens(args.device, families, compiling, root, deadline)),
        ]
        figures: dict[str, Any] = {"environment": environment(args.device)}
        failed = []
        for name, run in sections:
            print(f"{name}:", flush=True)
            start = time.perf_counter()
            try:
                result = run()
            except Exception as exc:  # record it; the next section still runs
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            result["wall_s"] = round(time.perf_counter() - start, 1)
            figures[name] = result
            if not result["ok"]:
                failed.append(name)
            (args.out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"figures: {args.out / 'figures.json'}; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
