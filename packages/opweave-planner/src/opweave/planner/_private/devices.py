"""Device types the planner may use: latency model, price, TP degrees and link coefficients.

A device type comes from the hardware catalog (roofline latencies, :class:`RooflineLatency`) or
from a profile (:class:`ProfiledLatency`); a profile overrides the catalog entry of the same id
and may add new ids (a ``cpu`` profile makes ``--gpus cpu`` valid).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from opweave.costmodel import (
    TP_DEGREES,
    HardwareCatalog,
    HardwareSpec,
    ModelSpec,
    Profile,
    ProfiledLatency,
    RooflineLatency,
    check_runs,
    default_catalog,
    profile_key,
    tp_problem,
)
from opweave.costmodel.errors import ConfigError, UnknownGPUError

from .host import NO_HOST, HostModel

LinkKind = Literal["intra_node", "network"]

LINKS = ("intra_node", "network")


@dataclass(frozen=True)
class Link:
    """Coefficients of the affine transfer time of one device over one link
    (:func:`opweave.costmodel.link_time_s`)."""

    latency_s: float
    s_per_byte: float

    @property
    def coeffs(self) -> tuple[float, float]:
        return (self.latency_s, self.s_per_byte)


@dataclass(frozen=True)
class Device:
    """One device type as the planner uses it."""

    id: str
    hardware: HardwareSpec
    latency: RooflineLatency | ProfiledLatency
    usd_per_hour: float
    tps: tuple[int, ...]
    provenance: str
    intra: Link
    network: Link
    # what the profile measured of the device's host (nothing for a GPU): see .host
    host: HostModel = NO_HOST
    # the degrees of ``tps`` over which the routed experts split too (plain TP owners); the
    # others serve MoE layers only with the experts over the GPUs of each expert (EP)
    plain_tps: tuple[int, ...] | None = None

    def link(self, kind: str) -> Link:
        return self.intra if kind == "intra_node" else self.network


def _link(latency: RooflineLatency | ProfiledLatency, kind: str) -> Link:
    # Every LatencyModel of the cost model is affine in bytes (latency + bytes / bandwidth);
    # read its two coefficients once so scalar and vectorised code agree exactly.
    link: LinkKind = "intra_node" if kind == "intra_node" else "network"
    zero = latency.transfer_s(link, 0.0)
    big = latency.transfer_s(link, 1e9)
    return Link(latency_s=zero, s_per_byte=(big - zero) / 1e9)


def _profiled_tps(profile: Profile, model: ModelSpec) -> tuple[int, ...]:
    keys = {profile_key(op, None) for op in (*model.pre_ops, *model.post_ops)}
    keys |= {profile_key(op, layer) for layer in model.layers for op in layer.ops}
    have = {(t.op, t.tp) for t in profile.ops}
    tps = tuple(tp for tp in TP_DEGREES if all((k, tp) in have for k in keys))
    if not tps:
        missing = sorted(k for k in keys if not any((k, tp) in have for tp in TP_DEGREES))
        raise ConfigError(
            f"profile for {profile.device.id} has no TP degree covering every operator of "
            f"{model.name} (missing {', '.join(missing[:4]) or 'a common TP degree'}); "
            "re-profile this model"
        )
    return tps


def profile_device_id(profile: Profile, catalog: HardwareCatalog) -> str:
    """The device id a profile is for: the catalog's id when the profile names a catalog GPU
    (by its id or an alias, in any case), else its own id in lower case."""
    try:
        return catalog.resolve(profile.device.id)
    except UnknownGPUError:
        return profile.device.id.strip().lower()


def resolve_devices(
    gpus: Sequence[str],
    model: ModelSpec,
    *,
    catalog: HardwareCatalog | None = None,
    profiles: Sequence[Profile] = (),
) -> list[Device]:
    """The device types named by ``gpus`` (ids or aliases), deduplicated, in order."""
    cat = catalog or default_catalog()
    by_id: dict[str, Profile] = {}
    for prof in profiles:
        problem = prof.config_problem(model)
        if problem is not None:
            raise ConfigError(f"profile for {prof.device.id} {problem}")
        key = profile_device_id(prof, cat)
        if key in by_id:
            raise ConfigError(f"two profiles are for device {key}; give one --profile per device")
        if key != prof.device.id:  # an alias (h100) or other spelling of a catalog id
            prof = prof.model_copy(update={"device": prof.device.model_copy(update={"id": key})})
        by_id[key] = prof
    if not gpus:
        raise ConfigError("no GPU types given; pass at least one with --gpus")
    out: list[Device] = []
    for name in gpus:
        key = name.strip().lower()
        prof = by_id.get(key)
        if prof is None:
            try:
                key = cat.resolve(key)
            except UnknownGPUError:
                known = ", ".join([*cat.ids, *by_id])
                raise UnknownGPUError(
                    f"unknown GPU {name!r}; known: {known} (or give a --profile or --hardware "
                    "file for it)"
                ) from None
            prof = by_id.get(key)
        if any(d.id == (prof.device.id if prof else key) for d in out):
            continue
        if prof is not None:
            hw = prof.device
            if hw.usd_per_hour is None and hw.id in cat.ids:
                # price the profiled device from the catalog (e.g. a --hardware file entry)
                hw = hw.model_copy(update={"usd_per_hour": cat.get(hw.id).usd_per_hour})
            if hw.usd_per_hour is None:
                raise ConfigError(
                    f"device {hw.id} of a profile has no price; set usd_per_hour "
                    "in the profile's device or give it in a --hardware file"
                )
            prof = prof.model_copy(update={"device": hw})
            latency: RooflineLatency | ProfiledLatency = ProfiledLatency(prof)
            tps = _profiled_tps(prof, model)
            src = f"{hw.id}:{prof.provenance.source}:{prof.provenance.date}"
        else:
            hw = cat.get(key)
            latency = RooflineLatency(hw)
            tps = tuple(tp for tp in TP_DEGREES if tp <= hw.gpus_per_node)
            src = f"{hw.id}:roofline"
        check_runs(model.precision, hw)  # a weight format the GPU cannot run is an error
        # only degrees the runtime can shard the model's operators over (costmodel's rule);
        # the routed experts need not split over them: under EP they split over the GPUs of
        # each expert instead (the owners check each parallelism: owners.py)
        dense = [op for op in model.operators if op.moe is None]
        plain_tps = tuple(tp for tp in tps if tp_problem(model, tp) is None)
        tps = tuple(tp for tp in tps if tp_problem(model, tp, dense) is None)
        if not tps:
            raise ConfigError(
                f"{model.name} cannot be sharded over any tensor-parallel degree {hw.id} "
                f"offers: {tp_problem(model, 2) or 'no degree left'}"
            )
        out.append(
            Device(
                id=hw.id,
                hardware=hw,
                latency=latency,
                usd_per_hour=hw.require_price(),
                tps=tps,
                provenance=src,
                intra=_link(latency, "intra_node"),
                network=_link(latency, "network"),
                host=HostModel.of(prof),
                plain_tps=plain_tps,
            )
        )
    return out
