# pyright: reportMissingImports=false
# (vLLM is an optional extra: imported only where vLLM is installed)
"""``RequestCheck``: vLLM's per-request parameter check for what OpWeave's ranks apply.

Imported (with vLLM) when ``opweave.runtime.vllm.RequestCheck`` is first asked for.
"""

from __future__ import annotations

from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import LogitsProcessor

from ._config import APPLIED, unapplied


class RequestCheck(LogitsProcessor):
    """A vLLM logits processor that changes no logits; its ``validate_params`` refuses a
    request for what :func:`~._config.unapplied` names, or for more than the server's limits,
    so vLLM's server answers it with HTTP 400 before it reaches the engine.

    Limits (set by :func:`~opweave.runtime.vllm.serve.serve` in the server's process, where
    vLLM's front end checks requests; ``None``: none): :attr:`max_n` completions per request
    (``n``) and :attr:`max_tokens` new tokens per completion (``max_tokens``)."""

    max_n: int | None = None
    max_tokens: int | None = None

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        n = getattr(sampling_params, "n", 1) or 1
        if cls.max_n is not None and n > cls.max_n:
            raise VLLMValidationError(
                f"n={n} is more completions than this server runs for one request (at most "
                f"{cls.max_n}: opweave run --max-n)",
                parameter="n",
            )
        tokens = getattr(sampling_params, "max_tokens", None)
        if cls.max_tokens is not None and tokens is not None and tokens > cls.max_tokens:
            raise VLLMValidationError(
                f"max_tokens={tokens} is more than this server generates for one request (at "
                f"most {cls.max_tokens}: opweave run --max-request-tokens)",
                parameter="max_tokens",
            )
        found = unapplied(sampling_params)
        if found:
            raise VLLMValidationError(
                f"OpWeave's ranks do not apply {', '.join(found)}: they sample with "
                f"{APPLIED} only; leave the others out of the request",
                parameter=found[0].split("=")[0],
            )

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: Any) -> Any:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: Any) -> None:
        pass


# the name vLLM's logits_processors and a pickled config use (REQUEST_CHECK)
RequestCheck.__module__ = "opweave.runtime.vllm"
