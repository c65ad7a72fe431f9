"""Several replicas' Prometheus expositions as one: each sample labelled with its replica, each metric family's
HELP and TYPE once with all its replicas' samples under it (the text format wants a family's samples together)."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+.*)$")
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family(name: str, families: dict[str, list[str]]) -> str:
    """The family a sample belongs to: its own name, or its name less a histogram's or counter's suffix."""
    if name in families:
        return name
    for suffix in _SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in families:
            return name[: -len(suffix)]
    return name


def merge_expositions(texts: dict[str, str]) -> str:
    """One exposition of `texts` (replica -> its /metrics), every sample given `replica="<name>"`; comment lines
    other than HELP and TYPE (a replica's engine down, say) kept, prefixed with the replica."""
    headers: dict[str, list[str]] = {}  # family -> its HELP and TYPE lines (the first replica's)
    samples: dict[str, list[str]] = {}
    notes: list[str] = []
    for replica, text in texts.items():
        label = f'replica="{_escape(replica)}"'
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split()[2]
                headers.setdefault(name, [])
                samples.setdefault(name, [])
                if len(headers[name]) < 2:
                    headers[name].append(line)
                continue
            if line.startswith("#"):
                notes.append(f"# replica {replica}: {line.lstrip('# ')}")
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, value = m.groups()
            labels = f"{{{label},{labels[1:]}" if labels and labels != "{}" else f"{{{label}}}"
            samples.setdefault(_family(name, headers), []).append(f"{name}{labels} {value}")
    lines = list(notes)
    for family, rows in samples.items():
        lines += headers.get(family, [])
        lines += rows
    return "\n".join(lines) + "\n"
