"""Replicas behind Ray Serve on the CPU (docs/replicas.md): the KV-aware router against power of two choices and
Ray Serve LLM's PrefixCacheAffinityRouter, one replica's own prefix-cache hit rate, a replica killed under load,
and one replica behind Ray against `tinypaged serve` alone. One call prints the table and writes the JSON.

    python3 benchmarks/replicas.py --json benchmarks/results/replicas-cpu.json

The workload ("multi-turn chat", defined here and in docs/replicas.md): `--sessions` chats run at once, each of
`--turns` turns; every chat opens with the same system prompt (186 tokens); each turn, after the user's think
time (uniform in 0 to `--think-s`, the same draws for every setup), adds a user message of about 25 tokens and
asks for a reply of `--reply-tokens` tokens (greedy, ignore_eos), sending the whole history, so a turn's prompt
is its chat's last prompt and reply plus its new message. Each replica's KV cache holds `--blocks` blocks of 16
tokens: fewer than half the chats' histories need, so each of two replicas evicts even when every chat keeps to
one replica (with 16 chats, half of them fit: the routers that keep chats home then make the same decisions, and
an exact view of each cache has nothing to add; benchmarks/HISTORY.md). `--seed` draws the think times, and turns
the order the routers run in. Hit rate: prompt blocks found in the prefix cache over prompt blocks looked up at
admission (the engines' own counters, summed over replicas). TTFT: from sending a turn to its first SSE event, at
the client. Each run's JSON also has, per replica, its engine's counters over the run (steps, tokens computed,
preemptions, the steps' host time) and its process's CPU seconds, and the ingress's: what tells a router that
costs the engines work from a machine that gave them less CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from tinypaged.replicas import launch
from tinypaged.server.local import LocalServer

PORT = 8947
ROUTERS = ("kv", "pow2", "prefix-affinity")
SYSTEM = (
    "You are a careful assistant for a shipping company. You answer questions about routes, cargo, ports, "
    "weather and schedules. Keep every answer short and precise, say when you do not know, never invent a "
    "vessel name or a port, quote distances in nautical miles and times in UTC, and when a question is about "
    "safety, tell the user to contact the harbour master. The company operates container ships between "
    "Rotterdam, Hamburg, Antwerp, Le Havre, Felixstowe, Algeciras, Genoa, Piraeus and Valencia, and bulk "
    "carriers between Narvik, Gdansk and Bilbao. Today is a normal working day."
)
TOPICS = ("cargo", "weather", "routes", "ports", "crew", "fuel", "customs", "insurance", "repairs", "tides")


def sessions(n: int, turns: int) -> list[list[str]]:
    """Each chat's user messages."""
    return [
        [
            f"Chat {i}, question {t}: about {TOPICS[i % len(TOPICS)]} on the line {i} between two of our ports, "
            f"what should the planner check first on day {t} of the voyage?"
            for t in range(turns)
        ]
        for i in range(n)
    ]


async def chat(
    http: aiohttp.ClientSession,
    url: str,
    users: list[str],
    reply_tokens: int,
    think: list[float],
    out: dict[str, list],
    index: int,
) -> None:
    """One chat's turns in order, each sending the whole history after the user's think time; TTFT of each turn
    into `out`, and each turn's record (chat, turn, sent at, replica, TTFT) into `out["turns"]`."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for turn, (text, pause) in enumerate(zip(users, think, strict=True)):
        await asyncio.sleep(pause)
        messages.append({"role": "user", "content": text})
        body = {
            "messages": messages,
            "max_tokens": reply_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        start, ttft, reply = time.monotonic(), None, []
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                out["errors"].append(f"{resp.status}: {await resp.text()}")
                return
            replica = resp.headers.get("x-tinypaged-replica", "")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                ttft = ttft if ttft is not None else time.monotonic() - start
                event = json.loads(line[6:])
                if "error" in event:
                    out["errors"].append(event["error"]["message"])
                    return
                reply.append(event["choices"][0]["delta"].get("content") or "")
        out["ttft"].append(ttft)
        out["turns"].append([index, turn, round(start, 3), replica, round(ttft * 1e3, 1)])
        messages.append({"role": "assistant", "content": "".join(reply)})


async def run_workload(
    url: str, n: int, turns: int, reply_tokens: int, think_s: float, seed: int = 0
) -> dict[str, Any]:
    """Every chat at once; TTFT percentiles, errors, and the hit rate from the replicas' counters."""
    out: dict[str, list] = {"ttft": [], "errors": [], "turns": []}
    before, cpu_before = await engine_counters(url), replica_cpu_s()
    t0 = time.monotonic()
    rng = random.Random(seed)  # the same think times for every setup
    chats = [(users, [rng.uniform(0, think_s) for _ in users]) for users in sessions(n, turns)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(
            *(chat(http, url, users, reply_tokens, think, out, i) for i, (users, think) in enumerate(chats))
        )
    wall = time.monotonic() - t0
    await asyncio.sleep(2.5)  # the replicas post their metrics every second
    after, cpu_after = await engine_counters(url), replica_cpu_s()
    engines = {
        r: {k: round(v - before.get(r, {}).get(k, 0.0), 3) for k, v in c.items()}
        | {"cpu_s": round(cpu_after.get(r, 0.0) - cpu_before.get(r, 0.0), 2)}
        for r, c in after.items()
    }
    engines["ingress"] = {"cpu_s": round(cpu_after.get("ingress", 0.0) - cpu_before.get("ingress", 0.0), 2)}
    hits = sum(e.get("prefix_cache_hits_total", 0.0) for e in engines.values())
    queries = sum(e.get("prefix_cache_queries_total", 0.0) for e in engines.values())
    return {
        "turns": len(out["ttft"]),
        "ttfts_ms": [round(t * 1e3, 1) for t in out["ttft"]],
        "turn_log": out["turns"],  # [chat, turn, sent at (s, monotonic), replica, TTFT ms]
        "errors": out["errors"][:5],
        "num_errors": len(out["errors"]),
        "wall_s": round(wall, 2),
        "hit_rate": hits / queries if queries else 0.0,
        "prefix_hits": hits,
        "prefix_queries": queries,
        "engines": engines,  # per replica: its engine's counters over the run, and its process's CPU seconds
        **percentiles(out["ttft"]),
    }


def percentiles(ttfts: list[float]) -> dict[str, float]:
    """TTFT p50 and p99 in milliseconds."""
    if not ttfts:
        return {"ttft_p50_ms": float("nan"), "ttft_p99_ms": float("nan")}
    q = statistics.quantiles(ttfts, n=100, method="inclusive") if len(ttfts) > 1 else [ttfts[0]] * 99
    return {"ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1), "ttft_p99_ms": round(q[98] * 1e3, 1)}


COUNTERS = (
    "prefix_cache_hits_total",
    "prefix_cache_queries_total",
    "prompt_tokens_total",
    "generation_tokens_total",
    "num_preemptions_total",
    "engine_steps_total",
    "engine_step_seconds_sum",
    "iteration_tokens_total_sum",
)


async def engine_counters(url: str) -> dict[str, dict[str, float]]:
    """Per replica (its label in the aggregated /metrics; "" for one server): the engine counters of COUNTERS."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("tinypaged:"):
            continue
        name = line.split("{")[0].split(" ")[0].removeprefix("tinypaged:")
        if name in COUNTERS:
            replica = line.split('replica="')[1].split('"')[0] if 'replica="' in line else ""
            out.setdefault(replica, dict.fromkeys(COUNTERS, 0.0))[name] += float(line.split()[-1])
    return out


def replica_cpu_s() -> dict[str, float]:
    """CPU seconds (user and system) of each engine replica's process so far, by replica id (its engine runs in
    it: the benchmark deploys with `engine_process` off), and the ingress's (its router's work), as "ingress".
    Empty where Ray's state API cannot say."""
    import os

    import ray

    try:  # from Ray's control store (ray.util.state wants the dashboard, not started here)
        actors = list(ray._private.state.actors().values())
    except Exception as e:  # noqa: BLE001 - the figure is optional
        print(f"no replica CPU times: {e!r}", file=sys.stderr)
        return {}
    ticks, out = os.sysconf("SC_CLK_TCK"), {}
    for a in actors:
        name, pid = a.get("Name") or "", a.get("Pid")
        if not ("EngineReplica" in name or "Ingress" in name) or a.get("State") != "ALIVE" or not pid:
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        key = name.rsplit("#", 1)[-1] if "EngineReplica" in name else "ingress"
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


async def probe_ttft(urls: list[str], n: int) -> list[dict[str, float]]:
    """TTFT of `n` short streamed completions one after another on each server, taking turns (so that the
    machine's other load falls on both alike): what the serving path adds, mostly."""
    ttfts: list[list[float]] = [[] for _ in urls]
    async with aiohttp.ClientSession() as http:
        for i in range(n):
            for url, times in zip(urls, ttfts, strict=True):
                body = {"prompt": f"Probe {i}: the capital of France is", "max_tokens": 2, "stream": True}
                start = time.monotonic()
                async with http.post(url + "/v1/completions", json=body) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            times.append(time.monotonic() - start)
                            break
                    await resp.read()
    return [percentiles(times[2:]) for times in ttfts]  # the first two warm the path


async def stream_once(http: aiohttp.ClientSession, url: str, i: int, out: list[dict[str, Any]]) -> None:
    """One long stream for the failure run: its chunks before an error event, how it ended, when."""
    body = {"prompt": f"Load {i}: tell a long story about ships", "max_tokens": 48, "ignore_eos": True}
    rec: dict[str, Any] = {"chunks": 0, "error": None, "finished": False, "status": None}
    try:
        async with http.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            rec["status"] = resp.status
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    rec["error"] = event["error"]["code"]
                elif event["choices"][0]["finish_reason"]:
                    rec["finished"] = True
                else:
                    rec["chunks"] += 1
    except Exception as e:  # noqa: BLE001 - recorded: a lost request
        rec["error"] = repr(e)
    rec["end"] = time.monotonic()
    out.append(rec)


async def kill_under_load(url: str, n: int) -> dict[str, Any]:
    """`n` streams at once on two replicas; one replica killed 3 s in. Lost: a request that failed without a
    byte of its answer (those must go to the other replica); cut: a stream begun on the dead replica."""
    import ray

    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        tasks = [asyncio.create_task(stream_once(http, url, i, out)) for i in range(n)]
        await asyncio.sleep(3.0)
        names = replica_actors()
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        killed = time.monotonic()
        replaced = asyncio.create_task(replacement(names, killed))
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
        replaced_s = await replaced
    cut = [r for r in out if not r["finished"] and r["chunks"] > 0]
    lost = [r for r in out if not r["finished"] and r["chunks"] == 0]
    return {
        "requests": n,
        "completed": sum(r["finished"] for r in out),
        "cut_mid_stream": len(cut),
        "cut_with_error_event": sum(r["error"] == "replica_unavailable" for r in cut),
        "lost_not_begun": len(lost),
        "last_cut_stream_end_s": round(max((r["end"] - killed for r in cut), default=0.0), 2),
        "last_request_end_s": round(max(r["end"] for r in out) - killed, 2),
        "replaced_after_s": round(replaced_s, 1) if replaced_s is not None else None,
    }


def replica_actors() -> list[str]:
    """The names of the engine replicas' actors now."""
    import ray

    return [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]
    ]


async def replacement(before: list[str], since: float) -> float | None:
    """Seconds from `since` until Serve runs a new replica (a name not in `before`) and two replicas run."""
    from ray import serve

    while time.monotonic() - since < 180:
        app = serve.status().applications.get(launch.APP_NAME)
        states = app.deployments["EngineReplica"].replica_states if app is not None else {}
        running = sum(n for state, n in states.items() if str(getattr(state, "value", state)) == "RUNNING")
        if running == 2 and set(replica_actors()) - set(before):
            return time.monotonic() - since
        await asyncio.sleep(0.5)
    return None


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one setup: hit rate over all of them, TTFT percentiles over every turn of every run."""
    hits, queries = sum(r["prefix_hits"] for r in runs), sum(r["prefix_queries"] for r in runs)
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "num_errors": sum(r["num_errors"] for r in runs),
        **percentiles([t / 1e3 for r in runs for t in r["ttfts_ms"]]),
        "runs": runs,
    }


def deploy(
    engine: dict[str, Any], replicas: int, router: str, router_kwargs: dict[str, Any] | None = None
) -> str:
    """(Re)deploy the application on the running Serve; its URL once healthy."""
    from ray import serve

    from tinypaged.replicas.app import build_app

    args = {"engine": engine, "replicas": replicas, "router": router, "engine_process": False}
    if router_kwargs:
        args["router_kwargs"] = router_kwargs
    serve.run(build_app(args), name=launch.APP_NAME, route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{PORT}"
    launch.wait_healthy(url, 600)
    time.sleep(1.0)  # the routers' first routing stats
    return url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=2.0, help="a user's pause before each turn: 0 to this")
    ap.add_argument("--seed", type=int, default=0, help="of the think times (the same for every setup)")
    ap.add_argument("--blocks", type=int, default=192, help="KV cache blocks of 16 tokens per replica")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--probes", type=int, default=42, help="requests of the overhead probe (2 warm up)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each router, in rounds")
    ap.add_argument("--routers", default=",".join(ROUTERS), help="which routers to compare, comma-separated")
    ap.add_argument(
        "--routing-only", action="store_true", help="only the routers (no one replica, failure, overhead)"
    )
    ap.add_argument("--router-log", help="the KV-aware router logs each decision here (JSON lines)")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/replicas-cpu.json"))
    args = ap.parse_args()
    engine = {
        "max_model_len": 1024,
        "num_gpu_blocks_override": args.blocks,
        "max_num_seqs": args.max_num_seqs,
    }
    flags = ["--no-engine-process", "--max-model-len", "1024", "--num-gpu-blocks-override", str(args.blocks)]
    result: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}, "engine": engine}
    routers = args.routers.split(",")
    kv_kwargs = {"decision_log": str(Path(args.router_log).resolve())} if args.router_log else None

    from ray import serve

    work = (args.sessions, args.turns, args.reply_tokens, args.think_s, args.seed)
    launch.start_ray(None, num_cpus=2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        if not args.routing_only:
            url = deploy(engine, 1, "kv")
            with LocalServer([*flags, "--max-num-seqs", str(args.max_num_seqs)]) as alone:
                probes = asyncio.run(probe_ttft([alone.url, url], args.probes))
            result["alone"] = {"probe": probes[0]}
            result["one_replica"] = {
                "probe": probes[1],
                "workload": pooled([asyncio.run(run_workload(url, *work))]),
            }
        runs: dict[str, list[dict[str, Any]]] = {router: [] for router in routers}
        # In rounds, so that the machine's other load falls on every router alike, and in an order that turns
        # with the seed and the round, so that no router always runs first (after the one replica's run).
        for i in range(args.repeats):
            first = (args.seed + i) % len(routers)
            for router in routers[first:] + routers[:first]:
                url = deploy(engine, 2, router, kv_kwargs if router == "kv" else None)
                runs[router].append(asyncio.run(run_workload(url, *work)))
                summary = {k: v for k, v in runs[router][-1].items() if k not in ("ttfts_ms", "turn_log")}
                print(router, summary, file=sys.stderr, flush=True)
        result.update({router: pooled(r) for router, r in runs.items()})
        if not args.routing_only:
            url = deploy(engine, 2, "kv")
            result["failure"] = asyncio.run(kill_under_load(url, 16))
    finally:
        launch.stop()
    report(result, routers)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def report(r: dict[str, Any], routers: list[str]) -> None:
    """The table (the parts that ran)."""
    one = r["one_replica"]["workload"] if "one_replica" in r else None
    print(
        f"\nmulti-turn chat: {r['args']['sessions']} chats x {r['args']['turns']} turns, {r['args']['blocks']} "
        f"KV blocks per replica, think-time seed {r['args']['seed']}, default model on the CPU"
    )
    print(f"{'setup':<34}{'hit rate':>9}{'of 1 replica':>14}{'TTFT p50':>10}{'TTFT p99':>10}{'errors':>8}")
    rows = ([("1 replica", one)] if one else []) + [(f"2 replicas, {k}", r[k]) for k in routers]
    for name, w in rows:
        share = w["hit_rate"] / one["hit_rate"] if one and one["hit_rate"] else float("nan")
        print(
            f"{name:<34}{w['hit_rate']:>9.1%}{share:>14.0%}{w['ttft_p50_ms']:>8.0f}ms{w['ttft_p99_ms']:>8.0f}ms"
            f"{w['num_errors']:>8}"
        )
    if "failure" not in r:
        return
    f = r["failure"]
    print(
        f"\nreplica killed under load: {f['requests']} streams, {f['completed']} completed, "
        f"{f['cut_mid_stream']} cut mid-stream ({f['cut_with_error_event']} with the error event), "
        f"{f['lost_not_begun']} lost before their first byte; the cut streams ended {f['last_cut_stream_end_s']} s "
        f"after the kill, the last request {f['last_request_end_s']} s after; replaced after "
        f"{f['replaced_after_s']} s"
    )
    a, o = r["alone"]["probe"], r["one_replica"]["probe"]
    print(
        f"overhead: TTFT p50 {a['ttft_p50_ms']:.1f} ms alone, {o['ttft_p50_ms']:.1f} ms behind Ray "
        f"(+{o['ttft_p50_ms'] - a['ttft_p50_ms']:.1f} ms)"
    )


if __name__ == "__main__":
    sys.exit(main())
