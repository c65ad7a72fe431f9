"""Run a command against a local `tinypaged serve`: start the server on a free loopback port, wait for
`/health`, run the command with TINYPAGED_URL and LOCUST_HOST set to the server's URL, then stop the server
with SIGTERM (a server that does not exit 0 fails the run). `make loadtest` runs locust this way.

    .venv/bin/python loadtest/local_server.py [tinypaged serve flags] -- COMMAND [ARGS...]
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


class LocalServer:
    """A `tinypaged serve` process on a free loopback port (`url`), started and stopped as a context."""

    def __init__(self, serve_args: list[str], start_timeout: float = 300.0) -> None:
        self.serve_args = serve_args
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> LocalServer:
        exe = Path(sys.executable).parent / "tinypaged"
        cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", "0", *self.serve_args]
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


def main(argv: list[str]) -> int:
    """Serve, run the command after `--`, stop; the command's status (or 1 if the server did not exit 0)."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: local_server.py [tinypaged serve flags] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    cut = argv.index("--")
    with LocalServer(argv[:cut]) as server:
        env = {**os.environ, "TINYPAGED_URL": server.url, "LOCUST_HOST": server.url}
        status = subprocess.run(argv[cut + 1 :], env=env).returncode
        served = server.stop()
    if served != 0:
        print(f"error: the server exited with status {served}", file=sys.stderr)
        return status or 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
