"""Helpers shared by the test modules (import as ``tests.helpers``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
