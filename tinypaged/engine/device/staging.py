"""Host-to-device staging of a step's batch: the scheduler's plain data packed into one pinned buffer, sent
in one non-blocking copy, read on the device as the model's input tensors (or written into the CUDA graphs'
fixed buffers); input tokens still pending on the device (async scheduling) are gathered there."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tinypaged.config import EngineConfig
from tinypaged.core.scheduler import ScheduledSeq
from tinypaged.model import AttentionMetadata

# Staged regions start on 128-byte boundaries and block-table rows are padded to 16 entries: Triton
# specialises kernels on pointer alignment and on strides divisible by 16, so unaligned views of the staging
# buffer would compile new kernel variants mid-run (about a second each).
_ALIGN = 32


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def longest_first(lens: np.ndarray, rows: int) -> np.ndarray:
    """The order decode attention takes `rows` sequences in: those with lengths `lens` longest first, then the
    padding rows after them (see kernels/attention.py)."""
    order = np.arange(rows, dtype=np.int32)
    order[: len(lens)] = np.argsort(-lens, kind="stable")
    return order


def table_width(num_blocks: int) -> int:
    """Columns of a step's block tables: the longest table's blocks, padded to 16 (see _ALIGN)."""
    return _round_up(max(num_blocks, 1), 16)


@dataclass(frozen=True)
class ModelInput:
    """The batch tensors of one step, built from the scheduler's plain data."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor | slice  # the rows of the T new tokens whose logits are sampled


@dataclass(frozen=True)
class PendingTokens:
    """Input tokens the host does not know yet (async scheduling): the previous step's samples, still on the
    device, by sequence. A scheduled sequence whose token_ids lack its last new token reads it from here."""

    sampled: torch.Tensor  # [N] int64 on the device
    rows: dict[int, int]  # seq_id -> row of `sampled`


class Staging:
    """Host-to-device staging of a step's integers: one pinned int32 buffer, one copy per step.

    Eager steps pack [input ids | positions | slots | sample rows | seq lens | query starts | decode order |
    block tables] back to back and read views of one device buffer. Decode graphs read fixed device buffers:
    ids, positions, slots, seq lens and decode order `[5, max_bs]` and block tables `[max_bs, max_blocks]`,
    filled by two device copies out of the same one host-to-device copy. Mixed-step graphs
    (`max_graph_tokens` > 0) read ids, positions and slots `[3, max_graph_tokens]`, seq lens, query starts and
    decode order `[3, max_num_seqs + 1]` and the same block tables, filled by three device copies. On the CPU
    the host buffer is the device buffer.

    `ids_from_rank0` (tensor-parallel ranks other than 0): input tokens pending on the device are not here; they
    are staged as zeros and the runner overwrites the ids with rank 0's by broadcast.
    """

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        ids_from_rank0: bool = False,
        max_graph_tokens: int = 0,
    ) -> None:
        self.device = device
        self.ids_from_rank0 = ids_from_rank0
        self.block_size = config.block_size
        self.max_blocks = config.max_blocks_per_seq
        seqs, tokens = config.max_num_seqs, max(config.max_num_batched_tokens, config.max_num_seqs)
        self.max_width = _round_up(self.max_blocks, 16)
        # Eager layout, or a mixed graph's (its token rows padded to its size, its sequence rows to max_num_seqs).
        size = 4 * tokens + 7 * seqs + 11 * _ALIGN + seqs * self.max_width + 3 * max_graph_tokens
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.int32, device=device) if cuda else self.host
        self._copied = torch.cuda.Event() if cuda else None  # the last copy out of `host` has finished
        # Decode-graph buffers (device only): padding rows keep slot -1 and seq len 0, so kernels skip them.
        self.max_graph_bs = seqs
        self.g_stride = _round_up(seqs, _ALIGN)
        self.g_small = torch.zeros((5, self.g_stride), dtype=torch.int32, device=device)
        self.g_small[4] = torch.arange(self.g_stride)  # every prefix is a permutation of its rows
        self.g_bt = torch.zeros((seqs, self.max_width), dtype=torch.int32, device=device)
        self.g_qsl = torch.arange(seqs + 1, dtype=torch.int32, device=device)
        # Mixed-graph buffers: ids, positions, slots; seq lens, query starts and decode order (block tables: g_bt's).
        self.m_tok = torch.zeros((3, max_graph_tokens), dtype=torch.int32, device=device)
        self.m_seq = torch.zeros((3, seqs + 1), dtype=torch.int32, device=device)
        self.m_seq[2] = torch.arange(seqs + 1)

    def _host_free(self) -> None:
        """Wait until the device has read the last step's staging (normally long done: the sampler synced)."""
        if self._copied is not None:
            self._copied.synchronize()

    def _send(self, n: int) -> None:
        """Copy the first n staged integers to the device buffer, without waiting."""
        if self._copied is None:
            return
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        self._copied.record()

    def _stage_pending(
        self, at: int, scheduled: tuple[ScheduledSeq, ...], starts: list[int], pending: PendingTokens | None
    ) -> tuple[int, int, int]:
        """Stage, from offset `at`, where each pending input token goes (its index among the step's input
        ids) and where it comes from (its row of `pending.sampled`); returns (offset of the sources, count,
        end). The placeholders in the ids are zeros until `_fill_pending` runs on the device."""
        dst: list[int] = []
        src: list[int] = []
        if self.ids_from_rank0:
            scheduled = ()
        for i, s in enumerate(scheduled):
            missing = s.num_new_tokens - len(s.token_ids)
            if missing:
                assert missing == 1 and pending is not None, f"seq {s.seq_id}: input tokens unknown"
                dst.append(starts[i] + s.num_new_tokens - 1)
                src.append(pending.rows[s.seq_id])
        k = len(dst)
        o_src = at + _round_up(k, _ALIGN)
        h = self.host_np
        h[at : at + k], h[o_src : o_src + k] = dst, src
        return o_src, k, o_src + k

    def _fill_pending(
        self, ids: torch.Tensor, at: int, o_src: int, k: int, pending: PendingTokens | None
    ) -> None:
        """On the device, after the staged copy: put the pending tokens into the step's input ids."""
        if not k:
            return
        assert pending is not None
        dst, src = self.dev[at : at + k].long(), self.dev[o_src : o_src + k]
        ids.index_copy_(0, dst, pending.sampled.index_select(0, src).to(ids.dtype))

    def graph_input(self, bs: int, max_seq_len: int) -> ModelInput:
        """The views a decode graph of batch size `bs` reads (captured once, refilled every step)."""
        ids, pos, slots, seq_lens, order = self.g_small[:, :bs]
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.g_bt[:bs],
            seq_lens=seq_lens,
            query_start_loc=self.g_qsl[: bs + 1],
            max_query_len=1,
            max_seq_len=max_seq_len,
            decode_order=order,
        )
        if bs == self.max_graph_bs:  # before capture: all rows are padding
            self.g_small[2].fill_(-1)
            self.g_small[3].zero_()
        return ModelInput(ids, pos, meta, slice(None))

    def stage_decode(
        self,
        scheduled: tuple[ScheduledSeq, ...],
        bs: int,
        max_seq_len: int,
        pending: PendingTokens | None = None,
    ) -> ModelInput:
        """Fill the graph buffers for a decode batch padded to `bs` rows."""
        self._host_free()
        n, block = len(scheduled), self.block_size
        mb = self.g_stride
        h = self.host_np
        ids, pos, slots, lens = [], [], [], []
        width = 1
        for s in scheduled:
            p, table = s.num_computed_tokens, s.block_table
            ids.append(s.token_ids[0] if s.token_ids else 0)
            pos.append(p)
            slots.append(table[p // block] * block + p % block)
            lens.append(p + 1)
            width = max(width, len(table))
        width = table_width(width)
        h[0:n], h[mb : mb + n], h[2 * mb : 2 * mb + n], h[3 * mb : 3 * mb + n] = ids, pos, slots, lens
        h[n:bs] = 0
        h[mb + n : mb + bs] = 0
        h[2 * mb + n : 2 * mb + bs] = -1
        h[3 * mb + n : 3 * mb + bs] = 0
        h[4 * mb : 4 * mb + bs] = longest_first(h[3 * mb : 3 * mb + n], bs)
        bt = h[5 * mb : 5 * mb + n * width].reshape(n, width)
        bt.fill(0)
        for i, s in enumerate(scheduled):
            bt[i, : len(s.block_table)] = s.block_table
        bt_end = 5 * mb + n * width
        o_dst = _round_up(bt_end, _ALIGN)
        o_src, k, end = self._stage_pending(o_dst, scheduled, list(range(n)), pending)
        self._send(end)
        self.g_small.view(-1).copy_(self.dev[: 5 * mb])
        self.g_bt[:n, :width].copy_(self.dev[5 * mb : bt_end].view(n, width))
        ids_t, pos_t, slots_t, lens_t, order_t = self.g_small[:, :bs]
        self._fill_pending(ids_t, o_dst, o_src, k, pending)
        meta = AttentionMetadata(
            slots_t, self.g_bt[:bs], lens_t, self.g_qsl[: bs + 1], 1, max_seq_len, decode_order=order_t
        )
        return ModelInput(ids_t, pos_t, meta, slice(0, n))

    def mixed_graph_input(self, num_tokens: int, max_seq_len: int) -> ModelInput:
        """The views a mixed-step graph of `num_tokens` tokens reads (captured once, refilled every step).

        Every sequence row (max_num_seqs) is in the batch; the rows a step leaves unused have no new tokens and
        a context of 0, so both attention launches skip them, and the padding tokens (slot -1) belong to no
        sequence. `max_query_len` is the graph's token count: an upper bound that has the kernel launch its
        prefill and its decode programs both (a single sequence with a single new token is a decode step,
        which a decode graph or an eager step runs)."""
        if num_tokens == self.m_tok.shape[1]:  # the first capture: every row is padding
            self.m_tok[2].fill_(-1)
            self.m_seq[:2].zero_()
        return self._mixed_views(num_tokens, max_seq_len, slice(None))

    def _mixed_views(self, num_tokens: int, max_seq_len: int, rows: torch.Tensor | slice) -> ModelInput:
        ids, pos, slots = self.m_tok[:, :num_tokens]
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.g_bt,
            seq_lens=self.m_seq[0, : self.max_graph_bs],
            query_start_loc=self.m_seq[1],
            max_query_len=num_tokens,
            max_seq_len=max_seq_len,
            decode_order=self.m_seq[2, : self.max_graph_bs],
        )
        return ModelInput(ids, pos, meta, rows)

    def stage(
        self, scheduled: tuple[ScheduledSeq, ...], pending: PendingTokens | None = None, graph_tokens: int = 0
    ) -> ModelInput:
        """Pack an arbitrary (prefill, mixed or decode) batch and send it in one copy; with `graph_tokens`,
        into the buffers of the mixed-step graph of that many tokens (`mixed_graph_input`)."""
        self._host_free()
        block = self.block_size
        n_tok = sum(s.num_new_tokens for s in scheduled)
        n_seq = len(scheduled)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        samples: list[int] = []
        lens: list[int] = []
        starts = [0]
        width = 1
        for s in scheduled:
            first, n, table = s.num_computed_tokens, s.num_new_tokens, s.block_table
            ids.extend(s.token_ids)
            ids.extend([0] * (n - len(s.token_ids)))  # pending on the device: filled in below
            pos.extend(range(first, first + n))
            p, end = first, first + n
            while p < end:  # one run of consecutive slots per block touched
                b, off = divmod(p, block)
                take = min(block - off, end - p)
                base = table[b] * block + off
                slots.extend(range(base, base + take))
                p += take
            lens.append(end)
            starts.append(starts[-1] + n)
            if s.do_sample:  # a verification samples each of its proposed tokens' positions too
                samples.extend(range(starts[-1] - 1 - s.num_spec_tokens, starts[-1]))
            width = max(width, len(table))
        n_samp = len(samples)
        width = table_width(width)
        # A graph's rows: tokens padded to its size (slot -1), sequences to max_num_seqs (no tokens, length 0).
        pad_tok = graph_tokens or n_tok
        pad_seq = self.max_graph_bs if graph_tokens else n_seq
        o_pos = _round_up(pad_tok, _ALIGN)
        o_slot = 2 * o_pos
        o_samp = 3 * o_pos
        o_len = o_samp + _round_up(n_samp, _ALIGN)
        seq_row = _round_up(pad_seq + 1, _ALIGN)  # seq lens, query starts, decode order: one row each
        o_qsl = o_len + seq_row
        o_ord = o_qsl + seq_row
        o_bt = o_ord + seq_row
        end = o_bt + n_seq * width
        h = self.host_np
        h[0:n_tok], h[o_pos : o_pos + n_tok], h[o_slot : o_slot + n_tok] = ids, pos, slots
        h[o_samp : o_samp + n_samp], h[o_len : o_len + n_seq], h[o_qsl : o_qsl + n_seq + 1] = (
            samples,
            lens,
            starts,
        )
        if graph_tokens:
            h[n_tok:pad_tok], h[o_pos + n_tok : o_pos + pad_tok] = 0, 0
            h[o_slot + n_tok : o_slot + pad_tok] = -1
            h[o_len + n_seq : o_len + pad_seq + 1] = 0
            h[o_qsl + n_seq + 1 : o_qsl + pad_seq + 1] = n_tok
        h[o_ord : o_ord + pad_seq] = longest_first(h[o_len : o_len + n_seq], pad_seq)
        bt = h[o_bt:end].reshape(n_seq, width)
        bt.fill(0)
        for i, s in enumerate(scheduled):
            bt[i, : len(s.block_table)] = s.block_table
        o_dst = _round_up(end, _ALIGN)
        o_src, k, end_all = self._stage_pending(o_dst, scheduled, starts, pending)
        self._send(end_all)
        d = self.dev
        rows: torch.Tensor | slice = slice(0, n_tok) if n_samp == n_tok else d[o_samp : o_samp + n_samp]
        if graph_tokens:
            self.m_tok[:, :pad_tok].copy_(d[: 3 * o_pos].view(3, o_pos)[:, :pad_tok])
            self.m_seq.copy_(d[o_len : o_len + 3 * seq_row].view(3, seq_row)[:, : pad_seq + 1])
            self.g_bt[:n_seq, :width].copy_(d[o_bt:end].view(n_seq, width))
            self._fill_pending(self.m_tok[0, :pad_tok], o_dst, o_src, k, pending)
            return self._mixed_views(pad_tok, max(lens), rows)
        self._fill_pending(d[0:n_tok], o_dst, o_src, k, pending)
        meta = AttentionMetadata(
            slot_mapping=d[o_slot : o_slot + n_tok],
            block_tables=d[o_bt:end].view(n_seq, width),
            seq_lens=d[o_len : o_len + n_seq],
            query_start_loc=d[o_qsl : o_qsl + n_seq + 1],
            max_query_len=max(s.num_new_tokens for s in scheduled),
            max_seq_len=max(lens),
            decode_order=d[o_ord : o_ord + n_seq],
        )
        return ModelInput(d[0:n_tok], d[o_pos : o_pos + n_tok], meta, rows)
