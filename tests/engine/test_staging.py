"""The staging of a step into a mixed-step CUDA graph's buffers (model_runner.py) computes what the eager staging
does: the same hidden states of the real tokens, the same K/V written, the padding inert. On the CPU, where no
graph is captured, the model runs over both layouts with the torch reference ops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tinypaged.config import EngineConfig
from tinypaged.core.scheduler import ScheduledSeq
from tinypaged.engine.device.model_runner import graph_token_sizes
from tinypaged.engine.device.staging import PendingTokens, Staging, longest_first
from tinypaged.model import load_model


def test_graph_token_sizes() -> None:
    assert graph_token_sizes(0) == [] and graph_token_sizes(15) == []
    assert graph_token_sizes(100) == [16, 32, 64, 100]
    sizes = graph_token_sizes(2048)
    assert sizes[:5] == [16, 32, 64, 128, 256] and sizes[-4:] == [1280, 1536, 1792, 2048]
    assert all(b - a <= 256 for a, b in zip(sizes[3:], sizes[4:], strict=False))


def test_longest_first() -> None:
    lens = np.array([3, 9, 9, 1, 12], dtype=np.int32)
    assert longest_first(lens, 5).tolist() == [4, 1, 2, 0, 3]  # ties keep their order
    assert longest_first(lens, 8).tolist() == [4, 1, 2, 0, 3, 5, 6, 7]
    assert longest_first(lens[:0], 3).tolist() == [0, 1, 2]


def test_decode_staging_orders_longest_first(model_dir: Path) -> None:
    """A decode graph's rows: the staged order is the real rows longest first, then the padding rows; the
    buffers of a larger graph's rows beyond the batch stay a permutation of their own."""
    config = EngineConfig(model=model_dir, device="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    staging = Staging(config, torch.device("cpu"))
    assert staging.graph_input(8, 64).meta.decode_order.tolist() == list(range(8))
    batch = (
        ScheduledSeq(0, "a", 20, 1, (5,), (3, 7), True),
        ScheduledSeq(1, "b", 40, 1, (6,), (4, 8, 2), True),
        ScheduledSeq(2, "c", 5, 1, (7,), (9,), True),
    )
    inp = staging.stage_decode(batch, 4, 64)
    assert inp.meta.seq_lens.tolist() == [21, 41, 6, 0]
    assert inp.meta.decode_order.tolist() == [1, 0, 2, 3]
    assert staging.graph_input(4, 64).meta.decode_order.tolist() == [1, 0, 2, 3]


def _batch() -> tuple[ScheduledSeq, ...]:
    """Two decodes (one of them pending on the device), a chunk in the middle of a prompt (it does not sample)
    and a prompt's last chunk; block tables of different widths."""
    return (
        ScheduledSeq(0, "a", 20, 1, (), (3, 7), True),
        ScheduledSeq(1, "b", 0, 13, tuple(range(5, 18)), (4,), False),
        ScheduledSeq(2, "c", 5, 1, (42,), (9,), True),
        ScheduledSeq(3, "d", 16, 9, tuple(range(30, 39)), (1, 2), True),
    )


def test_mixed_graph_staging_computes_what_eager_does(model_dir: Path) -> None:
    config = EngineConfig(model=model_dir, device="cpu", max_num_seqs=8, max_num_batched_tokens=64)
    m = config.model_config
    torch.manual_seed(0)
    model = load_model(m, torch.float32, torch.device("cpu"), config.max_model_len)
    for p in model.parameters():  # random weights: the default model's would do, this needs no download
        p.data.normal_(0, 0.05)
    staging = Staging(config, torch.device("cpu"), max_graph_tokens=64)
    batch = _batch()
    pending = PendingTokens(torch.tensor([11, 77]), {0: 1})
    shape = (m.num_layers, 2, 12, config.block_size, m.num_kv_heads, m.head_dim)
    context = torch.randn(shape)

    caches, hidden, rows = [], [], []
    for graph_tokens in (0, 32):
        inp = staging.stage(batch, pending, graph_tokens=graph_tokens)
        # Copies: the next stage() reuses the staging buffers.
        ids, pos, meta = inp.input_ids.clone(), inp.positions.clone(), inp.meta
        meta = type(meta)(*(x.clone() if isinstance(x, torch.Tensor) else x for x in vars(meta).values()))
        sample_rows = (
            inp.sample_rows.clone() if isinstance(inp.sample_rows, torch.Tensor) else inp.sample_rows
        )
        kv = context.clone()
        with torch.inference_mode():
            hidden.append(model(ids, pos, kv, meta))
        caches.append(kv)
        rows.append(sample_rows)
        if graph_tokens:
            assert ids.shape == (32,) and meta.max_query_len == 32
            assert ids[0].item() == 77 and ids[24:].eq(0).all()  # the pending token; the padding
            assert meta.slot_mapping[24:].eq(-1).all()
            assert meta.seq_lens.shape == (8,) and meta.seq_lens[4:].eq(0).all()
            assert meta.query_start_loc.tolist() == [0, 1, 14, 15, 24, 24, 24, 24, 24]
            assert meta.block_tables.shape[0] == 8
        # Longest first (lengths 21, 13, 6, 25), then the graph's padding rows.
        want_order = [3, 0, 1, 2, 4, 5, 6, 7] if graph_tokens else [3, 0, 1, 2]
        assert meta.decode_order.tolist() == want_order
    torch.testing.assert_close(hidden[1][:24], hidden[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1], caches[0], atol=1e-5, rtol=1e-5)
    assert not caches[0].equal(context)  # the step wrote K/V
    torch.testing.assert_close(rows[1], rows[0])
    assert rows[0].tolist() == [0, 14, 23]
