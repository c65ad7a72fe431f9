"""SamplingParams, as vLLM has them, with their checks."""

from __future__ import annotations

import enum
import functools
import json
import math
import reprlib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from tinypaged import limits
from tinypaged.errors import RequestError
from tinypaged.limits import MAX_LOGPROBS

_SAMPLING_EPS = 1e-5
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrained decoding, by vLLM's names: the output follows exactly one of `json` (a JSON schema, as a dict
    or its JSON text), `regex`, `choice` (the output is one of these strings), `grammar` (Lark, or GBNF as
    llama.cpp writes it) or `json_object` (any JSON object). JSON is written with one space after `:` and `,`
    and no other whitespace, unless `disable_any_whitespace` (none at all) or `whitespace_pattern` (whitespace
    matching this regex wherever JSON allows it). Invalid values raise RequestError naming the field."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Raise RequestError naming the first bad field: each of its type, exactly one constraint, within
        tinypaged.limits."""
        check_types(self, "structured_outputs.")
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise RequestError(
                f"structured_outputs takes exactly one of {', '.join(_CONSTRAINTS)}; got "
                f"{', '.join(given) if given else 'none'}",
                "structured_outputs",
            )
        kind = given[0]
        param = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(self.json, str):
                if len(self.json) > limits.MAX_GRAMMAR_CHARS:  # before it is parsed
                    raise RequestError(
                        f"json is {len(self.json)} characters long; the limit is {limits.MAX_GRAMMAR_CHARS}",
                        param,
                    )
                try:
                    self.json = json.loads(self.json)
                except RecursionError as e:
                    raise RequestError(schema_depth_error(), param) from e
                except ValueError as e:
                    raise RequestError(f"a JSON schema must be valid JSON: {e}", param) from e
            if not isinstance(self.json, dict):
                raise RequestError("a JSON schema is an object", param)
            check_schema(self.json, param)
            try:
                text = json.dumps(self.json, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise RequestError(f"a JSON schema must be JSON data: {e}", param) from e
        elif kind == "choice":
            choice = self.choice
            if not choice:
                raise RequestError("choice must be a non-empty list of strings", param)
            if len(choice) > limits.MAX_CHOICES:
                raise RequestError(f"at most {limits.MAX_CHOICES} choices, got {len(choice)}", param)
            text = "".join(choice)
        elif kind == "json_object":  # a bool, given: True
            text = ""
        else:
            text = getattr(self, kind)
            if kind == "grammar" and not text.strip():
                raise RequestError(f"{kind} must be a non-empty string", param)
        if len(text) > limits.MAX_GRAMMAR_CHARS:
            raise RequestError(
                f"{kind} is {len(text)} characters long; the limit is {limits.MAX_GRAMMAR_CHARS}", param
            )
        ws = self.whitespace_pattern
        if ws is not None and len(ws) > limits.MAX_STOP_STRING_CHARS:
            raise RequestError(
                f"whitespace_pattern must be a regex of at most {limits.MAX_STOP_STRING_CHARS} characters",
                "structured_outputs.whitespace_pattern",
            )
        if ws is not None and self.disable_any_whitespace:
            raise RequestError(
                "give at most one of whitespace_pattern and disable_any_whitespace",
                "structured_outputs.whitespace_pattern",
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: json, regex, choice, grammar or json_object."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


def check_schema(schema: dict[str, Any], param: str) -> None:
    """RequestError naming `param` if a JSON schema nests deeper than limits.MAX_SCHEMA_DEPTH or holds a number
    JSON cannot write (Infinity, NaN). A walk with its own stack: no depth makes it recurse."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > limits.MAX_SCHEMA_DEPTH:
                raise RequestError(schema_depth_error(), param)
            items = value.values() if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in items if isinstance(v, dict | list | float))
        elif isinstance(value, float) and not math.isfinite(value):
            raise RequestError(f"a JSON schema's numbers must be finite, got {value}", param)


def schema_depth_error() -> str:
    """Why a schema nested too deeply is refused."""
    return f"a JSON schema may nest objects and arrays at most {limits.MAX_SCHEMA_DEPTH} levels deep"


class RequestOutputKind(enum.Enum):
    """Which outputs `LLMEngine.step()` returns for a request (vLLM's names): CUMULATIVE, a snapshot of
    everything so far after each of its steps; FINAL_ONLY, only the finished one (`LLM.generate` asks for that:
    the engine then builds no snapshots and detokenizes once at the end, unless stop strings need the text
    every step)."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request's continuation(s); invalid values raise RequestError naming the parameter.

    Parallel sampling: `best_of` sequences are sampled (default `n`) and the `n` with the highest cumulative
    logprob are returned. Beam search (`use_beam_search=True`, vLLM v0's semantics, as HF's `num_beams`):
    the beam width is `best_of` (default `n`, at least 2), temperature must be 0, and the `n` best finished
    hypotheses are returned, ranked by cumulative logprob / (generated length ** length_penalty).
    `early_stopping`: True stops once `best_of` hypotheses are finished; False stops when no running beam can
    beat the worst kept hypothesis at its current length; "never" only when none could at max length.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives per generated token (the sampled one always included)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # The output follows a JSON schema, regex, choice list or grammar (constrained decoding:
    # engine/sampling/structured.py).
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # What the constructor takes besides the fields' own types (a str or None for stop, None for
        # stop_token_ids, a dict for structured_outputs); anything else is left for verify() to name.
        so = self.structured_outputs
        if isinstance(so, dict):
            unknown = [key for key in so if key not in _type_hints(StructuredOutputsParams)]
            if unknown:
                raise RequestError(f"structured_outputs has no field {unknown[0]!r}", "structured_outputs")
            self.structured_outputs = StructuredOutputsParams(**so)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if _fits(self.top_k, int) and self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self) -> None:
        """Raise RequestError naming the first bad value (call again after changing fields). The ranges are
        tinypaged.limits' (docs/limits.md). Types first, as HTTP's schema has them: no check below meets one it
        cannot compare."""
        check_types(self)
        best_of = self.best_of if self.best_of is not None else self.n
        checks = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("best_of", best_of >= 1, f"best_of must be at least 1, got {self.best_of}"),
            (
                "best_of",
                best_of >= self.n,
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={best_of}",
            ),
            _range("temperature", self.temperature, limits.TEMPERATURE),
            (
                "top_p",
                0.0 < self.top_p <= 1.0,
                f"top_p must be in (0, 1], got {self.top_p}",
            ),
            (
                "top_k",
                self.top_k >= 0,
                f"top_k must be -1 (disable) or at least 1, got {self.top_k}",
            ),
            _range("min_p", self.min_p, (0.0, 1.0)),
            _range("repetition_penalty", self.repetition_penalty, limits.REPETITION_PENALTY),
            _range("presence_penalty", self.presence_penalty, limits.PENALTY),
            _range("frequency_penalty", self.frequency_penalty, limits.PENALTY),
            (
                "max_tokens",
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (
                "min_tokens",
                self.min_tokens >= 0,
                f"min_tokens must be non-negative, got {self.min_tokens}",
            ),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                "stop",
                all(self.stop),
                "stop strings must be non-empty strings",
            ),
            (
                "stop",
                len(self.stop) <= limits.MAX_STOP_STRINGS
                and all(len(s) <= limits.MAX_STOP_STRING_CHARS for s in self.stop),
                f"at most {limits.MAX_STOP_STRINGS} stop strings of at most {limits.MAX_STOP_STRING_CHARS} "
                "characters each",
            ),
            (
                "stop_token_ids",
                all(t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be ids >= 0",
            ),
            (
                "stop_token_ids",
                len(self.stop_token_ids) <= limits.MAX_STOP_TOKEN_IDS,
                f"at most {limits.MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
            ),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
        ]
        if self.use_beam_search:
            checks += [
                (
                    "best_of",
                    best_of > 1,
                    f"beam search needs a beam width (best_of, default n) above 1, got {best_of}",
                ),
                (
                    "temperature",
                    self.greedy,
                    f"temperature must be 0 when using beam search, got {self.temperature}",
                ),
                (
                    "top_p",
                    self.top_p == 1.0 and self.top_k == 0 and self.min_p == 0.0,
                    "top_p, top_k and min_p must be left at their defaults when using beam search",
                ),
                _range("length_penalty", self.length_penalty, limits.LENGTH_PENALTY),
                (
                    "stop",
                    not self.stop,
                    "stop strings are not supported with beam search; use stop_token_ids",
                ),
            ]
        else:
            checks += [
                (
                    "early_stopping",
                    self.early_stopping is False,
                    "early_stopping only applies to beam search (use_beam_search=True)",
                ),
                (
                    "length_penalty",
                    1.0 - _SAMPLING_EPS < self.length_penalty < 1.0 + _SAMPLING_EPS,  # no float(a huge int)
                    "length_penalty only applies to beam search (use_beam_search=True)",
                ),
            ]
        for param, ok, message in checks:
            if not ok:
                raise RequestError(message, param)
        if self.structured_outputs is not None:
            self.structured_outputs.verify()

    @property
    def greedy(self) -> bool:
        """Temperature 0 means argmax."""
        return self.temperature < _SAMPLING_EPS

    @property
    def num_seqs(self) -> int:
        """Sequences generated for the request: best_of (default n); the beam width under beam search."""
        return self.best_of if self.best_of is not None else self.n


def _range(name: str, value: float, bounds: tuple[float, float]) -> tuple[str, bool, str]:
    """The check that a number is in [lo, hi] (not NaN)."""
    return (
        name,
        bounds[0] <= value <= bounds[1],
        f"{name} must be in [{bounds[0]}, {bounds[1]}], got {reprlib.repr(value)}",
    )


def check_types(obj: object, prefix: str = "") -> None:
    """RequestError naming (`prefix` + name) the first field of dataclass `obj` whose value is not of the type
    its annotation says, by the HTTP schema's (msgspec's) rules: a bool is not a number, an int is a float,
    a list's items and a dict's keys and values have their types too."""
    for name, hint in _type_hints(type(obj)).items():
        value = getattr(obj, name)
        if not _fits(value, hint):
            raise RequestError(f"{name} must be {_spell(hint)}, got {reprlib.repr(value)}", prefix + name)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fits(value: object, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is Literal:
        return any(type(value) is type(arg) and value == arg for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items()
        )
    if hint is Any:
        return True
    if hint in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, int | float) if hint is float else isinstance(value, hint)


def _spell(hint: Any) -> str:
    """A type as Python writes it: `int | None`, `list[str]`, `bool | 'never'`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType, Literal):
        return " | ".join(repr(arg) if origin is Literal else _spell(arg) for arg in args)
    if args:
        return f"{origin.__name__}[{', '.join(map(_spell, args))}]"
    return "None" if hint is type(None) else getattr(hint, "__name__", str(hint))
