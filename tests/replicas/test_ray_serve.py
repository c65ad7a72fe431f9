"""Two replicas of the default model behind Ray Serve on the CPU (Ray started and stopped here, small: 2 logical
CPUs, no dashboard): auth through the ingress, routing by cached prefix, the aggregated metrics, and a replica
killed under load."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from tinypaged.replicas import launch  # noqa: E402

API_KEY = "replica-key"
PORT = 8937
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    args: dict[str, Any] = {
        # max_num_seqs 2: under load, requests wait in a replica's queue (not begun) as others stream.
        "engine": {"max_model_len": 512, "num_gpu_blocks_override": 96, "max_num_seqs": 2},
        "server": {"api_key": API_KEY},
        "replicas": 2,
        "router": "kv",
        "engine_process": False,
    }
    base = launch.run(args, "127.0.0.1", PORT, num_cpus=2)
    try:
        yield base
    finally:
        launch.stop()


def post(
    url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any, str]:
    """Status, JSON body and serving replica of one request."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), AUTH if headers is None else headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), r.headers.get("x-tinypaged-replica", "")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("x-tinypaged-replica", "")


def test_auth_is_the_servers(url: str) -> None:
    status, body, _ = post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, {})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body, _ = post(
        url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, {**AUTH, "Authorization": "Bearer x"}
    )
    assert status == 401
    with urllib.request.urlopen(url + "/health", timeout=30) as r:  # public, as on one server
        assert r.status == 200
    status, body, _ = post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 3.5})
    assert status == 400 and body["error"]["param"] == "temperature"  # the server's own validation
    status, body, _ = post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_requests_go_where_their_prefix_is_cached(url: str) -> None:
    sessions = [
        f"Session {i}: " + " ".join(f"word{i}x{j}" for j in range(60)) for i in range(4)
    ]  # each well over 4 blocks of 16 tokens, and unlike the others from its first block
    first = {}
    for i, text in enumerate(sessions):
        status, _, replica = post(url, "/v1/completions", {"prompt": text, "max_tokens": 4})
        assert status == 200
        first[i] = replica
    assert len(set(first.values())) == 2, "new sessions spread over both replicas"
    time.sleep(1.5)  # the replicas publish what they cached
    for turn in range(2):
        for i, text in enumerate(sessions):
            status, _, replica = post(
                url, "/v1/completions", {"prompt": f"{text} turn {turn}", "max_tokens": 4}
            )
            assert status == 200 and replica == first[i], f"session {i} turn {turn} left its cached prefix"


def test_metrics_are_gathered_per_replica(url: str) -> None:
    for i in range(4):  # at least one request on each replica (new prefixes spread)
        post(url, "/v1/completions", {"prompt": f"metrics {i} " * 20, "max_tokens": 2})
    time.sleep(2.5)  # a push period and more
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    rows = [line for line in text.splitlines() if line.startswith("tinypaged:prefix_cache_queries_total{")]
    assert len(rows) == 2 and len({row.split('replica="')[1].split('"')[0] for row in rows}) == 2
    assert text.count("# TYPE tinypaged:prefix_cache_queries_total counter") == 1  # one family, both samples
    assert all(float(row.split()[-1]) > 0 for row in rows)


def _stream(url: str, prompt: str, results: list[dict[str, Any]]) -> None:
    """One streamed completion; what came back: chunks before an error event, whether it finished, its end."""
    body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True, "stream": True}
    out: dict[str, Any] = {"chunks": 0, "error": None, "done": False, "finished": False}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), AUTH)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out["status"] = r.status
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    out["done"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out["error"] = event["error"]["code"]
                elif event["choices"][0]["finish_reason"] == "length":
                    out["finished"] = True
                else:
                    out["chunks"] += 1
    except urllib.error.HTTPError as e:
        out["status"] = e.code
    out["end"] = time.monotonic()
    results.append(out)


def test_a_replica_killed_under_load(url: str) -> None:
    import ray

    results: list[dict[str, Any]] = []
    # 12 streams on 2 replicas of max_num_seqs 2: most wait, not begun, when one replica dies.
    threads = [
        threading.Thread(target=_stream, args=(url, f"Load {i}: tell a long story about ships " * 3, results))
        for i in range(12)
    ]
    for t in threads:
        t.start()
    time.sleep(4.0)
    victims = [n for n in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in n["name"]]
    assert len(victims) == 2
    ray.kill(ray.get_actor(victims[0]["name"], namespace=victims[0]["namespace"]), no_restart=True)
    killed = time.monotonic()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(results) == 12 and all(r["status"] == 200 for r in results)
    for r in results:
        assert r["done"], ("every stream ends with [DONE]", results)
        # A stream ends complete, or (begun on the dead replica) with the error event after some chunks.
        assert r["finished"] or (r["error"] == "replica_unavailable" and r["chunks"] > 0), r
    cut = [r for r in results if r["error"]]
    assert all(r["end"] - killed < 10 for r in cut), "a cut-off stream ended late"
    # Serve replaces the replica.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        names = [n for n in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in n["name"]]
        if len(names) == 2 and victims[0]["name"] not in {n["name"] for n in names}:
            status, _, _ = post(url, "/v1/completions", {"prompt": "after", "max_tokens": 2})
            if status == 200:
                return
        time.sleep(1.0)
    raise AssertionError("the killed replica was not replaced")


def test_serve_replicas_flags_build_the_app(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tinypaged import cli
    from tinypaged.replicas.app import build_app

    seen: dict[str, Any] = {}
    monkeypatch.setattr(
        launch, "serve_replicas", lambda args, host, port, address: seen.update(args=args) or 0
    )
    argv = ["serve", "--replicas", "2", "--max-replicas", "3", "--router", "pow2", "--api-key", "k"]
    assert cli.main([*argv, "--max-model-len", "256", "--port", "0"]) == 0
    args = seen["args"]
    assert args["replicas"] == 2 and args["max_replicas"] == 3 and args["router"] == "pow2"
    assert args["server"]["api_key"] == "k" and args["engine"]["max_model_len"] == 256
    app = build_app(args)  # what serve.run would deploy (Ray is up: the module's fixture)
    assert app is not None


def test_the_config_file_is_a_valid_serve_config(url: str) -> None:
    """deploy/ray-serve.yaml parses as Ray Serve's config schema, and its args build the application."""
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from tinypaged.replicas.app import build_app

    raw = yaml.safe_load((Path(__file__).parents[2] / "deploy" / "ray-serve.yaml").read_text())
    config = ServeDeploySchema.model_validate(raw)
    (app,) = config.applications
    assert app.import_path == "tinypaged.replicas.app:build_app"
    assert build_app(app.args) is not None
