"""A request's body, read within its limits: content codings inflated here (never by aiohttp, so an unread
body is never inflated) and only up to the body limit; JSON nesting bounded before anything walks it.

Nothing here knows aiohttp: app.py reads the raw bytes and hands them in.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi
import numpy as np

from tinypaged.limits import MAX_JSON_DEPTH
from tinypaged.server.errors import APIError

try:
    import brotli
except ImportError:  # pragma: no cover - an optional codec (aiohttp's too)
    brotli = None

T = TypeVar("T")
_PREFIX = 200  # characters of a client's bytes that an error message or a log line may quote
# Content codings one body may stack, and gzip members one body may have: real clients send one of each; each
# costs a pass of up to the body limit (or a decompressor), so a body of thousands would cost thousands.
_MAX_CODINGS = 2
_MAX_MEMBERS = 64


def prefix(text: str, limit: int = _PREFIX) -> str:
    """At most `limit` characters of `text` (a client's, quoted in an error or a log line)."""
    return text if len(text) <= limit else text[:limit] + "..."


# ---- content codings --------------------------------------------------------------------------------


def too_large(limit: int) -> APIError:
    """413 for a body past `limit` bytes (on the wire or inflated)."""
    return APIError(
        413, f"The request body is larger than the limit of {limit} bytes.", code="request_too_large"
    )


def _bad_coding(coding: str) -> APIError:
    return APIError(
        400,
        f"The body could not be read (Content-Encoding: {prefix(coding, 40)}).",
        code="invalid_body",
        headers={"Connection": "close"},
    )


def _inflate_zlib(data: bytes, coding: str, limit: int) -> bytes:
    """gzip (members one after another, as RFC 1952 allows) or deflate (zlib-wrapped, or raw as some clients
    send it), stopping as soon as the output passes `limit`."""
    if coding == "deflate":
        wbits = zlib.MAX_WBITS if data[:1] and data[0] & 0x0F == 8 else -zlib.MAX_WBITS
    else:
        wbits = 16 + zlib.MAX_WBITS
    out: list[bytes] = []
    size = members = 0
    while data:
        members += 1
        if members > _MAX_MEMBERS:
            raise _bad_coding(coding)
        d = zlib.decompressobj(wbits)
        while data:
            chunk = d.decompress(data, limit + 1 - size)  # max_length bounds the work, not just the result
            size += len(chunk)
            out.append(chunk)
            if size > limit:
                raise too_large(limit)
            if d.eof:
                break
            data = d.unconsumed_tail
        if not d.eof:
            raise _bad_coding(coding)  # truncated
        data = d.unused_data if coding != "deflate" else b""
    return b"".join(out)


def _inflate_brotli(data: bytes, limit: int) -> bytes:
    d = brotli.Decompressor()
    out = [d.process(data, output_buffer_limit=limit + 1)]
    size = len(out[0])
    while size <= limit and not d.is_finished() and not d.can_accept_more_data():
        out.append(d.process(b"", output_buffer_limit=limit + 1 - size))  # output held back by the limit
        size += len(out[-1])
    if size > limit:
        raise too_large(limit)
    if not d.is_finished():
        raise _bad_coding("br")
    return b"".join(out)


CODINGS: dict[str, Callable[[bytes, int], bytes]] = {
    "gzip": lambda data, limit: _inflate_zlib(data, "gzip", limit),
    "x-gzip": lambda data, limit: _inflate_zlib(data, "gzip", limit),
    "deflate": lambda data, limit: _inflate_zlib(data, "deflate", limit),
}
_CODEC_ERRORS: tuple[type[Exception], ...] = (zlib.error,)
if brotli is not None:
    CODINGS["br"] = _inflate_brotli
    _CODEC_ERRORS += (brotli.error,)


def codings(header: str) -> list[str]:
    """The content codings of a `Content-Encoding` header, in the order they were applied (415 for one this
    server cannot decode)."""
    names = [c.strip().lower() for c in header.split(",") if c.strip()]
    for name in names:
        if name != "identity" and name not in CODINGS or len(names) > _MAX_CODINGS:
            raise APIError(
                415,
                f"Content-Encoding {prefix(header, 40)!r} is not supported; use one of "
                f"{', '.join(['identity', *CODINGS])} (at most {_MAX_CODINGS}).",
                code="unsupported_encoding",
                headers={"Accept-Encoding": ", ".join(CODINGS), "Connection": "close"},
            )
    return [n for n in names if n != "identity"]


def inflate(data: bytes, names: list[str], limit: int) -> bytes:
    """The body decoded from its codings (the last applied is undone first), each step at most `limit`
    bytes: an inflated body past the limit is a 413 as soon as it passes it, never inflated whole."""
    for name in reversed(names):
        try:
            data = CODINGS[name](data, limit)
        except _CODEC_ERRORS as e:
            raise _bad_coding(name) from e
    return data


# ---- JSON nesting -----------------------------------------------------------------------------------


def _scan(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where JSON text's brackets outside strings are, +1 (open) or -1 (close) at each, and the nesting depth
    after each. Vectorized, over the quotes and brackets alone after one pass over the bytes."""
    a = np.frombuffer(data, dtype=np.uint8)
    quote = a == ord('"')
    backslash = a == ord("\\")
    escaped = np.flatnonzero(quote[1:] & backslash[:-1]) + 1
    if escaped.size:  # a quote after an odd run of backslashes is inside a string
        run_starts = np.flatnonzero(backslash & ~np.concatenate(([False], backslash[:-1])))
        start = run_starts[np.searchsorted(run_starts, escaped - 1, side="right") - 1]
        quote[escaped[(escaped - start) % 2 == 1]] = False
    opens = (a == ord("[")) | (a == ord("{"))
    pos = np.flatnonzero(quote | opens | (a == ord("]")) | (a == ord("}")))
    is_quote = quote[pos]
    # Odd quotes so far: inside a string (summed as uint8, whose wrap-around keeps the parity).
    outside = (np.cumsum(is_quote.view(np.uint8), dtype=np.uint8) & 1) == 0
    keep = outside & ~is_quote
    pos = pos[keep]
    step = np.where(opens[pos], 1, -1).astype(np.int32)
    return pos, step, np.cumsum(step, dtype=np.int32)


def deep_offset(data: bytes, limit: int = MAX_JSON_DEPTH) -> int | None:
    """The offset of the first `[` or `{` nested deeper than `limit` in JSON text (strings skipped), or None.
    A text with few brackets passes at a glance; else tens of milliseconds for a body of 4 MB."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return None
    pos, _, depth = _scan(data)
    over = np.flatnonzero(depth > limit)
    return int(pos[over[0]]) if over.size else None


def _stub(data: bytes, offset: int) -> Any:
    """The document cut at `offset` (a container nested too deep), with 0 in its place and the containers
    still open there closed, decoded: the same path leads to the 0, and nothing in it is too deep."""
    pos, step, depth = _scan(data[:offset])
    opens = np.flatnonzero(step == 1)[::-1]
    # The containers open at `offset`: for each level, the last one opened at it.
    _, last = np.unique(depth[opens], return_index=True)
    closers = bytes(ord("]") if data[i] == ord("[") else ord("}") for i in pos[opens[last]][::-1])
    return msgspec.json.decode(data[:offset] + b"0" + closers)


def _path_to_last(doc: Any) -> list[str | int]:
    """The path to the last value in document order (where the stub stands)."""
    path: list[str | int] = []
    while isinstance(doc, dict | list) and doc:
        key: str | int = next(reversed(doc)) if isinstance(doc, dict) else len(doc) - 1
        path.append(key)
        doc = doc[key]
    return path


def _containers(t: mi.Type) -> list[mi.Type]:
    return [
        u
        for u in (t.types if isinstance(t, mi.UnionType) else (t,))
        if isinstance(u, mi.StructType | mi.ListType)
    ]


def param_of(cls: type, path: list[str | int]) -> str | None:
    """The request parameter a path into the body falls in: the path as far as it follows the schema's Structs
    and lists, down to a free-form value (a schema, arguments), a field the schema does not know, or a value
    of the wrong kind."""
    out = ""
    t: mi.Type | None = mi.type_info(cls)
    for key in path:
        options = _containers(t) if t is not None else []
        lists = [u for u in options if isinstance(u, mi.ListType)]
        structs = [u for u in options if isinstance(u, mi.StructType)]
        if isinstance(key, int) and lists:
            t = lists[0].item_type
        elif isinstance(key, str) and structs:
            t = next((f.type for u in structs for f in u.fields if f.encode_name == key), None)
        else:
            break  # not the kind of value the schema has here
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else key)
        if t is None:
            break
    return out or None


def too_deep(param: str | None, what: str | None = None) -> APIError:
    """400 for JSON nested past MAX_JSON_DEPTH: `what` (a JSON string the request carries), or the body (in
    `param`)."""
    if what is None:
        what = "The body's JSON" + (f" (in `{param}`)" if param else "")
    return APIError(
        400, f"{what} is nested more than {MAX_JSON_DEPTH} levels deep.", param=param, code="json_too_deep"
    )


def decode_json(body: bytes, cls: type[T], error_param: Callable[[str], str | None]) -> T:
    """The body as a `cls` Struct: 400 for bad JSON, JSON nested past MAX_JSON_DEPTH (naming the parameter it
    is in) or a bad field (in `param`, by `error_param` of msgspec's message)."""
    offset = deep_offset(body)
    if offset is not None:
        try:
            param = param_of(cls, _path_to_last(_stub(body, offset)))
        except (ValueError, IndexError):  # not JSON before that point either
            param = None
        raise too_deep(param)
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as e:
        message = prefix(str(e), 500)
        raise APIError(400, message, param=error_param(str(e)), code="invalid_value") from e
    except msgspec.DecodeError as e:
        raise APIError(400, f"The body is not valid JSON: {prefix(str(e))}", code="invalid_json") from e


def loads(text: str, param: str) -> Any:
    """A JSON string a request carries (tool-call arguments, a schema as text), parsed only when it nests at most
    MAX_JSON_DEPTH levels (else a 400 naming `param`, before anything walks it) and as strictly as the body (no
    NaN or Infinity, which no schema compiler or template takes); ValueError if it is not JSON."""
    if deep_offset(text.encode("utf-8", "surrogatepass")) is not None:
        raise too_deep(param, f"`{param}`")
    return msgspec.json.decode(text)
