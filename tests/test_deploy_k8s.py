"""deploy/k8s: builds with kustomize (kubectl's built-in), validates against the Kubernetes OpenAPI schemas of
the kubectl's minor version (kubernetes-validate ships them offline), and agrees with compose on names,
commands, ports and env vars."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from tests.deploy_files import K8S_DIR, compose_with_example_env, parse_command, read_env_file
from tests.test_deploy_compose import SERVICE_ENV

# The API version the manifests target: the kubectl here (v1.32) and its built-in kustomize.
KUBERNETES_VERSION = "1.32.0"
# The env vars that only feed `$(VAR)` expansion inside the manifests (never read by our code).
MANIFEST_ONLY_ENV = {"REDIS_PASSWORD", "REDISCLI_AUTH"}


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.deploy_files import kustomize_build

    return kustomize_build(tmp_path_factory.mktemp("kustomize"))


def _find(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"].startswith(name))


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def test_manifests_validate_against_the_kubernetes_schemas(manifests: list[dict[str, Any]]) -> None:
    kinds = sorted(m["kind"] for m in manifests)
    assert kinds.count("Deployment") == 3 and "StatefulSet" in kinds and "HorizontalPodAutoscaler" in kinds
    for manifest in manifests:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    # Strict mode is not vacuous: an unknown container field is refused.
    broken = copy.deepcopy(_find(manifests, "StatefulSet", "engine"))
    _container(broken)["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_names_commands_and_ports_agree_with_compose(manifests: list[dict[str, Any]]) -> None:
    compose = compose_with_example_env()["services"]
    workloads = {
        "engine": _find(manifests, "StatefulSet", "engine"),
        "gateway": _find(manifests, "Deployment", "gateway"),
        "predictor": _find(manifests, "Deployment", "predictor"),
    }
    for name, workload in workloads.items():
        container = _container(workload)
        ours, theirs = parse_command(container["command"]), parse_command(compose[name]["command"])
        assert vars(ours) == vars(theirs), f"{name}: not the command docker-compose.yml runs"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        service = _find(manifests, "Service", name)
        assert {
            p["name"]: p["port"] for p in service["spec"]["ports"]
        } == ports  # Services named as in compose
        scrape = workload["spec"]["template"]["metadata"]["annotations"]
        assert scrape["prometheus.io/scrape"] == "true"
        assert int(scrape["prometheus.io/port"]) == (ours.port if name == "gateway" else ours.metrics_port)
    assert _find(manifests, "Service", "engine")["spec"]["clusterIP"] == "None"  # DNS lists every engine pod
    assert parse_command(_container(workloads["gateway"])["command"]).engines == "engine:50051"
    assert _find(manifests, "Service", "redis")["spec"]["ports"][0]["port"] == 6379
    assert _container(workloads["engine"])["resources"]["limits"]["nvidia.com/gpu"] == 1
    hpa = _find(manifests, "HorizontalPodAutoscaler", "gateway")["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "hintserve_num_requests_waiting"


def test_env_vars_are_the_ones_our_services_read(manifests: list[dict[str, Any]]) -> None:
    config = _find(manifests, "ConfigMap", "hintserve-engine-config")["data"]
    assert set(config) <= SERVICE_ENV["engine"]
    for name, kind in (("engine", "StatefulSet"), ("gateway", "Deployment"), ("predictor", "Deployment")):
        container = _container(_find(manifests, kind, name))
        names = {e["name"] for e in container.get("env", [])}
        assert names - MANIFEST_ONLY_ENV <= SERVICE_ENV[name], name
    secret_keys = set(_find(manifests, "Secret", "hintserve-secrets")["data"])
    assert secret_keys == set(read_env_file(K8S_DIR / "secrets.env.example"))


def test_secrets_env_is_git_ignored() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(Path("deploy/k8s/secrets.env"))], cwd=K8S_DIR.parents[1]
    )
    assert ignored.returncode == 0
