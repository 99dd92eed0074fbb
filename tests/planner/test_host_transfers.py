"""Host-driven transfers (CPU ranks): a message costs both ranks' compute streams."""

from __future__ import annotations

import numpy as np
import pytest

from opweave.costmodel import TransferProfile, canonical_plan, segments
from opweave.planner import NO_HOST, HostModel, simulate_plan
from tests.planner.conftest import random_profile, toy_gpu


def _with_link(profile, send: float, recv: float):
    link = TransferProfile(
        link="intra_node",
        latency_s=300e-6,
        bandwidth_bytes_per_s=1e9,
        host_send_s=send,
        host_recv_s=recv,
    )
    return profile.model_copy(update={"transfers": (link,)})


def _crossings(plan, model) -> int:
    owners = [seg.owner for seg in segments(model, plan.template, len(plan.owners))]
    return sum(a != b for a, b in zip(owners, owners[1:] + owners[:1], strict=True))


@pytest.mark.parametrize("strategy", ["afd", "cad"])
def test_one_microbatch_pays_every_message_on_both_compute_streams(tiny_llama, strategy) -> None:
    """With one microbatch the period is the token's round trip, so each crossing message adds
    exactly its sender's and its receiver's host cost to the TPOT."""
    base = random_profile(np.random.default_rng(3), tiny_llama, toy_gpu("cpu", gpus_per_node=2))
    plain, hosted = _with_link(base, 0.0, 0.0), _with_link(base, 40e-6, 110e-6)
    plan = canonical_plan(tiny_llama, strategy, gpu="cpu", batch=4, microbatches=1)
    a = simulate_plan(plan, tiny_llama, profiles=[plain])
    b = simulate_plan(plan, tiny_llama, profiles=[hosted])
    crossings = _crossings(plan, tiny_llama)
    assert crossings >= 2
    assert b.tpot_s - a.tpot_s == pytest.approx(crossings * 150e-6, rel=1e-9)


def test_colocated_plans_send_nothing(tiny_llama) -> None:
    base = random_profile(np.random.default_rng(4), tiny_llama, toy_gpu("cpu", gpus_per_node=2))
    plan = canonical_plan(tiny_llama, "colocated", gpu="cpu", batch=4, microbatches=2)
    a = simulate_plan(plan, tiny_llama, profiles=[_with_link(base, 0.0, 0.0)])
    b = simulate_plan(plan, tiny_llama, profiles=[_with_link(base, 1e-3, 1e-3)])
    assert a.tpot_s == b.tpot_s


def test_gpu_links_and_old_profiles_are_device_driven(tiny_llama) -> None:
    """Roofline devices and profiles written before the fields existed cost compute nothing."""
    base = random_profile(np.random.default_rng(5), tiny_llama, toy_gpu("cpu"))
    old = TransferProfile.model_validate(
        {"link": "intra_node", "latency_s": 1e-4, "bandwidth_bytes_per_s": 1e9}
    )
    host = HostModel.of(base.model_copy(update={"transfers": (old,)}))
    assert host.message_s("intra_node") == (0.0, 0.0)
    assert host.message_s("network") == (0.0, 0.0)  # not measured: device-driven
    assert host == NO_HOST == HostModel.of(None)  # a roofline device
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        TransferProfile(
            link="intra_node", latency_s=1e-4, bandwidth_bytes_per_s=1e9, host_recv_s=-1.0
        )
