"""A profile or plan made for another config of a model of the same name says what differs,
not "measured on model 'x', not 'x'"."""

from __future__ import annotations

import numpy as np
import pytest

from opweave.costmodel import ConfigError, canonical_plan, load_model, model_spec_from_config
from opweave.planner import plan, simulate_plan
from tests.helpers import TINY_LLAMA

from .conftest import random_profile, toy_gpu


def _twins():
    """Two configs named alike: the second has one more layer."""
    one = model_spec_from_config(TINY_LLAMA, name="tiny-llama")
    other = model_spec_from_config(TINY_LLAMA | {"num_hidden_layers": 3}, name="tiny-llama")
    assert one.name == other.name and one.config_sha256 != other.config_sha256
    return one, other


def _repeats_the_name(message: str, name: str) -> bool:
    return f"{name!r}, not {name!r}" in message or f"{name}, not {name}" in message


def test_profile_of_another_config_of_the_same_name() -> None:
    measured, planned = _twins()
    prof = random_profile(np.random.default_rng(0), measured, toy_gpu("cpu", memory_bytes=64e9))
    with pytest.raises(ConfigError) as info:
        plan(planned, ["cpu"], context=32, tpot_slo_s=1.0, profiles=[prof])
    message = str(info.value)
    assert not _repeats_the_name(message, "tiny-llama"), message
    assert "measured on another config of tiny-llama" in message
    assert prof.config_sha256[:12] in message and planned.config_sha256[:12] in message
    assert "profile this config" in message and "the config the profile was measured on" in message
    assert "\n" not in message


def test_profile_of_another_config_names_what_differs() -> None:
    measured, _ = _twins()
    prof = random_profile(np.random.default_rng(0), measured, toy_gpu("cpu", memory_bytes=64e9))
    half = model_spec_from_config(TINY_LLAMA | {"torch_dtype": "bfloat16"}, name="tiny-llama")
    message = prof.config_problem(half)
    assert message is not None and "dtype float32, this config bfloat16" in message
    assert prof.config_problem(measured) is None
    other = load_model("qwen3-32b")
    named = prof.config_problem(other)
    assert named is not None and "measured on model 'tiny-llama', not 'qwen3-32b'" in named


def test_plan_of_another_config_of_the_same_name() -> None:
    planned, other = _twins()
    p = canonical_plan(planned, "colocated", gpu="h100-sxm", batch=1, context_tokens=64)
    with pytest.raises(ConfigError) as info:
        simulate_plan(p, other)
    message = str(info.value)
    assert not _repeats_the_name(message, "tiny-llama"), message
    assert "made for another config of tiny-llama (num_layers 2, this config 3" in message
    assert "pass the config the plan was made for" in message


def test_a_profile_in_another_dtype_of_the_same_checkpoint_names_the_dtype() -> None:
    """A float32 checkpoint served in bf16 keeps its fingerprint (plans and profiles of it fit
    the folder), so a profile measured in bf16 fits the bf16-served model and is refused, by
    dtype, for the float32 one."""
    stored = model_spec_from_config(TINY_LLAMA, name="tiny-llama")
    served = model_spec_from_config(TINY_LLAMA, name="tiny-llama", quant="bf16")
    assert (stored.dtype, served.dtype) == ("float32", "bfloat16")
    assert served.config_sha256 == stored.config_sha256
    fp8_kv = model_spec_from_config(TINY_LLAMA, quant="bf16", kv_cache_dtype="fp8")
    assert (
        fp8_kv.config_sha256
        == model_spec_from_config(TINY_LLAMA, kv_cache_dtype="fp8").config_sha256
    )
    prof = random_profile(np.random.default_rng(0), served, toy_gpu("cpu", memory_bytes=64e9))
    assert prof.config_problem(served) is None
    message = prof.config_problem(stored)
    assert message is not None and message.startswith(
        "was measured in bfloat16, and tiny-llama is costed in float32"
    )
    assert "(--quant bf16)" in message
