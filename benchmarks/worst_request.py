"""Peak host memory of the server for the worst single requests its limits allow (tinypaged/limits.py,
docs/limits.md), one at a time, and /health's latency meanwhile.

    .venv/bin/python benchmarks/worst_request.py [--model DIR] [--only NAME ...]

It starts `tinypaged serve` on the default model (CPU) as a subprocess (`tinypaged.server.local`), warms it, and
for each request resets the peak resident set (`echo 5 > /proc/PID/clear_refs`) of the server's process and of
its engine-core process, sends the request, and reads each one's `VmHWM` (the peak since the reset) and `VmRSS`
from /proc/PID/status: a process's peak is its VmHWM minus its RSS before, and RSS after minus before is what it
left behind. A thread polls /health every 20 ms throughout.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import write_json

from tinypaged import limits as L
from tinypaged.server.local import LocalServer, engine_core_pid

MAX_MODEL_LEN = 8192  # the default model's context
VOCAB = 49152
MAX_NUM_SEQS = 256
BODY = 4 * 1024 * 1024  # the server's default --max-body-bytes


def mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process, MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


class Health(threading.Thread):
    """Polls GET /health every 20 ms and keeps the slowest answer since the last reset."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.worst, self.polls, self.stop = port, 0.0, 0, False

    def run(self) -> None:
        while not self.stop:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            t = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            self.worst = max(self.worst, time.perf_counter() - t)
            self.polls += 1
            conn.close()
            time.sleep(0.02)


def post(port: int, path: str, body: bytes, stream_events: int | None = None) -> tuple[int, int]:
    """POST a body; the status and the bytes of the answer (a stream: closed after `stream_events` events)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if stream_events is None or resp.status != 200:
        data = resp.read()
    else:
        data, events = b"", 0
        while events < stream_events:
            line = resp.readline()
            if not line:
                break
            data += line
            events += line.startswith(b"data:")
    conn.close()
    return resp.status, len(data)


def cases(rng: random.Random) -> dict[str, tuple[str, Callable[[], dict[str, Any]], int | None]]:
    """name -> (path, body builder, events to read before closing a stream or None)."""
    entries_per = L.MAX_LOGPROBS + 1
    n_lp = 64
    lp_tokens = L.MAX_LOGPROB_ENTRIES // (n_lp * entries_per)  # n x tokens x 21 at the limit
    n_prompts = 24  # prompt tokens x 21 (echo) plus one output token x 21 per prompt, at the limit:
    per_prompt_lp = (L.MAX_LOGPROB_ENTRIES // entries_per - n_prompts) // n_prompts

    def ids(k: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(k)]

    # As many prompts as the body allows, each as long as the context allows (ids of one digit: 2 bytes each).
    per_prompt = min(MAX_MODEL_LEN - 2, (BODY - 4096) // (2 * L.MAX_PROMPTS))
    return {
        "logprobs at the limit (n=64, 20 alternatives, not streamed)": (
            "/v1/completions",
            lambda: {
                "prompt": "Once upon a time",
                "n": n_lp,
                "max_tokens": lp_tokens,
                "logprobs": L.MAX_LOGPROBS,
                "temperature": 1.0,
                "seed": 1,
                "ignore_eos": True,
            },
            None,
        ),
        "echo with logprobs at the limit (24 prompts of 2079 ids, 20 alternatives)": (
            "/v1/completions",
            lambda: {
                "prompt": [ids(per_prompt_lp) for _ in range(n_prompts)],
                "max_tokens": 1,
                "echo": True,
                "logprobs": L.MAX_LOGPROBS,
            },
            None,
        ),
        "beam search, widest (best_of=256, 256 stop ids, length_penalty=-10)": (
            "/v1/completions",
            lambda: {
                "prompt": "The river",
                "n": MAX_NUM_SEQS,
                "best_of": MAX_NUM_SEQS,
                "use_beam_search": True,
                "temperature": 0.0,
                "max_tokens": 48,
                "stop_token_ids": ids(L.MAX_STOP_TOKEN_IDS),
                "length_penalty": L.LENGTH_PENALTY[0],
                "min_tokens": 8,
            },
            None,
        ),
        "stop strings, most (n=256, 16 x 256 chars)": (
            "/v1/completions",
            lambda: {
                "prompt": "The river",
                "n": MAX_NUM_SEQS,
                "temperature": 1.0,
                "max_tokens": 64,
                "stop": [
                    "".join(rng.choices("ab .", k=L.MAX_STOP_STRING_CHARS)) for _ in range(L.MAX_STOP_STRINGS)
                ],
            },
            None,
        ),
        f"{L.MAX_PROMPTS} prompts of {per_prompt} token ids (a full body; stream closed after one event)": (
            "/v1/completions",
            lambda: {
                "prompt": [[1] * per_prompt for _ in range(L.MAX_PROMPTS)],
                "max_tokens": 1,
                "stream": True,
            },
            1,
        ),
        "a 4 MiB text prompt (refused by its size)": (
            "/v1/completions",
            lambda: {"prompt": "word " * ((BODY - 4096) // 5), "max_tokens": 1},
            None,
        ),
        "a 4 MiB chat of short messages (refused by its length)": (
            "/v1/chat/completions",
            lambda: {
                "messages": [{"role": "user", "content": "hi"}] * ((BODY - 4096) // 34),
                "max_tokens": 1,
            },
            None,
        ),
        "detokenize a 4 MiB token list": (
            "/detokenize",
            lambda: {"tokens": ids((BODY - 4096) // 7)},
            None,
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument(
        "--kv-gib", type=float, default=4.0, help="CPU KV cache (the logprobs case needs ~2.3 GiB)"
    )
    ap.add_argument("--only", nargs="*", default=None, help="run the cases whose names start with these")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/worst_request-cpu.json"))
    args = ap.parse_args()

    flags = ["--cpu-kv-cache-space", str(args.kv_gib)] + (["--model", str(args.model)] if args.model else [])
    with LocalServer(flags) as local:
        server = local.proc
        assert server is not None
        port = int(local.url.rsplit(":", 1)[1])
        warm = {"prompt": "Hello", "max_tokens": 8, "logprobs": 5, "n": 2}
        post(port, "/v1/completions", json.dumps(warm).encode())
        core = engine_core_pid(server.pid)
        pids = {"server": server.pid} | ({"core": core} if core is not None else {})
        for role, pid in pids.items():
            base = mib(pid)
            print(f"{role} pid {pid}, warm: RSS {base['VmRSS']:.0f} MiB, HWM {base['VmHWM']:.0f} MiB")

        health = Health(port)
        health.start()
        rows = []
        for name, (path, build, events) in cases(random.Random(0)).items():
            if args.only and not any(name.startswith(o) for o in args.only):
                continue
            body = json.dumps(build()).encode()
            time.sleep(1.0)  # let the previous request's memory settle
            for pid in pids.values():
                Path(f"/proc/{pid}/clear_refs").write_text("5")
            before = {role: mib(pid) for role, pid in pids.items()}
            health.worst = 0.0
            t = time.perf_counter()
            status, size = post(port, path, body, events)
            secs = time.perf_counter() - t
            time.sleep(1.0)  # an aborted stream's requests leave the engine at its next step
            after = {role: mib(pid) for role, pid in pids.items()}
            row: dict[str, Any] = {
                "request": name,
                "body_bytes": len(body),
                "status": status,
                "answer_bytes": size,
                "seconds": round(secs, 2),
                "health_worst_ms": round(1000 * health.worst, 1),
            }
            for role in pids:
                b, a = before[role], after[role]
                row[role] = {
                    "rss_before_mib": round(b["VmRSS"]),
                    "peak_mib": round(a["VmHWM"]),
                    "peak_over_before_mib": round(a["VmHWM"] - b["VmRSS"]),
                    "rss_after_over_before_mib": round(a["VmRSS"] - b["VmRSS"]),
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
        health.stop = True

    write_json(
        args.out,
        {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "server": "tinypaged serve " + " ".join(flags),
            "limits": {k: getattr(L, k) for k in dir(L) if k.isupper()},
            "rows": rows,
        },
    )
    roles = " / ".join(pids)
    print(
        f"\n| request | body | status | s | peak over idle MiB ({roles}) | kept MiB ({roles}) | /health worst ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        peak = " / ".join(str(r[role]["peak_over_before_mib"]) for role in pids)
        kept = " / ".join(str(r[role]["rss_after_over_before_mib"]) for role in pids)
        print(
            f"| {r['request']} | {r['body_bytes'] / 2**20:.2f} MiB | {r['status']} | {r['seconds']} | {peak} | "
            f"{kept} | {r['health_worst_ms']} |"
        )


if __name__ == "__main__":
    main()
