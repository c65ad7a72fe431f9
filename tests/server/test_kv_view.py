"""GET /kv-cache and the playground's files: the wire format decoded against a hand-made snapshot, the key it
needs, a live view of a running n = 2 request (ids and counts only, nothing of its text), and a page that is
public, self-contained and writes model text as text."""

from __future__ import annotations

import json
import re
import threading
import time

import msgspec

from tinypaged.core.block_pool import PoolSnapshot
from tinypaged.core.kv_cache_manager import CacheSnapshot
from tinypaged.engine.step.stats import EngineSnapshot, EngineStats
from tinypaged.server.kv_view import kv_cache_view
from tinypaged.server.page import PAGE_FILES, STATIC

VIEW_KEYS = {
    "block_size",
    "requests",
    "gpu",
    "cpu",
    "num_running",
    "num_waiting",
    "num_swapped",
    "gpu_cache_usage",
    "cpu_cache_usage",
    "num_preemptions",
    "num_steps",
}


def decode(pool: dict) -> list[int]:
    """A pool's per-block codes from its runs."""
    runs = pool["runs"]
    codes = [code for code, count in zip(runs[::2], runs[1::2], strict=True) for _ in range(count)]
    assert len(codes) == pool["num_blocks"] and all(count > 0 for count in runs[1::2])
    return codes


def _stats(**kw: object) -> EngineStats:
    fields = dict.fromkeys(EngineStats.__dataclass_fields__, 0)
    return EngineStats(**{**fields, "gpu_cache_usage": 0.0, "cpu_cache_usage": 0.0, **kw})  # type: ignore[arg-type]


def test_wire_format_codes_holders_flags_and_runs() -> None:
    # GPU: 0-1 held by "a" twice (its samples) and cached; 2 by "b" and "a" (a prefix hit), 3 by "b"; 4 free but
    # cached; 5-7 free. CPU: a swapped-out group "c" sharing block 1.
    gpu = PoolSnapshot(
        (2, 2, 2, 1, 0, 0, 0, 0),
        frozenset({0, 1, 2, 4}),
        {0: ("a",), 1: ("a",), 2: ("b", "a"), 3: ("b",)},
    )
    cpu = PoolSnapshot((0, 2, 1), frozenset(), {1: ("c",), 2: ("c",)})
    snap = EngineSnapshot(CacheSnapshot(16, gpu, cpu), _stats(num_swapped=1))
    view = json.loads(msgspec.json.encode(kv_cache_view(snap)))
    assert set(view) == VIEW_KEYS and view["block_size"] == 16 and view["num_swapped"] == 1
    assert view["requests"] == [
        {"id": "a", "gpu_blocks": 3, "cpu_blocks": 0},
        {"id": "b", "gpu_blocks": 2, "cpu_blocks": 0},
        {"id": "c", "gpu_blocks": 0, "cpu_blocks": 2},
    ]
    a, b, c = 1, 2, 3  # holder numbers: 1 + the index in requests
    shared, cached = 2, 1
    assert decode(view["gpu"]) == [
        a << 2 | shared | cached,
        a << 2 | shared | cached,
        b << 2 | shared | cached,  # the first holder listed names the block
        b << 2,
        cached,
        0,
        0,
        0,
    ]
    assert view["gpu"]["runs"][:2] == [a << 2 | shared | cached, 2] and view["gpu"]["runs"][-2:] == [0, 3]
    assert (view["gpu"]["num_free"], view["gpu"]["num_shared"], view["gpu"]["num_cached"]) == (4, 3, 4)
    assert decode(view["cpu"]) == [0, c << 2 | shared, c << 2]


def test_kv_cache_needs_the_key(raw) -> None:
    status, _, data = raw("GET", "/kv-cache", auth=False)
    assert status == 401 and json.loads(data)["error"]["code"] == "invalid_api_key"
    status, _, data = raw("GET", "/kv-cache", headers={"Authorization": "Bearer wrong"})
    assert status == 401


def test_kv_cache_shows_a_running_request_by_id_and_counts_only(raw, server, client) -> None:
    secret = "Zanzibar marmalade"
    done = threading.Event()

    def run() -> None:
        try:
            client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": f"Tell me a long story about {secret}."}],
                max_tokens=40,
                n=2,
                temperature=0.8,
                extra_body={"ignore_eos": True},
            )
        finally:
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    views = []
    while not done.is_set():
        status, headers, data = raw("GET", "/kv-cache")
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        assert secret.split()[0] not in data.decode()
        views.append(json.loads(data))
        time.sleep(0.05)
    thread.join()
    busy = [v for v in views if v["requests"]]
    assert busy, "no view caught the request while it ran"
    for view in views:
        assert set(view) == VIEW_KEYS
        # Taken between steps: the codes, the counts and the palette agree in every view.
        codes = decode(view["gpu"])
        assert sum(1 for c in codes if c >> 2) == view["gpu"]["num_blocks"] - view["gpu"]["num_free"]
        assert sum(1 for c in codes if c & 2) == view["gpu"]["num_shared"]
        assert {c >> 2 for c in codes} - {0} == set(range(1, len(view["requests"]) + 1))
        for i, r in enumerate(view["requests"], 1):
            assert set(r) == {"id", "gpu_blocks", "cpu_blocks"}
            assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}-0", r["id"]), r["id"]
            assert r["gpu_blocks"] == sum(1 for c in codes if c >> 2 == i)
    # The two samples share the prompt's full blocks for the whole run.
    assert all(v["gpu"]["num_shared"] > 0 for v in busy)
    status, _, data = raw("GET", "/kv-cache")
    view = json.loads(data)
    assert not view["requests"] and view["gpu"]["num_free"] == view["gpu"]["num_blocks"]


def test_page_is_public_self_contained_and_strict(raw) -> None:
    for path, (name, content_type) in PAGE_FILES.items():
        status, headers, body = raw("GET", path, auth=False)
        assert status == 200 and headers["Content-Type"].startswith(content_type), path
        assert body == (STATIC / name).read_bytes()
        csp = headers["Content-Security-Policy"]
        # Nothing from outside, no inline script: model text could not run even if it became HTML.
        assert "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
        text = body.decode()
        assert not re.search(r"(https?:)?//[a-z0-9-]+\.[a-z]", text), f"{name} refers to another origin"
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(", text), name
    assert raw("GET", "/kv-cache", auth=False)[0] == 401  # the page is public, the cache view is not
