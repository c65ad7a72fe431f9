"""The model runner: owns the model and the KV caches, turns a SchedulerOutput into one forward pass.

On a GPU a step is built to stay off the host's critical path: the batch's integers are packed into one pinned
buffer and sent in one non-blocking copy, the attention launch gets its bounds from the host (no device
syncs), and decode-only batches replay a CUDA graph captured for the next batch size up (padding rows write no
K/V and attend to nothing). Prefill and mixed batches run eagerly. The only synchronisation of a step is the
sampler's read of the sampled tokens.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from tinypaged import ops
from tinypaged.config import EngineConfig
from tinypaged.core.scheduler import ScheduledSeq, SchedulerOutput
from tinypaged.model import AttentionMetadata, load_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GiB = 1 << 30
# Staged regions start on 128-byte boundaries and block-table rows are padded to 16 entries: Triton
# specialises kernels on pointer alignment and on strides divisible by 16, so unaligned views of the staging
# buffer would compile new kernel variants mid-run (about a second each).
_ALIGN = 32


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _table_width(num_blocks: int) -> int:
    """Columns of a step's block tables: the longest table's blocks, padded to 16 (see _ALIGN)."""
    return _round_up(max(num_blocks, 1), 16)


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA when there is a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """'auto': float32 on the CPU (exact, and fast there); the checkpoint's half type on a GPU."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if checkpoint_dtype not in ("float16",) else torch.float16


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a CUDA graph: 1, 2, 4, 8, then every multiple of 16, and max_num_seqs.

    Steps of 16 (not powers of two) above 16: a padded row costs as much as a real one in the matmuls, and
    large decode batches are compute-bound on the H200.
    """
    sizes = {s for s in (1, 2, 4, 8) if s < max_num_seqs} | set(range(16, max_num_seqs, 16)) | {max_num_seqs}
    return sorted(sizes)


@dataclass(frozen=True)
class ModelInput:
    """The batch tensors of one step, built from the scheduler's plain data."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor | slice  # the rows of the T new tokens whose logits are sampled
    graph_batch_size: int = 0  # > 0: replay the decode graph of this (padded) batch size


@dataclass(frozen=True)
class PendingTokens:
    """Input tokens the host does not know yet (async scheduling): the previous step's samples, still on the
    device, by sequence. A scheduled sequence whose token_ids lack its last new token reads it from here."""

    sampled: torch.Tensor  # [N] int64 on the device
    rows: dict[int, int]  # seq_id -> row of `sampled`


@dataclass(frozen=True)
class ExecuteOutput:
    """A step's logits: of the rows that sample, and of every new token of the sequences asked for."""

    logits: torch.Tensor  # [S, vocab]: each sampling sequence's last new token, in scheduled order
    # Index in SchedulerOutput.scheduled -> [num_new_tokens, vocab] (prompt_logprobs score every prompt token).
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class RunnerStats:
    """How the runner set itself up (seconds and bytes), for logs and benchmarks."""

    load_s: float = 0.0
    weights_bytes: int = 0
    profile_activation_bytes: int = 0
    non_torch_bytes: int = 0
    kv_cache_bytes: int = 0
    graph_capture_s: float = 0.0
    graph_pool_bytes: int = 0
    graph_batch_sizes: list[int] = field(default_factory=list)


class ModelRunner:
    """Loads the weights, allocates the paged KV cache (and its CPU swap space), runs forward passes.

    `use_cuda_graphs` may be switched off at run time (the graphs stay captured), e.g. to time eager decoding
    on the same engine.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mcfg = config.model
        self.stats = RunnerStats()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, mcfg.torch_dtype, self.device)
        t0 = time.perf_counter()
        self.model = load_model(mcfg, self.dtype, self.device, config.max_model_len)
        self.stats.load_s = time.perf_counter() - t0
        self.stats.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.block_size = config.cache.block_size
        shape = (mcfg.num_layers, 2, self.block_size, mcfg.num_kv_heads, mcfg.head_dim)
        self.block_bytes = torch.Size(shape).numel() * torch.tensor([], dtype=self.dtype).element_size()
        self._staging = _Staging(config, self.device)
        self.num_gpu_blocks = config.cache.num_gpu_blocks_override or self._blocks_that_fit()
        self.num_cpu_blocks = int(config.cache.swap_space * GiB // self.block_bytes)
        # Zeroed, not empty: the torch reference attention reads whole blocks (and padding) and masks afterwards,
        # and uninitialised memory can hold NaNs, which a zero attention weight does not cancel (0 * NaN = NaN).
        self.kv_cache = self._allocate(self.num_gpu_blocks, self.device, zero=True)
        self.stats.kv_cache_bytes = self.num_gpu_blocks * self.block_bytes
        # torch.empty leaves host pages untouched until a block is swapped out, so unused swap space costs nothing.
        self.swap_cache = self._allocate(
            self.num_cpu_blocks, torch.device("cpu"), pin=self.device.type == "cuda"
        )
        self.use_cuda_graphs = self.device.type == "cuda" and not config.enforce_eager
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_sizes: list[int] = []
        if self.use_cuda_graphs:
            self._capture_graphs()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB), swap: %d blocks; CUDA graphs for %s",
            self.num_gpu_blocks,
            self.block_size,
            self.num_gpu_blocks * self.block_bytes / GiB,
            self.num_cpu_blocks,
            self._graph_sizes or "no batch size",
        )

    def _allocate(
        self, num_blocks: int, device: torch.device, pin: bool = False, zero: bool = False
    ) -> torch.Tensor:
        m = self.config.model
        shape = (m.num_layers, 2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=self.dtype, device=device, pin_memory=pin)

    # ---- memory ------------------------------------------------------------------------------------------

    def _blocks_that_fit(self) -> int:
        """How many KV blocks the memory budget holds after the weights and the largest step's activations.

        As vLLM: budget = total memory x gpu_memory_utilization - (weights + peak activations of a profiling
        forward pass over max_num_batched_tokens + memory outside torch's allocator, e.g. the CUDA context).
        """
        if self.device.type == "cpu":
            return max(1, int(self.config.cache.cpu_kv_cache_space * GiB // self.block_bytes))
        torch.cuda.empty_cache()
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(self.device))
        # The sampler's working set is outside the profile: up to ~8 fp32 copies of the sampled rows' logits
        # (clone, probabilities, sorted values and int64 indices, cumulative sums, noise).
        sampler = 8 * self.config.max_num_seqs * self.config.model.vocab_size * 4
        self.stats.profile_activation_bytes = activations
        self.stats.non_torch_bytes = non_torch
        used = torch.cuda.memory_allocated(self.device) + activations + non_torch + sampler
        budget = total * self.config.cache.gpu_memory_utilization - used
        if budget < self.block_bytes:
            raise MemoryError("no GPU memory left for the KV cache; raise --gpu-memory-utilization")
        return int(budget // self.block_bytes)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """One forward pass of the largest batch the scheduler can form (max_num_batched_tokens tokens over
        up to max_num_seqs sequences), with its logits; it writes no K/V (slots -1) into a one-block cache."""
        tokens = self.config.max_num_batched_tokens
        seqs = min(self.config.max_num_seqs, tokens)
        lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
        starts = np.concatenate([[0], np.cumsum(lens)])
        positions = np.concatenate([np.arange(n) for n in lens])
        dev = self.device
        kv = self._allocate(1, dev).zero_()
        meta = AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int32, device=dev),
            # As wide as a step's would be, so that this pass compiles the prefill variant the steps use.
            block_tables=torch.zeros(
                (seqs, _table_width(-(-max(lens) // self.block_size))), dtype=torch.int32, device=dev
            ),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max(lens),
            max_seq_len=max(lens),
        )
        ids = torch.zeros(tokens, dtype=torch.int32, device=dev)
        hidden = self.model(ids, torch.tensor(positions, dtype=torch.int32, device=dev), kv, meta)
        rows = torch.tensor(starts[1:] - 1, device=dev)
        self.model.compute_logits(hidden[rows])

    # ---- CUDA graphs ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture the forward pass of a decode batch for each size of `graph_batch_sizes`, largest first,
        all in one memory pool; each reads its inputs from the staging area's persistent graph buffers."""
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        st = self._staging
        pool = torch.cuda.graph_pool_handle()
        sizes = graph_batch_sizes(self.config.max_num_seqs)
        for bs in reversed(sizes):
            inp = st.graph_input(bs, self.config.max_model_len)
            side = torch.cuda.Stream(self.device)  # warm up off the capture's stream, as torch advises
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile the kernels for this shape and settle the allocator
                    self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta)
            self._graphs[bs] = (graph, out)
        torch.cuda.synchronize(self.device)
        self._graph_sizes = sizes
        self.stats.graph_batch_sizes = sizes
        self.stats.graph_capture_s = time.perf_counter() - t0
        self.stats.graph_pool_bytes = torch.cuda.memory_reserved(self.device) - reserved

    def _graph_size_for(self, scheduled: tuple[ScheduledSeq, ...]) -> int:
        """The captured batch size this step pads up to, or 0 when it runs eagerly."""
        if not (self.use_cuda_graphs and self._graphs and ops.uses_triton(self.kv_cache)):
            return 0
        n = len(scheduled)
        if n > self._graph_sizes[-1] or any(s.num_new_tokens != 1 or not s.do_sample for s in scheduled):
            return 0
        return self._graph_sizes[bisect.bisect_left(self._graph_sizes, n)]

    # ---- steps ---------------------------------------------------------------------------------------------

    def prepare(
        self, out: SchedulerOutput, eager: bool = False, pending: PendingTokens | None = None
    ) -> ModelInput:
        """The step's batch tensors, staged through one pinned buffer (graph buffers for decode batches,
        unless `eager`); input tokens still pending on the device are gathered from `pending` there."""
        bs = 0 if eager else self._graph_size_for(out.scheduled)
        if bs:
            return self._staging.stage_decode(out.scheduled, bs, self.config.max_model_len, pending)
        return self._staging.stage(out.scheduled, pending)

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write: in that order, so a block swapped out is read before reuse."""
        ops.swap_blocks(self.kv_cache, self.swap_cache, list(out.blocks_to_swap_out))
        ops.swap_blocks(self.swap_cache, self.kv_cache, list(out.blocks_to_swap_in))
        if out.blocks_to_copy:
            mapping = torch.tensor(out.blocks_to_copy, dtype=torch.int64, device=self.device)
            ops.copy_blocks(self.kv_cache, mapping)

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        prompt_logits_of: Collection[int] = (),
        pending: PendingTokens | None = None,
    ) -> ExecuteOutput | None:
        """Perform the step's block moves and forward pass; the logits of the sampled rows and, for each
        index of `out.scheduled` in `prompt_logits_of`, of all that sequence's new tokens (such a step runs
        eagerly: a decode graph keeps only what it captured). None when nothing is scheduled.

        Nothing here waits for the device: the logits come back still being computed. Input tokens missing
        from the scheduler's token_ids are read from `pending` (the last step's samples) on the device.
        """
        self.move_blocks(out)
        if not out.scheduled:
            return None
        inp = self.prepare(out, eager=bool(prompt_logits_of), pending=pending)
        if inp.graph_batch_size:
            graph, hidden = self._graphs[inp.graph_batch_size]
            graph.replay()
        else:
            hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta)
        logits = self.model.compute_logits(hidden[inp.sample_rows])
        if not prompt_logits_of:
            return ExecuteOutput(logits)
        starts = list(itertools.accumulate((s.num_new_tokens for s in out.scheduled), initial=0))
        prompt_logits = {
            i: self.model.compute_logits(hidden[starts[i] : starts[i + 1]]) for i in prompt_logits_of
        }
        return ExecuteOutput(logits, prompt_logits)


class _Staging:
    """Host-to-device staging of a step's integers: one pinned int32 buffer, one copy per step.

    Eager steps pack [input ids | positions | slots | sample rows | seq lens | query starts | block tables]
    back to back and read views of one device buffer. Decode graphs read fixed device buffers: ids, positions,
    slots and seq lens `[4, max_bs]` and block tables `[max_bs, max_blocks]`, filled by two device copies out
    of the same one host-to-device copy. On the CPU the host buffer is the device buffer.
    """

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.device = device
        self.block_size = config.cache.block_size
        self.max_blocks = config.max_blocks_per_seq
        seqs, tokens = config.max_num_seqs, max(config.max_num_batched_tokens, config.max_num_seqs)
        self.max_width = _round_up(self.max_blocks, 16)
        size = 4 * tokens + 5 * seqs + 9 * _ALIGN + seqs * self.max_width
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=torch.int32, device=device) if cuda else self.host
        self._copied = torch.cuda.Event() if cuda else None  # the last copy out of `host` has finished
        # Decode-graph buffers (device only): padding rows keep slot -1 and seq len 0, so kernels skip them.
        self.max_graph_bs = seqs
        self.g_stride = _round_up(seqs, _ALIGN)
        self.g_small = torch.zeros((4, self.g_stride), dtype=torch.int32, device=device)
        self.g_bt = torch.zeros((seqs, self.max_width), dtype=torch.int32, device=device)
        self.g_qsl = torch.arange(seqs + 1, dtype=torch.int32, device=device)

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
        ids, pos, slots, seq_lens = self.g_small[:, :bs]
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.g_bt[:bs],
            seq_lens=seq_lens,
            query_start_loc=self.g_qsl[: bs + 1],
            max_query_len=1,
            max_seq_len=max_seq_len,
        )
        if bs == self.max_graph_bs:  # before capture: all rows are padding
            self.g_small[2].fill_(-1)
            self.g_small[3].zero_()
        return ModelInput(ids, pos, meta, slice(None), graph_batch_size=bs)

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
        width = _table_width(width)
        h[0:n], h[mb : mb + n], h[2 * mb : 2 * mb + n], h[3 * mb : 3 * mb + n] = ids, pos, slots, lens
        h[n:bs] = 0
        h[mb + n : mb + bs] = 0
        h[2 * mb + n : 2 * mb + bs] = -1
        h[3 * mb + n : 3 * mb + bs] = 0
        bt = h[4 * mb : 4 * mb + n * width].reshape(n, width)
        bt.fill(0)
        for i, s in enumerate(scheduled):
            bt[i, : len(s.block_table)] = s.block_table
        bt_end = 4 * mb + n * width
        o_dst = _round_up(bt_end, _ALIGN)
        o_src, k, end = self._stage_pending(o_dst, scheduled, list(range(n)), pending)
        self._send(end)
        self.g_small.view(-1).copy_(self.dev[: 4 * mb])
        self.g_bt[:n, :width].copy_(self.dev[4 * mb : bt_end].view(n, width))
        ids_t, pos_t, slots_t, lens_t = self.g_small[:, :bs]
        self._fill_pending(ids_t, o_dst, o_src, k, pending)
        meta = AttentionMetadata(slots_t, self.g_bt[:bs], lens_t, self.g_qsl[: bs + 1], 1, max_seq_len)
        return ModelInput(ids_t, pos_t, meta, slice(0, n), graph_batch_size=bs)

    def stage(self, scheduled: tuple[ScheduledSeq, ...], pending: PendingTokens | None = None) -> ModelInput:
        """Pack an arbitrary (prefill, mixed or decode) batch and send it in one copy."""
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
            if s.do_sample:
                samples.append(starts[-1] - 1)
            width = max(width, len(table))
        n_samp = len(samples)
        width = _table_width(width)
        o_pos = _round_up(n_tok, _ALIGN)
        o_slot = 2 * o_pos
        o_samp = 3 * o_pos
        o_len = o_samp + _round_up(n_samp, _ALIGN)
        o_qsl = o_len + _round_up(n_seq, _ALIGN)
        o_bt = o_qsl + _round_up(n_seq + 1, _ALIGN)
        end = o_bt + n_seq * width
        h = self.host_np
        h[0:n_tok], h[o_pos : o_pos + n_tok], h[o_slot : o_slot + n_tok] = ids, pos, slots
        h[o_samp : o_samp + n_samp], h[o_len : o_len + n_seq], h[o_qsl : o_qsl + n_seq + 1] = (
            samples,
            lens,
            starts,
        )
        bt = h[o_bt:end].reshape(n_seq, width)
        bt.fill(0)
        for i, s in enumerate(scheduled):
            bt[i, : len(s.block_table)] = s.block_table
        o_dst = _round_up(end, _ALIGN)
        o_src, k, end_all = self._stage_pending(o_dst, scheduled, starts, pending)
        self._send(end_all)
        d = self.dev
        self._fill_pending(d[0:n_tok], o_dst, o_src, k, pending)
        meta = AttentionMetadata(
            slot_mapping=d[o_slot : o_slot + n_tok],
            block_tables=d[o_bt:end].view(n_seq, width),
            seq_lens=d[o_len : o_len + n_seq],
            query_start_loc=d[o_qsl : o_qsl + n_seq + 1],
            max_query_len=max(s.num_new_tokens for s in scheduled),
            max_seq_len=max(lens),
        )
        rows: torch.Tensor | slice = slice(0, n_tok) if n_samp == n_tok else d[o_samp : o_samp + n_samp]
        return ModelInput(d[0:n_tok], d[o_pos : o_pos + n_tok], meta, rows)
