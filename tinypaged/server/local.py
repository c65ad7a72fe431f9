"""A `tinypaged serve` process on a free loopback port, started and stopped as a context: what the load tests
(`loadtest/local_server.py`, `make loadtest`), their tests and the serving benchmarks start a server with."""

from __future__ import annotations

import os
import re
import select
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


def wait_healthy(url: str, timeout: float, what: str | None = None) -> None:
    """Wait for `url`/health to answer 200; RuntimeError after `timeout` seconds (`what`: how to say it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}/health did not answer within {what or f'{timeout:.0f} s'}")


class LocalServer:
    """A `tinypaged serve` process on a free loopback port (`url`), started and stopped as a context."""

    def __init__(
        self,
        serve_args: list[str],
        start_timeout: float = 300.0,
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> None:
        """`env`: variables set for the server on top of ours; `log`: a file for its log (default: our stderr)."""
        self.serve_args = serve_args
        self.start_timeout = start_timeout
        self.env = env
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.ready_s = 0.0  # from the process's start to /health's first 200

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
        env = {**os.environ, **self.env} if self.env is not None else None
        stderr = self.log.open("a") if self.log is not None else None  # else: logs go to our stderr
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        if stderr is not None:
            stderr.close()  # the child holds its own descriptor
        deadline = t0 + self.start_timeout
        assert self.proc.stdout is not None
        # The server prints one line with its URL once it listens (its engine started): waited for with the
        # deadline, so that a start that hangs ends in an error instead of a blocked read.
        while not self.url and time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], min(1.0, deadline - time.monotonic()))
            if not ready:
                if self.proc.poll() is not None:
                    break
                continue
            line = self.proc.stdout.readline()
            if not line:
                break
            if m := re.search(r"on (http://\S+)", line):
                self.url = m.group(1)
        if not self.url:
            code = self.proc.poll()
            self.stop()
            if code is None:
                raise RuntimeError(f"tinypaged serve did not listen within {self.start_timeout:.0f} s")
            raise RuntimeError(f"tinypaged serve exited ({code}) before it printed its URL")
        try:
            wait_healthy(self.url, deadline - time.monotonic(), what=f"{self.start_timeout:.0f} s")
        except RuntimeError:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return self

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
