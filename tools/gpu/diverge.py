"""Where the runtime's greedy tokens part from transformers' for one tiny family on a device.

Prints, per prompt, the runtime's and transformers' tokens on the device and on the CPU, the
first position where they differ, and transformers' top-2 logit margin there (a near tie is
rounding; a wide margin is a wrong computation). Run:
``python tools/gpu/diverge.py minimax_m2 gpt_oss --device cuda``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check import MAX_NEW_TOKENS, PROMPTS, _hf_greedy


def _margins(model_dir: Path, device: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' top-1 minus top-2 logit at every generated position (teacher-forced)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device)
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    top = logits.topk(2, dim=-1).values
    return [round(float(x), 5) for x in (top[:, 0] - top[:, 1])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="+")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from opweave.runtime import LocalModel, write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            model_dir = write_tiny_model(family, Path(tmp) / family)
            found = {}
            for device in (args.device, "cpu"):
                found[f"hf_{device}"] = _hf_greedy(model_dir, device)
                model = LocalModel(model_dir, device=device, max_running=len(PROMPTS))
                found[f"opweave_{device}"] = model.generate(PROMPTS, MAX_NEW_TOKENS)
            for i, prompt in enumerate(PROMPTS):
                row = {k: v[i] for k, v in found.items()}
                ours, theirs = row[f"opweave_{args.device}"], row[f"hf_{args.device}"]
                pairs = enumerate(zip(ours, theirs, strict=False))
                at = next((j for j, (a, b) in pairs if a != b), None)
                print(f"{family} prompt {i}: first difference at {at}")
                for k, v in row.items():
                    print(f"  {k:<16} {v}")
                if at is not None:
                    margins = _margins(model_dir, args.device, prompt, theirs)
                    print(f"  hf margin there {margins[at]} (all: {margins})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
