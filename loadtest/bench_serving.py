"""Serving benchmark against a running `tinypaged serve` (or any OpenAI-compatible server).

Sends streamed completions with random token-id prompts (EOS ignored, so output lengths are exact) at a
Poisson request rate or all at once; reports throughput and TTFT / TPOT / ITL / E2E percentiles, as JSON too.

    .venv/bin/python loadtest/bench_serving.py --url http://127.0.0.1:8000 --num-requests 32 \\
        --prompt-len 32 256 --output-len 16 128 --request-rate inf --out loadtest/result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np


@dataclass
class RequestResult:
    """What one request measured (seconds)."""

    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    error: str | None = None


async def _one(
    session: aiohttp.ClientSession, url: str, model: str | None, prompt: list[int], max_tokens: int
) -> RequestResult:
    result = RequestResult(prompt_len=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if not chunk["choices"]:
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    except aiohttp.ClientError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.e2e = time.perf_counter() - start
    return result


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values) * 1000.0
    return {"mean_ms": float(arr.mean()), **{f"p{q}_ms": float(np.percentile(arr, q)) for q in (50, 90, 99)}}


def summarize(results: list[RequestResult], duration: float) -> dict:
    """Throughput and latency percentiles of a run."""
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput_tok_s": out_tokens / duration,
        "total_token_throughput_tok_s": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "ttft": _percentiles([r.ttft for r in ok]),
        "tpot": _percentiles(tpot),
        "itl": _percentiles([x for r in ok for x in r.itl]),
        "e2e": _percentiles([r.e2e for r in ok]),
    }


async def run(args: argparse.Namespace) -> dict:
    """Send the workload; returns the summary (and the per-request results when asked)."""
    rng = random.Random(args.seed)
    work = [
        (
            [rng.randrange(100, args.vocab) for _ in range(rng.randint(*args.prompt_len))],
            rng.randint(*args.output_len),
        )
        for _ in range(args.num_requests)
    ]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    limit = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=limit) as session:
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in work:
            tasks.append(asyncio.create_task(_one(session, args.url, args.model, prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("api_key", "out")}
    if args.per_request:
        summary["requests"] = [asdict(r) for r in results]
    return summary


def main() -> None:
    """Parse arguments, run, print the summary and write it to --out."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's model")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--vocab", type=int, default=49152, help="random prompt ids are drawn below this")
    ap.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once"
    )
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--per-request", action="store_true", help="include every request's measurements")
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    args = ap.parse_args()
    summary = asyncio.run(run(args))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
