"""What the router knows, without Ray: a chat request's routing key is the engine's own block hashes (its prefix-
cache events, sent as the core process sends them and replayed, hold every key of the prompt once it ran), and
replicas' metrics merge per replica."""

from __future__ import annotations

import json

from tinypaged.engine.frontend.wire import Outputs, decode, encode
from tinypaged.replicas.metrics import merge_expositions
from tinypaged.replicas.routing import CachedBlocks, longest_prefix, prompt_block_keys, route_key
from tinypaged.sampling_params import SamplingParams


def test_route_key_is_what_the_engine_caches(llm, generate_with_stats) -> None:  # noqa: ANN001
    engine = llm.engine
    messages = [
        {"role": "system", "content": "You answer in one word. " * 8},
        {"role": "user", "content": "Name a colour of the sky at noon, please, in one word."},
    ]
    body = json.dumps({"messages": messages, "max_tokens": 3}).encode()
    text, keys = route_key(engine.tokenizer, engine.config.block_size, "/v1/chat/completions", body)
    ids = engine.tokenizer.encode(text, False)
    assert len(keys) == len(ids) // engine.config.block_size >= 4
    cached = CachedBlocks()
    _, steps = generate_with_stats(
        engine, [{"prompt": text, "prompt_token_ids": ids}], [SamplingParams(max_tokens=3, temperature=0.0)]
    )
    for stats in steps:  # as the core process sends them (wire.py), so both transports carry the events
        received = decode(encode(Outputs(applied=1, outputs=[], stats=engine.stats(), step=stats)))
        assert isinstance(received, Outputs) and received.step is not None
        cached.apply(received.step.kv_events)
    assert longest_prefix(keys, cached.keys) == len(keys)
    # The same prompt with another system message shares no leading block.
    other = prompt_block_keys(engine.tokenizer.encode(text.replace("one word", "two words"), False), 16)
    assert longest_prefix(other, cached.keys) == 0


def test_route_key_of_a_body_it_cannot_read_is_none(llm) -> None:  # noqa: ANN001
    tok = llm.engine.tokenizer
    assert route_key(tok, 16, "/v1/chat/completions", b"{not json") is None
    assert route_key(tok, 16, "/v1/completions", json.dumps({"prompt": [1, 2, 3]}).encode()) is None


def test_expositions_merge_with_a_replica_label() -> None:
    one = (
        '# HELP t:x_total X.\n# TYPE t:x_total counter\nt:x_total{m="a"} 1\n'
        '# HELP t:h H.\n# TYPE t:h histogram\nt:h_bucket{m="a",le="1.0"} 2\nt:h_sum{m="a"} 0.5\n'
        "rss 10\n"
    )
    merged = merge_expositions({"r1": one, "r2": one.replace(" 1\n", " 7\n")})
    lines = merged.splitlines()
    assert lines.count("# TYPE t:x_total counter") == 1
    assert 't:x_total{replica="r1",m="a"} 1' in lines and 't:x_total{replica="r2",m="a"} 7' in lines
    # A family's samples stay together, under its HELP and TYPE.
    start = lines.index("# TYPE t:h histogram")
    assert lines[start + 1 : start + 5] == [
        't:h_bucket{replica="r1",m="a",le="1.0"} 2',
        't:h_sum{replica="r1",m="a"} 0.5',
        't:h_bucket{replica="r2",m="a",le="1.0"} 2',
        't:h_sum{replica="r2",m="a"} 0.5',
    ]
    assert 'rss{replica="r2"} 10' in lines
