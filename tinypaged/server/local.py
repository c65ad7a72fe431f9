"""A `tinypaged serve` process on a free loopback port, started and stopped as a context: what the load tests
(`loadtest/local_server.py`, `make loadtest`), their tests and the serving benchmarks start a server with."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def child_processes(pid: int) -> list[tuple[int, str]]:
    """The child processes of `pid`, each as (pid, command line); Linux (/proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                found.append(
                    (int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
                )
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


def engine_core_pid(server_pid: int) -> int | None:
    """The engine-core process of a `tinypaged serve` process (its multiprocessing child), if it has one."""
    cores = [pid for pid, cmd in child_processes(server_pid) if "spawn_main" in cmd]
    return cores[0] if len(cores) == 1 else None


class LocalServer:
    """A `tinypaged serve` process on a free loopback port (`url`), started and stopped as a context."""

    def __init__(self, serve_args: list[str], start_timeout: float = 300.0) -> None:
        self.serve_args = serve_args
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> LocalServer:
        cmd = [
            sys.executable,
            "-m",
            "tinypaged.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *self.serve_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)  # logs go to our stderr
        deadline = time.monotonic() + self.start_timeout
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the server prints one line with its URL once it listens
            if m := re.search(r"on (http://\S+)", line):
                self.url = m.group(1)
                break
        if not self.url:
            self.stop()
            raise RuntimeError(f"tinypaged serve exited ({self.proc.returncode}) before it printed its URL")
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.url}/health did not answer within {self.start_timeout:.0f} s")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait (SIGKILL after `timeout`); the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()
