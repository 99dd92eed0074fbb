"""Deployment files of a plan (``opweave deploy``): node layout, launch scripts, Kubernetes.

Pure functions from a plan and its node layout (:func:`opweave.costmodel.plan_nodes`) to file
contents; ``deploying.py`` writes them. Layout of the output directory::

    DIR/plan.json            the plan, so the directory is self-contained
    DIR/nodes.json           [{"gpu": id, "gpus": n, "ranks": [global ranks]}, ...]
    DIR/run-secret           the run's shared secret (mode 0600): ranks authenticate with it
    DIR/api-key              the API key clients send (mode 0600): node 0 serves behind it
    DIR/launch/node-R.sh     `opweave run` of node R (rendezvous address, port, model path
                             and extra `opweave run` options from the environment / arguments)
    DIR/k8s/*.yaml           ConfigMap (plan + nodes), Secret (the run's secret and the API
                             key), headless rendezvous Service, API Service, one StatefulSet
                             for node 0 (it serves; ready when ``/health`` says so) and one per
                             group of consecutive identical nodes after it
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

RENDEZVOUS_PORT = 29500  # torch.distributed's customary MASTER_PORT
API_PORT = 8000  # `opweave run`'s serving port (DESIGN: --port 8000)
MODEL_MOUNT = "/models"
CONFIG_MOUNT = "/etc/opweave"
SECRET_MOUNT = "/etc/opweave-secrets"  # the API key, as a file (not an environment variable)
# SIGTERM drains for up to 10 s (opweave run's drain deadline); Kubernetes SIGKILLs a pod this
# long after SIGTERM, so the drain ends first
TERMINATION_GRACE_S = 30


@dataclass(frozen=True)
class NodeGroup:
    """Consecutive nodes with the same GPU type and count: one Kubernetes workload."""

    index: int
    first_node: int
    count: int
    gpu: str
    gpus: int


def node_groups(nodes: Sequence[Any]) -> list[NodeGroup]:
    """Node 0 alone (it serves the API: its pod alone has a readiness probe on ``/health``),
    then runs of consecutive nodes with the same GPU type and count."""
    groups: list[NodeGroup] = []
    for r, node in enumerate(nodes):
        last = groups[-1] if groups else None
        if last is not None and r > 1 and (last.gpu, last.gpus) == (node.gpu, node.gpus):
            groups[-1] = NodeGroup(last.index, last.first_node, last.count + 1, node.gpu, node.gpus)
        else:
            groups.append(NodeGroup(len(groups), r, 1, node.gpu, node.gpus))
    return groups


def dns_name(text: str, limit: int = 40) -> str:
    """A Kubernetes (DNS-1123) name: lowercase letters, digits and '-', at most ``limit``."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")
    return name or "opweave"


def nodes_json(nodes: Sequence[Any]) -> str:
    return json.dumps([n.model_dump(mode="json") for n in nodes], indent=2) + "\n"


def launch_script(plan: Any, nodes: Sequence[Any], rank: int) -> str:
    node = nodes[rank]
    first, last = node.ranks[0], node.ranks[-1]
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    if len(nodes) > 1:  # every node must reach node 0: loopback would never be right
        master_doc = "address of node 0, the rendezvous (required)"
        master = ': "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0 (the rendezvous)}"\n'
    else:
        master_doc = "address of node 0, the rendezvous (default 127.0.0.1)"
        master = 'MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"\n'
    key_doc = key = ""
    pool = ""
    if plan.prefill is not None:  # its ranks come after the decode owners'
        decode = sum(o.replicas * o.tp * o.dp for o in plan.owners)
        mine = [r for r in node.ranks if r >= decode]
        pool = (
            f"\n# Prefill pool ranks here: {mine[0]}-{mine[-1]} (they prefill every prompt and"
            "\n# send its KV cache to the decode ranks)."
            if mine
            else "\n# Decode ranks only: the plan's prefill pool runs on other nodes."
        )
    if rank == 0:  # node 0 serves: clients must send the deployment's API key
        key_doc = (
            "\n#   OPWEAVE_API_KEY     the key API clients must send (default: the deployment's"
            "\n#                       api-key file; keep it private)"
        )
        key = 'export OPWEAVE_API_KEY="${OPWEAVE_API_KEY:-$(cat "$here/../api-key")}"\n'
    return f"""#!/usr/bin/env bash
# OpWeave: node {rank} of {len(nodes)} for the {plan.strategy} plan of {plan.model.name}:
# {node.gpus} x {node.gpu}, global {ranks}. Written by `opweave deploy`; run it on that node
# (every node's script at about the same time; node 0 hosts the rendezvous and serves).{pool}
#
#   MODEL_PATH=/path/to/model MASTER_ADDR=<address of node 0> ./node-{rank}.sh [options]
#
# Options go to `opweave run`: --prompt/--prompts-file with --max-tokens generate and exit;
# without prompts node 0 serves the OpenAI API (--host, --port).
#   MODEL_PATH          the model folder (config.json + safetensors) on this node (required)
#   MASTER_ADDR         {master_doc}
#   MASTER_PORT         rendezvous port on node 0 (default {RENDEZVOUS_PORT})
#   OPWEAVE_RUN_SECRET  the secret every node's ranks authenticate with (default: the
#                       deployment's run-secret file; keep it private)
#   OPWEAVE             the opweave command (default: opweave on PATH){key_doc}
set -euo pipefail
here="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
: "${{MODEL_PATH:?set MODEL_PATH to the model folder on this node}}"
{master}export OPWEAVE_RUN_SECRET="${{OPWEAVE_RUN_SECRET:-$(cat "$here/../run-secret")}}"
{key}exec ${{OPWEAVE:-opweave}} run "$here/../plan.json" --model-path "$MODEL_PATH" \\
  --nnodes {len(nodes)} --node-rank {rank} --nodes "$here/../nodes.json" \\
  --master-addr "$MASTER_ADDR" --master-port "${{MASTER_PORT:-{RENDEZVOUS_PORT}}}" \\
  "$@"
"""


@dataclass(frozen=True)
class K8sOptions:
    name: str
    image: str
    model_pvc: str
    node_selector_key: str
    namespace: str | None = None


def _meta(opts: K8sOptions, name: str, **labels: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {
            "app.kubernetes.io/name": "opweave",
            "app.kubernetes.io/instance": opts.name,
            **labels,
        },
    }
    if opts.namespace:
        meta["namespace"] = opts.namespace
    return meta


def k8s_manifests(
    plan: Any,
    nodes: Sequence[Any],
    plan_text: str,
    opts: K8sOptions,
    gpu_resources: dict[str, str | None],
    secret: str,
    api_key: str,
) -> dict[str, dict[str, Any]]:
    """File name -> Kubernetes resource (as a dict) for the plan's deployment."""
    rdzv = f"{opts.name}-rdzv"
    groups = node_groups(nodes)
    master = f"{opts.name}-g0-0.{rdzv}"
    out: dict[str, dict[str, Any]] = {
        "config.yaml": {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(opts, f"{opts.name}-plan"),
            "data": {"plan.json": plan_text, "nodes.json": nodes_json(nodes)},
        },
        # the run's shared secret (ranks of the run accept only each other) and the API key
        # (node 0 serves only clients that send it)
        "secret.yaml": {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta(opts, f"{opts.name}-run-secret"),
            "type": "Opaque",
            "stringData": {"secret": secret, "api-key": api_key},
        },
        # a stable DNS name per pod (node 0: the rendezvous), resolvable before pods are ready
        "rendezvous-service.yaml": {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(opts, rdzv),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {"app.kubernetes.io/instance": opts.name},
                "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}],
            },
        },
        "api-service.yaml": {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(opts, f"{opts.name}-api"),
            "spec": {
                "selector": {"statefulset.kubernetes.io/pod-name": f"{opts.name}-g0-0"},
                "ports": [{"name": "http", "port": API_PORT, "targetPort": API_PORT}],
            },
        },
    }
    nodes_flag = f" --nodes {CONFIG_MOUNT}/nodes.json"
    for g in groups:
        group_label = {"opweave.io/node-group": str(g.index)}
        # node rank = the group's first node + the pod's ordinal (its hostname's suffix);
        # `$$(` is Kubernetes' escape for a literal `$(` in args
        serves = g.first_node == 0  # node 0, alone in its group (node_groups)
        command = (
            f"exec opweave run {CONFIG_MOUNT}/plan.json --model-path {MODEL_MOUNT} "
            f"--nnodes {len(nodes)} --node-rank $$(({g.first_node} + ${{HOSTNAME##*-}}))"
            f"{nodes_flag} --master-addr {master} --master-port {RENDEZVOUS_PORT}"
        )
        if serves:
            command += f" --host 0.0.0.0 --port {API_PORT} --api-key-file {SECRET_MOUNT}/api-key"
        resource = gpu_resources.get(g.gpu)
        limits = {resource: g.gpus} if resource else {}
        container: dict[str, Any] = {
            "name": "opweave",
            "image": opts.image,
            "command": ["/bin/sh", "-c"],
            "args": [command],
            "env": [
                {
                    "name": "OPWEAVE_RUN_SECRET",
                    "valueFrom": {
                        "secretKeyRef": {"name": f"{opts.name}-run-secret", "key": "secret"}
                    },
                }
            ],
            "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
            "volumeMounts": [
                {"name": "plan", "mountPath": CONFIG_MOUNT, "readOnly": True},
                {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True},
                {"name": "shm", "mountPath": "/dev/shm"},
            ],
        }
        volumes: list[dict[str, Any]] = [
            {"name": "plan", "configMap": {"name": f"{opts.name}-plan"}},
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": opts.model_pvc, "readOnly": True},
            },
            # NCCL and torch share tensors through /dev/shm
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
        ]
        if serves:
            container["ports"].append({"name": "http", "containerPort": API_PORT})
            container["volumeMounts"].append(
                {"name": "api-key", "mountPath": SECRET_MOUNT, "readOnly": True}
            )
            volumes.append(
                {
                    "name": "api-key",
                    "secret": {
                        "secretName": f"{opts.name}-run-secret",
                        "items": [{"key": "api-key", "path": "api-key"}],
                        "defaultMode": 0o400,
                    },
                }
            )
            # /health is the one route without the key: 200 while serving, 503 while draining
            # (then the API Service stops sending it requests)
            container["readinessProbe"] = {
                "httpGet": {"path": "/health", "port": "http"},
                "periodSeconds": 5,
                "failureThreshold": 1,
            }
        if limits:
            container["resources"] = {"limits": limits, "requests": limits}
        out[f"node-group-{g.index}.yaml"] = {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": _meta(opts, f"{opts.name}-g{g.index}", **group_label),
            "spec": {
                "serviceName": rdzv,
                "replicas": g.count,
                # every node must join the rendezvous: start them together, not one by one
                "podManagementPolicy": "Parallel",
                "selector": {
                    "matchLabels": {"app.kubernetes.io/instance": opts.name, **group_label}
                },
                "template": {
                    "metadata": {
                        "labels": {
                            "app.kubernetes.io/name": "opweave",
                            "app.kubernetes.io/instance": opts.name,
                            **group_label,
                        }
                    },
                    "spec": {
                        "nodeSelector": {opts.node_selector_key: g.gpu},
                        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
                        "containers": [container],
                        "volumes": volumes,
                    },
                },
            },
        }
    return out


class _BlockDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, as people write manifests: multi-line strings as literal blocks
    (``|``, not quoted scalars full of ``\\n``: the ConfigMap's plan reads as the plan file
    does), a list indented under its key, and a value used twice (a container's GPU limits and
    requests) written out twice rather than as an anchor and an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockDumper.add_representer(str, _string)
_YAML_WIDTH = 1 << 16  # no folding of long scalars (a pod's command line) over lines


def to_yaml(value: Any) -> str:
    """A Kubernetes resource as block-style YAML, its keys in the order they were written."""
    return yaml.dump(
        value,
        Dumper=_BlockDumper,
        sort_keys=False,
        default_flow_style=False,
        allow_unicode=True,
        width=_YAML_WIDTH,
    )
