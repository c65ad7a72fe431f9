"""Run a command against a local `tinypaged serve`: start the server on a free loopback port, wait for
`/health`, run the command with TINYPAGED_URL and LOCUST_HOST set to the server's URL, then stop the server
with SIGTERM (a server that does not exit 0 fails the run). `make loadtest` runs locust this way.

    .venv/bin/python loadtest/local_server.py [tinypaged serve flags] -- COMMAND [ARGS...]
"""

from __future__ import annotations

import os
import subprocess
import sys

from tinypaged.server.local import LocalServer


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
