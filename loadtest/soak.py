"""A fault soak against a running `tinypaged serve`, bounded in time: normal streaming requests mixed with
clients that disconnect mid-stream, stalled readers, malformed and oversized bodies, aborts, bodies that never
arrive, silent connections and bursts past `--max-queue-len`; then the checks.

    .venv/bin/python loadtest/soak.py --url http://127.0.0.1:8000 --duration 300 --concurrency 16 \\
        --max-queue-len 64 --idle-timeout 5 --out soak.json

Give the server's own `--max-queue-len`, `--idle-timeout` and `--max-body-bytes` so that the soak can push past
them (without `--max-queue-len` there are no bursts; the 408 and silent-connection faults need an idle timeout
of at most 30 s). At the end it checks, and exits 1 when one fails:
- no 5xx but the documented 503s (`overloaded`, with Retry-After);
- every normal request complete and well formed (one finish reason per choice, usage, [DONE]); every greedy one
  equal to the same prompt run alone before the load (with `--tie-tolerance T`, a greedy run may instead part
  from it at a token that, alone, was among the best five and within T of the best in log-probability:
  batched float arithmetic may break such near-ties either way on a GPU);
- every fault answered as documented (4xx JSON for bad bodies, 408 for a body that never arrives, the
  connection closed for a silent client, 503 or a complete answer in a burst);
- after the load, nothing running or waiting and every KV block free (from `/metrics`);
- the server's resident memory (`process_resident_memory_bytes`, plus its engine-core process's) grew by at most
  `--max-rss-growth-mib` between the end of a warm-up (the first tenth of the run) and the end;
- the server still serving: `/health` and a greedy request equal to its reference.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from aioclient import get_metrics, is_idle, post_stream, resident_memory, wait_idle
from workload import CHAT, COMPLETIONS, LengthDist, Stream, random_text, request_body

# How often each kind of client is picked (normal ones most of the time).
KINDS = {
    "greedy": 6,
    "sampled": 4,
    "disconnect": 1,
    "stalled_reader": 1,
    "abort": 1,
    "malformed": 2,
    "oversized": 1,
    "body_never_arrives": 0.3,
    "silent_connection": 0.3,
}
MIB = 2**20
TOP = 5  # alternatives logged per token of the greedy references


@dataclass
class Reference:
    """A greedy request and what it produced alone: choice 0's text, tokens and their top log-probabilities."""

    path: str
    body: dict
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Tally:
    """What happened: requests by kind, outcomes by kind, statuses, greedy comparisons, violations."""

    kinds: Counter = field(default_factory=Counter)
    outcomes: dict[str, Counter] = field(default_factory=dict)
    statuses: Counter = field(default_factory=Counter)
    greedy: Counter = field(default_factory=Counter)
    # Where greedy runs parted: how far, alone, the token taken under load was below the best (None: not in
    # the alone run's best five).
    gaps: list[float | None] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def note(self, kind: str, outcome: str, status: int | None = None) -> None:
        """Count one request of `kind` and its outcome (and HTTP status, when one came)."""
        self.kinds[kind] += 1
        self.outcomes.setdefault(kind, Counter())[outcome] += 1
        if status is not None:
            self.statuses[str(status)] += 1

    def violate(self, what: str) -> None:
        """Record a failed check (the first 50 are kept in full)."""
        if len(self.violations) < 50:
            self.violations.append(what)
        else:
            self.violations[-1] = f"... and more (last: {what})"


class Soak:
    """The soak's clients, their shared settings and the tally."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = args.url.rstrip("/")
        u = urlsplit(self.base)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.prompt_len, self.output_len = (
            LengthDist.parse(args.prompt_len),
            LengthDist.parse(args.output_len),
        )
        self.tally = Tally()
        self.refs: list[Reference] = []
        self.deadline = 0.0

    # ---- normal requests ---------------------------------------------------------------------------------

    def _body(self, rng: random.Random, path: str, max_tokens: int, **sampling: object) -> dict:
        text = random_text(rng, self.prompt_len.sample(rng))
        prompt = [{"role": "user", "content": text}] if path == CHAT else text
        return request_body(path, prompt, max_tokens, model=self.args.model, **sampling)

    async def make_references(self, session: aiohttp.ClientSession) -> None:
        """The greedy pool, each prompt run alone (one at a time, before any load), with top-5 logprobs."""
        rng = random.Random(self.args.seed)
        for i in range(self.args.references):
            path = CHAT if i % 2 else COMPLETIONS
            logprobs = {"logprobs": True, "top_logprobs": TOP} if path == CHAT else {"logprobs": TOP}
            ref = Reference(
                path, self._body(rng, path, self.output_len.sample(rng), temperature=0.0, **logprobs)
            )
            reply = await post_stream(session, self.base + path, ref.body)
            problems = reply.stream.check(max_tokens=ref.body["max_tokens"], exact=True)
            if reply.status != 200 or problems:
                raise SystemExit(
                    f"error: reference request {i} failed alone: {reply.status} {reply.body[:200]!r} {problems}"
                )
            ref.text, ref.tokens, ref.top = (
                reply.stream.text.get(0, ""),
                reply.stream.tokens,
                reply.stream.top_logprobs,
            )
            self.refs.append(ref)

    def compare(self, ref: Reference, s: Stream) -> str:
        """'equal', 'near_tie' (parted at a token that, alone, was within the tolerance of the best) or
        'differ'."""
        if s.text.get(0, "") == ref.text:
            return "equal"
        k = next((i for i, (a, b) in enumerate(zip(s.tokens, ref.tokens, strict=False)) if a != b), None)
        if k is not None and k < len(ref.top) and ref.top[k]:
            taken = ref.top[k].get(s.tokens[k])
            gap = None if taken is None else max(ref.top[k].values()) - taken
            self.tally.gaps.append(None if gap is None else round(gap, 4))
            if gap is not None and gap <= self.args.tie_tolerance:
                return "near_tie"
        return "differ"

    async def greedy(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """A reference prompt again, under load: complete, well formed, and equal to its run alone."""
        ref = rng.choice(self.refs)
        reply = await post_stream(session, self.base + ref.path, ref.body)
        if reply.status != 200:
            self._unexpected("greedy", reply.status, reply.body)
            return
        problems = reply.stream.check(max_tokens=ref.body["max_tokens"], exact=True)
        if problems:
            self.tally.note("greedy", "ill_formed", 200)
            self.tally.violate(f"greedy {ref.path}: {problems}")
            return
        verdict = self.compare(ref, reply.stream)
        self.tally.greedy[verdict] += 1
        self.tally.note("greedy", "complete", 200)
        if verdict == "differ":
            self.tally.violate(f"greedy {ref.path}: {_parting(reply.stream.text.get(0, ''), ref.text)}")

    async def sampled(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """A sampled request (n of 1 or 2, a seed, EOS honoured), streamed or whole: complete and well formed."""
        path = rng.choice((COMPLETIONS, CHAT))
        n, max_tokens = rng.choice((1, 1, 2)), self.output_len.sample(rng)
        body = self._body(rng, path, max_tokens, temperature=0.8, top_p=0.95, seed=rng.randrange(2**31), n=n)
        body["ignore_eos"] = False
        if rng.random() < 0.25:  # not streamed
            del body["stream"], body["stream_options"]
            async with session.post(self.base + path, json=body) as r:
                data = await r.read()
                if r.status != 200:
                    self._unexpected("sampled", r.status, data)
                    return
                problems = _whole_problems(json.loads(data), n, max_tokens)
        else:
            reply = await post_stream(session, self.base + path, body)
            if reply.status != 200:
                self._unexpected("sampled", reply.status, reply.body)
                return
            problems = reply.stream.check(choices=n, max_tokens=max_tokens)
        self.tally.note("sampled", "ill_formed" if problems else "complete", 200)
        if problems:
            self.tally.violate(f"sampled {path}: {problems}")

    def _unexpected(self, kind: str, status: int, body: bytes) -> None:
        """A status a normal request should not get; except the documented 503 of a full queue (a burst can
        fill it under any request), counted apart."""
        if status == 503 and b'"overloaded"' in body:
            self.tally.note(kind, "refused_overloaded_503", status)
            return
        self.tally.note(kind, f"http_{status}", status)
        self.tally.violate(f"{kind}: HTTP {status} {body[:200]!r}")

    # ---- faults --------------------------------------------------------------------------------------------

    async def disconnect(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """Read a few chunks of a long stream, then drop the connection."""
        body = self._body(rng, rng.choice((COMPLETIONS, CHAT)), self.args.long_output, temperature=0.0)
        chunks = rng.randint(1, 4)
        async with session.post(self.base + (CHAT if "messages" in body else COMPLETIONS), json=body) as r:
            if r.status != 200:
                self._unexpected("disconnect", r.status, await r.read())
                return
            got = 0
            async for line in r.content:
                got += line.startswith(b"data:")
                if got >= chunks:
                    break
            r.close()  # drops the connection mid-stream
        self.tally.note("disconnect", "dropped_mid_stream", 200)

    async def abort(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """Send a request and give up on it within 0-300 ms (often before its first token)."""
        stream = rng.random() < 0.5
        body = self._body(rng, COMPLETIONS, self.args.long_output, temperature=0.0, stream=stream)
        try:
            async with asyncio.timeout(rng.uniform(0.0, 0.3)):
                async with session.post(self.base + COMPLETIONS, json=body) as r:
                    await r.read()
            self.tally.note("abort", f"finished_first_{r.status}", r.status)
        except TimeoutError:
            self.tally.note("abort", "aborted")

    async def stalled_reader(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """A stream whose reader stops reading (tiny receive buffer, so the server's writes block) for a few
        seconds, then reads the rest: the answer must still be complete and well formed."""
        max_tokens = self.args.long_output
        body = self._body(rng, COMPLETIONS, max_tokens, temperature=0.0)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
        try:
            writer.write(_http_request("POST", COMPLETIONS, json.dumps(body).encode(), self.auth))
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(rng.uniform(1.0, self.args.stall))  # read nothing meanwhile
            rest = await reader.read()  # Connection: close, so the body ends at EOF
        finally:
            writer.close()
        status = int(head.split()[1])
        if status != 200:
            self._unexpected("stalled_reader", status, rest)
            return
        s = Stream(start=0.0)
        for line in _dechunk(rest).split(b"\n"):
            s.feed(line, 0.0)
        problems = s.check(max_tokens=max_tokens, exact=True)
        self.tally.note("stalled_reader", "ill_formed" if problems else "complete", status)
        if problems:
            self.tally.violate(f"stalled reader: {problems}")

    async def malformed(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """A body the server must refuse with a 4xx in OpenAI's JSON."""
        name, path, data, headers, want = rng.choice(MALFORMED)
        async with session.post(self.base + path, data=data, headers=headers) as r:
            status, payload = r.status, await r.read()
        self._expect_error("malformed", name, status, payload, want)

    async def oversized(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """A body just past `--max-body-bytes`: 413."""
        body = json.dumps({"prompt": "x" * (self.args.max_body_bytes + rng.randint(1, 4096))}).encode()
        try:
            async with session.post(self.base + COMPLETIONS, data=body, headers=JSON) as r:
                status, payload = r.status, await r.read()
        except aiohttp.ClientOSError:  # the server answered 413 and closed before the whole body was sent
            self.tally.note("oversized", "closed_while_sending")
            return
        self._expect_error("oversized", "body", status, payload, {413})

    def _expect_error(self, kind: str, name: str, status: int, payload: bytes, want: set[int]) -> None:
        ok = status in want
        with contextlib.suppress(ValueError, KeyError, TypeError):
            ok = ok and bool(json.loads(payload)["error"]["message"])
        self.tally.note(kind, f"{name}_{status}" if ok else f"{name}_unexpected_{status}", status)
        if not ok:
            self.tally.violate(f"{kind} {name}: HTTP {status} (expected {sorted(want)}) {payload[:200]!r}")

    async def body_never_arrives(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """Headers promise a body that never comes: 408 after the server's idle timeout."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            head = _http_request("POST", COMPLETIONS, b"", self.auth, length=200)
            writer.write(head + b'{"prompt": "never fin')
            await writer.drain()
            async with asyncio.timeout(self.args.idle_timeout + 15):
                answer = await reader.read()
        except TimeoutError:
            answer = b""
        finally:
            writer.close()
        status = int(answer.split()[1]) if answer.startswith(b"HTTP/1.1 ") else 0
        self._expect_error("body_never_arrives", "half_body", status, answer.partition(b"\r\n\r\n")[2], {408})

    async def silent_connection(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """A connection that sends nothing is closed after the server's idle timeout."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.args.idle_timeout + 15):
                data = await reader.read()
            closed = data == b""
        except TimeoutError:
            closed = False
        except ConnectionResetError:
            closed = True
        finally:
            writer.close()
        self.tally.note("silent_connection", "closed" if closed else "left_open")
        if not closed:
            self.tally.violate(f"a silent connection was still open after {time.monotonic() - t0:.0f} s")

    async def burst(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        """Many requests at once, past --max-queue-len: each answered 503 (overloaded, Retry-After) or whole."""
        limit, n = self.args.max_queue_len, self.args.burst_n
        count = 2 * limit // n + self.args.burst_extra

        async def one(i: int) -> None:
            body = self._body(rng, COMPLETIONS, 4, temperature=0.8, n=n, seed=i, stream=False)
            async with session.post(self.base + COMPLETIONS, json=body) as r:
                status, data, retry = r.status, await r.read(), r.headers.get("Retry-After")
            try:
                answer = json.loads(data)
            except ValueError:
                self._unexpected("burst", status, data)
                return
            if status == 503:
                code = answer["error"].get("code")
                ok = retry is not None and code == "overloaded"
                self.tally.note("burst", "503_overloaded" if ok else "503_malformed", status)
                if not ok:
                    self.tally.violate(f"burst 503 without Retry-After or code overloaded: {data[:200]!r}")
            elif status == 200:
                problems = _whole_problems(answer, n, 4)
                self.tally.note("burst", "ill_formed" if problems else "complete", status)
                if problems:
                    self.tally.violate(f"burst: {problems}")
            else:
                self._unexpected("burst", status, data)

        await asyncio.gather(*(one(i) for i in range(count)))
        # One request larger than the whole queue: 400 (a request the queue could never take is not retried).
        body = self._body(rng, COMPLETIONS, 2, temperature=0.8, n=limit + 1, stream=False)
        async with session.post(self.base + COMPLETIONS, json=body) as r:
            self._expect_error("burst", "larger_than_queue", r.status, await r.read(), {400})

    # ---- the run -------------------------------------------------------------------------------------------

    async def client(self, session: aiohttp.ClientSession, index: int) -> None:
        """Pick a kind by weight, run it, again until the deadline."""
        rng = random.Random(self.args.seed * 7919 + index)
        kinds = [k for k in KINDS if self._enabled(k)]
        weights = [KINDS[k] for k in kinds]
        tour = (
            list(kinds) if index == 0 else []
        )  # client 0 runs every kind once first, even past the deadline
        while tour or time.monotonic() < self.deadline:
            kind = tour.pop(0) if tour else rng.choices(kinds, weights)[0]
            try:
                await getattr(self, kind)(session, rng)
            except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError, TimeoutError) as e:
                self.tally.note(kind, f"client_error_{type(e).__name__}")
                if kind in ("greedy", "sampled", "stalled_reader", "burst"):
                    self.tally.violate(f"{kind}: {type(e).__name__}: {e}")

    def _enabled(self, kind: str) -> bool:
        if kind in ("body_never_arrives", "silent_connection"):
            return self.args.idle_timeout is not None and self.args.idle_timeout <= 30
        return True

    async def bursts(self, session: aiohttp.ClientSession) -> None:
        """A burst every --burst-every seconds until the deadline."""
        rng = random.Random(self.args.seed + 99)
        while time.monotonic() + self.args.burst_every < self.deadline:
            await asyncio.sleep(self.args.burst_every)
            try:
                await self.burst(session, rng)
            except (aiohttp.ClientError, OSError) as e:
                self.tally.violate(f"burst: {type(e).__name__}: {e}")

    async def run(self) -> dict:
        """References, the load, then the checks; the report."""
        a = self.args
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
        # Pooled connections are let go well before the server's idle timeout closes them: a request sent on a
        # connection the server is closing at that moment would be reset (a keep-alive race, not a fault).
        keepalive = min(15.0, (a.idle_timeout or 30.0) / 2)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive)
        async with aiohttp.ClientSession(headers=self.auth, timeout=timeout, connector=connector) as session:
            if a.model is None:
                async with session.get(self.base + "/v1/models") as r:
                    a.model = (await r.json())["data"][0]["id"]
            m0 = await get_metrics(session, self.base)
            await self.make_references(session)
            t0 = time.monotonic()
            self.deadline = t0 + a.duration
            tasks = [asyncio.create_task(self.client(session, i)) for i in range(a.concurrency)]
            if a.max_queue_len is not None:
                tasks.append(asyncio.create_task(self.bursts(session)))
            await asyncio.sleep(min(a.duration / 10, 30))
            rss_warm = resident_memory(await get_metrics(session, self.base))
            await asyncio.gather(*tasks)
            load_s = time.monotonic() - t0
            m1 = await wait_idle(session, self.base, timeout=60)
            rss_end = resident_memory(m1)
            # Still serving: health, and a reference answered as it was alone.
            async with session.get(self.base + "/health") as r:
                healthy = r.status == 200
            await self.greedy(session, random.Random(a.seed))
        return self.report(m0, m1, rss_warm, rss_end, healthy, load_s)

    def report(
        self, m0: dict, m1: dict, rss_warm: float | None, rss_end: float | None, healthy: bool, load_s: float
    ) -> dict:
        """The figures and the end checks."""
        t, a = self.tally, self.args
        for status, count in t.statuses.items():
            if int(status) >= 500 and status != "503":
                t.violate(f"{count} responses with HTTP {status}")
        if not is_idle(m1):
            t.violate("not idle after the load: " + json.dumps({k: v for k, v in m1.items() if "num_" in k}))
        if not healthy:
            t.violate("/health did not answer 200 after the load")
        growth = None
        if rss_warm is not None and rss_end is not None:
            growth = (rss_end - rss_warm) / MIB
            if growth > a.max_rss_growth_mib:
                t.violate(f"server RSS grew {growth:.0f} MiB (limit {a.max_rss_growth_mib})")
        aborts = 'tinypaged:request_success_total{finished_reason="abort"}'
        return {
            "config": {k: v for k, v in vars(a).items() if k not in ("api_key", "out")},
            "load_s": round(load_s, 1),
            "requests": dict(t.kinds),
            "outcomes": {k: dict(v) for k, v in sorted(t.outcomes.items())},
            "statuses": dict(sorted(t.statuses.items())),
            "greedy": dict(t.greedy),
            # At each parting: the two best log-probabilities' gap alone (None: the token taken was not among them).
            "parting_gaps": _gap_summary(t.gaps),
            "server": {
                "running": m1.get("tinypaged:num_requests_running"),
                "waiting": m1.get("tinypaged:num_requests_waiting"),
                "free_blocks": m1.get("tinypaged:num_free_gpu_blocks"),
                "total_blocks": m1.get("tinypaged:num_gpu_blocks"),
                "aborted_requests": m1.get(aborts, 0) - m0.get(aborts, 0),
                "rss_mib_before": _mib(resident_memory(m0)),
                "rss_mib_after_warmup": _mib(rss_warm),
                "rss_mib_end": _mib(rss_end),
                "rss_growth_mib": None if growth is None else round(growth, 1),
            },
            "violations": t.violations,
            "ok": not t.violations,
        }


JSON = {"Content-Type": "application/json"}
# (name, path, body, extra headers, statuses allowed): bodies the server must refuse in OpenAI's JSON.
MALFORMED = [
    ("bad_json", COMPLETIONS, b'{"prompt": "Hello", ', JSON, {400}),
    ("not_an_object", COMPLETIONS, b"[1, 2, 3]", JSON, {400}),
    ("wrong_type", COMPLETIONS, b'{"prompt": "Hi", "max_tokens": "ten"}', JSON, {400}),
    ("out_of_range", COMPLETIONS, b'{"prompt": "Hi", "temperature": -1}', JSON, {400}),
    (
        "deep_nesting",
        COMPLETIONS,
        b'{"prompt": "Hi", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        JSON,
        {400},
    ),
    ("bad_utf8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', JSON, {400}),
    ("bad_encoding", COMPLETIONS, b"not gzip at all", {**JSON, "Content-Encoding": "gzip"}, {400}),
    ("empty_messages", CHAT, b'{"messages": []}', JSON, {400}),
    ("message_without_content", CHAT, b'{"messages": [{"role": "user"}]}', JSON, {400}),
    ("tool_without_call_id", CHAT, b'{"messages": [{"role": "tool", "content": "4"}]}', JSON, {400}),
    (
        "image_part",
        CHAT,
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        JSON,
        {400},
    ),
    ("unknown_model", COMPLETIONS, b'{"prompt": "Hi", "model": "no-such-model"}', JSON, {404}),
    ("unknown_route", "/v1/nothing-here", b"{}", JSON, {404}),
    ("prompt_too_long", COMPLETIONS, json.dumps({"prompt": [1] * 20_000}).encode(), JSON, {400}),
]


def _whole_problems(body: dict, n: int, max_tokens: int) -> list[str]:
    """What is wrong with a non-streamed completion or chat completion of `n` choices."""
    problems = []
    choices = body.get("choices", [])
    if sorted(c["index"] for c in choices) != list(range(n)):
        problems.append(f"choices {[c['index'] for c in choices]}, expected {n}")
    if any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        problems.append(f"finish reasons {[c.get('finish_reason') for c in choices]}")
    usage = body.get("usage") or {}
    if not 0 < usage.get("completion_tokens", 0) <= n * max_tokens:
        problems.append(f"usage {usage}")
    return problems


def _http_request(
    method: str, path: str, body: bytes, headers: dict[str, str], length: int | None = None
) -> bytes:
    """A raw HTTP/1.1 request that asks the server to close the connection after answering."""
    lines = [f"{method} {path} HTTP/1.1", "Host: soak", "Content-Type: application/json", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _dechunk(data: bytes) -> bytes:
    """The body of a chunked transfer encoding."""
    out, i = bytearray(), 0
    while i < len(data):
        end = data.index(b"\r\n", i)
        size = int(data[i:end].split(b";")[0], 16)
        if size == 0:
            break
        out += data[end + 2 : end + 2 + size]
        i = end + 2 + size + 2
    return bytes(out)


def _parting(text: str, alone: str) -> str:
    """Where two texts part, with a little context either side."""
    k = next(
        (i for i, (a, b) in enumerate(zip(text, alone, strict=False)) if a != b), min(len(text), len(alone))
    )
    lo = max(0, k - 20)
    return f"from character {k}: {text[lo : k + 30]!r} != alone {alone[lo : k + 30]!r}"


def _gap_summary(gaps: list[float | None]) -> dict:
    known = sorted(g for g in gaps if g is not None)
    q = (
        {f"p{p}": known[min(len(known) - 1, int(p / 100 * len(known)))] for p in (50, 90, 99)}
        if known
        else {}
    )
    return {
        "partings": len(gaps),
        f"not_in_top{TOP}": gaps.count(None),
        **q,
        "max": known[-1] if known else None,
    }


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / MIB, 1)


def summary_lines(report: dict) -> list[str]:
    """The report in a few lines of text."""
    s = report["server"]
    lines = [
        f"soak: {sum(report['requests'].values())} requests in {report['load_s']} s: "
        + ", ".join(f"{k} {v}" for k, v in sorted(report["requests"].items())),
        "statuses: " + ", ".join(f"{k}: {v}" for k, v in report["statuses"].items()),
        "greedy vs alone: "
        + (", ".join(f"{k} {v}" for k, v in report["greedy"].items()) or "none")
        + f"; where they parted, the token taken below the best alone by: {report['parting_gaps']}",
        f"end: {s['running']:.0f} running, {s['waiting']:.0f} waiting, {s['free_blocks']:.0f} of "
        f"{s['total_blocks']:.0f} KV blocks free; aborted requests {s['aborted_requests']:.0f}",
        f"server RSS: {s['rss_mib_before']} MiB before, {s['rss_mib_after_warmup']} after warm-up, "
        f"{s['rss_mib_end']} at the end (growth {s['rss_growth_mib']} MiB)",
    ]
    for kind, outcomes in report["outcomes"].items():
        lines.append(f"  {kind}: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    lines += [f"VIOLATION: {v}" for v in report["violations"]]
    lines.append("soak: OK" if report["ok"] else f"soak: FAILED ({len(report['violations'])} violations)")
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The soak's options."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=8, help="clients at once")
    ap.add_argument("--prompt-len", default="4-32", help="length spec, in words")
    ap.add_argument("--output-len", default="4-24", help="length spec, tokens")
    ap.add_argument(
        "--long-output", type=int, default=64, help="max_tokens of the streams that are cut or stalled"
    )
    ap.add_argument(
        "--references", type=int, default=6, help="greedy prompts run alone, then again under load"
    )
    ap.add_argument(
        "--tie-tolerance", type=float, default=0.0, help="see the checks above; 0: exact equality"
    )
    ap.add_argument("--max-queue-len", type=int, default=None, help="the server's; bursts push past it")
    ap.add_argument("--burst-n", type=int, default=2, help="n of each burst request")
    ap.add_argument("--burst-extra", type=int, default=8, help="requests beyond twice the queue in a burst")
    ap.add_argument("--burst-every", type=float, default=20.0, help="seconds between bursts")
    ap.add_argument("--idle-timeout", type=float, default=None, help="the server's")
    ap.add_argument("--max-body-bytes", type=int, default=4 * MIB, help="the server's")
    ap.add_argument("--stall", type=float, default=4.0, help="longest stall of a stalled reader (s)")
    ap.add_argument("--max-rss-growth-mib", type=float, default=256.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the JSON report here")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print the summary, write the report; 1 when a check failed."""
    args = build_parser().parse_args(argv)
    try:
        LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    report = asyncio.run(Soak(args).run())
    print("\n".join(summary_lines(report)), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
