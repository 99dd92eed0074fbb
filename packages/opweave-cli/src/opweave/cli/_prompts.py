"""The prompts of ``opweave run --prompt/--prompts-file``: read, encoded and checked against
the model (its vocabulary and its positions), a one-line error naming the file and line for any
bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def tokenizer(model_path: Path) -> Any:
    """The model folder's tokenizer.json, loaded; None without one."""
    path = model_path / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    from opweave.costmodel import ConfigError

    try:
        return Tokenizer.from_file(str(path))
    except BaseException as exc:
        if not _tokenizer_failure(exc):
            raise
        raise ConfigError(f"{path} is not a valid tokenizer: {str(exc)[:200]}") from None


def _tokenizer_failure(exc: BaseException) -> bool:
    """The tokenizers library raises a bare ``Exception`` on bad files, and a Rust panic
    (``pyo3_runtime.PanicException``, a ``BaseException``) on some malformed ones."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def read_prompts(
    prompts: list[str] | None, path: Path | None, coder: Any, vocab_size: int
) -> list[tuple[list[int], int | None]]:
    """``(prompt ids, max tokens or None)`` per request; bad input (a token id outside the
    model's ``vocab_size`` ids included) is a one-line error naming the file and line."""
    from opweave.costmodel import ConfigError

    def encode(text: str, where: str) -> list[int]:
        if coder is None:
            raise ConfigError(
                f"{where}: the model folder has no tokenizer.json to encode text; "
                'give "prompt_token_ids" in a --prompts-file instead'
            )
        try:
            ids = coder.encode(text).ids
        except BaseException as exc:
            if not _tokenizer_failure(exc):
                raise
            raise ConfigError(f"{where}: the tokenizer failed: {str(exc)[:200]}") from None
        if not ids:
            raise ConfigError(f"{where}: the prompt encodes to no tokens")
        return in_vocabulary(list(ids), where)

    def in_vocabulary(ids: list[int], where: str) -> list[int]:
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ConfigError(
                f"{where}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
            )
        return ids

    if prompts is not None:
        return [(encode(p, f"--prompt {p!r}"), None) for p in prompts]
    assert path is not None
    if not path.is_file():
        from opweave.costmodel.errors import not_a_file

        raise ConfigError(f"prompts file {path} {not_a_file(path)}")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"prompts file {path} is not UTF-8 text (JSONL expected)") from None
    out: list[tuple[list[int], int | None]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
        except (ValueError, RecursionError):  # a 5,000-digit number, or [[[[...]]]]
            raise ConfigError(
                f"{where}: not a prompt (a number too long or nesting too deep)"
            ) from None
        if not isinstance(entry, dict) or ("prompt" in entry) == ("prompt_token_ids" in entry):
            raise ConfigError(f'{where}: expected an object with "prompt" or "prompt_token_ids"')
        limit = entry.get("max_tokens")
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 1
        ):
            raise ConfigError(f'{where}: "max_tokens" must be a positive integer')
        if "prompt" in entry:
            if not isinstance(entry["prompt"], str):
                raise ConfigError(f'{where}: "prompt" must be a string')
            out.append((encode(entry["prompt"], where), limit))
            continue
        ids = entry["prompt_token_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise ConfigError(f'{where}: "prompt_token_ids" must be a non-empty list of integers')
        out.append((in_vocabulary(ids, where), limit))
    if not out:
        raise ConfigError(f"prompts file {path} holds no prompts")
    return out


def check_lengths(
    entries: list[tuple[list[int], int | None]], max_tokens: int | None, model: Any
) -> list[int]:
    """The new tokens of each request (its own "max_tokens", else ``--max-tokens``), checked:
    every request has a budget, and its prompt and new tokens fit the model's positions."""
    from opweave.costmodel import ConfigError

    limit = model.max_context_tokens
    budgets: list[int] = []
    for i, (ids, own) in enumerate(entries):
        new = own if own is not None else max_tokens
        if new is None:
            raise ConfigError(
                f'request {i} of the prompts file has no "max_tokens"; give it one, or give '
                "--max-tokens for every request without"
            )
        total = len(ids) + new
        if total > limit:
            raise ConfigError(
                f"request {i}: {len(ids)} prompt tokens + {new} new tokens exceed "
                f"{model.name}'s context of {limit} tokens (max_position_embeddings); lower "
                "--max-tokens or shorten the prompt"
            )
        budgets.append(new)
    return budgets
