"""`tinypaged serve --replicas N`: start Ray here (or join a cluster at `--ray-address`), run the application
(app.py) on Ray Serve's HTTP proxy at --host:--port, print the URL as `tinypaged serve` does, and on SIGTERM or
SIGINT shut the application down (and Ray, if it was started here)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from tinypaged import __version__
from tinypaged.server.local import wait_healthy

APP_NAME = "tinypaged"


def start_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Join the cluster at `address`, or start a small local Ray (no dashboard); True if started here."""
    import ray

    if address:
        ray.init(address=address, namespace="tinypaged", log_to_driver=False)
        return False
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace="tinypaged",
        log_to_driver=False,
        configure_logging=False,
    )
    return True


def run(
    args: dict[str, Any], host: str, port: int, address: str | None = None, num_cpus: int | None = None
) -> str:
    """Deploy the application on Ray Serve (starting Ray if needed) and wait until every replica answers;
    returns the base URL."""
    from ray import serve

    from tinypaged.replicas.app import build_app

    started = start_ray(address, num_cpus)
    try:
        serve.start(http_options={"host": host, "port": port}, detached=False)
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
    except BaseException:
        if started:
            import ray

            ray.shutdown()
        raise
    url = f"http://{host}:{port}"
    wait_healthy(url, timeout=600.0)
    return url


def stop() -> None:
    """Delete the application and stop Serve and Ray (Ray only if this process started it)."""
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def serve_replicas(args: dict[str, Any], host: str, port: int, address: str | None) -> int:
    """The `--replicas` form of `tinypaged serve`: serve until SIGTERM or SIGINT; 0 on a clean shutdown."""
    most = int(args.get("max_replicas") or args.get("replicas", 1))
    cpus = (
        None if address else max(os.cpu_count() or 1, most + 1)
    )  # one logical CPU a replica, beside the rest
    url = run(args, host, port, address, cpus)
    name = (args.get("server") or {}).get("served_model_name") or Path(args["engine"]["model"]).name
    print(
        f"tinypaged {__version__} serving {name} on {url} ({args.get('replicas')} replicas, Ray Serve)",
        flush=True,
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    stop()
    return 0
