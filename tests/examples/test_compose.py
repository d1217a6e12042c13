"""compose.yaml validates with docker-compose v1.29 (no daemon) and names real images."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
pytestmark = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose is not installed (apt-get install -y docker-compose)",
)


def _compose(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=os.environ | env,
    )


def test_config_is_valid() -> None:
    out = _compose("config", "-q")
    assert out.returncode == 0, out.stderr


def test_services_and_gpu() -> None:
    out = _compose("config")
    assert out.returncode == 0, out.stderr
    svc = yaml.safe_load(out.stdout)["services"]
    assert set(svc) == {"engine", "proxy", "mqtt"}
    assert svc["mqtt"]["image"].startswith("eclipse-mosquitto")
    engine, proxy = svc["engine"], svc["proxy"]
    dev = engine["deploy"]["resources"]["reservations"]["devices"][0]
    assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert "deploy" not in proxy  # the GPU is the engine's alone
    assert proxy["depends_on"]["engine"]["condition"] == "service_healthy"
    assert "8001/health" in " ".join(engine["healthcheck"]["test"])
    assert "--mqtt=mqtt://mqtt:1883" in proxy["command"] and "--engine=http://engine:8001" in proxy["command"]
    assert any(":8000" in str(p) for p in proxy["ports"])
    assert proxy["image"] == engine["image"]  # one image, built once
    # one engine key on both sides, unset (empty: none) unless the shell sets it
    assert engine["environment"]["TOKENDANCE_ENGINE_API_KEY"] == proxy["environment"]["TOKENDANCE_ENGINE_API_KEY"]
    assert "TOKENDANCE_API_KEY" in proxy["environment"]


def test_the_keys_come_from_the_shell() -> None:
    out = _compose("config", TOKENDANCE_ENGINE_API_KEY="ek", TOKENDANCE_API_KEY="pk")
    svc = yaml.safe_load(out.stdout)["services"]
    assert svc["engine"]["environment"]["TOKENDANCE_ENGINE_API_KEY"] == "ek"
    assert svc["proxy"]["environment"] == {"TOKENDANCE_API_KEY": "pk", "TOKENDANCE_ENGINE_API_KEY": "ek"}


def _parse(service: str) -> Any:
    """A service's command as `tokendance` parses it today."""
    from tokendance.examples.cli import CliError, Parser, load

    cmd = yaml.safe_load(COMPOSE.read_text())["services"][service]["command"]
    try:
        mod = load(cmd[0])
    except CliError as e:
        pytest.skip(f"tokendance {cmd[0]} unavailable: {e}")
    parser = Parser(prog="tokendance")
    mod.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args([c.replace("${TOKENDANCE_MODE:-collective}", "collective") for c in cmd])


def test_commands_parse_as_tokendance_engine_and_serve() -> None:
    engine, proxy = _parse("engine"), _parse("proxy")
    assert (engine.command, engine.host, engine.port) == ("engine", "0.0.0.0", 8001)
    assert (proxy.command, proxy.port, proxy.mqtt) == ("serve", 8000, "mqtt://mqtt:1883")
    assert proxy.engine == [f"http://engine:{engine.port}"]


def test_dockerfile_targets_and_sources_exist() -> None:
    svc = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in ("engine",):
        build = svc[name]["build"]
        text = (ROOT / build["dockerfile"]).read_text()
        stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
        assert build["target"] in stages
        for src in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
            for item in src.split():
                assert list(ROOT.glob(item.rstrip("/"))) or item.endswith("*"), item
    conf = svc["mqtt"]["volumes"][0].split(":")[0]
    assert (ROOT / conf).is_file()
