"""SSE framing on the wire, clients that disconnect (their requests aborted, blocks freed), /metrics parsed by
prometheus_client while requests run, and the small endpoints (/tokenize, /detokenize, /openapi.json)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families


def _events(body: bytes) -> list[bytes]:
    """The SSE events of a body, checking the framing: `data: ...` events, each ended by a blank line."""
    assert body.endswith(b"\n\n"), body[-50:]
    events = body[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events), events
    return [e[len(b"data: ") :] for e in events]


def test_sse_framing_completions_and_chat(raw, server) -> None:
    status, headers, body = raw(
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = _events(body)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"

    status, headers, body = raw(
        "POST", "/v1/completions", {"prompt": ["Hi", "Yo"], "max_tokens": 3, "stream": True}
    )
    events = _events(body)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == b"[DONE]" and all(c["object"] == "text_completion" for c in chunks)
    finished = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert sorted(finished) == [0, 1]


async def _read_some_then_leave(server, path: str, body: dict, events: int) -> None:
    async with aiohttp.ClientSession(headers=server.auth) as s, s.post(server.url + path, json=body) as r:
        assert r.status == 200
        seen = 0
        async for line in r.content:
            seen += line.startswith(b"data: ")
            if seen >= events:
                return  # leaving the block closes the connection mid-stream


def _aborts(server) -> float:
    return server.serving.metrics.finished["abort"]


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server) -> None:
    before = _aborts(server)
    long = {"max_tokens": 400, "ignore_eos": True, "stream": True}
    asyncio.run(_read_some_then_leave(server, "/v1/completions", {"prompt": "Count: 1, 2,", **long}, 3))
    asyncio.run(_read_some_then_leave(server, "/v1/completions", {"prompt": ["A", "B C"], **long}, 3))
    asyncio.run(
        _read_some_then_leave(
            server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Tell a story"}], **long},
            4,
        )
    )
    # 400 tokens each would take tens of seconds here: idle soon means the requests were aborted
    server.wait_idle(timeout=10)
    assert _aborts(server) - before == 4


def test_client_gone_before_a_plain_response_aborts(server) -> None:
    before = _aborts(server)

    async def go() -> None:
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(headers=server.auth, timeout=timeout) as s:
            try:
                await s.post(
                    server.url + "/v1/completions",
                    json={"prompt": "Count: 1, 2,", "max_tokens": 400, "ignore_eos": True},
                )
            except TimeoutError:
                return
        raise AssertionError("the request finished within a second")

    asyncio.run(go())
    server.wait_idle(timeout=10)
    assert _aborts(server) - before == 1


def _scrape(url: str) -> dict[str, list]:
    async def go() -> str:
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            return await r.text()

    return {f.name: f.samples for f in text_string_to_metric_families(asyncio.run(go()))}


def _value(families: dict[str, list], family: str, suffix: str = "", **labels: str) -> float:
    samples = [
        s
        for s in families[family]
        if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(samples) == 1, (family, suffix, families[family])
    return samples[0].value


def test_metrics_move_while_requests_run(server) -> None:
    before = _scrape(server.url)
    assert _value(before, "tinypaged:num_requests_running") == 0
    assert _value(before, "tinypaged:gpu_cache_usage_perc") == 0
    assert before["tinypaged:time_to_first_token_seconds"][0].labels["model_name"] == server.model
    config = server.engine.config
    info = {
        "block_size": str(config.block_size),
        "cache_dtype": config.kv_cache_dtype,
        "quantization": "None",
    }
    assert _value(before, "tinypaged:cache_config_info", model_name=server.model, **info) == 1
    # The engine core's startup, phase by phase (it reached the server with the core's Ready message).
    phases = {s.labels["phase"]: s.value for s in before["tinypaged:startup_phase_seconds"]}
    assert list(phases) == ["weights", "kv_cache", "graph_capture", "warmup", "total"]
    assert phases["total"] >= phases["weights"] > 0 and min(phases.values()) >= 0
    assert phases["graph_capture"] == phases["warmup"] == 0  # the CPU: no graphs, nothing to compile

    async def load() -> list[dict]:
        async with aiohttp.ClientSession(headers=server.auth) as s:

            async def one(i: int) -> dict:
                async with s.post(
                    server.url + "/v1/completions",
                    json={"prompt": f"Story {i}: once upon a time", "max_tokens": 24, "ignore_eos": True},
                ) as r:
                    return await r.json()

            return await asyncio.gather(*(one(i) for i in range(3)))

    task_result: list = []
    loop_thread = threading.Thread(target=lambda: task_result.append(asyncio.run(load())))
    loop_thread.start()
    running = usage = 0.0
    deadline = time.monotonic() + 60
    while loop_thread.is_alive() and time.monotonic() < deadline:
        during = _scrape(server.url)
        running = max(running, _value(during, "tinypaged:num_requests_running"))
        usage = max(usage, _value(during, "tinypaged:gpu_cache_usage_perc"))
        time.sleep(0.1)
    loop_thread.join()
    assert running >= 1 and 0 < usage <= 1
    server.wait_idle()
    after = _scrape(server.url)
    assert _value(after, "tinypaged:num_requests_running") == 0
    assert _value(after, "tinypaged:gpu_cache_usage_perc") == 0
    stats = server.call(server.engine.stats)
    assert _value(after, "tinypaged:num_gpu_blocks") == stats.num_gpu_blocks > 0
    assert _value(after, "tinypaged:num_free_gpu_blocks") == stats.num_free_gpu_blocks == stats.num_gpu_blocks
    # The server's own RSS (it runs in this test process): a model's worth of memory, read fresh each scrape.
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert 0.5 * rss < _value(after, "process_resident_memory_bytes") < 2 * rss
    gen = _value(after, "tinypaged:generation_tokens", "_total") - _value(
        before, "tinypaged:generation_tokens", "_total"
    )
    assert gen == 3 * 24 == sum(r["usage"]["completion_tokens"] for r in task_result[0])
    assert _value(after, "tinypaged:prompt_tokens", "_total") > _value(
        before, "tinypaged:prompt_tokens", "_total"
    )
    for hist in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "time_per_output_token_seconds",
    ):
        family = "tinypaged:" + hist
        grew = _value(after, family, "_count") - _value(before, family, "_count")
        assert grew >= 3, hist
        assert _value(after, family, "_bucket", le="+Inf") == _value(after, family, "_count")
    done = _value(after, "tinypaged:request_success", "_total", finished_reason="length")
    assert done >= 3
    # Step statistics: every step counted; each token computed once (prompts, then each output token but the
    # last, which is sampled and never fed back).
    steps = _value(after, "tinypaged:engine_steps", "_total") - _value(
        before, "tinypaged:engine_steps", "_total"
    )
    assert steps >= 24
    assert _value(after, "tinypaged:engine_step_seconds", "_count") >= steps
    prompt = _value(after, "tinypaged:prompt_tokens", "_total") - _value(
        before, "tinypaged:prompt_tokens", "_total"
    )
    computed = _value(after, "tinypaged:iteration_tokens_total", "_sum") - _value(
        before, "tinypaged:iteration_tokens_total", "_sum"
    )
    assert computed == prompt + gen - 3


def test_tokenize_detokenize_models_version_openapi(raw, server) -> None:
    status, _, data = raw("POST", "/tokenize", {"prompt": "Hello world"})
    tokens = json.loads(data)
    assert status == 200 and tokens["tokens"] == server.engine.tokenizer.encode("Hello world")
    assert (
        tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == server.serving.max_model_len
    )
    status, _, data = raw("POST", "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and json.loads(data) == {"prompt": "Hello world"}
    status, _, data = raw("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and json.loads(data)["count"] > 3
    assert json.loads(raw("GET", "/version")[2])["version"]
    doc = json.loads(raw("GET", "/openapi.json")[2])
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    req = schemas["CompletionRequest"]
    assert "prompt" in req["required"] and req["properties"]["top_p"]["exclusiveMinimum"] == 0
    refs = json.dumps(doc).split('"$ref": "')[1:]
    assert all(r.split('"')[0].removeprefix("#/components/schemas/") in schemas for r in refs)


def test_requests_read_at_their_end_ask_for_the_final_output(server) -> None:
    """A request that is not streamed, or is streamed whole (beam search, best_of > n), asks the engine for its
    final output alone; a streamed one for every step's. (The metrics test above times the final-only ones.)"""
    from tinypaged.sampling_params import RequestOutputKind
    from tinypaged.server import protocol as p

    kinds = {}
    for name, body in {
        "plain": {},
        "stream": {"stream": True},
        "stream beams": {"stream": True, "use_beam_search": True, "n": 2, "temperature": 0.0},
        "stream best_of": {"stream": True, "n": 1, "best_of": 2},
    }.items():
        req = msgspec.convert({"prompt": "Hello", **body}, p.CompletionRequest)
        kinds[name] = server.serving.sampling_params(req, 8, None).output_kind
    assert kinds == {
        "plain": RequestOutputKind.FINAL_ONLY,
        "stream": RequestOutputKind.CUMULATIVE,
        "stream beams": RequestOutputKind.FINAL_ONLY,
        "stream best_of": RequestOutputKind.FINAL_ONLY,
    }
