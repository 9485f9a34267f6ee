"""The deployment files as data: docker-compose.yml (raw and interpolated from .env.example), the Prometheus
config, the Grafana dashboard's PromQL, and our CLIs' parsers to read their commands with."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
ENV_EXAMPLE = REPO_ROOT / ".env.example"
PROMETHEUS_CONFIG = REPO_ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dashboards" / "hintserve.json"
K8S_DIR = REPO_ROOT / "deploy" / "k8s"
# Our own services in compose; the others run upstream images.
OUR_SERVICES = ("predictor", "engine", "gateway", "loadgen")

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}, $VAR; `$$` is a literal `$`.
_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, f"{path.name}: not NAME=value: {line!r}"
            values[name.strip()] = value.strip()
    return values


def compose_variables(text: str) -> set[str]:
    return {m.group(1) or m.group(4) for m in _VARIABLE.finditer(text) if m.group(0) != "$$"}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation rules; a required variable that is unset raises KeyError."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3)
        value = env.get(name)
        unset_or_empty = value is None or (op is not None and op.startswith(":") and value == "")
        if op in (":-", "-") and unset_or_empty:
            return arg
        if op in (":?", "?") and unset_or_empty:
            raise KeyError(f"{name}: {arg}")
        return value or ""

    return _VARIABLE.sub(one, text)


def compose_raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def compose_with_example_env() -> dict[str, Any]:
    return yaml.safe_load(interpolate(COMPOSE_FILE.read_text(), read_env_file(ENV_EXAMPLE)))


def hintserve_parser() -> argparse.ArgumentParser:
    from services.cli import build_parser

    return build_parser()


def parse_command(command: list[str]) -> argparse.Namespace:
    """A container command read by the parser of the program it runs (argparse errors fail the test)."""
    if command[0] == "hintserve":
        return hintserve_parser().parse_args(command[1:])
    if command[:3] == ["python", "-m", "loadgen"]:
        from loadgen.cli import build_parser

        return build_parser().parse_args(command[3:])
    if command[:3] == ["python", "-m", "services.common.healthcheck"]:
        from services.common.healthcheck import build_parser

        return build_parser().parse_args(command[3:])
    raise AssertionError(f"not one of our programs: {command}")


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2].split("/")[0])


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of the dashboard, Grafana's range variable made concrete."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"].replace("$__rate_interval", "1m")))
    return out


def kustomize_build(tmp_path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` of a copy of deploy/k8s with secrets.env made from its example."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        import pytest

        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    work = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, work)
    shutil.copy(work / "secrets.env.example", work / "secrets.env")
    result = subprocess.run([kubectl, "kustomize", str(work)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]
