"""``opweave deploy``: the files that run a plan on a cluster: nodes, launch scripts, k8s."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Any

import typer

from ._common import catalog, emit_json
from ._options import (
    DeployOutputOpt,
    DeviceProfilesOpt,
    HardwareOpt,
    ImageOpt,
    JsonOpt,
    ModelPvcOpt,
    NameOpt,
    NamespaceOpt,
    NodeSelectorKeyOpt,
    PlanArg,
)


def register(app: typer.Typer) -> None:
    app.command("deploy")(deploy)


def deploy(
    plan_file: PlanArg,
    output: DeployOutputOpt,
    name: NameOpt = None,
    image: ImageOpt = ...,  # type: ignore[assignment]
    model_pvc: ModelPvcOpt = None,
    node_selector_key: NodeSelectorKeyOpt = "opweave.io/gpu",
    namespace: NamespaceOpt = None,
    profile: DeviceProfilesOpt = None,
    json_out: JsonOpt = False,
    hardware: HardwareOpt = None,
) -> None:
    """Write DIR/nodes.json (which ranks run on which node), one launch script per node in
    DIR/launch/ and Kubernetes manifests in DIR/k8s/ for a plan."""
    from opweave.costmodel import plan_nodes

    from .planning import load_profiles, load_servable_plan

    the_plan = load_servable_plan(plan_file, "deploy")
    profiles = load_profiles(profile)
    specs = _hardware(the_plan, hardware, profiles)
    _check_it_runs(the_plan, plan_file, hardware, profiles)
    nodes = plan_nodes(the_plan, {gpu: hw.gpus_per_node for gpu, hw in specs.items()})
    opts = _k8s_options(the_plan, name, image, model_pvc, node_selector_key, namespace)
    if output.exists() and not output.is_dir():
        from opweave.costmodel import ConfigError

        raise ConfigError(f"{output} exists and is not a directory")
    files = _write(output, the_plan, nodes, opts, specs)
    if json_out:
        emit_json(
            {
                "nodes": [n.model_dump(mode="json") for n in nodes],
                "files": sorted(str(p) for p in files),
            }
        )
        return
    _print_summary(the_plan, nodes, output, opts, manifests=len(files) - 4 - len(nodes))


def _check_it_runs(plan: Any, path: Path, hardware: Path | None, profiles: Any) -> None:
    """For a built-in model, what ``opweave simulate`` checks: the template's cuts, each
    owner's memory, and whether a prefill pool's parallelism splits the model (the nodes check
    the rest when they load the checkpoint; a model of another name is the folder the plan was
    made from, which only the nodes hold)."""
    from opweave.costmodel import BUILTIN_MODELS
    from opweave.planner import simulate_plan

    from .planning import _planned_model, planned_config

    unchecked = (
        "so its memory and cuts were not re-checked here; the nodes check them when they load "
        "the checkpoint"
    )
    if plan.model.name not in BUILTIN_MODELS:
        typer.echo(
            f"note: plan {path} is of model {plan.model.name!r}, whose config only the nodes "
            f"hold, {unchecked}",
            err=True,
        )
        return
    spec = _planned_model(plan.model.name, plan, path)
    if not planned_config(plan.model.name, spec, plan, path):
        typer.echo(
            f"note: plan {path} was made for a {plan.model.name} config other than the built-in "
            f"one (its fingerprint differs), {unchecked}",
            err=True,
        )
        return
    simulate_plan(
        plan, spec, catalog=None if hardware is None else catalog(hardware), profiles=profiles
    )


def _k8s_options(
    plan: Any,
    name: str | None,
    image: str,
    model_pvc: str | None,
    node_selector_key: str,
    namespace: str | None,
) -> Any:
    """The Kubernetes settings, checked: Kubernetes would refuse them later, one resource at a
    time."""
    from opweave.costmodel import ConfigError

    from . import _deploy

    prefix = _deploy.dns_name(name or f"opweave-{plan.model.name}")
    if name is not None and prefix != name:
        raise ConfigError(
            f"--name {name!r} is not a Kubernetes name (lowercase letters, digits and '-', "
            "at most 40 characters); try --name " + prefix
        )
    _check_k8s_values(image, model_pvc, node_selector_key, namespace)
    return _deploy.K8sOptions(
        name=prefix,
        image=image,
        model_pvc=model_pvc or f"{prefix}-model",
        node_selector_key=node_selector_key,
        namespace=namespace,
    )


def _write(
    output: Path, plan: Any, nodes: list[Any], opts: Any, specs: dict[str, Any]
) -> list[Path]:
    """Write the deployment's files into ``output`` (secrets readable by their owner only)
    and remove the ones an earlier deployment of more nodes left; the paths written."""
    from . import _deploy

    plan_text = plan.model_dump_json(indent=2) + "\n"
    secret = secrets.token_hex(32)
    api_key = secrets.token_urlsafe(32)
    files: dict[Path, str] = {
        output / "plan.json": plan_text,
        output / "nodes.json": _deploy.nodes_json(nodes),
    }
    for r in range(len(nodes)):
        files[output / "launch" / f"node-{r}.sh"] = _deploy.launch_script(plan, nodes, r)
    resources = {gpu: _gpu_resource(hw) for gpu, hw in specs.items()}
    for fname, manifest in _deploy.k8s_manifests(
        plan, nodes, plan_text, opts, resources, secret, api_key
    ).items():
        files[output / "k8s" / fname] = _deploy.to_yaml(manifest)
    output.mkdir(parents=True, exist_ok=True)
    key_file, api_key_file = output / "run-secret", output / "api-key"
    _write_private(key_file, secret + "\n")
    _write_private(api_key_file, api_key + "\n")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.name == "secret.yaml":  # holds the run's secret, as run-secret does
            _write_private(path, text)
            continue
        path.write_text(text)
        if path.suffix == ".sh":
            path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    # an earlier deployment of more nodes into DIR left scripts and node groups this one has
    # not: kubectl apply -f DIR/k8s/ would start them too
    for folder, pattern in (("launch", "node-*.sh"), ("k8s", "node-group-*.yaml")):
        for stale in (output / folder).glob(pattern):
            if stale not in files:
                stale.unlink()
    return [*files, key_file, api_key_file]


def _print_summary(plan: Any, nodes: list[Any], output: Path, opts: Any, manifests: int) -> None:
    used = sum(n.gpus for n in nodes)
    pool = plan.prefill
    typer.echo(
        f"{plan.strategy} plan of {plan.model.name}: {len(nodes)} node"
        f"{'s' if len(nodes) > 1 else ''}, {used} GPUs"
        + (
            f" (a prefill pool of {pool.replicas} x {pool.tp * pool.dp} {pool.gpu}: the last "
            f"{pool.gpus} ranks)"
            if pool is not None
            else ""
        )
    )
    for r, n in enumerate(nodes):
        typer.echo(f"  node {r}: {n.gpus} x {n.gpu}, ranks {n.ranks[0]}-{n.ranks[-1]}")
    typer.echo(
        f"wrote {output}/nodes.json, {output}/launch/"
        f"{'node-0.sh' if len(nodes) == 1 else f'node-0..{len(nodes) - 1}.sh'} and "
        f"{output}/k8s/ ({manifests} manifests, image {opts.image}); the run's "
        f"secret is in {output}/run-secret and the API key clients must send in "
        f"{output}/api-key (keep both private)\n"
        f"  on each node: MODEL_PATH=DIR MASTER_ADDR=<node 0> {output}/launch/node-R.sh\n"
        f"  on Kubernetes: label the nodes {opts.node_selector_key}=<gpu id>, put the model in "
        f"PersistentVolumeClaim {opts.model_pvc}, kubectl apply -f {output}/k8s/"
    )


def _hardware(plan: Any, hardware: Path | None, profiles: list[Any]) -> dict[str, Any]:
    """Each GPU type of the plan: its profile's device, else the --hardware file's entry, else
    the spec the plan was made with (the built-in entry for a plan that recorded none)."""
    from opweave.costmodel import planned_catalog
    from opweave.planner import profile_device_id

    cat = planned_catalog(plan, None if hardware is None else catalog(hardware))
    by_profile = {profile_device_id(p, cat): p.device for p in profiles}
    gpus = [o.gpu for o in plan.owners] + ([plan.prefill.gpu] if plan.prefill else [])
    return {gpu: by_profile[gpu] if gpu in by_profile else cat.get(gpu) for gpu in gpus}


def _gpu_resource(hw: Any) -> str | None:
    """The Kubernetes extended resource of a device type's GPUs (device plugins' names)."""
    if hw.id == "cpu":
        return None  # CPU ranks (tests, profiling): no accelerator to request
    return "amd.com/gpu" if "AMD" in hw.name else "nvidia.com/gpu"


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (also if it existed before)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _check_k8s_values(
    image: str, model_pvc: str | None, node_selector_key: str, namespace: str | None
) -> None:
    """Kubernetes would refuse these manifests later, one resource at a time: refuse now."""
    import re

    from opweave.costmodel import ConfigError

    label = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"  # RFC 1123 label
    subdomain = rf"{label}(\.{label})*"
    if namespace is not None and not re.fullmatch(label, namespace):
        raise ConfigError(
            f"--namespace {namespace!r} is not a Kubernetes namespace (lowercase letters, "
            "digits and '-', at most 63 characters)"
        )
    if model_pvc is not None and (len(model_pvc) > 253 or not re.fullmatch(subdomain, model_pvc)):
        raise ConfigError(
            f"--model-pvc {model_pvc!r} is not a PersistentVolumeClaim name (lowercase "
            "letters, digits, '-' and '.')"
        )
    prefix, _, key = node_selector_key.rpartition("/")
    name_ok = re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", key)
    if not name_ok or (prefix and (len(prefix) > 253 or not re.fullmatch(subdomain, prefix))):
        raise ConfigError(
            f"--node-selector-key {node_selector_key!r} is not a Kubernetes label key "
            "([prefix/]name: a DNS prefix, a name of letters, digits, '-', '_', '.')"
        )
    if not image.strip() or any(c.isspace() for c in image):
        raise ConfigError(f"--image {image!r} is not a container image reference")
