"""deploy/: render every kustomize overlay and check, offline, what a cluster and ringmaster rely on.

- Every rendered object validates against the Kubernetes OpenAPI schemas that the
  `kubernetes-validate` package ships (strict: unknown fields are errors), for the oldest and the
  newest Kubernetes version checked here. It has no schema for KubeRay's RayCluster, so the RayCluster
  is checked against a structural schema of the KubeRay ray.io/v1 fields (below), and its pod
  templates against the core PodTemplateSpec schema.
- The wiring ringmaster relies on: head without GPUs and with its dashboard on 0.0.0.0, worker groups
  with min ≤ replicas ≤ max, GPUs in the gpu overlay and none in dev, the ringmaster image, the
  checkpoint volume mounted at RINGMASTER_STORAGE_URI on head, workers and control plane, 2
  control-plane replicas probed on /healthz, every RINGMASTER_* variable a real Settings field whose
  value parses, Ray/API/database addresses that point at objects of the same render, and Services
  whose selectors match pod labels.
- Ray's token authentication in every overlay: the RayCluster asks KubeRay for it (authOptions), no Ray container
  turns it off or carries a token of its own, and the control plane reads the token from the Secret KubeRay fills.
- The Dockerfile's cpu/cuda switch and its Ray pin.

`kubectl kustomize` renders (no cluster needed). Without kubectl these tests skip locally and fail
in CI (CI=true).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from sqlalchemy import make_url

from ringmaster.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAY_DIR = K8S / "overlays"
OVERLAYS = sorted(p.name for p in OVERLAY_DIR.iterdir() if (p / "kustomization.yaml").is_file())
ENV_PREFIX = "RINGMASTER_"
CONTROL_PLANE = "ringmaster-api"
GPU = "nvidia.com/gpu"
PLACEHOLDER = "REPLACE_ME"
PLACEHOLDER_IMAGES = ("ringmaster-ray", "ringmaster-control-plane")
RAY_TOKEN_KEY = "auth_token"  # the key of KubeRay's token Secret

# What each overlay promises. A new overlay must say what it promises here before its tests pass.
EXPECTED: dict[str, dict[str, Any]] = {
    "dev": {"gpus": False, "ray_tag": "cpu", "control_plane_tag": "cpu", "bundled_postgres": True, "rwx": False},
    "gpu": {"gpus": True, "ray_tag": "cuda", "control_plane_tag": "cpu", "bundled_postgres": False, "rwx": True},
    "ha": {
        "gpus": False,
        "ray_tag": "cpu",
        "control_plane_tag": "cpu",
        "bundled_postgres": True,
        "rwx": False,
        "gcs_fault_tolerance": True,
    },
}


def _required(what: str, hint: str) -> None:
    """Missing tooling: a clear failure in CI, a skip on a developer's machine."""
    message = f"{what} is needed to check deploy/: {hint}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@cache
def _kubectl() -> str | None:
    return shutil.which("kubectl")


@pytest.fixture(scope="module")
def kubectl() -> str:
    path = _kubectl()
    if path is None:
        _required("kubectl (for `kubectl kustomize`)", "install kubectl ≥ 1.27; no cluster is needed")
    return path


@pytest.fixture(scope="module")
def kv():
    try:
        import kubernetes_validate
    except ImportError:
        _required("the kubernetes-validate package", "pip install -e '.[test]'")
    return kubernetes_validate


@cache
def _render_cached(kubectl: str, path: str) -> tuple[dict[str, Any], ...]:
    result = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        pytest.fail(f"`kubectl kustomize {Path(path).relative_to(ROOT)}` failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def render(kubectl: str, path: Path) -> list[dict[str, Any]]:
    """The objects a kustomization renders to (a deep copy: tests may mutate it)."""
    return copy.deepcopy(list(_render_cached(kubectl, str(path))))


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest, kubectl: str) -> Rendered:
    name = request.param
    if name not in EXPECTED:
        pytest.fail(f"overlay {name!r} has no entry in EXPECTED in {Path(__file__).name}: say what it promises")
    return Rendered(name, render(kubectl, OVERLAY_DIR / name))


# -- a rendered overlay, indexed -------------------------------------------------------------------


class Rendered:
    def __init__(self, name: str, docs: list[dict[str, Any]]) -> None:
        self.name = name
        self.docs = docs
        self.expect = EXPECTED.get(name, {})

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [doc for doc in self.docs if doc["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [doc for doc in self.of_kind(kind) if doc["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind} {name!r}, found {len(found)}"
        return found[0]

    def find(self, kind: str, name: str) -> dict[str, Any] | None:
        found = [doc for doc in self.of_kind(kind) if doc["metadata"]["name"] == name]
        return found[0] if found else None

    @property
    def raycluster(self) -> dict[str, Any]:
        clusters = self.of_kind("RayCluster")
        assert len(clusters) == 1, f"{self.name}: expected one RayCluster, found {len(clusters)}"
        return clusters[0]

    @property
    def control_plane(self) -> dict[str, Any]:
        return self.get("Deployment", CONTROL_PLANE)

    def pod_templates(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, pod template) for every workload: Deployments, StatefulSets, the RayCluster's groups."""
        for doc in self.docs:
            where = f"{doc['kind']}/{doc['metadata']['name']}"
            if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
                yield where, doc["spec"]["template"]
            elif doc["kind"] == "RayCluster":
                yield f"{where} head", doc["spec"]["headGroupSpec"]["template"]
                for group in doc["spec"].get("workerGroupSpecs", []):
                    yield f"{where} workers {group['groupName']}", group["template"]

    def containers(self) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
        """(where, container, pod spec) for every container and init container."""
        for where, template in self.pod_templates():
            spec = template["spec"]
            for container in spec.get("initContainers", []) + spec["containers"]:
                yield f"{where} container {container['name']}", container, spec

    def ray_token_secret(self) -> str | None:
        """The Secret that holds the Ray cluster's token when its authOptions ask for one: the one secretName names,
        else the one KubeRay generates under the RayCluster's name (key auth_token)."""
        options = self.raycluster["spec"].get("authOptions") or {}
        if options.get("mode") != "token":
            return None
        return str(options.get("secretName") or self.raycluster["metadata"]["name"])

    def data(self, kind: str, name: str) -> dict[str, str]:
        """A ConfigMap's or Secret's decoded key/value pairs."""
        doc = self.get(kind, name)
        values = dict(doc.get("stringData") or {}) if kind == "Secret" else {}
        for key, value in (doc.get("data") or {}).items():
            values[key] = base64.b64decode(value).decode() if kind == "Secret" else value
        return values

    def environment(self, container: dict[str, Any]) -> dict[str, str | None]:
        """The container's environment as Kubernetes builds it: envFrom first, env over it. A value
        that comes from a Secret or ConfigMap key is resolved; one Kubernetes fills in at run time
        (fieldRef, resourceFieldRef) is None."""
        environment: dict[str, str | None] = {}
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in source:
                    name = source[key]["name"]
                    assert self.find(kind, name), f"{self.name}: envFrom names a missing {kind} {name!r}"
                    environment.update({prefix + k: v for k, v in self.data(kind, name).items()})
        for variable in container.get("env", []):
            if "value" in variable:
                environment[variable["name"]] = variable["value"]
                continue
            source = variable.get("valueFrom", {})
            generated = source.get("secretKeyRef", {})
            if (generated.get("name"), generated.get("key")) == (self._generated_token_secret(), RAY_TOKEN_KEY):
                environment[variable["name"]] = None  # KubeRay's random token, made when it reconciles the cluster
                continue
            for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                if key in source:
                    ref = source[key]
                    assert self.find(kind, ref["name"]), (
                        f"{self.name}: {variable['name']} names a missing {kind} {ref['name']!r}"
                    )
                    values = self.data(kind, ref["name"])
                    assert ref["key"] in values, f"{self.name}: {kind} {ref['name']} has no key {ref['key']!r}"
                    environment[variable["name"]] = values[ref["key"]]
                    break
            else:
                environment[variable["name"]] = None
        return environment

    def _generated_token_secret(self) -> str | None:
        """The token Secret KubeRay generates itself (none is rendered), if the RayCluster has it make one."""
        name = self.ray_token_secret()
        return name if name is not None and self.find("Secret", name) is None else None

    @property
    def control_plane_settings(self) -> Settings:
        """The Settings the control plane's container starts with (its RINGMASTER_* environment)."""
        container = self.control_plane["spec"]["template"]["spec"]["containers"][0]
        env = {k: v for k, v in self.environment(container).items() if k.startswith(ENV_PREFIX) and v is not None}
        return settings_from(env)


def settings_from(env: dict[str, str]) -> Settings:
    """Settings as pydantic-settings reads them from exactly this environment."""
    saved = {k: v for k, v in os.environ.items() if k.upper().startswith(ENV_PREFIX)}
    try:
        for key in saved:
            del os.environ[key]
        os.environ.update(env)
        return Settings()
    finally:
        for key in env:
            os.environ.pop(key, None)
        os.environ.update(saved)


def cpu_quantity(value: str | int | float) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def container_port(containers: list[dict[str, Any]], port: int | str) -> int | None:
    """The container port a Service's targetPort or a probe's port names (a number or a port name)."""
    for container in containers:
        for declared in container.get("ports", []):
            if port in (declared["containerPort"], declared.get("name")):
                return declared["containerPort"]
    return None


# -- the RayCluster's schema (KubeRay ray.io/v1) ---------------------------------------------------

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_COUNT = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_OBJECT = {"type": "object"}
_ARRAY = {"type": "array"}
# Field names as in KubeRay's ray-operator/apis/ray/v1/raycluster_types.go (v1.0 to the newest); a
# misspelt field is an error here, as it would be silently dropped or refused by the API server.
RAYCLUSTER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "labels": _STRING_MAP,
                "annotations": _STRING_MAP,
            },
        },
        "spec": {
            "type": "object",
            "required": ["headGroupSpec"],
            "additionalProperties": False,
            "properties": {
                "rayVersion": {"type": "string"},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "autoscalerOptions": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "resources": _OBJECT,
                        "image": {"type": "string"},
                        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                        "securityContext": _OBJECT,
                        "idleTimeoutSeconds": _COUNT,
                        "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
                        "version": {"enum": ["v1", "v2"]},
                        "env": _ARRAY,
                        "envFrom": _ARRAY,
                        "volumeMounts": _ARRAY,
                        "command": _ARRAY,
                        "args": _ARRAY,
                    },
                },
                "headServiceAnnotations": _STRING_MAP,
                "suspend": {"type": "boolean"},
                "managedBy": {"enum": ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"]},
                "upgradeStrategy": _OBJECT,
                "authOptions": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "mode": {"enum": ["disabled", "token"]},
                        "secretName": {"type": "string", "minLength": 1},
                        "enableK8sTokenAuth": {"type": "boolean"},
                    },
                },
                "gcsFaultToleranceOptions": _OBJECT,
                "historyServerOptions": _OBJECT,
                "networkPolicy": _OBJECT,
                "tlsOptions": _OBJECT,
                "headGroupSpec": {
                    "type": "object",
                    "required": ["template"],
                    "additionalProperties": False,
                    "properties": {
                        "template": _OBJECT,
                        "rayStartParams": _STRING_MAP,
                        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                        "headService": _OBJECT,
                        "enableIngress": {"type": "boolean"},
                        "ingressOptions": _OBJECT,
                        "resources": _STRING_MAP,
                        "labels": _STRING_MAP,
                    },
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["groupName", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "groupName": {"type": "string", "minLength": 1},
                            "replicas": _COUNT,
                            "minReplicas": _COUNT,
                            "maxReplicas": _COUNT,
                            "numOfHosts": {"type": "integer", "minimum": 1},
                            "idleTimeoutSeconds": _COUNT,
                            "priority": {"type": "integer"},
                            "rayStartParams": _STRING_MAP,
                            "resources": _STRING_MAP,
                            "labels": _STRING_MAP,
                            "template": _OBJECT,
                            "scaleStrategy": _OBJECT,
                            "suspend": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def raycluster_problems(cluster: dict[str, Any], kv, version: str) -> list[str]:
    """What is wrong with a RayCluster: its structure, its pod templates (core schema), its groups."""
    import jsonschema  # kubernetes-validate's dependency

    problems = [
        f"{'.'.join(map(str, error.path)) or '<root>'}: {error.message}"
        for error in jsonschema.Draft202012Validator(RAYCLUSTER_SCHEMA).iter_errors(cluster)
    ]
    if problems:
        return problems
    spec = cluster["spec"]
    templates = [("headGroupSpec.template", spec["headGroupSpec"]["template"])]
    templates += [
        (f"workerGroupSpecs[{i}].template", g["template"]) for i, g in enumerate(spec.get("workerGroupSpecs", []))
    ]
    for where, template in templates:
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
        try:
            kv.validate(wrapped, version, strict=True)
        except kv.ValidationError as error:
            problems.append(f"{where}.{'.'.join(map(str, list(error.path)[1:]))}: {error.message}")
    names = [g["groupName"] for g in spec.get("workerGroupSpecs", [])]
    if len(set(names)) != len(names):
        problems.append(f"worker group names repeat: {names}")
    for group in spec.get("workerGroupSpecs", []):
        low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        replicas = group.get("replicas", low)
        if not low <= replicas <= high:
            problems.append(
                f"worker group {group['groupName']}: needs minReplicas {low} ≤ replicas {replicas} ≤ maxReplicas {high}"
            )
        if high < 1:
            problems.append(f"worker group {group['groupName']}: maxReplicas {high} leaves it without workers")
    head_params = spec["headGroupSpec"].get("rayStartParams", {})
    if head_params.get("dashboard-host") != "0.0.0.0":
        problems.append(
            "headGroupSpec.rayStartParams.dashboard-host must be '0.0.0.0': the control plane "
            f"reaches the dashboard / Jobs API through the head Service (got {head_params.get('dashboard-host')!r})"
        )
    return problems


def validation_problems(doc: dict[str, Any], kv, versions: tuple[str, ...]) -> list[str]:
    where = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    problems = []
    for version in versions:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as error:
            problems.append(f"{where} (Kubernetes {version}): {'.'.join(map(str, error.path))}: {error.message}")
        except kv.SchemaNotFoundError:
            if doc.get("kind") == "RayCluster":
                problems += [f"{where} (Kubernetes {version}): {p}" for p in raycluster_problems(doc, kv, version)]
            else:
                problems.append(
                    f"{where}: no schema for {doc.get('apiVersion')} {doc.get('kind')} in Kubernetes {version}"
                )
    return problems


@pytest.fixture(scope="module")
def versions(kv) -> tuple[str, ...]:
    """The oldest Kubernetes these manifests promise to work on, and the newest the package knows."""
    return ("1.30.0", kv.utils.latest_version())


# -- rendering and schemas -------------------------------------------------------------------------


def test_the_dev_and_gpu_overlays_exist() -> None:
    assert {"dev", "gpu"} <= set(OVERLAYS), f"overlays found: {OVERLAYS}"


def test_every_object_validates_against_the_kubernetes_schemas(overlay: Rendered, kv, versions) -> None:
    problems = [problem for doc in overlay.docs for problem in validation_problems(doc, kv, versions)]
    assert not problems, f"{overlay.name}:\n" + "\n".join(problems)


def test_the_base_is_namespace_agnostic_and_overlays_use_one_namespace(kubectl: str, overlay: Rendered) -> None:
    base = render(kubectl, K8S / "base")
    assert not [d for d in base if "namespace" in d["metadata"] or d["kind"] == "Namespace"]
    namespaces = {d["metadata"].get("namespace") for d in overlay.docs if d["kind"] != "Namespace"}
    assert len(namespaces) == 1 and None not in namespaces, f"{overlay.name}: namespaces {namespaces}"
    assert overlay.find("Namespace", namespaces.pop()), f"{overlay.name}: the overlay should create its namespace"


def test_schema_checks_catch_mistakes(overlay: Rendered, kv, versions) -> None:
    """The checks above are not vacuous: typical mistakes in each kind are reported."""
    deployment = copy.deepcopy(overlay.control_plane)
    deployment["spec"]["replicas"] = "two"
    assert validation_problems(deployment, kv, versions)
    deployment = copy.deepcopy(overlay.control_plane)
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {
        "httpGet": {"path": "/healthz", "port": 8765}
    }
    assert validation_problems(deployment, kv, versions)

    def broken(change) -> list[str]:
        cluster = copy.deepcopy(overlay.raycluster)
        change(cluster["spec"])
        return validation_problems(cluster, kv, versions)

    assert not broken(lambda spec: None)
    assert broken(lambda spec: spec["workerGroupSpecs"][0].update(minReplicas=5, maxReplicas=2))
    assert broken(lambda spec: spec["workerGroupSpecs"][0].update(maxReplica=2))
    assert broken(lambda spec: spec["headGroupSpec"]["rayStartParams"].update({"num-gpus": 0}))
    assert broken(lambda spec: spec["headGroupSpec"]["rayStartParams"].pop("dashboard-host"))
    assert broken(lambda spec: spec["headGroupSpec"]["template"]["spec"]["containers"][0].update(imagePolicy="Always"))
    assert broken(
        lambda spec: spec["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"].update(limits=[])
    )


# -- the RayCluster --------------------------------------------------------------------------------


def _gpus(container: dict[str, Any]) -> tuple[str | None, str | None]:
    resources = container.get("resources", {})
    return resources.get("requests", {}).get(GPU), resources.get("limits", {}).get(GPU)


def test_raycluster_head_has_no_gpus_and_serves_the_dashboard(overlay: Rendered) -> None:
    cluster = overlay.raycluster
    assert cluster["apiVersion"] == "ray.io/v1"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert head["rayStartParams"].get("num-gpus") == "0"
    for container in head["template"]["spec"]["containers"]:
        assert _gpus(container) == (None, None), f"{overlay.name}: the head asks for GPUs"


def test_raycluster_workers_autoscale_within_bounds(overlay: Rendered) -> None:
    spec = overlay.raycluster["spec"]
    assert spec.get("enableInTreeAutoscaling") is True
    assert spec.get("workerGroupSpecs"), f"{overlay.name}: no worker group"
    for group in spec["workerGroupSpecs"]:
        assert "minReplicas" in group and "maxReplicas" in group, group["groupName"]
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
        assert group["maxReplicas"] >= 1


def test_gpus_in_the_gpu_overlay_and_none_in_dev(overlay: Rendered) -> None:
    workers = [
        (g["groupName"], c)
        for g in overlay.raycluster["spec"]["workerGroupSpecs"]
        for c in g["template"]["spec"]["containers"]
    ]
    if overlay.expect["gpus"]:
        for group, container in workers:
            request, limit = _gpus(container)
            assert limit is not None and int(limit) >= 1, f"{overlay.name}: workers {group} have no {GPU} limit"
            assert request == limit, f"{overlay.name}: workers {group}: {GPU} request {request} != limit {limit}"
    else:
        for where, container, pod in overlay.containers():
            assert _gpus(container) == (None, None), f"{overlay.name}: {where} asks for GPUs"
            assert not [t for t in pod.get("tolerations", []) if t.get("key") == GPU], (
                f"{overlay.name}: {where} tolerates GPU nodes"
            )
        for group in overlay.raycluster["spec"]["workerGroupSpecs"]:
            assert group["rayStartParams"].get("num-gpus", "0") == "0"


def test_ray_pods_and_the_control_plane_run_the_ringmaster_image(overlay: Rendered) -> None:
    def image(container: dict[str, Any]) -> tuple[str, str]:
        repository, _, tag = container["image"].rpartition(":")
        return repository.rsplit("/", 1)[-1], tag

    cluster = overlay.raycluster["spec"]
    ray = [c for c in cluster["headGroupSpec"]["template"]["spec"]["containers"] if c["name"] == "ray-head"]
    ray += [g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]
    assert len(ray) == 1 + len(cluster["workerGroupSpecs"])
    for container in ray:
        assert image(container) == ("ringmaster", overlay.expect["ray_tag"]), container["image"]
    for container in overlay.control_plane["spec"]["template"]["spec"]["containers"]:
        assert image(container) == ("ringmaster", overlay.expect["control_plane_tag"]), container["image"]
    images = {c["image"] for _, c, _ in overlay.containers()}
    assert not {i for i in images if i.split(":")[0].rsplit("/", 1)[-1] in PLACEHOLDER_IMAGES}, images


def test_checkpoint_volume_is_mounted_at_the_storage_uri_everywhere(overlay: Rendered) -> None:
    storage = overlay.control_plane_settings.storage_uri
    assert storage, f"{overlay.name}: RINGMASTER_STORAGE_URI is not set: each pod would checkpoint to its own disk"
    if urlsplit(storage).scheme:  # an object store (s3://, gs://): nothing to mount
        assert urlsplit(storage).scheme in {"s3", "gs", "gcs", "az", "abfs"}, storage
        return
    assert storage.startswith("/"), (
        f"{overlay.name}: RINGMASTER_STORAGE_URI {storage!r} is neither an absolute path nor a URI"
    )
    cluster = overlay.raycluster["spec"]
    pods = {
        "control plane": overlay.control_plane["spec"]["template"]["spec"],
        "ray head": cluster["headGroupSpec"]["template"]["spec"],
    }
    pods.update({f"ray workers {g['groupName']}": g["template"]["spec"] for g in cluster["workerGroupSpecs"]})
    claims = set()
    for where, pod in pods.items():
        main = pod["containers"][0]
        mounts = [m for m in main.get("volumeMounts", []) if m["mountPath"] == storage]
        assert len(mounts) == 1, f"{overlay.name}: {where} does not mount anything at {storage}"
        volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
        assert "persistentVolumeClaim" in volume, (
            f"{overlay.name}: {where} mounts {volume} at {storage}, not the shared claim"
        )
        claims.add(volume["persistentVolumeClaim"]["claimName"])
        assert not mounts[0].get("readOnly") and not mounts[0].get("subPath"), f"{overlay.name}: {where}"
    assert len(claims) == 1, f"{overlay.name}: the pods mount different claims {claims}"
    claim = overlay.get("PersistentVolumeClaim", claims.pop())
    if overlay.expect["rwx"]:
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"], (
            f"{overlay.name}: checkpoints must be shared across nodes"
        )


# -- the control plane -----------------------------------------------------------------------------


def test_control_plane_runs_two_replicas_probed_on_healthz(overlay: Rendered) -> None:
    deployment = overlay.control_plane
    assert deployment["spec"]["replicas"] == 2
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container = containers[0]
    assert container["command"][:2] == ["ringmaster", "serve"]
    api_port = overlay.control_plane_settings.api_port
    for probe in ("livenessProbe", "readinessProbe"):
        http = container.get(probe, {}).get("httpGet")
        assert http and http["path"] == "/healthz", f"{overlay.name}: {probe} is not GET /healthz"
        assert container_port(containers, http["port"]) == api_port, (
            f"{overlay.name}: {probe} port {http['port']} is not the API port"
        )


def test_every_container_has_resource_requests_and_limits(overlay: Rendered) -> None:
    for where, container, _ in overlay.containers():
        resources = container.get("resources", {})
        for kind in ("requests", "limits"):
            missing = {"cpu", "memory"} - set(resources.get(kind, {}))
            assert not missing, f"{overlay.name}: {where} has no {kind} for {missing}"
        request, limit = resources["requests"]["cpu"], resources["limits"]["cpu"]
        assert cpu_quantity(request) <= cpu_quantity(limit), (
            f"{overlay.name}: {where}: cpu request {request} > limit {limit}"
        )
    autoscaler = overlay.raycluster["spec"].get("autoscalerOptions", {}).get("resources", {})
    assert {"requests", "limits"} <= set(autoscaler), f"{overlay.name}: the autoscaler sidecar has no resources"


def test_every_ringmaster_variable_is_a_settings_field_and_parses(overlay: Rendered) -> None:
    fields = set(Settings.model_fields)
    for where, container, _ in overlay.containers():
        environment = overlay.environment(container)
        ours = {k: v for k, v in environment.items() if k.upper().startswith(ENV_PREFIX)}
        unknown = {k for k in ours if k[len(ENV_PREFIX) :].lower() not in fields}
        assert not unknown, (
            f"{overlay.name}: {where} sets {sorted(unknown)}, which service.settings.Settings does not read"
        )
        settings_from({k: v for k, v in ours.items() if v is not None})  # raises when a value does not parse
    assert {
        "RINGMASTER_DATABASE_URL",
        "RINGMASTER_RAY_ADDRESS",
        "RINGMASTER_RAY_DASHBOARD_URL",
        "RINGMASTER_API_URL",
        "RINGMASTER_STORAGE_URI",
    } <= set(overlay.environment(overlay.control_plane["spec"]["template"]["spec"]["containers"][0]))


def test_ray_addresses_point_at_the_head_service(overlay: Rendered) -> None:
    settings = overlay.control_plane_settings
    head_service = f"{overlay.raycluster['metadata']['name']}-head-svc"  # KubeRay's name for it
    head = overlay.raycluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    ray = urlsplit(settings.ray_address)
    # The control plane is no Ray node: it joins as a Ray Client (ray://…:10001); a bare GCS address
    # needs a raylet in the same pod.
    assert ray.scheme == "ray", (
        f"{overlay.name}: RINGMASTER_RAY_ADDRESS {settings.ray_address!r} is not a ray:// address"
    )
    assert ray.hostname == head_service and ray.port == container_port(head, "client") == 10001
    dashboard = urlsplit(settings.ray_dashboard_url)
    assert (dashboard.scheme, dashboard.hostname) == ("http", head_service)
    assert dashboard.port == container_port(head, "dashboard") == 8265
    assert container_port(head, "gcs-server") == 6379


def test_gcs_fault_tolerance_has_its_redis_and_keeps_drivers_off_the_head(overlay: Rendered) -> None:
    spec = overlay.raycluster["spec"]
    options = spec.get("gcsFaultToleranceOptions")
    driver_resources = overlay.control_plane_settings.driver_resources
    if not overlay.expect.get("gcs_fault_tolerance"):
        assert options is None and not driver_resources, f"{overlay.name}: GCS fault tolerance where none is promised"
        return
    host, port = options["redisAddress"].rsplit(":", 1)
    redis = overlay.get("Service", host)
    assert int(port) in {p["port"] for p in redis["spec"]["ports"]}, f"{overlay.name}: {host} has no port {port}"
    redis_pods = [
        t for _, t in overlay.pod_templates() if redis["spec"]["selector"].items() <= t["metadata"]["labels"].items()
    ]
    assert len(redis_pods) == 1 and container_port(redis_pods[0]["spec"]["containers"], int(port))
    secret = options["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert secret["key"] in overlay.data("Secret", secret["name"]), f"{overlay.name}: no Redis password secret"
    # Every driver asks for a resource that only worker pods have, so a restarted head takes no driver with it.
    assert driver_resources, f"{overlay.name}: RINGMASTER_DRIVER_RESOURCES is unset, so drivers land on the head"
    head_resources = spec["headGroupSpec"]["rayStartParams"].get("resources")
    assert head_resources is None or not set(driver_resources) & set(json.loads(json.loads(head_resources)))
    for group in spec["workerGroupSpecs"]:
        offered = json.loads(json.loads(group["rayStartParams"]["resources"]))  # KubeRay's quoted JSON
        assert all(offered.get(name, 0) >= amount for name, amount in driver_resources.items()), (
            f"{overlay.name}: worker group {group['groupName']} offers {offered}, drivers need {driver_resources}"
        )


def test_api_url_reaches_the_control_plane_through_its_service(overlay: Rendered) -> None:
    settings = overlay.control_plane_settings
    api = urlsplit(settings.resolved_api_url())
    service = overlay.get("Service", api.hostname)
    port = next((p for p in service["spec"]["ports"] if p["port"] == api.port), None)
    assert port, f"{overlay.name}: Service {api.hostname} has no port {api.port}"
    template = overlay.control_plane["spec"]["template"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert container_port(template["spec"]["containers"], port.get("targetPort", port["port"])) == settings.api_port


def test_service_selectors_match_pod_labels(overlay: Rendered) -> None:
    pods = [(where, t) for where, t in overlay.pod_templates() if not where.startswith("RayCluster")]
    for service in overlay.of_kind("Service"):
        selector = service["spec"].get("selector")
        assert selector, f"{overlay.name}: Service {service['metadata']['name']} selects nothing"
        matched = [(w, t) for w, t in pods if selector.items() <= t["metadata"].get("labels", {}).items()]
        assert matched, f"{overlay.name}: Service {service['metadata']['name']} selector {selector} matches no pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for where, template in matched:
                assert container_port(template["spec"]["containers"], target), (
                    f"{overlay.name}: Service {service['metadata']['name']} targets port {target!r}, "
                    f"which {where} does not declare"
                )
    for kind in ("Deployment", "StatefulSet"):
        for workload in overlay.of_kind(kind):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
            if kind == "StatefulSet":
                service = overlay.get("Service", workload["spec"]["serviceName"])
                assert service["spec"].get("clusterIP") == "None", "a StatefulSet's governing Service is headless"
    for budget in overlay.of_kind("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(selector.items() <= t["metadata"]["labels"].items() for _, t in pods)


def test_node_shape_settings_match_the_worker_pods(overlay: Rendered) -> None:
    """RINGMASTER_GPUS_PER_NODE / CPUS_PER_NODE, when set, are what one worker pod gives Ray."""
    settings = overlay.control_plane_settings
    workers = [
        g["template"]["spec"]["containers"][0]["resources"]["limits"]
        for g in overlay.raycluster["spec"]["workerGroupSpecs"]
    ]
    if settings.gpus_per_node is not None:
        assert {int(w.get(GPU, 0)) for w in workers} == {settings.gpus_per_node}
    if settings.cpus_per_node is not None:
        assert {cpu_quantity(w["cpu"]) for w in workers} == {settings.cpus_per_node}
    if overlay.expect["gpus"]:
        assert settings.gpus_per_node is not None, f"{overlay.name}: set RINGMASTER_GPUS_PER_NODE"


# -- database and secrets --------------------------------------------------------------------------


def test_database_url_points_at_the_bundled_or_an_external_postgresql(overlay: Rendered) -> None:
    url = make_url(overlay.control_plane_settings.database_url)
    assert url.drivername == "postgresql+psycopg", f"{overlay.name}: {url.drivername}"
    statefulsets = overlay.of_kind("StatefulSet")
    if overlay.expect["bundled_postgres"]:
        assert len(statefulsets) == 1 and statefulsets[0]["spec"]["volumeClaimTemplates"]
        service = overlay.get("Service", url.host)
        assert url.port in {p["port"] for p in service["spec"]["ports"]}
        postgres = statefulsets[0]["spec"]["template"]
        assert service["spec"]["selector"].items() <= postgres["metadata"]["labels"].items()
        environment = overlay.environment(postgres["spec"]["containers"][0])
        assert (url.username, url.password, url.database) == (
            environment["POSTGRES_USER"],
            environment["POSTGRES_PASSWORD"],
            environment["POSTGRES_DB"],
        )
    else:
        assert not statefulsets, f"{overlay.name}: an external-database overlay bundles a StatefulSet"
        assert not overlay.find("Service", url.host.split(".")[0]), (
            f"{overlay.name}: {url.host} is a Service of this render"
        )
        assert PLACEHOLDER in str(url.render_as_string(hide_password=False)), (
            f"{overlay.name}: the external database URL should be a marked placeholder, not a real credential"
        )


def test_ray_token_authentication_is_on_and_the_control_plane_presents_the_token(overlay: Rendered) -> None:
    secret = overlay.ray_token_secret()
    assert secret is not None, f"{overlay.name}: the RayCluster's authOptions do not ask for token authentication"
    assert not overlay.raycluster["spec"]["authOptions"].get("enableK8sTokenAuth"), "ringmaster presents a static token"
    for where, container, _ in overlay.containers():
        if not where.startswith("RayCluster"):
            continue
        variables = {variable["name"]: variable for variable in container.get("env", [])}
        # KubeRay sets both on every Ray container unless the template already does: neither may be set otherwise.
        assert variables.get("RAY_AUTH_MODE", {}).get("value", "token") == "token", f"{overlay.name}: {where}"
        assert "RAY_AUTH_TOKEN" not in variables and "RAY_AUTH_TOKEN_PATH" not in variables, f"{overlay.name}: {where}"
    control_plane = overlay.control_plane["spec"]["template"]["spec"]["containers"][0]
    token = next((v for v in control_plane.get("env", []) if v["name"] == "RINGMASTER_RAY_AUTH_TOKEN"), None)
    assert token is not None, f"{overlay.name}: the control plane has no RINGMASTER_RAY_AUTH_TOKEN"
    assert token.get("valueFrom", {}).get("secretKeyRef") == {"name": secret, "key": RAY_TOKEN_KEY}, (
        f"{overlay.name}: RINGMASTER_RAY_AUTH_TOKEN does not come from the cluster's token Secret {secret}"
    )
    assert "RINGMASTER_RAY_AUTH_TOKEN_FILE" not in overlay.environment(control_plane)


def test_no_api_token_is_deployed_tokens_live_hashed_in_the_database(overlay: Rendered) -> None:
    for secret in overlay.of_kind("Secret"):
        assert not [key for key in overlay.data("Secret", secret["metadata"]["name"]) if "token" in key], secret[
            "metadata"
        ]["name"]


# -- the image -------------------------------------------------------------------------------------

DOCKERFILE = DEPLOY / "Dockerfile"


def _instructions() -> list[str]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _arg_defaults() -> dict[str, str]:
    return dict(re.findall(r"^ARG\s+(\w+)=(\S*)", "\n".join(_instructions()), flags=re.M))


def _torch_install(variant: str, index: str = "") -> subprocess.CompletedProcess:
    """Run the Dockerfile's torch step with `pip` replaced by echo."""
    step = next(i for i in _instructions() if i.startswith("RUN") and "VARIANT" in i)[len("RUN") :]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "VARIANT": variant,
        "TORCH_INDEX": index,
        "TORCH_VERSION": _arg_defaults()["TORCH_VERSION"],
    }
    return subprocess.run(
        ["sh", "-c", 'pip() { echo "pip $*"; }\n' + step], env=env, capture_output=True, text=True, timeout=30
    )


def test_dockerfile_builds_cpu_and_cuda_variants() -> None:
    defaults = _arg_defaults()
    assert defaults["VARIANT"] == "cpu"
    cpu, cuda = _torch_install("cpu"), _torch_install("cuda")
    assert cpu.returncode == 0 and "--index-url https://download.pytorch.org/whl/cpu" in cpu.stdout, cpu
    assert cuda.returncode == 0 and "--index-url https://pypi.org/simple" in cuda.stdout, cuda
    assert f"torch=={defaults['TORCH_VERSION']}" in cuda.stdout
    custom = _torch_install("cuda", "https://download.pytorch.org/whl/cu128")
    assert "--index-url https://download.pytorch.org/whl/cu128" in custom.stdout
    wrong = _torch_install("rocm")
    assert wrong.returncode != 0 and "VARIANT must be cpu or cuda" in wrong.stderr


def test_dockerfile_fits_the_manifests(kubectl: str) -> None:
    instructions = _instructions()
    for instruction in instructions:
        if instruction.startswith("COPY") and "--from" not in instruction:
            for source in instruction.split()[1:-1]:
                assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which is not in the repository"
    base = {d["kind"]: d for d in render(kubectl, K8S / "base")}
    ray_version = _arg_defaults()["RAY_VERSION"]
    assert ray_version == base["RayCluster"]["spec"]["rayVersion"], (
        "RAY_VERSION in deploy/Dockerfile and rayVersion in the RayCluster differ"
    )
    pinned = re.search(r'"ray\[[^\]]*\]==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    if pinned:  # `pip install .` would otherwise replace the image's Ray with the pinned one
        assert pinned.group(1) == ray_version, (
            "RAY_VERSION in deploy/Dockerfile and the Ray pin in pyproject.toml differ"
        )
    # KubeRay's injected probes on Ray pods run `bash -c "wget … | grep success"`.
    assert any(i.startswith("RUN") and "apt-get install" in i and "wget" in i for i in instructions)
    assert re.search(r"^USER\s+\d+$", "\n".join(instructions), flags=re.M), (
        "a numeric USER lets Kubernetes verify runAsNonRoot"
    )


def test_deploy_guide_covers_every_overlay() -> None:
    guide = (DEPLOY / "README.md").read_text()
    for name in OVERLAYS:
        assert f"kubectl apply -k deploy/k8s/overlays/{name}" in guide, f"deploy/README.md never applies overlay {name}"
    for step in (
        "helm install kuberay-operator",
        "port-forward svc/ringmaster-api",
        "ringmaster submit",
        "RINGMASTER_STORAGE_URI=s3://",
    ):
        assert step in guide, f"deploy/README.md lacks {step!r}"
