"""The draft-model proposer: a smaller model of the target's vocabulary (or the target itself, quantized: its
own low-bit copy, `quantization="int4"` through the loader's low-bit path) proposes k tokens autoregressively,
greedy for a greedy request and sampled otherwise, with the distribution q it sampled each from kept for the
target's rejection sampling.

The draft's KV cache is paged by the same block manager (core/kv_cache_manager.py) over a pool of its own. Per
sequence it remembers the tokens whose K/V it holds; at the next proposal it keeps the longest prefix of them
that the sequence still has (the proposals the target accepted) and gives back the blocks past it, then
catches up on the rest in ragged passes, and decodes k - 1 more. Preemption follows the target's: a group
swapped out has its draft blocks swapped out too (to the draft's own CPU pool) and back in
at its next proposal, so it resumes without recomputing; a group preempted by recompute, or one whose draft blocks
do not fit the CPU pool, is freed and catches up from its prompt when it comes back. A sequence that ended is
freed at the next proposal. A sequence whose blocks do not fit in the draft's pool gets no proposal that step (it
decodes as without speculation).

The draft's weights are loaded, and its pools sized within the target's memory budget, by the model runner
(device/draft_weights.py). A catch-up pass takes at most max_num_batched_tokens tokens, so the draft's
activations stay within the profiled peak of the target's largest step.

On a GPU whose target runs CUDA graphs, so does the draft: its decode passes replay a graph of the next batch
size up (1, 2, 4, 8, 16, 32), its catch-ups of up to 64 tokens a mixed-step graph of 16, 32 or 64 tokens, each
reading a staging area of its own (device/staging.py, as the target's runner does), captured at the engine's
warm-up in a memory pool of their own. Longer catch-ups (a prompt's first) run eagerly. Without graphs each of
the draft's passes launched its few hundred kernels one by one, and the INT4 self-draft ran at 0.07-0.22x.
"""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING

import torch

from tinypaged import compile_cache, ops
from tinypaged.config import EngineConfig
from tinypaged.core.kv_cache_manager import KVCacheManager
from tinypaged.core.schedule_types import ScheduledSeq
from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from tinypaged.engine.device.model_runner import GraphChoice, graph_batch_sizes
from tinypaged.engine.device.staging import Staging
from tinypaged.engine.request import Request
from tinypaged.engine.sampling.rejection import target_probs
from tinypaged.engine.sampling.sampler import _GAMMA, SamplingRow, mix64, upload
from tinypaged.engine.speculative.proposers import NO_PROPOSAL, OracleProposer, Proposal
from tinypaged.model import AttentionMetadata
from tinypaged.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from tinypaged.engine.device.model_runner import ModelRunner

_DRAFT = 0xD4AF7  # salt: the draft's uniforms are independent of verification's
_GRAPH_MAX_BS = 32  # the largest decode batch the draft replays as a CUDA graph
_GRAPH_TOKENS = (16, 32, 64)  # catch-up token counts the draft replays as CUDA graphs


class DraftModelProposer:
    """Runs the draft model over its own paged KV cache; see the module docstring."""

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, runner: ModelRunner) -> None:
        draft = runner.draft  # loaded, and its pools sized, by the runner (device/draft_weights.py)
        assert draft is not None and config.max_model_len is not None
        mcfg = draft.config
        self.device, self.dtype = runner.device, runner.dtype
        self.model = draft.model
        # The acceptance switch's cost of one proposed token, in target decode steps: a batch-1 decode reads
        # every weight once, so the draft's weight bytes over the target's.
        self.token_cost = draft.weights_bytes / max(runner.stats.weights_bytes, 1)
        self.block_size = bs = config.block_size
        self.max_chunk = config.max_num_batched_tokens  # a catch-up pass's most tokens
        blocks, swap_blocks = runner.num_draft_blocks, runner.num_draft_cpu_blocks
        self.kv = KVCacheManager(bs, blocks, swap_blocks, watermark=0.0)
        shape = (mcfg.num_layers, 2, blocks, bs, mcfg.num_kv_heads, mcfg.head_dim)
        self.cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        cpu = torch.device("cpu")
        pin = self.device.type == "cuda"
        self.swap_cache = torch.zeros((*shape[:2], swap_blocks, *shape[3:]), dtype=self.dtype, device=cpu)
        if pin and swap_blocks:
            self.swap_cache = self.swap_cache.pin_memory()
        self._swapped: dict[int, SequenceGroup] = {}  # seq id -> its group, while its draft blocks are on CPU
        self.num_swap_outs = self.num_swap_ins = 0
        self.vocab_size = config.model_config.vocab_size
        self._mirror: dict[int, Sequence] = {}  # per sequence: the tokens whose K/V the draft holds
        # Benchmarks: keep the draft's cost, replace its proposals as the oracle's (docs/speculative.md).
        self.oracle: OracleProposer | None = None
        if spec.oracle_acceptance_rate is not None:
            self.oracle = OracleProposer(spec.oracle_acceptance_rate, self.vocab_size, config.seed)
        # CUDA graphs, where the target has them (captured at warm-up: `_capture`).
        self.max_model_len = config.max_model_len
        self._graphs: dict[GraphChoice, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._batch_sizes = graph_batch_sizes(min(config.max_num_seqs, _GRAPH_MAX_BS))
        self._token_sizes = [t for t in _GRAPH_TOKENS if t <= config.max_num_batched_tokens]
        self._staging: Staging | None = None
        if runner.use_cuda_graphs and ops.uses_triton(self.cache):
            self._staging = Staging(config, self.device, max_graph_tokens=max(self._token_sizes, default=0))

    def free(self, seq_id: int) -> None:
        """Forget a sequence: its draft blocks go back (to the CPU pool when they are swapped out)."""
        self._swapped.pop(seq_id, None)
        if self._mirror.pop(seq_id, None) is not None:
            self.kv.free(seq_id)

    def preempted(self, group: SequenceGroup, swapped: bool) -> None:
        """The target preempted the group: swap its draft blocks out with it, or free them (recompute, or no
        room in the CPU pool: the draft catches up from the prompt when the group comes back)."""
        seqs = [s for s in group.seqs if s.seq_id in self._mirror]
        if swapped and seqs and self.kv.can_swap_out(group):
            ops.swap_blocks(self.cache, self.swap_cache, self.kv.swap_out(group))
            self._swapped.update((s.seq_id, group) for s in seqs)
            self.num_swap_outs += 1
            return
        for s in seqs:
            self.free(s.seq_id)

    def _swap_in(self, seq: Sequence) -> None:
        """Bring back the draft blocks of the sequence's group (swapped out with it) before it proposes again;
        freed instead if the draft's GPU pool has no room for them."""
        group = self._swapped[seq.seq_id]
        seqs = [seq_id for seq_id, g in self._swapped.items() if g is group]
        if self.kv.can_swap_in(group, use_watermark=False):
            ops.swap_blocks(self.swap_cache, self.cache, self.kv.swap_in(group))
            self.num_swap_ins += 1
            for seq_id in seqs:
                del self._swapped[seq_id]
        else:
            for seq_id in seqs:
                self.free(seq_id)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """The draft's kernels compiled before ready (its shapes are not the target's; an INT4 copy launches
        kernels the target never does): a catch-up of 17 and of 16 tokens (Triton specialises lengths on
        multiples of 16), then decodes of two rows and of one, on scratch sequences whose blocks go back."""
        scratch = [Sequence(-1 - i, [0] * n) for i, n in enumerate((17, 16))]
        for m in scratch:
            assert self.kv.allocate_slots(m, len(m.token_ids) + 2) is not None
        self._forward(scratch, [m.token_ids for m in scratch])
        self._forward(scratch, [[0], [0]])
        self._forward(scratch[:1], [[0]])
        for m in scratch:
            self.kv.free(m.seq_id)
        if self._staging is not None and not self._graphs and not compile_cache.compiling_only():
            self._capture()

    def _capture(self) -> None:
        """Capture the draft's forward pass for each catch-up token count, then each decode batch size, largest
        first, in one memory pool of their own; each reads the draft's staging area's graph buffers."""
        st = self._staging
        assert st is not None
        st.g_small[2].fill_(-1)  # a decode graph's padding rows: no slot, no context
        st.g_small[3].zero_()
        pool = torch.cuda.graph_pool_handle()
        inputs = [
            (GraphChoice(num_tokens=t), st.mixed_graph_input(t, self.max_model_len))
            for t in self._token_sizes[::-1]
        ]
        inputs += [
            (GraphChoice(batch_size=b), st.graph_input(b, self.max_model_len))
            for b in self._batch_sizes[::-1]
        ]
        stream = torch.cuda.current_stream(self.device)
        for key, inp in inputs:
            side = torch.cuda.Stream(self.device)  # warm up off the capture's stream, as torch advises
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model(inp.input_ids, inp.positions, self.cache, inp.meta)
            stream.wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(inp.input_ids, inp.positions, self.cache, inp.meta)
            self._graphs[key] = (graph, out)
        torch.cuda.synchronize(self.device)

    def _graph_for(self, feed: list[list[int]]) -> GraphChoice | None:
        """The captured graph a pass over `feed` replays: a decode graph (one token each), a catch-up graph (up to
        64 tokens), or None (eager)."""
        if not self._graphs:
            return None
        sizes, tokens = self._batch_sizes, self._token_sizes
        if all(len(f) == 1 for f in feed) and len(feed) <= sizes[-1]:
            return GraphChoice(batch_size=sizes[bisect.bisect_left(sizes, len(feed))])
        n = sum(len(f) for f in feed)
        if tokens and n <= tokens[-1]:
            return GraphChoice(num_tokens=tokens[bisect.bisect_left(tokens, n)])
        return None

    @torch.inference_mode()
    def propose(self, batch: list[tuple[Request, Sequence, int]]) -> list[Proposal]:
        """k tokens per sequence, drawn one position at a time from the draft's processed distribution."""
        live = {seq.seq_id for _, seq, _ in batch}
        for seq_id in [s for s in self._mirror if s not in live and not self._waits_swapped(s)]:
            self.free(seq_id)  # ended or preempted since the last proposal
        for _, seq, _ in batch:
            if seq.seq_id in self._swapped:
                self._swap_in(seq)
        items = [(req, seq, k) for req, seq, k in batch if self._catch_up_fits(seq, k)]
        if not items:
            return [NO_PROPOSAL] * len(batch)
        mirrors = [self._mirror[seq.seq_id] for _, seq, _ in items]
        # Catch up: every token the draft has not computed, the sequence's last included; then k - 1 decodes.
        feed = self._catch_up(mirrors, [m.token_ids[m.num_computed_tokens :] for m in mirrors])
        drafts: list[list[int]] = [[] for _ in items]
        qs: list[list[torch.Tensor]] = [[] for _ in items]
        active = list(range(len(items)))
        for step in range(max(k for _, _, k in items)):
            logits = self._forward([mirrors[i] for i in active], [feed[i] for i in active])
            rows = [self._row(items[i][0], items[i][1], step) for i in active]
            if all(r.params.greedy for r in rows):  # point masses: the argmax, q left implicit
                probs, tokens = None, logits.argmax(dim=-1).tolist()
            else:
                probs = target_probs(logits.float(), rows)
                tokens = self._draw(probs, rows, [mirrors[i].num_tokens for i in active])
            nxt = []
            for a, i in enumerate(active):
                drafts[i].append(tokens[a])
                if probs is not None:
                    qs[i].append(probs[a])
                if len(drafts[i]) < items[i][2]:
                    mirrors[i].append_token(tokens[a])
                    feed[i] = [tokens[a]]
                    nxt.append(i)
            active = nxt
            if not active:
                break
        # A greedy draft's q is a point mass at each proposal: None says so (what verification assumes for it).
        out = {
            seq.seq_id: Proposal(tuple(drafts[i]), torch.stack(qs[i]) if qs[i] else None)
            for i, (_, seq, _) in enumerate(items)
        }
        if self.oracle is not None:  # the draft's cost kept, its proposals replaced (point masses)
            for _, seq, _ in items:
                out[seq.seq_id] = self.oracle.proposal(seq, len(out[seq.seq_id].tokens))
        return [out.get(seq.seq_id, NO_PROPOSAL) for _, seq, _ in batch]

    def _catch_up(self, mirrors: list[Sequence], feed: list[list[int]]) -> list[list[int]]:
        """Run the feeds' leading tokens in passes of at most max_chunk tokens until what is left of them fits
        one pass (each keeps its last token, whose logits the first proposal needs); what is left."""
        while sum(len(f) for f in feed) > self.max_chunk:
            room, take = self.max_chunk, []
            for f in feed:
                take.append(min(len(f) - 1, room))
                room -= take[-1]
            run = [i for i, n in enumerate(take) if n]
            if not run:  # more sequences than the chunk has tokens: one token each is left, in one pass
                break
            self._forward([mirrors[i] for i in run], [feed[i][: take[i]] for i in run])
            feed = [f[n:] for f, n in zip(feed, take, strict=True)]
        return feed

    def _waits_swapped(self, seq_id: int) -> bool:
        """Whether the sequence's draft blocks are swapped out with its group, which has not ended."""
        group = self._swapped.get(seq_id)
        statuses = (SequenceStatus.SWAPPED, SequenceStatus.RUNNING)
        return group is not None and any(s.seq_id == seq_id and s.status in statuses for s in group.seqs)

    def _catch_up_fits(self, seq: Sequence, k: int) -> bool:
        """Bring the sequence's mirror to its tokens (keeping the K/V of the prefix they share, freeing the rest)
        and allocate the blocks this proposal writes; False (the mirror dropped) if the pool has no room."""
        mirror = self._mirror.get(seq.seq_id)
        if mirror is None:
            mirror = self._mirror[seq.seq_id] = Sequence(seq.seq_id, seq.token_ids)
        else:
            held = mirror.token_ids
            same = next(
                (i for i, (a, b) in enumerate(zip(held, seq.token_ids, strict=False)) if a != b),
                min(len(held), len(seq.token_ids)),
            )
            mirror.num_computed_tokens = min(mirror.num_computed_tokens, same, len(seq.token_ids) - 1)
            mirror.token_ids = list(seq.token_ids)
            self.kv.trim(mirror)
        # The catch-up writes up to the last token, each decode one proposal more (the last proposal never).
        need = len(mirror.token_ids) - mirror.num_computed_tokens + k - 1
        if self.kv.allocate_slots(mirror, need) is None:
            self.free(seq.seq_id)
            return False
        return True

    def _row(self, req: Request, seq: Sequence, step: int) -> SamplingRow:
        """The draft's sampling row for proposal `step` (its temperature and truncation: q is what it draws)."""
        seed_key = req.states[seq.seq_id].seed_key if seq.seq_id in req.states else None
        return SamplingRow(req.params, [], [], seed_key, (), seq.num_tokens - seq.prompt_len + step)

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow], positions: list[int]) -> list[int]:
        """One token per row from `probs` (greedy rows are point masses), by inverse CDF on a uniform that is a
        function of the seed and the position for seeded requests."""
        fresh = torch.rand(len(rows), dtype=torch.float64).tolist()
        us = [
            fresh[i]
            if r.seed_key is None
            else ((mix64(mix64(r.seed_key + p * _GAMMA) ^ _DRAFT) >> 11) + 0.5) / 2**53
            for i, (r, p) in enumerate(zip(rows, positions, strict=True))
        ]
        cdf = probs.cumsum(dim=-1)
        u = upload([min(max(x, 2.0**-24), 1 - 2.0**-24) for x in us], torch.float32, probs.device)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        return drawn.clamp(max=probs.shape[-1] - 1).tolist()

    def _forward(self, mirrors: list[Sequence], feed: list[list[int]]) -> torch.Tensor:
        """The draft over each mirror's `feed` tokens from its computed position (K/V written to its blocks);
        the logits of each one's last token. The mirrors advance past what they were fed."""
        key = self._graph_for(feed)
        if key is not None:
            return self._replay(key, mirrors, feed)
        bs, dev = self.block_size, self.device
        ids, pos, slots, lens, tables = [], [], [], [], []
        for m, toks in zip(mirrors, feed, strict=True):
            first = m.num_computed_tokens
            table = self.kv.get_block_table(m.seq_id)
            ids += toks
            pos += range(first, first + len(toks))
            slots += [table[p // bs] * bs + p % bs for p in range(first, first + len(toks))]
            lens.append(first + len(toks))
            tables.append(table)
            m.num_computed_tokens += len(toks)
        width = max(len(t) for t in tables)
        starts = list(itertools.accumulate((len(t) for t in feed), initial=0))
        meta = AttentionMetadata(
            upload(slots, torch.int64, dev),
            upload([t + [0] * (width - len(t)) for t in tables], torch.int32, dev),
            upload(lens, torch.int32, dev),
            upload(starts, torch.int32, dev),
            max(len(t) for t in feed),
            max(lens),
        )
        hidden = self.model(
            upload(ids, torch.int64, dev), upload(list(pos), torch.int64, dev), self.cache, meta
        )
        return self.model.compute_logits(hidden[upload([s - 1 for s in starts[1:]], torch.int64, dev)])

    def _replay(self, key: GraphChoice, mirrors: list[Sequence], feed: list[list[int]]) -> torch.Tensor:
        """`_forward` through the captured graph `key`: the pass staged as the target's runner stages a step."""
        scheduled = []
        for m, toks in zip(mirrors, feed, strict=True):
            table = tuple(self.kv.get_block_table(m.seq_id))
            scheduled.append(
                ScheduledSeq(m.seq_id, "", m.num_computed_tokens, len(toks), tuple(toks), table, True)
            )
            m.num_computed_tokens += len(toks)
        st = self._staging
        assert st is not None
        if key.batch_size:
            inp = st.stage_decode(tuple(scheduled), key.batch_size, self.max_model_len)
        else:
            inp = st.stage(tuple(scheduled), None, key.num_tokens)
        graph, hidden = self._graphs[key]
        graph.replay()
        return self.model.compute_logits(hidden[inp.sample_rows])
