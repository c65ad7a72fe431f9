"""The model runner: owns the model and the KV caches, turns a SchedulerOutput into one forward pass.

On a GPU a step is built to stay off the host's critical path: the batch's integers are packed into one pinned
buffer and sent in one non-blocking copy, the attention launch gets its bounds from the host (no device
syncs), and steps replay CUDA graphs where their shapes allow: decode-only batches the graph captured for the
next batch size up, steps with prefill chunks (up to `cuda_graph_max_tokens`) the graph of the next token count
up, captured with every sequence row (padding rows and tokens write no K/V and attend to nothing; the attention
kernel's grid depends on shapes only). Larger steps, and steps that score prompts, run eagerly. The only
synchronisation of a step is the sampler's read of the sampled tokens. The staging itself lives in `staging.py`.

One job, past 450 lines: turning one SchedulerOutput into one forward pass over the caches it owns. Loading the
model, allocating the caches, capturing and choosing the CUDA graphs and running a step all read the same
shapes and buffers; the parts that stand alone are apart already: the staging of the inputs (`staging.py`),
an FP8 cache's dtype and scales (`kv_scales.py`) and a draft model's weights and share of the budget
(`draft_weights.py`). `scratch_step` builds the SchedulerOutputs the runner executes before any request (the
warm-up's passes, the speculative costs' measurement), over the first blocks of these caches.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from tinypaged import compile_cache, cpu_linear, ops
from tinypaged.config import EngineConfig
from tinypaged.core.schedule_types import ScheduledSeq
from tinypaged.core.scheduler import SchedulerOutput
from tinypaged.engine.device.draft_weights import DraftWeights, load_draft, split_kv_budget
from tinypaged.engine.device.kv_scales import resolve_kv_cache_dtype, set_kv_scales
from tinypaged.engine.device.staging import ModelInput, PendingTokens, Staging, table_width
from tinypaged.errors import ConfigError
from tinypaged.model import AttentionMetadata, cpu_graph, load_model
from tinypaged.model.llama import Attention
from tinypaged.model.parallel import TPGroup
from tinypaged.model.quant import Linear, cpu_reference_layers

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GiB = 1 << 30


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA when there is a GPU, else the CPU; a CUDA device this machine lacks is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    count = torch.cuda.device_count() if device.type == "cuda" and torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise ConfigError(f"device {name}: this machine has {count} CUDA device(s)")
    return device


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


def graph_token_sizes(max_tokens: int) -> list[int]:
    """Token counts of the steps with prefill chunks that get a CUDA graph: 16 to 128 by doubling, multiples
    of 128 to 1024, of 256 above, and `max_tokens` (0: none). Such steps near 1,000 tokens are compute-bound,
    so a padded token costs as much as a real one: the larger the step, the finer the steps."""
    if max_tokens < 16:
        return []
    sizes = {16, 32, 64} | set(range(128, min(max_tokens, 1024) + 1, 128)) | set(range(1280, max_tokens, 256))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class GraphChoice(NamedTuple):
    """The CUDA graph a step replays: a decode graph (its batch size), a mixed-step graph (its token count), or
    neither (both 0: the step runs eagerly)."""

    batch_size: int = 0
    num_tokens: int = 0


EAGER = GraphChoice()


@dataclass(frozen=True)
class ExecuteOutput:
    """A step's logits: of the rows that sample, and of every new token of the sequences asked for."""

    # [S, vocab] in the model's dtype: each sampling sequence's last new token (a verification's last k + 1)
    logits: torch.Tensor
    # Index in SchedulerOutput.scheduled -> [num_new_tokens, vocab] (prompt_logprobs score every prompt token).
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    graph: GraphChoice = EAGER  # the CUDA graph the forward pass replayed
    # Recorded before and after the forward pass when `ModelRunner.time_device` is on (CUDA only).
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None


@dataclass
class RunnerStats:
    """How the runner set itself up (seconds and bytes), for logs and benchmarks."""

    compile_cache: str = ""  # Triton's cache directory and what it held at the start (GPU only)
    load_s: float = 0.0
    weights_bytes: int = 0
    # Weight-only layers on the CPU that torch's packed kernels do not take: each dequantizes its whole weight
    # every call (model/quant/linear.py, `cpu_reference_layers`); 0 for every type the kernels run
    cpu_reference_layers: int = 0
    profile_activation_bytes: int = 0
    non_torch_bytes: int = 0
    kv_cache_bytes: int = 0
    draft_weights_bytes: int = 0  # a draft model's (speculative decoding), in the same budget
    draft_kv_cache_bytes: int = 0
    kv_cache_dtype: str = ""  # e.g. "bfloat16", "float8_e4m3fn"
    kv_scales: str = ""  # an FP8 cache's scales: checkpoint, calibrated or 1.0 (none: no FP8 cache)
    kv_cache_s: float = 0.0  # sizing (the profiling pass, which compiles the prefill kernels) and allocation
    graph_capture_s: float = 0.0
    graph_pool_bytes: int = 0
    graph_batch_sizes: list[int] = field(default_factory=list)
    graph_token_sizes: list[int] = field(default_factory=list)
    warm_logits_s: float = 0.0
    cpu_graph: str = ""  # the CPU's compiled decode step: building, loaded or failed (none: not taken)


class ModelRunner:
    """Loads the weights, allocates the paged KV cache (and its CPU swap space), runs forward passes.

    `use_cuda_graphs` may be switched off at run time (the graphs stay captured), e.g. to time eager decoding
    on the same engine; `use_mixed_graphs` likewise for the graphs of steps with prefill chunks alone.
    `time_device` (benchmarks) records CUDA events around each forward pass; the engine reports the time between
    them in its step statistics.

    Under tensor parallelism (`tp` of several ranks) each rank has a runner over its share of the weights and
    of the KV heads, and runs every step of the same plan (executor.py): the collectives of the forward pass
    pair up rank by rank. Rank 0's runner is the driver's, whose logits the sampler reads; the others take
    their input ids from rank 0 by broadcast, since tokens still pending on the device exist only there.
    """

    def __init__(
        self, config: EngineConfig, tp: TPGroup | None = None, device: torch.device | None = None
    ) -> None:
        self.config = config
        self.tp = tp or TPGroup()
        mcfg = config.model_config
        self.stats = RunnerStats()
        self.device = device or resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, mcfg.torch_dtype, self.device)
        # Checked before anything is loaded: a GPU without FP8 refuses an FP8 cache at once.
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.stats.kv_cache_dtype = str(self.kv_dtype).removeprefix("torch.")
        if self.device.type == "cuda":
            ops.prefer_cublaslt()
            # Before the first launch compiles anything: the kernels come from (and go to) the persistent cache.
            self.stats.compile_cache = compile_cache.setup().describe()
        t0 = time.perf_counter()
        self.model = load_model(
            mcfg,
            self.dtype,
            self.device,
            config.max_model_len,
            self.tp,
            config.quantization,
            cpu_kernels=True,
        )
        self.stats.load_s = time.perf_counter() - t0
        if self.device.type == "cpu" and _float32_products(self.model):
            cpu_linear.transposed_rows()  # measured now, once a process, not inside a request's first step
        self.stats.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        slow = cpu_reference_layers(self.model)
        self.stats.cpu_reference_layers = len(slow)
        if slow:
            logger.warning(
                "%d weight-only layers run the dequantizing reference on the CPU (torch's packed kernels do not "
                "take them), e.g. %s: slow",
                len(slow),
                slow[0],
            )
        # A draft model (speculative decoding) loads before the KV cache is sized, on the driver's rank alone:
        # its weights and its pools share the target's budget (draft_weights.py).
        self.draft: DraftWeights | None = None
        self.cpu_graph: cpu_graph.CpuGraph | None = None
        spec = config.speculative
        if spec is not None:  # a verification's k + 1 new tokens a sequence take the split decode attention
            for module in self.model.modules():
                if isinstance(module, Attention):
                    module.short_query_len = spec.num_speculative_tokens + 1
        if spec is not None and spec.method == "draft_model" and self.tp.rank == 0:
            self.draft = load_draft(config, self.device, self.dtype)
            self.stats.draft_weights_bytes = self.draft.weights_bytes
        self.block_size = config.block_size
        t0 = time.perf_counter()
        kv_start, kv_end = self.tp.kv_heads(mcfg.num_kv_heads)
        self.num_kv_heads = kv_end - kv_start  # this rank's
        # Before the graphs are captured: they keep the scales they see.
        self.stats.kv_scales = set_kv_scales(
            self.model, config, self.kv_dtype, self.tp, lambda p: self._prefill(p, self.dtype)[2]
        )
        shape = (mcfg.num_layers, 2, self.block_size, self.num_kv_heads, mcfg.head_dim)
        self.block_bytes = torch.Size(shape).numel() * self.kv_dtype.itemsize
        self.use_cuda_graphs = self.device.type == "cuda" and not config.enforce_eager
        max_graph_tokens = min(config.cuda_graph_max_tokens, config.max_num_batched_tokens)
        self._token_sizes = graph_token_sizes(max_graph_tokens) if self.use_cuda_graphs else []
        self._staging = Staging(
            config,
            self.device,
            ids_from_rank0=self.tp.rank > 0,
            max_graph_tokens=self._token_sizes[-1] if self._token_sizes else 0,
        )
        # Every rank holds every block (its share of each): the rank with the least memory decides.
        self.num_gpu_blocks = self.tp.min_int(
            config.num_gpu_blocks_override or self._blocks_that_fit(), self.device
        )
        self.num_cpu_blocks = self._split(int(config.swap_space * GiB))
        self.num_draft_blocks = self.draft.pool_blocks(self.num_gpu_blocks) if self.draft else 0
        self.num_draft_cpu_blocks = min(self.num_draft_blocks, self.num_cpu_blocks)
        if self.draft is not None:
            self.stats.draft_kv_cache_bytes = self.num_draft_blocks * self.draft.block_bytes
        # Zeroed, not empty: the torch reference attention reads whole blocks (and padding) and masks afterwards,
        # and uninitialised memory can hold NaNs, which a zero attention weight does not cancel (0 * NaN = NaN).
        pool = "cpu_kv_cache_space" if self.device.type == "cpu" else "gpu_memory_utilization"
        pool = "num_gpu_blocks_override" if config.num_gpu_blocks_override else pool
        self.kv_cache = self._allocate(self.num_gpu_blocks, self.device, zero=True, setting=pool)
        # The CPU's decode step compiled into one graph, built in the background (model/cpu_graph.py).
        on_cpu = self.device.type == "cpu" and not config.enforce_eager
        self.cpu_graph = cpu_graph.start(self.model, self.kv_cache) if on_cpu else None
        self.stats.cpu_graph = self.cpu_graph.state if self.cpu_graph else ""
        self.stats.kv_cache_bytes = self.num_gpu_blocks * self.block_bytes
        # torch.empty leaves host pages untouched until a block is swapped out, so unused swap space costs nothing.
        self.swap_cache = self._allocate(
            self.num_cpu_blocks, torch.device("cpu"), pin=self.device.type == "cuda", setting="swap_space"
        )
        self.stats.kv_cache_s = time.perf_counter() - t0
        self.time_device = False
        self.use_mixed_graphs = True
        self._graphs: dict[GraphChoice, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_sizes: list[int] = []
        if self.use_cuda_graphs:
            self._capture_graphs()
        if self.device.type == "cuda":
            self._warm_logits()
        logger.info(
            "KV cache: %d blocks of %d tokens in %s (%.2f GiB), swap: %d blocks; CUDA graphs for decode batches "
            "%s and steps of %s tokens",
            self.num_gpu_blocks,
            self.block_size,
            self.stats.kv_cache_dtype,
            self.num_gpu_blocks * self.block_bytes / GiB,
            self.num_cpu_blocks,
            self._graph_sizes or "(none)",
            self._token_sizes or "(none)",
        )
        if self.draft is not None:
            logger.info(
                "Draft model: %.2f GiB of weights; its KV cache %d blocks (%.2f GiB), swap %d blocks",
                self.draft.weights_bytes / GiB,
                self.num_draft_blocks,
                self.stats.draft_kv_cache_bytes / GiB,
                self.num_draft_cpu_blocks,
            )

    def _allocate(
        self,
        num_blocks: int,
        device: torch.device,
        pin: bool = False,
        zero: bool = False,
        dtype: torch.dtype | None = None,
        setting: str = "",
    ) -> torch.Tensor:
        """A KV pool of `num_blocks`; one that cannot be allocated is a ConfigError naming the `setting` that
        sized it (e.g. a num_gpu_blocks_override past the memory), not an allocator's message."""
        m = self.config.model_config
        shape = (m.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, m.head_dim)
        make = torch.zeros if zero else torch.empty
        try:
            return make(shape, dtype=dtype or self.kv_dtype, device=device, pin_memory=pin)
        except (RuntimeError, MemoryError) as e:  # torch's allocators raise RuntimeError (OutOfMemoryError)
            size = torch.Size(shape).numel() * (dtype or self.kv_dtype).itemsize
            raise ConfigError(
                f"a KV cache of {num_blocks} blocks ({size / GiB:.1f} GiB) cannot be allocated on {device}"
                + (f": lower {setting}" if setting else "")
                + f" ({type(e).__name__})"
            ) from e

    # ---- memory ------------------------------------------------------------------------------------------

    def _blocks_that_fit(self) -> int:
        """How many KV blocks the memory budget holds after the weights and the largest step's activations.

        As vLLM: budget = total memory x gpu_memory_utilization - (weights + peak activations of a profiling
        forward pass over max_num_batched_tokens + memory outside torch's allocator, e.g. the CUDA context).
        """
        if self.device.type == "cpu":
            return max(1, self._split(int(self.config.cpu_kv_cache_space * GiB)))
        torch.cuda.empty_cache()
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        if self.tp.size == 1:  # its kernels compiled side by side first (a tensor-parallel rank runs in step)
            compile_cache.dry_run(self._profile_run, "the profiling pass")
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(self.device))
        # The sampler's working set is outside the profile: a few fp32 copies of the sampled rows' logits (the
        # penalties' copy, logprobs' log-softmax and ranks, beam search's log-softmax), reserved generously.
        sampler = 8 * self.config.max_num_seqs * self.config.model_config.vocab_size * 4
        self.stats.profile_activation_bytes = activations
        self.stats.non_torch_bytes = non_torch
        used = torch.cuda.memory_allocated(self.device) + activations + non_torch + sampler
        budget = total * self.config.gpu_memory_utilization - used
        blocks = self._split(int(budget))
        if blocks < 1:
            raise MemoryError("no GPU memory left for the KV cache; raise --gpu-memory-utilization")
        return blocks

    def _split(self, budget: int) -> int:
        """The target's KV blocks in `budget` bytes, beside the draft model's pool when there is one."""
        return split_kv_budget(budget, self.block_bytes, self.draft)

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
                (seqs, table_width(-(-max(lens) // self.block_size))), dtype=torch.int32, device=dev
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

    @torch.inference_mode()
    def _warm_logits(self) -> None:
        """Run the LM head once for every row count a step can sample (1 to max_num_seqs), before any step (on a
        GPU only: the CPU has nothing to load).

        The sampled rows' logits are computed outside the graphs, at a row count that changes from step to
        step. The first matmul of a new shape can load a BLAS kernel, and that load waits for all the work
        queued on the device: the host then stalls for a whole step instead of queuing the next one. In W1's
        first run this cost 1.2-1.3% (BENCHMARKS.md, "The LM head's first shapes")."""
        t0 = time.perf_counter()
        spec = self.config.speculative  # verification samples k + 1 rows a sequence
        rows = self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        hidden = torch.zeros(
            (
                max(self.config.max_num_seqs, min(rows, self.config.max_num_batched_tokens)),
                self.config.model_config.hidden_size,
            ),
            dtype=self.dtype,
            device=self.device,
        )
        for n in range(1, hidden.shape[0] + 1):
            self.model.compute_logits(hidden[:n])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.warm_logits_s = time.perf_counter() - t0

    # ---- CUDA graphs ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture the forward pass of a decode batch for each size of `graph_batch_sizes`, then of a step with
        prefill chunks for each token count of `graph_token_sizes`, largest first, all in one memory pool; each
        reads its inputs from the staging area's persistent graph buffers.

        Under tensor parallelism the graphs hold the step's collectives too (NCCL kernels are captured like any
        other): the broadcast of rank 0's input ids, then the forward pass with its all-reduces."""
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        st = self._staging
        pool = torch.cuda.graph_pool_handle()
        sizes = graph_batch_sizes(self.config.max_num_seqs)
        max_len = self.config.max_model_len
        inputs = [
            (GraphChoice(num_tokens=t), st.mixed_graph_input(t, max_len)) for t in self._token_sizes[::-1]
        ]
        inputs += [(GraphChoice(batch_size=bs), st.graph_input(bs, max_len)) for bs in sizes[::-1]]
        if self.tp.size == 1:  # a dry run first: the kernels of every graph compile side by side
            compile_cache.dry_run(lambda: self._forward_each(inputs), "graph capture")
        # NCCL's watchdog thread queries events while we capture: only this thread's calls are checked.
        mode = "thread_local" if self.tp.size > 1 else "global"
        for key, inp in inputs:
            side = torch.cuda.Stream(self.device)  # warm up off the capture's stream, as torch advises
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile the kernels for this shape and settle the allocator
                    self._forward(inp, self.kv_cache, ids_pending=True)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                out = self._forward(inp, self.kv_cache, ids_pending=True)
            self._graphs[key] = (graph, out)
        torch.cuda.synchronize(self.device)
        self._graph_sizes = sizes
        self.stats.graph_batch_sizes = sizes
        self.stats.graph_token_sizes = self._token_sizes
        self.stats.graph_capture_s = time.perf_counter() - t0
        self.stats.graph_pool_bytes = torch.cuda.memory_reserved(self.device) - reserved

    def _forward_each(self, inputs: list[tuple[GraphChoice, ModelInput]]) -> None:
        """One forward pass over each graph's input, results dropped (the graphs' dry run)."""
        for _, inp in inputs:
            self._forward(inp, self.kv_cache, ids_pending=True)

    def choose_graph(self, out: SchedulerOutput, eager: bool = False) -> GraphChoice:
        """The CUDA graph this step replays (EAGER: none; always, with `eager`): a decode-only batch the decode
        graph of the next batch size up, any other step the mixed-step graph of the next token count up."""
        if eager or not (self.use_cuda_graphs and self._graphs and ops.uses_triton(self.kv_cache)):
            return EAGER
        scheduled = out.scheduled
        n = len(scheduled)
        sizes = self._graph_sizes
        if n <= sizes[-1] and all(s.num_new_tokens == 1 and s.do_sample for s in scheduled):
            return GraphChoice(batch_size=sizes[bisect.bisect_left(sizes, n)])
        tokens = self._token_sizes
        if tokens and self.use_mixed_graphs and out.num_batched_tokens <= tokens[-1]:
            return GraphChoice(num_tokens=tokens[bisect.bisect_left(tokens, out.num_batched_tokens)])
        return EAGER

    # ---- steps ---------------------------------------------------------------------------------------------

    def prepare(
        self, out: SchedulerOutput, graph: GraphChoice = EAGER, pending: PendingTokens | None = None
    ) -> ModelInput:
        """The step's batch tensors, staged through one pinned buffer (into the buffers of the `graph` it
        replays); input tokens still pending on the device are gathered from `pending` there."""
        if graph.batch_size:
            return self._staging.stage_decode(
                out.scheduled, graph.batch_size, self.config.max_model_len, pending
            )
        return self._staging.stage(out.scheduled, pending, graph.num_tokens)

    def _forward(self, inp: ModelInput, kv_cache: torch.Tensor, ids_pending: bool) -> torch.Tensor:
        """The model over a staged batch. Under tensor parallelism, when some input ids are pending on the
        device (they are only on rank 0), every rank first takes rank 0's ids."""
        if ids_pending and self.tp.size > 1:
            self.tp.broadcast(inp.input_ids)
        if self.cpu_graph is not None and kv_cache is self.kv_cache:
            hidden = self.cpu_graph.forward(inp.input_ids, inp.positions, inp.meta)
            if hidden is not None:
                return hidden
        return self.model(inp.input_ids, inp.positions, kv_cache, inp.meta)

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
        graph: GraphChoice | None = None,
    ) -> ExecuteOutput | None:
        """Perform the step's block moves and forward pass; the logits of the sampled rows and, for each
        index of `out.scheduled` in `prompt_logits_of`, of all that sequence's new tokens (such a step runs
        eagerly: a graph keeps only what it captured). None when nothing is scheduled.

        Nothing here waits for the device: the logits come back still being computed. Input tokens missing
        from the scheduler's token_ids are read from `pending` (the last step's samples) on the device.
        `graph`: the CUDA graph to replay (EAGER: none), as rank 0 chose it for every rank; None: this runner
        chooses (`choose_graph()`).
        """
        if not out.scheduled:
            self.move_blocks(out)
            return None
        events = None
        if self.time_device and self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        self.move_blocks(out)
        if graph is None:
            graph = self.choose_graph(out, eager=bool(prompt_logits_of))
        inp = self.prepare(out, graph, pending)
        if graph != EAGER:
            cuda_graph, hidden = self._graphs[graph]
            cuda_graph.replay()
        else:
            ids_pending = self.tp.size > 1 and any(s.num_new_tokens > len(s.token_ids) for s in out.scheduled)
            hidden = self._forward(inp, self.kv_cache, ids_pending)
        logits = self.model.compute_logits(hidden[inp.sample_rows])
        if events is not None:
            events[1].record()
        prompt_logits = {}
        if prompt_logits_of:
            # One LM head over every scored chunk's rows: a call per chunk re-reads the whole vocabulary's
            # weights each time (34 chunks of 15 rows: 3.4 s on the CPU, against 0.6 s for their 512 rows at once).
            starts = list(itertools.accumulate((s.num_new_tokens for s in out.scheduled), initial=0))
            rows = [r for i in prompt_logits_of for r in range(starts[i], starts[i + 1])]
            logits_of = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
            sizes = [starts[i + 1] - starts[i] for i in prompt_logits_of]
            prompt_logits = dict(zip(prompt_logits_of, logits_of.split(sizes), strict=True))
        return ExecuteOutput(logits, prompt_logits, graph, events)

    # ---- outside the engine's steps ------------------------------------------------------------------------

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """A zeroed paged KV cache of `num_blocks` blocks in the runner's layout, dtype and device: scratch space
        for a forward pass outside the engine's steps (e.g. a numerics check)."""
        return self._allocate(num_blocks, self.device, zero=True)

    @torch.inference_mode()
    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits `[P, vocab]` of every position of each prompt (on the CPU), by one eager ragged prefill
        into a scratch paged cache: what the engine's first step computes for them, outside its steps (the
        engine's cache is untouched). Under tensor parallelism every rank must run it (executor.py)."""
        hidden, starts, _ = self._prefill(prompts)
        logits = self.model.compute_logits(hidden).float()
        return [logits[starts[i] : starts[i + 1]].cpu() for i in range(len(prompts))]

    @torch.inference_mode()
    def _prefill(
        self, prompts: list[list[int]], kv_dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """One eager ragged prefill of the prompts into a zeroed scratch cache (of `kv_dtype`, by default the
        runner's) whose blocks they take in turn: (hidden states of every position, the prompts' first rows and
        the end, the cache)."""
        bs, dev = self.block_size, self.device
        widths = [-(-len(p) // bs) for p in prompts]
        kv = self._allocate(sum(widths), dev, zero=True, dtype=kv_dtype)
        tables, slots, first = [], [], 0
        for p, w in zip(prompts, widths, strict=True):
            table = list(range(first, first + w))
            first += w
            tables.append(table + [0] * (max(widths) - w))
            slots += [table[i // bs] * bs + i % bs for i in range(len(p))]
        starts = list(itertools.accumulate((len(p) for p in prompts), initial=0))
        meta = AttentionMetadata(
            torch.tensor(slots, device=dev),
            torch.tensor(tables, dtype=torch.int32, device=dev),
            torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev),
            torch.tensor(starts, dtype=torch.int32, device=dev),
        )
        ids = torch.tensor([t for p in prompts for t in p], device=dev)
        pos = torch.tensor([i for p in prompts for i in range(len(p))], device=dev)
        return self.model(ids, pos, kv, meta), starts, kv

    def release(self) -> None:
        """Free the weights, the KV caches and the CUDA graphs (e.g. before another model loads in the same
        process); the runner cannot run afterwards. Idempotent."""
        if not hasattr(self, "model"):
            return
        self._graphs.clear()
        self._graph_sizes = []
        self._token_sizes = []
        self.use_cuda_graphs = False
        if self.cpu_graph is not None:
            self.cpu_graph.close()
            self.cpu_graph = None
        del self.model, self.kv_cache, self.swap_cache


def scratch_step(seqs: list[tuple[int, int]], block_size: int, num_spec: int = 0) -> SchedulerOutput:
    """A step of sequences given as (tokens already computed, new tokens), each on blocks 0, 1, ... (their K/V
    are scratch: the warm-up's passes and the speculative costs' measurement, before any request); `num_spec` of
    each one's new tokens proposed ones."""
    scheduled = tuple(
        ScheduledSeq(
            seq_id=i,
            request_id=f"warmup-{i}",
            num_computed_tokens=done,
            num_new_tokens=new,
            token_ids=(0,) * new,
            block_table=tuple(range(-(-(done + new) // block_size))),
            do_sample=True,
            num_spec_tokens=num_spec,
        )
        for i, (done, new) in enumerate(seqs)
    )
    return SchedulerOutput(scheduled, (), (), (), (), (), sum(new for _, new in seqs))


def _float32_products(model: torch.nn.Module) -> bool:
    """Whether the model's steps run float32 products through `ops.linear` (a layer kept unquantized in float32,
    or the LM head where it is not held in int8): where `cpu_linear` may take them the transposed way. A GGUF
    model served quantized runs none."""
    head_int8 = model.lm_head is None and model.embed_tokens.int8 is not None
    layers = (m for m in model.modules() if isinstance(m, Linear))
    return any(
        getattr(m, "weight", None) is not None and m.weight.dtype == torch.float32 for m in layers
    ) or (not head_int8 and model.embed_tokens.weight.dtype == torch.float32)
