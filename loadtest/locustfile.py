"""Locust users for an OpenAI-compatible server: streamed `/v1/completions` and multi-turn `/v1/chat/completions`.

    locust -f loadtest/locustfile.py --headless -u 16 -r 16 -t 60s --host http://127.0.0.1:8000 \\
        --prompt-len 64-512 --output-len 32-256 --csv /tmp/run

Each request is one locust request (`POST` under its path: the end-to-end time, and output tokens as its
"size"), and its streamed tokens add three more entries under the same path, so that locust's console, CSV
and web UI show them beside it:
- `TTFT`: time to the first output token (ms);
- `ITL`: each gap between chunks with output after the first (ms), the inter-token latency;
- `TOKENS`: output tokens of each request (the "response time" columns of this entry are token counts).
At the end the summary line gives output tokens per second.

Users: `CompletionsUser` (random prompts: common words, or random token ids below `--vocab`) and `ChatUser` (a
synthetic conversation of `--chat-turns` turns: each request sends the whole history, the server's answers
included, then a new conversation starts). Name one class on the command line to run only it. Options (each
also an environment variable): `--model` (default: the server's first), `--api-key`, `--prompt-len` and
`--output-len` (length specs: `N`, `MIN-MAX`, `normal:MEAN:STD`, `exponential:MEAN`; prompts in words or
token ids, outputs in tokens, EOS ignored unless `--stop-at-eos`), `--temperature`, `--chat-turns`, `--seed`,
and `--request-rate R`: the users together start R requests per second, Poisson (each user paces its own
starts; a user whose request outlasts its gap starts the next at once, so R is reached only with enough users:
locust reports the rate achieved). Without it each user sends its next request as soon as the last ends.
"""

from __future__ import annotations

import itertools
import random
import time

import requests
from locust import User, events, task
from locust.env import Environment
from workload import (
    CHAT,
    COMPLETIONS,
    LengthDist,
    Stream,
    make_conversations,
    random_text,
    random_token_ids,
    request_body,
)

_user_ids = itertools.count()


# (option, type, default, help): each also the environment variable TINYPAGED_<OPTION>, e.g. TINYPAGED_PROMPT_LEN.
OPTIONS = (
    ("model", str, "", "default: the server's first model"),
    ("api-key", str, "", "sent as `Authorization: Bearer KEY`"),
    ("prompt-len", str, "32-256", "length spec: words, or token ids with --vocab"),
    ("output-len", str, "16-128", "length spec: tokens (max_tokens)"),
    ("vocab", int, 0, "completions: random token ids below this (0: random words)"),
    ("temperature", float, 0.0, "sampling temperature"),
    (
        "stop-at-eos",
        bool,
        False,
        "let requests stop at EOS (by default EOS is ignored: exact output lengths)",
    ),
    ("chat-turns", str, "1-4", "turns per chat conversation (length spec)"),
    (
        "request-rate",
        float,
        0.0,
        "requests/s started by all users together (Poisson); 0: each user back to back",
    ),
    ("seed", int, 1, "the workload's seed"),
)


@events.init_command_line_parser.add_listener
def _options(parser) -> None:  # noqa: ANN001 - locust's configargparse parser
    """The workload's options; locust's web UI shows them too (the API key masked)."""
    for name, kind, default, help_text in OPTIONS:
        env = "TINYPAGED_" + name.upper().replace("-", "_")
        if kind is bool:
            parser.add_argument(
                f"--{name}", env_var=env, action="store_true", default=default, help=help_text
            )
        else:
            secret = {"is_secret": True} if name == "api-key" else {}
            parser.add_argument(
                f"--{name}", env_var=env, type=kind, default=default, help=help_text, **secret
            )


@events.test_start.add_listener
def _check_options(environment: Environment, **_: object) -> None:
    opts = environment.parsed_options
    for name in ("prompt_len", "output_len", "chat_turns"):
        LengthDist.parse(getattr(opts, name))  # a bad spec stops the run here, with the grammar
    environment.tinypaged_start = time.time()  # type: ignore[attr-defined]


@events.test_stop.add_listener
def _summary(environment: Environment, **_: object) -> None:
    """Output tokens per second and each endpoint's TTFT / ITL medians, printed once at the end."""
    start = getattr(environment, "tinypaged_start", None)
    if start is None:
        return
    elapsed = max(time.time() - start, 1e-9)
    stats = environment.stats
    for path in (COMPLETIONS, CHAT):
        req = stats.entries.get((path, "POST"))
        if req is None or req.num_requests == 0:
            continue
        tokens = stats.entries.get((path, "TOKENS"))
        ttft, itl = stats.entries.get((path, "TTFT")), stats.entries.get((path, "ITL"))
        total = tokens.total_response_time if tokens else 0
        line = (
            f"tinypaged {path}: {req.num_requests} requests, {req.num_failures} failed, {total:.0f} output "
            f"tokens in {elapsed:.1f} s = {total / elapsed:.1f} tok/s"
        )
        if ttft and ttft.num_requests:
            line += f"; TTFT p50 {ttft.get_response_time_percentile(0.5):.0f} ms"
            line += f" p99 {ttft.get_response_time_percentile(0.99):.0f} ms"
        if itl and itl.num_requests:
            line += f"; ITL p50 {itl.get_response_time_percentile(0.5):.0f} ms"
            line += f" p99 {itl.get_response_time_percentile(0.99):.0f} ms"
        print(line, flush=True)


class StreamError(Exception):
    """A response that was not a complete, well-formed stream."""


class LLMUser(User):
    """One client: streamed requests to `path`, reported as locust requests and token metrics."""

    abstract = True
    path = COMPLETIONS

    def on_start(self) -> None:
        """Read the options, open a session, find the model when none is given."""
        opts = self.environment.parsed_options
        self.index = next(_user_ids)
        self.rng = random.Random(opts.seed * 1_000_003 + self.index)
        self.prompt_len = LengthDist.parse(opts.prompt_len)
        self.output_len = LengthDist.parse(opts.output_len)
        self.rate = opts.request_rate
        self.next_start = time.monotonic()
        self.session = requests.Session()
        if opts.api_key:
            self.session.headers["Authorization"] = f"Bearer {opts.api_key}"
        self.model = opts.model or self._served_model()
        self.sampling = {"temperature": opts.temperature, "ignore_eos": not opts.stop_at_eos}

    def on_stop(self) -> None:
        """Close the session."""
        self.session.close()

    def wait_time(self) -> float:
        """Back to back; or, with --request-rate, until this user's next Poisson start."""
        if self.rate <= 0:
            return 0.0
        users = max(1, self.environment.runner.target_user_count if self.environment.runner else 1)
        now = time.monotonic()
        self.next_start = max(self.next_start, now) + self.rng.expovariate(self.rate / users)
        return self.next_start - now

    def _served_model(self) -> str:
        r = self.session.get(self.host + "/v1/models", timeout=30)
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def stream(self, body: dict) -> str:
        """Send one streamed request and report it; returns choice 0's text ("" when it failed)."""
        fire = self.environment.events.request.fire
        start = time.perf_counter()
        acc, exc = None, None
        try:
            acc = Stream(start=start)
            with self.session.post(self.host + self.path, json=body, stream=True, timeout=(10, 600)) as r:
                if r.status_code != 200:
                    raise StreamError(f"HTTP {r.status_code}: {r.text[:200]}")
                for line in r.iter_lines(chunk_size=None):
                    acc.feed(line, time.perf_counter())
            problems = acc.check(max_tokens=body["max_tokens"], exact=body["ignore_eos"])
            if problems:
                raise StreamError("; ".join(problems))
        except (requests.RequestException, StreamError) as e:
            exc = e
        e2e_ms = (time.perf_counter() - start) * 1000
        tokens = acc.output_tokens if acc is not None and acc.ttft is not None else 0
        fire(request_type="POST", name=self.path, response_time=e2e_ms, response_length=tokens, exception=exc)
        if exc is not None or acc is None:
            return ""
        for kind, value in [("TTFT", acc.ttft * 1000)] + [("ITL", gap * 1000) for gap in acc.itl]:
            fire(request_type=kind, name=self.path, response_time=value, response_length=0, exception=None)
        fire(request_type="TOKENS", name=self.path, response_time=tokens, response_length=0, exception=None)
        return acc.text.get(0, "")


class CompletionsUser(LLMUser):
    """Streamed completions of random prompts."""

    path = COMPLETIONS

    @task
    def complete(self) -> None:
        """One completion."""
        opts = self.environment.parsed_options
        n = self.prompt_len.sample(self.rng)
        prompt = random_token_ids(self.rng, n, opts.vocab) if opts.vocab else random_text(self.rng, n)
        self.stream(
            request_body(
                self.path, prompt, self.output_len.sample(self.rng), model=self.model, **self.sampling
            )
        )


class ChatUser(LLMUser):
    """Multi-turn chats: each turn sends the whole conversation so far."""

    path = CHAT

    def on_start(self) -> None:
        """A first conversation."""
        super().on_start()
        self.turns = LengthDist.parse(self.environment.parsed_options.chat_turns)
        self.conversation: list[dict[str, str]] = []
        self.pending: list[tuple[str, int]] = []

    @task
    def turn(self) -> None:
        """The conversation's next turn (a new conversation when the last has ended)."""
        if not self.pending:
            seed = self.rng.randrange(2**31)
            conv = make_conversations(1, self.turns, self.prompt_len, self.output_len, seed)[0]
            self.conversation = [{"role": "system", "content": conv.system}] if conv.system else []
            self.pending = list(zip(conv.user_messages, conv.output_lens, strict=True))
        message, max_tokens = self.pending.pop(0)
        self.conversation.append({"role": "user", "content": message})
        body = request_body(self.path, self.conversation, max_tokens, model=self.model, **self.sampling)
        answer = self.stream(body)
        if not answer:  # a failed turn ends the conversation
            self.pending = []
            return
        self.conversation.append({"role": "assistant", "content": answer})
