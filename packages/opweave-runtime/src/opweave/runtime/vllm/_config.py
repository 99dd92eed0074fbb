# pyright: reportMissingImports=false
# (vLLM is an optional extra: imported lazily, absent from the locked dev environment)
"""What the OpWeave executor reads from vLLM's configuration, and what it refuses; no vLLM here.

``additional_config`` carries the plan and the run's options under the keys below; they become
one :class:`~opweave.runtime.RunOptions` (:func:`run_options`), the only place they are parsed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PLAN_KEY = "opweave_plan"  # additional_config: plan file path, or the plan as a JSON dict
DEVICE_KEY = "opweave_device"  # cpu or cuda (default: cuda where visible)
TIMEOUT_KEY = "opweave_timeout_s"  # longest wait of a rank for a step's messages (60 s)
KERNELS_KEY = "opweave_kernels"  # "opweave" (default), "vllm" or "vllm-all"
DECODE_KEY = "opweave_decode_step"  # "per-request" (default), "static", "compiled" or "traced"
NODES_KEY = "opweave_nodes"  # {"nnodes", "master_addr", "master_port", "layout"}: several nodes
WAIT_KEY = "opweave_wait"  # how CPU ranks wait: "auto" (default), "spin" or "block"
LOG_DIR_KEY = "opweave_log_dir"  # a folder for the ranks' logs, kept (default: none)
FAULT_KEY = "opweave_fault"  # test seam: RunOptions.fault ({"rank", "iteration", "mode"})
FAILURE_ENV = "OPWEAVE_FAILURE_FILE"  # a file to leave the failure's one line in (opweave run)
# vLLM's per-request parameter check (a logits processor's ``validate_params``, run by vLLM's
# front end before a request reaches the engine), as vLLM's ``logits_processors`` names it
REQUEST_CHECK = "opweave.runtime.vllm:RequestCheck"
APPLIED = "temperature, top_k, top_p, min_p and seed"  # what the ranks' samplers apply


def refuse(message: str) -> None:
    """Stop the executor's start with ``message``, left for ``opweave serve`` to print."""
    from opweave.costmodel import ConfigError

    leave_failure(message)
    raise ConfigError(message)


def leave_failure(line: str, *, first: bool = False) -> None:
    """The failure's first line, for ``opweave serve`` to print when vLLM's server stops
    (``FAILURE_ENV``; nothing without it). Written whole (a reader never sees half of it);
    ``first``: only if no line was left yet."""
    failure_file = os.environ.get(FAILURE_ENV)
    text = line.strip()
    if not failure_file or not text:
        return
    path = Path(failure_file)
    part = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
    with contextlib.suppress(OSError):
        part.write_text(text.splitlines()[0] + "\n")
        try:
            if first:
                os.link(part, path)  # fails where a line is already there
            else:
                os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)


def failure_left() -> bool:
    """Whether a failure's line was left for ``opweave serve`` to print."""
    path = os.environ.get(FAILURE_ENV)
    try:
        return bool(path) and bool(Path(path).read_text().strip())
    except OSError:
        return False


class _ExplainedFailure(logging.Filter):
    """Drops vLLM's records of a failure whose one line ``opweave serve`` prints last.

    In the engine process: records logged while an OpWeave error is raised (vLLM's fatal
    error with its traceback, the step's whole input dumped beside it); the error's line is
    left for the server first, if the ranks have not left theirs yet. In the front end: the
    "engine dead" errors that follow (its output handler's, and one per open stream), once a
    line was left. Without ``opweave serve`` to print the line (no failure file), every record
    stays.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from opweave.costmodel import OpWeaveError

        if os.environ.get(FAILURE_ENV) is None:
            return True
        exc = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        if isinstance(exc, OpWeaveError):
            leave_failure(str(exc), first=True)
            return not failure_left()
        if exc is not None and type(exc).__name__ == "EngineDeadError":
            return not failure_left()
        return True


_EXPLAINED = _ExplainedFailure()


def quiet_explained_failures() -> None:
    """Put :class:`_ExplainedFailure` on the handlers of vLLM's logger, once vLLM has
    configured its logging (which replaces them)."""
    for handler in logging.getLogger("vllm").handlers:
        if _EXPLAINED not in handler.filters:
            handler.addFilter(_EXPLAINED)


def unapplied(params: Any) -> list[str]:
    """The settings of ``params`` (a vLLM ``SamplingParams``, or any object with its field names)
    that the plan's ranks would not apply, as ``name=value``.

    The ranks sample with :data:`APPLIED`; vLLM's front end and scheduler apply stops, lengths,
    ``n`` and ``ignore_eos``. The rest (log-probabilities, penalties, logit bias, allowed and
    banned tokens, ``min_tokens``, structured output, a thinking budget) is computed by vLLM's
    model runner, which the OpWeave executor replaces.
    """
    found = []
    for name in ("logprobs", "prompt_logprobs", "logprob_token_ids", "prompt_logprob_token_ids"):
        if getattr(params, name, None) is not None:
            found.append(f"{name}={getattr(params, name)!r}")
    for name, neutral in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
        ("min_tokens", 0),
    ):
        value = getattr(params, name, neutral)
        if value is not None and value != neutral:
            found.append(f"{name}={value!r}")
    for name in ("logit_bias", "allowed_token_ids", "bad_words"):
        if getattr(params, name, None):
            found.append(name)
    if getattr(params, "structured_outputs", None) is not None:
        found.append("structured output")
    if getattr(params, "thinking_token_budget", None) is not None:
        found.append("thinking_token_budget")
    return found


def load_plan(plan: Any) -> Any:  # -> opweave.costmodel.Plan | None
    """A plan from a ``Plan``, its JSON dict, a path to a plan file, or ``None``."""
    from opweave.costmodel import ConfigError, Plan

    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.model_validate(plan)
    path = Path(plan)
    if not path.is_file():
        raise ConfigError(f"opweave plan file {path} does not exist")
    return Plan.from_json(path.read_text())


# additional_config key -> RunOptions field
OPTION_KEYS = {
    DEVICE_KEY: "device",
    TIMEOUT_KEY: "timeout_s",
    KERNELS_KEY: "kernels",
    DECODE_KEY: "decode_step",
    WAIT_KEY: "wait",
    LOG_DIR_KEY: "log_dir",
    FAULT_KEY: "fault",
}


def run_options(extra: Mapping[str, Any], dtype: str | None = None) -> Any:
    """The run's :class:`~opweave.runtime.RunOptions` from ``additional_config``; a bad value
    is a ``ValueError`` naming its key."""
    from .._private.options import RunOptions, options_error

    fields: dict[str, Any] = {f: extra[k] for k, f in OPTION_KEYS.items() if k in extra}
    try:
        return RunOptions(**fields, dtype=dtype)
    except ValueError as exc:  # pydantic's ValidationError is one
        raise ValueError(options_error(exc, {f: k for k, f in OPTION_KEYS.items()})) from None
