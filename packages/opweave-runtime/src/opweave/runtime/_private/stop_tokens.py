"""The token ids that end a generation: the config's EOS ids and those of the checkpoint's
``generation_config.json``, which instruct checkpoints use to list every end-of-turn token
(Llama 3's ``[128001, 128008, 128009]``). transformers' ``generate`` stops on the generation
config's ids, and vLLM adds them to its stop tokens (``--generation-config auto``)."""

from __future__ import annotations

import json
from pathlib import Path

from opweave.costmodel import Architecture

from ..errors import CheckpointError


def stop_token_ids(arch: Architecture, model_dir: str | Path) -> tuple[int, ...]:
    """``arch``'s EOS ids, then those ``model_dir/generation_config.json`` adds."""
    ids = list(arch.eos_token_ids)
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return tuple(ids)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read as JSON ({exc}); fix or remove it") from None
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    given = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in given):
        raise CheckpointError(f"{path}: eos_token_id: expected token ids, got {eos!r}")
    outside = [i for i in given if i >= arch.vocab_size]
    if outside:
        raise CheckpointError(
            f"{path}: eos_token_id {outside[0]} is outside the vocabulary "
            f"(vocab_size {arch.vocab_size})"
        )
    return tuple(ids + [i for i in dict.fromkeys(given) if i not in ids])
