"""Every limit one request is held to, in one place (docs/limits.md explains each). The engine checks them
(SamplingParams, engine/step/inputs.py) and the HTTP schema shows them (server/protocol.py, `/openapi.json`).

They keep one request's work and memory bounded whatever its options, so that it cannot hurt the others: no
option multiplies another's cost past these bounds.
"""

from __future__ import annotations

MAX_LOGPROBS = 20  # top alternatives per token (logprobs, prompt_logprobs, top_logprobs), as vLLM
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # each: the stop-string search and hold-back scan this much per token
MAX_STOP_TOKEN_IDS = 256
# Logprob entries one request (one HTTP request's prompts together) may make the engine keep: sequences x output
# tokens x (1 + logprobs), plus prompt tokens x (1 + prompt_logprobs). An entry costs about 500 bytes of Python
# objects and JSON at its peak: a request at the limit peaked 527 MiB over idle (benchmarks/worst_request.py).
MAX_LOGPROB_ENTRIES = 1024 * 1024
LENGTH_PENALTY = (-10.0, 10.0)  # beam scores divide by length ** length_penalty: finite for any length
REPETITION_PENALTY = (0.01, 2.0)  # logits divided (or multiplied) by it stay finite in float32
PENALTY = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's range)
TEMPERATURE = (0.0, 2.0)  # OpenAI's range
MAX_PROMPTS = 1024  # prompts in one /v1/completions request
# Structured outputs (engine/sampling/structured.py): a JSON schema (as JSON text), regex, grammar or choices together.
MAX_GRAMMAR_CHARS = 64 * 1024
# Nesting of a JSON schema's objects and arrays (a property's schema is two levels below its object's: the
# `properties` map, then the schema). Checked without recursion, before any compiler sees the schema; real
# schemas stay far below it, and llguidance's JSON reader stops at 128.
MAX_SCHEMA_DEPTH = 64
MAX_CHOICES = 1024
# A grammar that takes longer to compile (and to compute its first token mask) is refused with a 400.
# llguidance's own limits (LLParserLimits' defaults) bound each later step's mask; past them the request fails.
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
MAX_TOOLS = 128  # functions in one chat request's `tools`
# JSON nested deeper than this is refused with a 400 naming the parameter: the request body (counted from its
# top) and each JSON string the server parses (tool-call arguments, a schema given as text). Real schemas and
# arguments nest tens of levels at most (OpenAI's strict schemas: 10 object levels, about 20 JSON levels). It
# keeps every walk of a value (json.dumps, a chat template's tojson and macros) far from Python's stack limit,
# and a schema, even wrapped by a "required" tool_choice (5 levels more), under the 127 levels llguidance's
# JSON parser (serde_json's default limit) takes.
MAX_JSON_DEPTH = 64
