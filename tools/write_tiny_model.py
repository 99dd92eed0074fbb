"""Write a tiny random-weight Hugging Face model folder for tests and demos (no hub access).

    uv run python tools/write_tiny_model.py qwen3 tiny-qwen3 [--dtype bfloat16] [--seed 1]
    uv run python tools/write_tiny_model.py qwen3_next tiny-next --set hidden_size=256

The folder holds config.json, model.safetensors and a `tokenizers` WordLevel tokenizer, so
`opweave run`, `opweave profile`, transformers and vLLM can all load it offline.
"""

from __future__ import annotations

import argparse
import json
import sys

from opweave.runtime import TINY_CONFIGS, write_tiny_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", choices=sorted(TINY_CONFIGS))
    parser.add_argument("out_dir")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (JSON value), e.g. num_hidden_layers=4",
    )
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a tiny model is written at once: no bar to watch
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set takes KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    path = write_tiny_model(
        args.family, args.out_dir, seed=args.seed, dtype=args.dtype, **overrides
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
