"""What the load tools share: length distributions, random prompts and synthetic multi-turn chats from a seed,
one request body per endpoint, the accounting of one streamed response (TTFT, inter-token gaps, tokens, the
checks that make it well formed) and a reader of `/metrics`. Plain Python: the locustfile (gevent), the serving
benchmark and the soak (asyncio) each bring their own HTTP client and feed the lines they read into `Stream`.

Scripts run as `python loadtest/NAME.py` (or `locust -f loadtest/locustfile.py`), which puts this folder first
on sys.path: `from workload import ...` needs no path edits.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = {"completions": COMPLETIONS, "chat": CHAT}

# Words for chat text: common English words, about one token each for real tokenizers (a synthetic byte-level
# tokenizer reads them as bytes; the server's usage gives the exact count either way).
WORDS = (
    "the of and to in is was for on that with as by at from his her this which but be are have not had one "
    "all were they their there been has more when will would who so no out up into than them can only other "
    "new some could time these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go came "
    "right used take three"
).split()


@dataclass(frozen=True)
class LengthDist:
    """A distribution of lengths (tokens), from a spec: `N` or `fixed:N`; `MIN-MAX` or `uniform:MIN:MAX`;
    `normal:MEAN:STD`; `exponential:MEAN`. Draws are whole numbers of at least 1."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """The distribution a spec names; ValueError with the grammar otherwise."""
        s = spec.strip().lower()
        try:
            if re.fullmatch(r"\d+", s):
                return cls._checked("fixed", int(s))
            if m := re.fullmatch(r"(\d+)-(\d+)", s):
                return cls._checked("uniform", int(m[1]), int(m[2]))
            kind, _, rest = s.partition(":")
            nums = [float(x) for x in rest.split(":")] if rest else []
            if kind == "fixed" and len(nums) == 1:
                return cls._checked("fixed", nums[0])
            if kind in ("uniform", "normal") and len(nums) == 2:
                return cls._checked(kind, *nums)
            if kind == "exponential" and len(nums) == 1:
                return cls._checked(kind, nums[0])
        except ValueError:
            pass
        raise ValueError(
            f"bad length spec {spec!r}: use N, MIN-MAX, fixed:N, uniform:MIN:MAX, normal:MEAN:STD or exponential:MEAN"
        )

    @classmethod
    def _checked(cls, kind: str, a: float, b: float = 0.0) -> LengthDist:
        if a < (0 if kind == "normal" and b > 0 else 1) or b < 0 or (kind == "uniform" and b < a):
            raise ValueError(kind)
        return cls(kind, a, b)

    def sample(self, rng: random.Random) -> int:
        """One length."""
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        else:
            x = rng.expovariate(1.0 / self.a)
        return max(1, round(x))

    @property
    def mean(self) -> float:
        """The mean length (before rounding and the floor at 1)."""
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def __str__(self) -> str:
        return {
            "fixed": f"{self.a:g}",
            "uniform": f"uniform {self.a:g}-{self.b:g}",
            "normal": f"normal({self.a:g}, {self.b:g})",
            "exponential": f"exponential({self.a:g})",
        }[self.kind]


def random_token_ids(rng: random.Random, n: int, vocab: int, low: int = 100) -> list[int]:
    """`n` random token ids in [low, vocab) (low skips the special tokens tokenizers put first)."""
    return [rng.randrange(low, vocab) for _ in range(n)]


def random_text(rng: random.Random, n_words: int) -> str:
    """`n_words` random common words."""
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Conversation:
    """A synthetic multi-turn chat: the user's messages in order and each turn's output length. The assistant's
    turns are the server's answers, appended as the conversation runs."""

    user_messages: list[str]
    output_lens: list[int]
    system: str | None = None


def make_conversations(
    n: int, turns: LengthDist, user_len: LengthDist, output_len: LengthDist, seed: int
) -> list[Conversation]:
    """`n` conversations from a seed: each a number of turns, user messages of `user_len` words."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = turns.sample(rng)
        out.append(
            Conversation(
                user_messages=[random_text(rng, user_len.sample(rng)) for _ in range(k)],
                output_lens=[output_len.sample(rng) for _ in range(k)],
                system=f"You are assistant {i}. Answer at length." if rng.random() < 0.5 else None,
            )
        )
    return out


def request_body(
    endpoint: str,
    prompt: str | list[int] | list[dict[str, str]],
    max_tokens: int,
    *,
    model: str | None,
    stream: bool = True,
    ignore_eos: bool = True,
    **sampling: Any,
) -> dict[str, Any]:
    """The JSON body of one request: `prompt` is text or token ids for completions, the messages for chat."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": ignore_eos, **sampling}
    if model is not None:
        body["model"] = model
    body["messages" if endpoint == CHAT else "prompt"] = prompt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Stream:
    """The accounting of one streamed response, fed line by line (`feed`) with the reader's clock.

    TTFT is the time to the first chunk with output; each later chunk with output adds one inter-token gap (a
    chunk may carry several tokens when the reader was slow). `problems` lists what makes the stream
    ill-formed: an error event, JSON that does not parse, a chunk after [DONE], a choice without a finish
    reason, usage that disagrees with what arrived.
    """

    start: float
    ttft: float | None = None
    last: float | None = None
    itl: list[float] = field(default_factory=list)
    text: dict[int, str] = field(default_factory=dict)  # per choice index
    finish: dict[int, str] = field(default_factory=dict)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    done: bool = False
    error: str | None = None
    problems: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)  # choice 0's tokens, when logprobs were asked
    top_logprobs: list[dict[str, float]] = field(default_factory=list)

    def feed(self, line: bytes | str, now: float) -> None:
        """One line of the SSE body (blank lines and comments are skipped)."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", "replace")
        line = line.strip()
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if self.done:
            self.problems.append("data after [DONE]")
            return
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            self.problems.append(f"not JSON: {data[:80]}")
            return
        if "error" in chunk:
            self.error = str(chunk["error"].get("message", chunk["error"]))
            self.problems.append(f"error event: {self.error[:200]}")
            return
        if chunk.get("usage"):
            self.prompt_tokens = chunk["usage"]["prompt_tokens"]
            self.completion_tokens = chunk["usage"]["completion_tokens"]
        got_output = False
        for choice in chunk.get("choices", []):
            i = choice["index"]
            piece = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content") or ""
            if piece:
                self.text[i] = self.text.get(i, "") + piece
                got_output = True
            if i == 0 and (lp := choice.get("logprobs")):
                if "content" in lp:  # chat: a list of {token, logprob, top_logprobs: [{token, logprob}]}
                    self.tokens += [t["token"] for t in lp["content"]]
                    self.top_logprobs += [
                        {a["token"]: a["logprob"] for a in t["top_logprobs"]} for t in lp["content"]
                    ]
                else:  # completions: parallel lists
                    self.tokens += lp.get("tokens") or []
                    self.top_logprobs += lp.get("top_logprobs") or []
            if choice.get("finish_reason") is not None:
                if i in self.finish:
                    self.problems.append(f"choice {i} finished twice")
                self.finish[i] = choice["finish_reason"]
        if got_output:
            if self.ttft is None:
                self.ttft = now - self.start
            elif self.last is not None:
                self.itl.append(now - self.last)
            self.last = now

    def check(self, choices: int = 1, max_tokens: int | None = None, exact: bool = False) -> list[str]:
        """What is wrong with the finished stream (empty when it is well formed)."""
        problems = list(self.problems)
        if not self.done:
            problems.append("no [DONE]")
        if sorted(self.finish) != list(range(choices)):
            problems.append(f"finish reasons for choices {sorted(self.finish)}, expected {choices}")
        if self.completion_tokens is None:
            problems.append("no usage chunk")
        elif max_tokens is not None:
            want = max_tokens * choices
            if (exact and self.completion_tokens != want) or self.completion_tokens > want:
                problems.append(f"{self.completion_tokens} completion tokens, max_tokens {max_tokens}")
        if exact and any(r != "length" for r in self.finish.values()):
            problems.append(f"finish reasons {self.finish} with EOS ignored")
        return problems

    @property
    def output_tokens(self) -> int:
        """Tokens generated (the usage chunk's count; else the chunks with output)."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.itl) + 1


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name: value} for samples without labels or with only `model_name`, and
    {name{labels}: value} for the others (histogram buckets, finish reasons)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        labels = re.sub(r'model_name="(?:[^"\\]|\\.)*",?', "", labels.rstrip("}"))
        key = f"{name}{{{labels}}}" if labels else name
        out[key] = float("inf") if value == "+Inf" else float(value)
    return out


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """Mean, median, p90 and p99 of `values` (seconds, reported in ms by default)."""
    if not values:
        return {}
    xs = sorted(v * scale for v in values)

    def q(p: float) -> float:  # linear interpolation between closest ranks, as numpy's default
        k = (len(xs) - 1) * p
        lo = math.floor(k)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)

    return {"mean": sum(xs) / len(xs), "median": q(0.5), "p90": q(0.9), "p99": q(0.99)}
