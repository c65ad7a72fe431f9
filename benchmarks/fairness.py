"""One request's size against another's latency: a single-prompt stream's first token while a big request runs.

    .venv/bin/python benchmarks/fairness.py [--checkout DIR ...] [--rounds N] [--case big|long] [--model DIR]

For each round and each checkout (default: this one), in turn, it starts `tinypaged serve` from that checkout (its
PYTHONPATH; the default model on the CPU, serve's defaults unless --serve-arg), warms it, sends the big request
and, `--delay` seconds after the engine has it (its /metrics count it), one single-prompt streamed completion,
and reports:

- `ttft_s`: the stream's first token, from its send;
- `big_s` and `big_tok_s`: the big request's wall time and its tokens (prompt + completion, from its usage) per
  second.

Cases: `big`, one completion with `--prompts` prompts of 10-30 tokens each, `echo` and `logprobs=1`, `max_tokens`
`--max-tokens` (the probe of issue #45: 91 s for the stream); `long`, one prompt of `--long-tokens` tokens with
`prompt_logprobs` (the probe's 11 s). Rounds alternate the checkouts, so that a machine shared with other work
slows each about as much; the spread is the min and max over rounds.

`--steps` replays the case on the scheduler alone (this checkout's, or PYTHONPATH's; no model, no server) and
prints the step in which the stream, arriving at step 1, gets its first token: deterministic, so it shows the
policy's effect where a loaded machine's timings cannot.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from common import write_json

from tinypaged.server.local import LocalServer

WORDS = (
    "the a of river stone light city winter garden paper music engine window morning quiet green old new "
    "small large bright dark north south open closed story number letter house bridge forest ocean cloud"
).split()


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/completions; the JSON answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {data[:300]!r}")
    return json.loads(data)


def num_queued(port: int) -> int:
    """Requests running or waiting in the engine, from /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return sum(
        int(float(line.split()[-1]))
        for line in text.splitlines()
        if line.startswith(("tinypaged:num_requests_running", "tinypaged:num_requests_waiting"))
    )


def first_token(port: int, body: dict[str, Any]) -> tuple[float, float]:
    """A streamed completion: seconds to its first chunk with text, and to its end."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    conn.request(
        "POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    ttft = None
    while line := resp.readline():
        if ttft is None and line.startswith(b"data: {") and b'"text":"' in line and b'"text":""' not in line:
            ttft = time.perf_counter() - t0
    conn.close()
    end = time.perf_counter() - t0
    return (ttft if ttft is not None else end), end


def big_body(args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """The big request of the case."""
    if args.case == "long":
        return {
            "prompt": [rng.randrange(100, 40000) for _ in range(args.long_tokens)],
            "max_tokens": 1,
            "prompt_logprobs": 1,
        }
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))) for _ in range(args.prompts)]
    return {"prompt": prompts, "max_tokens": args.max_tokens, "echo": True, "logprobs": 1, "temperature": 0}


def one_run(checkout: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Start a server from `checkout`, run the case once; its figures."""
    os.environ["PYTHONPATH"] = checkout
    serve = [*args.serve_arg] + (["--model", args.model] if args.model else [])
    with LocalServer(serve) as server:
        port = urlparse(server.url).port
        assert port is not None
        post(port, {"prompt": "warm up", "max_tokens": 4})
        body = big_body(args, random.Random(seed))
        big: dict[str, Any] = {}

        def run_big() -> None:
            t = time.perf_counter()
            try:
                big["usage"] = post(port, body)["usage"]
            except Exception as e:  # reported, not raised: the other figures still count
                big["error"] = str(e)
            big["s"] = time.perf_counter() - t

        thread = threading.Thread(target=run_big)
        t0 = time.perf_counter()
        thread.start()
        # The delay counts from when the engine has the big request: the server takes a while to read and
        # check 1,024 prompts, and a stream that reached the engine first would not wait behind them at all.
        while num_queued(port) == 0 and thread.is_alive():
            time.sleep(0.02)
        queued_s = time.perf_counter() - t0
        time.sleep(args.delay)
        ttft, stream_s = first_token(port, {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0})
        print(
            f"  {checkout}: the stream's first token after {ttft:.2f} s; waiting for the big request",
            flush=True,
        )
        thread.join()
    usage = big.get("usage") or {}
    tokens = usage.get("total_tokens", 0)
    return {
        "checkout": checkout,
        "queued_s": round(queued_s, 3),
        "ttft_s": round(ttft, 3),
        "stream_s": round(stream_s, 3),
        "big_s": round(big["s"], 3),
        "big_tok_s": round(tokens / big["s"], 1),
        "big_tokens": tokens,
        "big_error": big.get("error"),
    }


def steps_waited(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The case on the scheduler alone (this process's tinypaged.core, no model): the steps the stream waits
    for its first token, the big request arriving as the HTTP server's fan-out queues it. Deterministic."""
    from tinypaged.core.kv_cache_manager import KVCacheManager
    from tinypaged.core.scheduler import Scheduler, SchedulerConfig
    from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(256, 512, 8192), KVCacheManager(16, 20000, 0))
    big = args.prompts if args.case == "big" else 1
    key = "big" if big > 1 else None
    for i in range(big):
        n = args.long_tokens if args.case == "long" else rng.randint(10, 30)
        group = SequenceGroup(f"big-{i}", [Sequence(i, [5] * n)], 0.0)
        group.client_request_id = key  # (a checkout before fairness has no such field: it is ignored there)
        sched.add_seq_group(group)
    limit = 1 if args.case == "long" else args.max_tokens
    for step in range(100000):
        if step == 1:
            sched.add_seq_group(SequenceGroup("stream", [Sequence(big, [7] * 5)], 1.0))
        out = sched.schedule()
        sched.update_from_output(out)
        for s in out.scheduled:
            if s.do_sample:
                if s.request_id == "stream":
                    return {"case": args.case, "stream_first_token_step": step, "arrived_step": 1}
                seq = sched.get_seq(s.seq_id)
                assert seq is not None
                seq.append_token(1)
                if len(seq.output_token_ids) >= limit:
                    sched.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
    raise RuntimeError("the stream never ran")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    here = str(Path(__file__).resolve().parents[1])
    ap.add_argument("--checkout", action="append", help="a tinypaged checkout to serve from (repeatable)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--case", choices=["big", "long"], default="big")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--delay", type=float, default=1.0, help="seconds between the big request and the stream")
    ap.add_argument("--model", default=None)
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `tinypaged serve` argument")
    ap.add_argument("--out", default=None, help="write the runs as JSON here")
    ap.add_argument(
        "--steps", action="store_true", help="only count the steps waited, on the scheduler alone"
    )
    args = ap.parse_args()
    if args.steps:
        print(json.dumps(steps_waited(args, 0)))
        return
    checkouts = args.checkout or [here]
    runs = []
    for r in range(args.rounds):
        for checkout in checkouts:
            run = one_run(checkout, args, seed=r)
            print(json.dumps(run), flush=True)
            runs.append(run)
    print(f"\ncase {args.case}, {args.rounds} round(s): median (min-max)")
    for checkout in checkouts:
        mine = [x for x in runs if x["checkout"] == checkout]
        cols = []
        for key in ("ttft_s", "big_s", "big_tok_s"):
            xs = [x[key] for x in mine]
            cols.append(f"{key} {statistics.median(xs):g} ({min(xs):g}-{max(xs):g})")
        print(f"  {checkout}: " + ", ".join(cols))
    if args.out:
        write_json(args.out, {"args": vars(args), "runs": runs})


if __name__ == "__main__":
    main()
