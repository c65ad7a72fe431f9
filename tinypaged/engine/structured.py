"""Structured outputs: grammars compiled once per distinct spec, off the engine's step; a matcher per sequence;
the token masks of a step's constrained rows filled in parallel, while the device runs the forward pass.

Built on llguidance (docs/structured-outputs.md says why): its tokenizer view is made from the model's own
tokenizer.json (no transformers), a grammar is checked and built in well under a millisecond for typical JSON
schemas (its lexer is lazy, so a request with a schema never seen before does not wait), a matcher deep-copies
for forked sequences (n > 1, beam search), and a batch's masks are computed by its own thread pool with the GIL
released. Plain Python here: the masks are written into a host tensor the engine hands in, and applied on the
device by `ops.apply_token_bitmask`. No torch is imported here: the server checks specs through this module.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from tinypaged import limits
from tinypaged.errors import RequestError
from tinypaged.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

GRAMMAR_CACHE_SIZE = 512  # distinct compiled grammars kept (each a few kB to a few MB of lexer state)
PARALLEL_FILL_ROWS = (
    32  # a step with this many constrained rows or more fills its masks in llguidance's threads
)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: bit j of word i allows token 32 i + j."""
    return (vocab_size + 31) // 32


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (not yet checked against the tokenizer); deterministic, so it is also
    the cache key: the same schema, regex or grammar compiles once."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else {"type": "object"}
        if spec.whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": spec.whitespace_pattern}
        elif spec.disable_any_whitespace:
            options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        else:
            # Free whitespace lets a model pad with newlines until max_tokens: one space, as json.dumps writes.
            options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        # Not sorted: properties are generated in the schema's order, as the client wrote them.
        text = json.dumps(schema)
        return LLMatcher.grammar_from_json_schema(text, overrides=options)  # type: ignore[arg-type]
    if kind == "regex":
        assert spec.regex is not None
        return LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        assert spec.choice is not None
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    assert spec.grammar is not None
    try:
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark as it is; GBNF converted to Lark
    except ValueError as e:
        raise RequestError(f"invalid grammar: {e}", "structured_outputs.grammar") from e


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar: each sequence constrained by it gets its own matcher, a copy of this one's start."""

    source: str
    compile_s: float  # host time to build and check it, its first mask included
    _start: LLMatcher

    def matcher(self) -> LLMatcher:
        """A matcher at the grammar's start, for one sequence."""
        return self._start.deep_copy()


class GrammarCompiler:
    """Compiles structured-output specs into Grammars in a small thread pool, one compile per distinct spec
    (an LRU cache of futures, failures included: a bad schema sent again is refused at once), and fills token
    masks for a batch of matchers.

    The tokenizer view (the vocabulary as bytes, about a second for a 128k vocabulary) is built on the first
    compile, in the pool, so an engine that never sees a grammar never pays for it.
    """

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: list[int]) -> None:
        self.tokenizer_file = tokenizer_file
        self.vocab_size = (
            vocab_size  # the logits' width: ids past the tokenizer's vocabulary are never allowed
        )
        self.eos_ids = eos_ids
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[Grammar]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._executor: LLExecutor | None = None

    def submit(self, spec: StructuredOutputsParams) -> Future[Grammar]:
        """The Grammar of `spec`, compiled in the pool (at once if it was compiled before); the future raises
        RequestError naming the parameter if the spec is invalid, unsupported or too slow to compile."""
        try:
            source = grammar_source(spec)
        except RequestError as e:
            failed: Future[Grammar] = Future()
            failed.set_exception(e)
            return failed
        param = f"structured_outputs.{spec.kind}"
        with self._lock:
            future = self._cache.get(source)
            if future is not None:
                self._cache.move_to_end(source)
                return future
            if self._pool is None:
                workers = max(1, min(4, os.cpu_count() or 1))
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tinypaged-grammar")
            future = self._pool.submit(self._compile, source, param)
            self._cache[source] = future
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """`submit(spec)` waited for (at most the compile time limit)."""
        return wait(self.submit(spec), f"structured_outputs.{spec.kind}")

    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the model's tokenizer (built once)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(
                    self.tokenizer_file.read_text(), n_vocab=self.vocab_size, eos_token=self.eos_ids
                )
            return self._tokenizer

    def _compile(self, source: str, param: str) -> Grammar:
        tokenizer = self.tokenizer()
        t0 = time.perf_counter()
        start = LLMatcher(tokenizer, source, log_level=0)  # releases the GIL while it builds
        if start.is_error():
            raise RequestError(f"invalid or unsupported {param.split('.')[-1]}: {_first_line(start)}", param)
        # The first mask builds the lexer's first states: its cost belongs to the compile, and an error that
        # only shows there (a grammar past llguidance's limits) is the request's 400, not a failure later.
        scratch = np.empty(bitmask_width(self.vocab_size), dtype=np.int32)
        start.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if start.is_error():
            raise RequestError(f"invalid or unsupported {param.split('.')[-1]}: {_first_line(start)}", param)
        elapsed = time.perf_counter() - t0
        if elapsed > limits.GRAMMAR_COMPILE_TIMEOUT_S:
            raise RequestError(
                f"the {param.split('.')[-1]} took {elapsed:.1f} s to compile, more than the limit of "
                f"{limits.GRAMMAR_COMPILE_TIMEOUT_S} s",
                param,
            )
        return Grammar(source, elapsed, start)

    def fill_bitmask(self, matchers: list[LLMatcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` (int32 `[N, bitmask_width]`, contiguous, on the host) := the tokens matcher i
        allows next: in llguidance's thread pool (the GIL released) for a large batch; in this thread for a
        small one, where a row's few microseconds cost less than waking the pool's threads."""
        assert bitmask.element_size() == 4 and bitmask.is_contiguous() and not bitmask.is_cuda
        row_bytes = bitmask.shape[1] * 4
        ptr = bitmask.data_ptr()
        if len(matchers) < PARALLEL_FILL_ROWS:
            for i, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(ptr + i * row_bytes, row_bytes)
            return
        if self._executor is None:
            self._executor = LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], ptr, row_bytes, len(matchers)
        )

    def shutdown(self) -> None:
        """Stop the compile threads (compiles in flight finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def wait(future: Future[Grammar], param: str, timeout: float = limits.GRAMMAR_COMPILE_TIMEOUT_S) -> Grammar:
    """A compile's result, waited for at most `timeout` (RequestError naming `param` past it)."""
    try:
        return future.result(timeout=timeout)
    except TimeoutError as e:
        raise RequestError(
            f"the {param.split('.')[-1]} did not compile within {limits.GRAMMAR_COMPILE_TIMEOUT_S} s", param
        ) from e


def _first_line(matcher: LLMatcher) -> str:
    """llguidance's error without its dump of the parser state and the grammar (they can be long)."""
    error = matcher.get_error()
    return error.split("\n<state>")[0].strip()
