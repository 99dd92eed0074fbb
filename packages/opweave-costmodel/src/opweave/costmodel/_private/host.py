"""Host profiles: the per-step time a serving engine's host work adds to a decode step.

Between two decode steps an engine schedules, prepares the next step's inputs, reads the sampled
tokens back and turns them into outputs. An engine that overlaps that work with the GPU's step
leaves the GPU a short gap; one that does not makes every step wait for it. That time belongs to
the engine (its version and scheduling mode) and the host CPU, not to the GPU, so it is not a
hardware-catalog figure: a :class:`HostProfile` names an engine's value and where it was
measured, and :func:`estimate_step` (``host=``) or ``opweave estimate --host NAME`` applies it in
place of the hardware's ``step_overhead_s`` / ``step_overhead_per_request_s`` (charged to the
``sample`` operator, ``fixed_costs.step_overhead_s``).

Sources:
  [VLLM-GAP] vllm-project/vllm#11133: with asynchronous scheduling and CUDA graphs the GPU sits
  idle 150-170 us between two decode steps (5-6 ms before).
  [SGL-HOST] sgl-project/sglang-omni#760, H100, CUDA graphs, no overlap: the host's share of a
  decode step is 1.36-1.38 / 1.65-1.66 / 1.82-1.86 ms at batch 16 / 24 / 32.
  [QWEN-0.5B] QwenLM/Qwen2.5 docs/source/benchmark/speed_benchmark.rst (vLLM 0.6.3, A100 80GB,
  CUDA graphs, batch 1, ``LLM.generate`` with repetition/presence/frequency penalties):
  Qwen2.5-0.5B-Instruct generates at 311.55 tokens/s, 3.210 ms a step, of which the roofline
  with its fixed costs (A100, context 1025) accounts for 1.496 ms of GPU work: 1.71 ms is host.
  A model this small (0.99 GB of weights) is where a step is mostly host time; the same table's
  7B-72B rows, which the accuracy benchmark compares, are not used for it.
  [VLLM-6913] vllm-project/vllm#6913 (vLLM 0.5, 4 x H100, Llama-3-70B FP8): the engine's output
  processing (``_process_model_outputs``, on the critical path before the asynchronous output
  processor of vLLM 0.6.0) takes 0.2 ms at batch 1 and 3.4 ms at batch 32: 0.103 ms a request.
"""

from __future__ import annotations

from pydantic import Field

from ..errors import ConfigError
from .base import Frozen
from .hardware import HardwareSpec

US = 1e-6
MS = 1e-3


class HostProfile(Frozen):
    """The host time one engine adds to every decode step: ``step_overhead_s`` plus
    ``step_overhead_per_request_s`` per request of the step."""

    name: str
    step_overhead_s: float = Field(ge=0, description="Per decode step (and microbatch).")
    step_overhead_per_request_s: float = Field(
        default=0.0, ge=0, description="... and per request of the step."
    )
    description: str = ""
    source: str = Field(default="", description="Where the values were measured.")

    def apply(self, hardware: HardwareSpec) -> HardwareSpec:
        """``hardware`` with this engine's per-step host time in place of its own.

        >>> from opweave.costmodel import default_catalog
        >>> hw = HOST_PROFILES["vllm-0.4"].apply(default_catalog().get("a100"))
        >>> round(hw.step_overhead_s * 1e3, 2), round(hw.step_overhead_per_request_s * 1e6)
        (1.71, 103)
        """
        return hardware.model_copy(
            update={
                "step_overhead_s": self.step_overhead_s,
                "step_overhead_per_request_s": self.step_overhead_per_request_s,
            }
        )


# vLLM 0.6's V0 engine at batch 1 [QWEN-0.5B]; shared by the 0.4 profile, which adds the output
# processing that 0.6 overlaps with the GPU [VLLM-6913].
VLLM_V0_STEP_S = 1.71 * MS
VLLM_V0_OUTPUT_PER_REQUEST_S = (3.4 - 0.2) / (32 - 1) * MS

HOST_PROFILES: dict[str, HostProfile] = {
    profile.name: profile
    for profile in (
        HostProfile(
            name="overlapped",
            step_overhead_s=160 * US,
            description="An engine that overlaps its host work with the GPU's step "
            "(asynchronous scheduling: vLLM V1 with async scheduling, SGLang's and TensorRT-LLM's "
            "overlap schedulers, OpWeave's compiled schedules, a CUDA-graph replay loop without a "
            "host sync). The catalog's default.",
            source="[VLLM-GAP] vllm-project/vllm#11133",
        ),
        HostProfile(
            name="sglang-sync",
            step_overhead_s=0.90 * MS,
            step_overhead_per_request_s=29 * US,
            description="SGLang's scheduler without overlap: schedule, launch, sync, process.",
            source="[SGL-HOST] sgl-project/sglang-omni#760 (H100): 0.90 ms + 29 us per request",
        ),
        HostProfile(
            name="vllm-0.6",
            step_overhead_s=VLLM_V0_STEP_S,
            description="vLLM 0.6's V0 engine, single-step scheduling, CUDA graphs: schedule, "
            "prepare inputs, sample and read the tokens back before the next step; output "
            "processing overlapped (asynchronous output processor).",
            source="[QWEN-0.5B] QwenLM/Qwen2.5 speed_benchmark.rst, Qwen2.5-0.5B, vLLM 0.6.3, "
            "A100: 3.21 ms a step less 1.50 ms of modelled GPU work",
        ),
        HostProfile(
            name="vllm-0.4",
            step_overhead_s=VLLM_V0_STEP_S,
            step_overhead_per_request_s=VLLM_V0_OUTPUT_PER_REQUEST_S,
            description="vLLM 0.4-0.5's V0 engine: as vllm-0.6, plus output processing "
            "(detokenisation, stop checks) on the critical path of every step.",
            source="[QWEN-0.5B] for the step; [VLLM-6913] vllm-project/vllm#6913 for the "
            "0.103 ms per request of output processing",
        ),
    )
}


def host_profile(name: str) -> HostProfile:
    """A built-in host profile by name.

    >>> round(host_profile("vllm-0.6").step_overhead_s * 1e3, 2)
    1.71
    """
    try:
        return HOST_PROFILES[name.strip().lower()]
    except KeyError:
        raise ConfigError(
            f"unknown host profile {name!r}; known: {', '.join(HOST_PROFILES)}"
        ) from None
