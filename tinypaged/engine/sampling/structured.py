"""Structured outputs: grammars checked once per distinct spec, off the engine's step; a matcher per request
(its sequences' matchers are copies of it);
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
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import llguidance
import numpy as np
from llguidance import LLExecutor, LLMatcher, LLParserLimits, LLTokenizer

from tinypaged import limits
from tinypaged.errors import RequestError
from tinypaged.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

GRAMMAR_CACHE_SIZE = 512  # distinct compiled grammars kept (each a few kB to a few MB of lexer state)
PARALLEL_FILL_ROWS = (
    32  # a step with this many constrained rows or more fills its masks in llguidance's threads
)


# llguidance's limits, set here rather than left to its defaults so that what a grammar may cost is written down
# (docs/limits.md). Per step: lexer fuel and Earley items bound one mask's work. Per request: the lexer's states
# (its lazily built DFA, 1-2 kB each) are shared by every matcher copied from one start (deep_copy shares the
# lexer), so each request builds its own start (`GrammarCompiler.start`) and its sequences' matchers are copies
# of it: a request that runs its lexer out fails alone, and no other request, nor the cache, sees its lexer.
# `verbose_errors=False`: an error is one line, without the parser's state or the grammar (a client's schema).
PARSER_LIMITS = LLParserLimits(
    max_items_in_row=2_000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=500_000,
    precompute_large_lexemes=True,
    verbose_errors=False,
)
# Failures of a grammar's preparation that say the spec is at fault (llguidance refuses it; it nests or grows past
# what its compilers can hold): the request's 400. Anything else is a failure of that request alone (a 500).
_SPEC_FAULTS = (ValueError, RecursionError, MemoryError, OverflowError, UnicodeError)


class GrammarFailure(RuntimeError):
    """Preparing a grammar failed for a reason other than the spec (logged where it happened): its requests
    fail alone."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask: bit j of word i allows token 32 i + j."""
    return (vocab_size + 31) // 32


def grammar_key(spec: StructuredOutputsParams) -> str:
    """The cache key of a spec: its constraint and options as JSON text, cheap enough for any thread (the spec
    was checked: its JSON schema is shallow). The same schema, regex, choices or grammar compiles once."""
    value = True if spec.kind == "json_object" else getattr(spec, spec.kind)
    return json.dumps([spec.kind, value, spec.disable_any_whitespace, spec.whitespace_pattern])


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (not yet checked against the tokenizer). It can take long and raise
    anything on a hostile spec: only the compile pool runs it."""
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


@dataclass(frozen=True)
class Grammar:
    """A checked grammar, shared by every request with its spec: immutable (its text), so that nothing one
    request does can reach another; each request builds its own matcher from it (`GrammarCompiler.start`)."""

    key: str  # grammar_key of its spec
    source: str
    compile_s: float  # host time to build and check it, its first mask included


class GrammarCompiler:
    """Compiles structured-output specs into Grammars in a small thread pool, one compile per distinct spec
    (an LRU cache of futures, failures included: a bad schema sent again is refused at once), builds each
    request's matcher from its Grammar in the same pool, and fills token masks for a batch of matchers.

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
        """The Grammar of `spec`, compiled in the pool (at once if it was compiled before). Never raises and does
        no grammar work in the calling thread (the engine's loop): the future raises RequestError naming the
        parameter if the spec is invalid, unsupported or too slow to compile, or GrammarFailure."""
        param = f"structured_outputs.{getattr(spec, 'kind', '')}"
        try:
            key = grammar_key(spec)
        except BaseException as e:  # noqa: BLE001 - an unchecked spec: its failure is the request's
            return _failed(RequestError(f"invalid {param.split('.')[-1]}: {type(e).__name__}", param))
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._pool is None:
                workers = max(1, min(4, os.cpu_count() or 1))
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tinypaged-grammar")
            try:
                future = self._pool.submit(self._compile, spec, key, param)
            except RuntimeError as e:  # the pool was shut down
                return _failed(GrammarFailure(f"the grammar cannot be compiled: {e}"))
            self._cache[key] = future
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_unless_cacheable(key, f))
        return future

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """`submit(spec)` waited for (at most the compile time limit)."""
        return wait(self.submit(spec), f"structured_outputs.{spec.kind}")

    def start(self, spec: StructuredOutputsParams) -> Future[LLMatcher]:
        """A request's own matcher at the start of `spec`'s grammar, built in the pool once the grammar is
        checked (`submit`). Never raises: the future fails as `submit`'s does. Its lexer is this request's
        alone: a limit it runs out of fails this request, never another with the same spec."""
        param = f"structured_outputs.{getattr(spec, 'kind', '')}"
        matcher: Future[LLMatcher] = Future()

        def build(checked: Future[Grammar]) -> None:
            try:
                grammar = wait(checked, param, timeout=0)
                assert self._pool is not None  # submit made it
                self._pool.submit(self._build_start, grammar, param, matcher)
            except BaseException as e:  # noqa: BLE001 - the spec refused, or the pool shut down: this request's
                matcher.set_exception(e if isinstance(e, RequestError | GrammarFailure) else _internal(e))

        self.submit(spec).add_done_callback(build)
        return matcher

    def _forget_unless_cacheable(self, key: str, future: Future[Grammar]) -> None:
        """Keep a compile in the cache if it succeeded or the spec was refused for good; a failure that may not
        happen again (an internal error, memory, a cancelled compile) is retried by the next request."""
        if not future.cancelled():
            error = future.exception()
            if error is None or (
                isinstance(error, RequestError) and not isinstance(error.__cause__, MemoryError)
            ):
                return
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]

    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the model's tokenizer (built once)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(
                    self.tokenizer_file.read_text(), n_vocab=self.vocab_size, eos_token=self.eos_ids
                )
            return self._tokenizer

    def _compile(self, spec: StructuredOutputsParams, key: str, param: str) -> Grammar:
        """Build and check a grammar (in the pool). Raises RequestError naming `param` when the spec is at
        fault, GrammarFailure otherwise: nothing else leaves it."""
        what = param.split(".")[-1]
        with _faults(what, param):
            t0 = time.perf_counter()
            source = grammar_source(spec)
            start = self._matcher(source, what, param)
            # The first mask builds the lexer's first states: its cost belongs to the compile, and an error that
            # only shows there (a grammar past llguidance's limits) is the request's 400, not a failure later.
            scratch = np.empty(bitmask_width(self.vocab_size), dtype=np.int32)
            start.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
            if start.is_error():
                raise RequestError(f"invalid or unsupported {what}: {first_line(start)}", param)
            elapsed = time.perf_counter() - t0
            if elapsed > limits.GRAMMAR_COMPILE_TIMEOUT_S:
                raise RequestError(
                    f"the {what} took {elapsed:.1f} s to compile, more than the limit of "
                    f"{limits.GRAMMAR_COMPILE_TIMEOUT_S} s",
                    param,
                )
            return Grammar(key, source, elapsed)

    def _build_start(self, grammar: Grammar, param: str, out: Future[LLMatcher]) -> None:
        """Build one request's matcher (in the pool) into `out`."""
        what = param.split(".")[-1]
        try:
            with _faults(what, param):
                matcher = self._matcher(grammar.source, what, param)
        except BaseException as e:  # noqa: BLE001 - _faults made it RequestError or GrammarFailure
            out.set_exception(e)
        else:
            out.set_result(matcher)

    def _matcher(self, source: str, what: str, param: str) -> LLMatcher:
        """A new matcher (and lexer) at the start of a grammar's source."""
        matcher = LLMatcher(self.tokenizer(), source, log_level=0, limits=PARSER_LIMITS)  # GIL released
        if matcher.is_error():
            raise RequestError(f"invalid or unsupported {what}: {first_line(matcher)}", param)
        return matcher

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


def wait(future: Future[T], param: str, timeout: float = limits.GRAMMAR_COMPILE_TIMEOUT_S) -> T:
    """A compile's result, waited for at most `timeout`: RequestError naming `param` if the spec is at fault or
    past the time limit, GrammarFailure if the compile failed otherwise (or was cancelled by a shutdown)."""
    try:
        return future.result(timeout=timeout)
    except TimeoutError as e:
        raise RequestError(
            f"the {param.split('.')[-1]} did not compile within {limits.GRAMMAR_COMPILE_TIMEOUT_S} s", param
        ) from e
    except CancelledError as e:
        raise GrammarFailure("the grammar's compile was cancelled (the engine is shutting down)") from e
    except (RequestError, GrammarFailure):
        raise
    except BaseException as e:  # noqa: BLE001 - a future set by other code: the request's failure all the same
        raise _internal(e) from e


def _internal(e: BaseException) -> GrammarFailure:
    return GrammarFailure(f"compiling the grammar failed: {type(e).__name__}")


@contextmanager
def _faults(what: str, param: str) -> Iterator[None]:
    """Preparing a grammar: RequestError naming `param` when the spec is at fault, GrammarFailure (logged)
    otherwise; nothing else leaves it."""
    try:
        yield
    except RequestError:
        raise
    except _SPEC_FAULTS as e:
        reason = "it nests too deeply" if isinstance(e, RecursionError) else _short(e)
        raise RequestError(f"invalid or unsupported {what}: {reason}", param) from e
    except BaseException as e:  # noqa: BLE001 - a panic in llguidance is a BaseException: still this request's
        logger.exception("compiling a %s failed", what)
        raise GrammarFailure(f"compiling the {what} failed (an internal error, logged)") from e


def _failed(error: BaseException) -> Future[Grammar]:
    """A future that has already failed with `error`."""
    future: Future[Grammar] = Future()
    future.set_exception(error)
    return future


def first_line(matcher: LLMatcher) -> str:
    """llguidance's error without any dump of the parser state or the grammar (they can be long)."""
    return _short(matcher.get_error())


def _short(error: object) -> str:
    """An error's text without llguidance's dump of its state (`<state>...`, or `<non-verbose/>` in its place),
    at most 500 characters (a client's schema can be in it)."""
    text = str(error).split("\n<")[0].strip()
    return text[:500] if text else type(error).__name__
