"""Helpers shared by the test modules (import as ``tests.helpers``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``opweave`` as a user would: a fresh process, output captured."""
    env = {k: v for k, v in os.environ.items() if k != "OPWEAVE_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "opweave.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"opweave {' '.join(args)} failed: {proc.stderr}")
    return proc


def cli_json(*args: str) -> Any:
    proc = run_cli(*args, "--json")
    return json.loads(proc.stdout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a server started with ``start_new_session=True`` (unless it already exited);
    after 60 s, SIGKILL its whole process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tiny_llama_with_plan(root: Path, strategy: str) -> tuple[Path, Path]:
    """A tiny llama (hidden 128, head dim 32) and a canonical ``strategy`` plan file for it,
    with batch 4 in 2 microbatches: one rank per owner."""
    from opweave.costmodel import canonical_plan, load_model
    from opweave.runtime import write_tiny_model

    model = write_tiny_model(
        "llama", root / "llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    plan = root / "plan.json"
    plan.write_text(
        canonical_plan(
            load_model(model), strategy, gpu="cpu", batch=4, microbatches=2
        ).model_dump_json()
    )
    return model, plan
