"""deploy/: the systemd unit verifies, and its command line (from its environment) serves."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from loaderd.launch import stop_daemon, wait_ready
from tests.helpers import free_port

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "loaderd.service"
LOADERD = Path(sys.executable).with_name("loaderd")


def unit_lines(key: str) -> list[str]:
    return [ln.split("=", 1)[1] for ln in UNIT.read_text().splitlines() if ln.startswith(key + "=")]


def test_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    unit = tmp_path / "loaderd.service"  # verify checks that ExecStart's binary exists
    unit.write_text(UNIT.read_text().replace("/opt/loaderd/.venv/bin/loaderd", str(LOADERD)))
    got = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and got.stdout + got.stderr == "", got.stdout + got.stderr


def expand(command: str, env: dict[str, str]) -> list[str]:
    """ExecStart's variables as systemd expands them: ${X} is one word, $X splits on spaces."""
    words: list[str] = []
    for word in shlex.split(command):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            words += env.get(whole.group(1), "").split()
        else:
            words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env[m.group(1)], word))
    return words


def test_units_command_line_serves_with_the_example_settings(dataset: tuple[Path, object]) -> None:
    """Environment= defaults, then the example EnvironmentFile over them (as systemd reads
    them), with this machine's paths: the expanded ExecStart starts a daemon that serves."""
    env: dict[str, str] = {}
    for line in unit_lines("Environment"):
        key, value = line.split("=", 1)
        env[key] = value
    for line in (DEPLOY / "loaderd.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    assert {"LOADERD_CLUSTER", "LOADERD_NODES", "LOADERD_NODE_RANK"} <= env.keys()
    run_dir = Path(tempfile.mkdtemp(prefix="ld-unit-", dir="/tmp"))
    try:
        env.update(
            LOADERD_DB=str(dataset[0]),
            LOADERD_STATE_DIR=str(run_dir / "state"),
            LOADERD_SOCKET=f"ipc://{run_dir}/loaderd.sock",
            LOADERD_ARGS=env["LOADERD_ARGS"].replace("64GiB", "16MiB"),
            # a cluster of one on this machine (the example's node 0 is elsewhere)
            LOADERD_CLUSTER=f"tcp://127.0.0.1:{free_port()}",
            LOADERD_NODES="1",
            LOADERD_NODE_RANK="0",
        )
        (command,) = unit_lines("ExecStart")
        argv = expand(command.replace("/opt/loaderd/.venv/bin/loaderd", str(LOADERD)), env)
        assert argv[1:4] == ["serve", "--db", str(dataset[0])]
        with open(run_dir / "log", "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(env["LOADERD_SOCKET"], timeout_s=30, proc=proc)
        finally:
            assert stop_daemon(proc) == 0, (run_dir / "log").read_text()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
