"""``opweave deploy``: node layout, launch scripts and Kubernetes manifests of a plan.

The files round-trip (nodes.json is the costmodel's layout, the manifests parse back to what
was meant and pass kubernetes-validate), and the launch scripts run: a tiny-model plan as two
nodes on 127.0.0.1 produces transformers' greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from opweave.costmodel import Node, Plan, canonical_plan, load_model, plan_nodes
from opweave.planner import plan as search
from tests.helpers import IMAGE, cli_json, free_port, run_cli

K8S_VERSION = "1.30"
MAX_TOKENS = 16  # shares hf_greedy's cache with the runtime tests
CPU_NODE = """[[gpus]]
id = "cpu"
name = "CPU node"
memory_bytes = 8e9
mem_bandwidth_bytes_per_s = 2e10
dense_flops_per_s = 1e11
intra_node_bandwidth_bytes_per_s = 1e10
network_bandwidth_bytes_per_s = 1e9
usd_per_hour = 0.1
gpus_per_node = 1
"""


@pytest.fixture(scope="module")
def fleet_plan(tmp_path_factory) -> tuple[Plan, Path]:
    """A heterogeneous plan for 16 H100 + 8 A100: uneven nodes (4 H100, 8 A100)."""
    result = search(
        load_model("qwen3-next-80b-a3b"),
        ["h100", "a100"],
        context=32768,
        tpot_slo_s=0.05,
        inventory={"h100": 16, "a100": 8},
    )
    assert result.best is not None
    path = tmp_path_factory.mktemp("fleet") / "plan.json"
    path.write_text(result.best.model_dump_json())
    return result.best, path


def test_deploy_files_round_trip_and_validate(fleet_plan, tmp_path) -> None:
    plan, path = fleet_plan
    out = tmp_path / "dep"
    doc = cli_json("deploy", str(path), "-o", str(out), *IMAGE, "--namespace", "serving")
    nodes = [Node.model_validate(n) for n in json.loads((out / "nodes.json").read_text())]
    assert nodes == plan_nodes(plan, {"h100-sxm": 8, "a100-sxm-80gb": 8})
    assert [n.model_dump(mode="json") for n in nodes] == doc["nodes"]
    ranks = [r for n in nodes for r in n.ranks]
    assert ranks == list(range(sum(o.replicas * o.gpus_per_replica for o in plan.owners)))
    for gpu in {o.gpu for o in plan.owners}:
        used = sum(o.replicas * o.gpus_per_replica for o in plan.owners if o.gpu == gpu)
        assert sum(n.gpus for n in nodes if n.gpu == gpu) == used
    assert all(n.gpus <= 8 for n in nodes)
    assert Plan.model_validate_json((out / "plan.json").read_text()) == plan
    # the scripts pass the layout (uneven nodes) and the run's secret
    scripts = sorted((out / "launch").iterdir())
    assert [s.name for s in scripts] == [f"node-{r}.sh" for r in range(len(nodes))]
    for r, script in enumerate(scripts):
        assert os.access(script, os.X_OK)
        subprocess.run(["bash", "-n", str(script)], check=True)
        text = script.read_text()
        assert f"--nnodes {len(nodes)} --node-rank {r} --nodes" in text
        assert "run-secret" in text
    manifests = {p.name: yaml.safe_load(p.read_text()) for p in (out / "k8s").iterdir()}
    kinds = sorted(m["kind"] for m in manifests.values())
    # node 0 alone (it serves), then runs of consecutive nodes of one GPU type and count
    groups = 1 + sum(
        1
        for r in range(1, len(nodes))
        if r == 1 or (nodes[r].gpu, nodes[r].gpus) != (nodes[r - 1].gpu, nodes[r - 1].gpus)
    )
    assert kinds == sorted(["ConfigMap", "Secret", "Service", "Service"] + ["StatefulSet"] * groups)
    for name, manifest in manifests.items():
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
        assert manifest["metadata"]["namespace"] == "serving", name
    config = manifests["config.yaml"]["data"]
    assert Plan.model_validate_json(config["plan.json"]) == plan
    assert json.loads(config["nodes.json"]) == doc["nodes"]
    # per node group: the GPU-type node selector, the GPU request and the node ranks it runs
    sets = [m for m in manifests.values() if m["kind"] == "StatefulSet"]
    assert sum(s["spec"]["replicas"] for s in sets) == len(nodes)
    for s in sets:
        pod = s["spec"]["template"]["spec"]
        gpu = pod["nodeSelector"]["opweave.io/gpu"]
        (container,) = pod["containers"]
        count = container["resources"]["limits"]["nvidia.com/gpu"]
        assert any(n.gpu == gpu and n.gpus == count for n in nodes)
        assert "--nodes /etc/opweave/nodes.json" in container["args"][0]
        (env,) = container["env"]
        assert (
            env["valueFrom"]["secretKeyRef"]["name"] == manifests["secret.yaml"]["metadata"]["name"]
        )
        assert s["spec"]["serviceName"].endswith("-rdzv")
        assert container["image"] == IMAGE[1]


def _wide_plan(tmp_path: Path) -> Path:
    """A wide-EP plan: 2 replicas of 8 DP ranks of TP 2 (experts over EP 16), 32 H100s."""
    plan = canonical_plan(
        load_model("qwen3-30b-a3b"),
        "colocated",
        gpu="h100-sxm",
        batch=64,
        tp=2,
        ep=16,
        dp=8,
        replicas=2,
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    return path


def test_the_api_is_behind_a_key_and_probed_on_health(tmp_path) -> None:
    """Node 0 serves on 0.0.0.0 behind the API key of the deployment's Secret (a file it reads,
    the same key as DIR/api-key), and is ready when /health says 200; the other nodes serve
    nothing. The launch scripts need MASTER_ADDR on a deployment of several nodes."""
    path = _wide_plan(tmp_path)
    out = tmp_path / "dep"
    cli_json("deploy", str(path), "-o", str(out), *IMAGE)
    key = (out / "api-key").read_text().strip()
    assert len(key) >= 32 and (out / "api-key").stat().st_mode & 0o077 == 0
    manifests = {p.name: yaml.safe_load(p.read_text()) for p in (out / "k8s").iterdir()}
    secret = manifests["secret.yaml"]
    assert secret["stringData"]["api-key"] == key
    sets = sorted(
        (m for m in manifests.values() if m["kind"] == "StatefulSet"),
        key=lambda m: m["metadata"]["name"],
    )
    first = sets[0]
    assert first["metadata"]["name"].endswith("-g0") and first["spec"]["replicas"] == 1
    assert [s["spec"]["replicas"] for s in sets[1:]] == [3]  # nodes 1-3: one group
    for s in sets:
        pod = s["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = container["args"][0]
        serves = s is first
        assert ("--host 0.0.0.0" in args) == serves
        assert pod["terminationGracePeriodSeconds"] > 10 + 5  # the drain, then some
        if not serves:
            assert "readinessProbe" not in container and "--api-key" not in args
            continue
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        flag = args.split("--api-key-file ")[1].split()[0]
        mount = next(m for m in container["volumeMounts"] if flag.startswith(m["mountPath"] + "/"))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        (item,) = volume["secret"]["items"]
        assert item["key"] == "api-key" and flag == f"{mount['mountPath']}/{item['path']}"
    service = manifests["api-service.yaml"]["spec"]["selector"]
    assert service == {"statefulset.kubernetes.io/pod-name": f"{first['metadata']['name']}-0"}
    # the launch scripts: node 0 serves with the deployment's key; MASTER_ADDR is required
    assert '"$here/../api-key"' in (out / "launch" / "node-0.sh").read_text()
    assert "api-key" not in (out / "launch" / "node-1.sh").read_text()
    env = {k: v for k, v in os.environ.items() if k != "MASTER_ADDR"}
    env |= {"MODEL_PATH": str(tmp_path), "OPWEAVE": "echo"}
    for r in (0, 1):
        proc = subprocess.run(
            ["bash", str(out / "launch" / f"node-{r}.sh")], env=env, capture_output=True, text=True
        )
        assert proc.returncode != 0 and "set MASTER_ADDR" in proc.stderr, proc.stderr
    proc = subprocess.run(
        ["bash", str(out / "launch" / "node-1.sh")],
        env={**env, "MASTER_ADDR": "10.0.0.1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "--master-addr 10.0.0.1" in proc.stdout, proc.stderr


def test_manifests_are_readable_yaml_with_the_values_meant(tmp_path) -> None:
    """Every manifest parses back (PyYAML, as kubectl reads it) to the values written: the
    Secret holds the deployment's secret and API key, the rendezvous Service is headless and
    publishes pods before they are ready, the API Service selects node 0's pod, and the
    ConfigMap holds the plan and node layout byte for byte, as literal blocks a person can
    read (no anchors, no escaped newlines)."""
    path = _wide_plan(tmp_path)
    out = tmp_path / "dep"
    cli_json("deploy", str(path), "-o", str(out), *IMAGE, "--name", "wide", "--namespace", "ns")
    texts = {p.name: p.read_text() for p in (out / "k8s").iterdir()}
    manifests = {name: yaml.safe_load(text) for name, text in texts.items()}
    for name, text in texts.items():
        assert "&id" not in text and "*id" not in text, name  # no aliases
        assert not text.startswith(("{", "---")), name  # block style, one document
        meta = manifests[name]["metadata"]
        assert meta["namespace"] == "ns" and meta["labels"]["app.kubernetes.io/instance"] == "wide"
    secret = manifests["secret.yaml"]
    assert (secret["apiVersion"], secret["kind"], secret["type"]) == ("v1", "Secret", "Opaque")
    assert secret["metadata"]["name"] == "wide-run-secret"
    assert secret["stringData"] == {
        "secret": (out / "run-secret").read_text().strip(),
        "api-key": (out / "api-key").read_text().strip(),
    }
    rdzv = manifests["rendezvous-service.yaml"]
    assert (rdzv["kind"], rdzv["metadata"]["name"]) == ("Service", "wide-rdzv")
    assert rdzv["spec"] == {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,
        "selector": {"app.kubernetes.io/instance": "wide"},
        "ports": [{"name": "rendezvous", "port": 29500}],
    }
    api = manifests["api-service.yaml"]
    assert (api["kind"], api["metadata"]["name"]) == ("Service", "wide-api")
    assert api["spec"] == {
        "selector": {"statefulset.kubernetes.io/pod-name": "wide-g0-0"},
        "ports": [{"name": "http", "port": 8000, "targetPort": 8000}],
    }
    config = manifests["config.yaml"]
    assert (config["kind"], config["metadata"]["name"]) == ("ConfigMap", "wide-plan")
    assert config["data"]["plan.json"] == (out / "plan.json").read_text()
    assert config["data"]["nodes.json"] == (out / "nodes.json").read_text()
    assert "  plan.json: |\n" in texts["config.yaml"]
    (group,) = [m for n, m in manifests.items() if n == "node-group-0.yaml"]
    (container,) = group["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == container["resources"]["requests"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert "--node-rank $$((0 + ${HOSTNAME##*-}))" in container["args"][0]


def test_deploy_counts_tp_x_dp_gpus_per_replica(tmp_path) -> None:
    """A wide-EP plan: 2 replicas of 8 DP ranks of TP 2 (experts over EP 16) are 32 GPUs, four
    nodes of 8, one launch script each, ranks numbered DP rank by DP rank."""
    plan = canonical_plan(
        load_model("qwen3-30b-a3b"),
        "colocated",
        gpu="h100-sxm",
        batch=64,
        tp=2,
        ep=16,
        dp=8,
        replicas=2,
    )
    path = tmp_path / "plan.json"
    path.write_text(plan.model_dump_json())
    out = tmp_path / "dep"
    cli_json("deploy", str(path), "-o", str(out), *IMAGE)
    nodes = json.loads((out / "nodes.json").read_text())
    assert [(n["gpu"], n["gpus"]) for n in nodes] == [("h100-sxm", 8)] * 4
    assert [r for n in nodes for r in n["ranks"]] == list(range(32))
    assert sorted(p.name for p in (out / "launch").iterdir()) == [f"node-{r}.sh" for r in range(4)]


def test_manifests_fail_validation_when_broken(fleet_plan, tmp_path) -> None:
    """The validation above can fail: a manifest with a wrong field type does not pass."""
    _, path = fleet_plan
    out = tmp_path / "dep"
    run_cli("deploy", str(path), "-o", str(out), *IMAGE)
    manifest = yaml.safe_load((out / "k8s" / "node-group-0.yaml").read_text())
    manifest["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_bad_deploy_input_is_one_line_errors(fleet_plan, tmp_path) -> None:
    _, path = fleet_plan
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    cpu_plan = tmp_path / "cpu.json"
    cpu_plan.write_text(
        canonical_plan(load_model("qwen3-32b"), "afd", gpu="cpu", batch=2).model_dump_json()
    )
    cases = [
        (("deploy", str(bad), "-o", str(tmp_path / "x"), *IMAGE), "not a valid plan"),
        (("deploy", str(cpu_plan), "-o", str(tmp_path / "x"), *IMAGE), "unknown GPU 'cpu'"),
        (("deploy", str(path), "-o", str(tmp_path / "x"), *IMAGE, "--name", "Bad_Name"), "--name"),
        (("deploy", str(path), "-o", str(bad), *IMAGE), "is not a directory"),
        # no image exists by default: Kubernetes would pull one that does not exist
        (("deploy", str(path), "-o", str(tmp_path / "x")), "Missing option '--image'"),
    ]
    for args, message in cases:
        proc = run_cli(*args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert message in proc.stderr, proc.stderr


def test_launch_scripts_run_two_nodes(tmp_path, tiny_model, hf_greedy, prompts) -> None:
    """The emitted scripts, one per node on 127.0.0.1, generate transformers' greedy tokens."""
    model_dir = tiny_model("llama")
    plan = canonical_plan(load_model(model_dir), "afd", gpu="cpu", batch=4, microbatches=2)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json())
    hw = tmp_path / "cpu.toml"
    hw.write_text(CPU_NODE)
    out = tmp_path / "dep"
    doc = cli_json("deploy", str(plan_path), "-o", str(out), *IMAGE, "--hardware", str(hw))
    assert doc["nodes"] == [
        {"gpu": "cpu", "gpus": 1, "ranks": [0]},
        {"gpu": "cpu", "gpus": 1, "ranks": [1]},
    ]
    secret = (out / "run-secret").read_text().strip()
    assert len(secret) == 64 and (out / "run-secret").stat().st_mode & 0o077 == 0
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(
        "".join(json.dumps({"prompt_token_ids": list(p)}) + "\n" for p in prompts)
    )
    env = {
        **os.environ,
        "MODEL_PATH": str(model_dir),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("OPWEAVE_DEBUG", None)
    extra = ["--prompts-file", str(prompts_file), "--max-tokens", str(MAX_TOKENS)]
    extra += ["--timeout-s", "60", "--json"]
    procs = [
        subprocess.Popen(
            ["bash", str(out / "launch" / f"node-{r}.sh"), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    node0 = json.loads(results[0][0])
    assert [o["token_ids"] for o in node0["outputs"]] == hf_greedy(model_dir, prompts, MAX_TOKENS)
    assert [r["rank"] for r in node0["ranks"]] == [0, 1]
    assert json.loads(results[1][0]) == {"node_rank": 1, "outputs": None}
