"""Speculative decoding (issue 39): speedups and acceptance, CPU and H200, in one script; table last, JSON to --json.

    python benchmarks/speculative.py --part cpu --json benchmarks/results/speculative-cpu.json
    tinypaged weights random --config llama-3.1-8b --out /tmp/llama-3.1-8b
    python benchmarks/speculative.py --part gpu --model /tmp/llama-3.1-8b \
        --json benchmarks/results/speculative-h200.json

CPU part (the default model, float32, one stream, greedy; `--served-gguf`: its Q4_1 GGUF as `make serve` runs it
on a CPU, where the INT4 kernel's bf16 arithmetic rounds a several-row pass otherwise than a one-row pass, so
outputs may differ from the run without speculation):
- **copy-heavy** workload (published here and in docs/speculative.md): each prompt (chat template) asks the model
  to repeat a given paragraph of about 60-80 words exactly, with one named word changed ("Repeat the following
  paragraph exactly, but replace the word 'X' with 'Y'."); 4 paragraphs, 96 tokens each. The answer is mostly a
  copy of the prompt: n-gram prompt lookup (k = 4, prompt_lookup_min 2, max 4) proposes it. Target >= 1.5x.
  EOS is ignored, so after the copy the model runs on into text of its own (a new invented conversation).
  `--copy-until-eos` also runs the same prompts ending at EOS (`copy_heavy_eos`, not the published workload:
  the copy without what follows it).
- **random-token** prompts: 128 uniformly random token ids, 64 tokens each, nothing to copy: the n-gram
  proposer rarely matches and its rejected proposals cost verification rows. Target >= 0.95x.
  Tokens/s = generated tokens / wall time of `LLM.generate`, each prompt alone (one stream), without and with
  speculation on the same engine (`Speculator.active`) in turn prompt by prompt, after a warm-up of two prompts
  each way (the first passes of a step's shapes are 3-6x slower on the CPU); the outputs must be identical.
- **real acceptance**: the default model's f32 target with its own INT4 copy (`quantization="int4"`) as the greedy
  draft. For a greedy draft the proposal at position t is the draft's argmax given the target's own prefix, so
  the target's greedy continuation scored by the INT4 copy in one teacher-forced pass gives, exactly, whether
  each position's proposal would match; walking it as the engine does (k proposals, a accepted, a + 1 tokens)
  gives the acceptance rate and acceptance by position for k = 1..5 (the INT4 path on the CPU dequantizes a
  layer at a time, far too slow to time). Over the copy-heavy prompts and 4 open-ended ones.
- **crossover**: the oracle (below) at alpha 0..0.8 and k = 1 and 4, with the acceptance switch off and on,
  against no speculation, 2 open prompts: at alpha 0 the slowdown is one plus the verified rows' cost; where k = 1
  starts paying. The n-gram runs above use the switch (the engine's default).

GPU part (an H200; a random-weight 8B target, bf16, batch 1, prompt 512 random tokens, 256 greedy tokens):
- **oracle**: `"method": "oracle"` proposes the target's own greedy continuation (taken from the run without
  speculation), each token right with probability alpha = 0.8 and wrong otherwise, at no cost: verification
  itself. Tokens/s against the same engine without speculation; k = 4, target >= 2.5x (ideal 3.36x); and k = 1..6.
- **INT4 self-draft**: `"method": "draft_model", "quantization": "int4"` with its real cost, its proposals
  replaced as the oracle's (`oracle_acceptance_rate` 0.8): speedup by k.
- **batch sweep**: the oracle at k = 4 against no speculation at batch 1..64: where speculation stops paying
  (the batch to set disable_by_batch_size to).
- **verification row cost**: the oracle at alpha 0 (every proposal wrong), k = 1 and 4, batch 1: one more verified
  row's cost in one-row steps, the acceptance switch's `VERIFY_ROW_COST["cuda"]` (an estimate until then).
  These GPU tables run with the switch off (a fixed k).
- **host profile** (`host_time.py`): the same request under cProfile, decode-only and speculative, the longest
  functions per step; and the decode graph's (batch 1) and the 16-token mixed graph's launch alone: the host
  time of `replay()` against the device's.
- **step profile**: batch 1, k = 4, alpha 0.8, against the same request without speculation: the median of each
  StepStats phase, of the forward pass's device time and of the wall time between steps, for decode and for
  verification steps: whether a verification's extra cost (1.7x a decode step in run 74) is the device's
  forward pass or host work that async scheduling overlaps in a decode step.
"""

from __future__ import annotations

import argparse
import itertools
import time
import traceback
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from common import free_llm, greedy, header, random_prompt, write_json
from host_time import graph_launch, host_profile, print_host_profile, request_steps

from tinypaged import LLM, SamplingParams, cpu_linear
from tinypaged.engine.device.model_runner import GraphChoice
from tinypaged.engine.speculative.proposers import OracleProposer

PARAGRAPHS = [
    (
        "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its "
        "keeper climbed the narrow stairs, trimmed the wick and wound the clockwork that turned the great lens. "
        "Ships passing in the dark counted its flashes to know where they were, and the fishermen of the "
        "village said that as long as the light burned, no boat of theirs would be lost.",
        "keeper",
        "guardian",
    ),
    (
        "A paged memory manager divides the cache into fixed-size blocks and gives each sequence a block table "
        "that maps its logical positions to physical blocks. Blocks are allocated on demand, shared between "
        "sequences that start with the same prompt, and copied only when one of the sharers writes. Nothing "
        "is reserved in advance, so almost no memory is wasted.",
        "shared",
        "reused",
    ),
    (
        "On Saturday morning the market filled the square before the church. Farmers brought apples, pears and "
        "late plums in wooden crates, a baker sold bread still warm from the oven, and an old man played the "
        "accordion by the fountain. By noon the crates were empty and the children had spent their coins on "
        "honey cakes.",
        "baker",
        "cook",
    ),
    (
        "To make the soup, soften two chopped onions in butter over a low heat, add four sliced carrots and a "
        "peeled potato, and cover them with a litre of stock. Simmer for twenty minutes until the vegetables are "
        "tender, blend until smooth, and season with salt, pepper and a little grated nutmeg before serving.",
        "carrots",
        "parsnips",
    ),
]
OPEN_PROMPTS = [
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "What are the main differences between a list and a tuple in Python?",
    "Give three tips for sleeping better.",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def copy_prompts(llm: LLM) -> list[str]:
    """The copy-heavy workload: repeat a paragraph with one word changed (see the module docstring)."""
    tok = llm.get_tokenizer()
    return [
        tok.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Repeat the following paragraph exactly, but replace the word '{old}' with "
                    f"'{new}'.\n\n{text}",
                }
            ]
        )
        for text, old, new in PARAGRAPHS
    ]


def one_stream(llm: LLM, prompts: list[Any], params: SamplingParams, speculate: bool) -> dict[str, Any]:
    """Each prompt alone (one stream): tokens/s over all of them, the outputs, and the acceptance counts."""
    spec = llm.engine.speculator
    spec.active = speculate
    before = spec.totals.as_tuple()
    tokens, wall, outs = 0, 0.0, []
    for p in prompts:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = llm.generate([p], params)[0]
        wall += time.perf_counter() - t0
        tokens += len(out.outputs[0].token_ids)
        outs.append(out.outputs[0].token_ids)
    after = spec.totals.as_tuple()
    drafted, accepted = after[1] - before[1], after[2] - before[2]
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "outputs": outs,
    }


def compare(llm: LLM, prompts: list[Any], params: SamplingParams, warm: bool = True) -> dict[str, Any]:
    """Without and with speculation on the same engine (a warm-up first), prompt by prompt in turn so that a
    shared machine's load weighs on both alike; the outputs must agree."""
    for speculate in (False, True) if warm else ():  # warm-up: a shape's first passes are slow on the CPU
        one_stream(llm, prompts[:2], params, speculate)
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for prompt in prompts:
        for speculate in (False, True):
            runs[speculate].append(one_stream(llm, [prompt], params, speculate))
    out: dict[str, Any] = {}
    for speculate, name in ((False, "baseline"), (True, "speculative")):
        rs = runs[speculate]
        tokens, seconds = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        drafted, accepted = sum(r["draft_tokens"] for r in rs), sum(r["accepted_tokens"] for r in rs)
        out[name] = {
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "draft_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
        }
    out["speedup"] = out["speculative"]["tokens_per_s"] / out["baseline"]["tokens_per_s"]
    out["identical"] = [r["outputs"] for r in runs[False]] == [r["outputs"] for r in runs[True]]
    return out


def crossover(args: argparse.Namespace, prompts: list[Any]) -> dict[str, Any]:
    """The oracle at controlled acceptance alpha against no speculation, k = 1 and 4, with the acceptance switch
    off (what verification costs: at alpha = 0 every step emits one token, so the slowdown at k is one plus k
    verified rows' cost) and on (it must never lose much); the crossover alpha where speculation starts paying."""
    llm = LLM(speculative_config={"method": "oracle", "num_speculative_tokens": 4}, seed=0)
    speculator, params = llm.engine.speculator, greedy(args.crossover_tokens)
    proposer, switch, spec = speculator.proposer, speculator.switch, speculator.spec
    speculator.active = False
    for out in llm.generate(prompts, params):
        proposer.add_reference(out.prompt_token_ids, out.outputs[0].token_ids)
    rows: dict[str, Any] = {}
    for alpha in args.alphas:
        proposer.alpha = alpha
        for k, dynamic in ((1, False), (4, False), (4, True)):
            speculator.spec = replace(spec, num_speculative_tokens=k)
            speculator.switch = switch if dynamic else None
            r = compare(llm, prompts, params, warm=alpha == args.alphas[0])
            rows[f"alpha={alpha} k={k}{' switch' if dynamic else ''}"] = {
                "alpha": alpha,
                "k": k,
                "switch": dynamic,
                "speedup": r["speedup"],
                "acceptance_rate": r["speculative"]["acceptance_rate"],
                "draft_tokens": r["speculative"]["draft_tokens"],
                "identical": r["identical"],
            }
            print(f"crossover alpha {alpha} k {k} switch {dynamic}: {r['speedup']:.3f}x", flush=True)
    free_llm(llm)
    res: dict[str, Any] = {"rows": rows}
    zero = {k: rows[f"alpha={args.alphas[0]} k={k}"]["speedup"] for k in (1, 4)}
    if args.alphas[0] == 0.0:  # one more verified row's cost, in one-row decode steps
        res["verify_row_cost"] = {k: (1 / s - 1) / k for k, s in zero.items()}
    static = [(rows[f"alpha={a} k=1"]["alpha"], rows[f"alpha={a} k=1"]["speedup"]) for a in args.alphas]
    above = [(a0, s0, a1, s1) for (a0, s0), (a1, s1) in itertools.pairwise(static) if s0 < 1.0 <= s1]
    if above:  # linear between the two alphas that straddle 1.0x
        a0, s0, a1, s1 = above[0]
        res["crossover_alpha_k1"] = a0 + (1.0 - s0) * (a1 - a0) / (s1 - s0)
    return res


def walk_acceptance(match: list[bool], k: int) -> tuple[int, int, list[int], int]:
    """The engine's walk over one greedy continuation whose positions the draft matches or not: (proposed,
    accepted, accepted by position, steps)."""
    t = proposed = accepted = steps = 0
    by_pos = [0] * k
    while t < len(match):
        n = min(k, len(match) - t - 1)
        a = 0
        while a < n and match[t + a]:
            by_pos[a] += 1
            a += 1
        proposed, accepted, steps = proposed + n, accepted + a, steps + 1
        t += a + 1
    return proposed, accepted, by_pos, steps


def real_acceptance(target: LLM, prompts: list[Any], max_tokens: int) -> dict[str, Any]:
    """The INT4 copy as a greedy draft of the f32 target (see the module docstring): acceptance by k."""
    target.engine.speculator.active = False
    outs = target.generate(prompts, greedy(max_tokens))
    seqs = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
    draft = LLM(quantization="int4", seed=0)
    try:
        logits = draft.engine.runner.prompt_logits([p + c for p, c in seqs])
    finally:
        draft.shutdown()
    match_lists = []
    for (p, c), lg in zip(seqs, logits, strict=True):
        # Row i predicts token i + 1: the draft's proposal for output token j is its argmax at row len(p) - 1 + j.
        pred = lg[len(p) - 1 : len(p) - 1 + len(c)].argmax(dim=-1).tolist()
        match_lists.append([a == b for a, b in zip(pred, c, strict=True)])
    by_k = {}
    for k in range(1, 6):
        tot = [0, 0, [0] * k, 0]
        for m in match_lists:
            proposed, accepted, by_pos, steps = walk_acceptance(m, k)
            tot = [
                tot[0] + proposed,
                tot[1] + accepted,
                [x + y for x, y in zip(tot[2], by_pos, strict=True)],
                tot[3] + steps,
            ]
        tokens = sum(len(m) for m in match_lists)
        by_k[k] = {
            "proposed": tot[0],
            "accepted": tot[1],
            "acceptance_rate": tot[1] / tot[0] if tot[0] else 0.0,
            "accepted_by_position": tot[2],
            "tokens_per_target_pass": tokens / tot[3],
        }
    per_token = sum(sum(m) for m in match_lists) / sum(len(m) for m in match_lists)
    return {"per_token_agreement": per_token, "by_k": by_k, "tokens": sum(len(m) for m in match_lists)}


def cpu_part(args: argparse.Namespace) -> dict[str, Any]:
    """The default model on the CPU: copy-heavy and random-token speedups, the INT4 copy's real acceptance."""
    model = None
    if args.served_gguf:  # the default model as `make serve` runs it on a CPU: its Q4_1 GGUF, kept quantized
        from tinypaged.weights import default_gguf_path

        model = str(default_gguf_path())
    llm = LLM(model=model, speculative_config=NGRAM, seed=0)
    res: dict[str, Any] = {"ngram": NGRAM, "model": model or "the default model's f32 conversion"}
    # What this machine chose: the switch's C(k) (measured at start) and the float32 row counts taken transposed
    res["verify_costs"] = list(llm.engine.speculator.switch.costs)
    res["cpu_transposed_rows"] = sorted(cpu_linear.transposed_rows())
    prompts = copy_prompts(llm)
    if not args.skip_ngram:
        res["copy_heavy"] = compare(llm, prompts, greedy(args.copy_tokens))
        if args.copy_until_eos:
            until_eos = SamplingParams(temperature=0.0, max_tokens=args.copy_tokens)
            res["copy_heavy_eos"] = compare(llm, prompts, until_eos)
        rng = np.random.default_rng(0)
        vocab = llm.config.model_config.vocab_size
        randoms = [random_prompt(rng, 128, vocab) for _ in range(args.random_prompts)]
        res["random_tokens"] = compare(llm, randoms, greedy(args.random_tokens))
    tok = llm.get_tokenizer()
    opens = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in OPEN_PROMPTS]
    if not args.skip_int4:
        res["int4_draft_acceptance"] = real_acceptance(llm, prompts + opens, args.copy_tokens)
    llm.shutdown()
    if not args.skip_crossover:
        res["crossover"] = crossover(args, opens[: args.crossover_prompts])
    if args.cost_table:
        res["cost_table"] = cost_table(opens[: args.crossover_prompts], args.crossover_tokens)
        print(f"verification cost C(k), k = 0..6, in decode steps: {res['cost_table']['c']}", flush=True)
    return res


def cost_table(prompts: list[Any], max_tokens: int, max_k: int = 6) -> dict[str, Any]:
    """C(k) for k = 0..max_k (the acceptance switch's `VERIFY_COSTS`): the oracle at alpha 0, the switch off,
    so every step verifies k wrong proposals; each prompt's median verification step (wall time between step
    calls, `step_profile`) against its median decode step without speculation, the median over the prompts."""
    llm = LLM(speculative_config={"method": "oracle", "num_speculative_tokens": max_k}, seed=0)
    speculator = llm.engine.speculator
    speculator.switch = None
    proposer, spec = speculator.proposer, speculator.spec
    speculator.active = False
    for out in llm.generate(prompts, greedy(max_tokens)):
        proposer.add_reference(out.prompt_token_ids, out.outputs[0].token_ids)
    proposer.alpha = 0.0
    step_profile(llm, prompts[0], 8, True)  # the verification shapes' first passes (3-6x slower on the CPU)
    decode = [step_profile(llm, p, max_tokens, False)["decode"]["wall_s"] for p in prompts]
    table: dict[int, list[float]] = {}
    for k in range(1, max_k + 1):
        speculator.spec = replace(spec, num_speculative_tokens=k)
        table[k] = [step_profile(llm, p, max_tokens, True)["verify"]["wall_s"] for p in prompts]
    free_llm(llm)
    c = [1.0] + [float(np.median([v / d for v, d in zip(table[k], decode, strict=True)])) for k in table]
    return {"decode_s": decode, "verify_s": table, "c": [round(x, 3) for x in c]}


def gpu_tokens_per_s(
    llm: LLM, prompts: list[Any], max_tokens: int, speculate: bool, one_at_a_time: bool = False
) -> dict[str, Any]:
    """Decode tokens/s of a batch run together (all prompts at once; `one_at_a_time`: each prompt alone in
    turn, tokens and wall time summed), the prefix cache reset first. The oracle's draws restart from the same
    seed every run, so a k's run draws alike in a sweep and alone."""
    spec = llm.engine.speculator
    spec.active = speculate
    oracle = getattr(spec.proposer, "oracle", spec.proposer)
    if isinstance(oracle, OracleProposer):
        oracle.reseed(0)
    llm.reset_prefix_cache()
    before = spec.totals.as_tuple()
    t0 = time.perf_counter()
    groups = [[p] for p in prompts] if one_at_a_time else [prompts]
    outs = [o for g in groups for o in llm.generate(g, greedy(max_tokens))]
    wall = time.perf_counter() - t0
    after = spec.totals.as_tuple()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafted, accepted = after[1] - before[1], after[2] - before[2]
    return {
        "tokens_per_s": tokens / wall,
        "seconds": wall,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def expected(alpha: float, k: int) -> tuple[float, float]:
    """The oracle's expected acceptance rate (accepted over proposed: each token right with probability alpha,
    accepted up to the first wrong one) and tokens a verification step emits, (1 - alpha^(k+1)) / (1 - alpha):
    the speedup of a verification that cost what a decode step costs."""
    if alpha >= 1.0:
        return 1.0, k + 1.0
    per_step = (1 - alpha ** (k + 1)) / (1 - alpha)
    return (per_step - 1) / k, per_step


STEP_FIELDS = ("schedule_s", "execute_s", "sample_s", "update_s", "wait_s", "total_s")


def step_profile(llm: LLM, prompt: Any, max_tokens: int, speculate: bool) -> dict[str, Any]:
    """One request's decode steps through `LLMEngine.step()`: the median of each StepStats phase (host seconds)
    and of the forward pass's device time, and the median wall time between step calls, over the steps after
    the prompt's (its own and the one that applies its token), split by whether the step verified proposals.
    Where a verification step's extra cost lies: the device's forward pass, or host work a decode step overlaps
    (async scheduling)."""
    engine, spec = llm.engine, llm.engine.speculator
    spec.active = speculate
    llm.reset_prefix_cache()
    engine.runner.time_device = engine.runner.device.type == "cuda"
    engine.add(
        engine.process_inputs(f"profile-{speculate}-{time.monotonic_ns()}", prompt, greedy(max_tokens))
    )
    by_kind: dict[str, list[tuple[float, ...]]] = {"decode": [], "verify": []}
    graphs: dict[str, set[int]] = {"decode": set(), "verify": set()}
    last, steps = time.perf_counter(), 0
    try:
        while engine.has_unfinished_requests():
            before = spec.totals.as_tuple()[1]
            result = engine.step()
            now = time.perf_counter()
            st, steps = result.stats, steps + 1
            kind = "verify" if spec.totals.as_tuple()[1] > before else "decode"
            if steps > 2:  # past the prompt's step and the one that applies it
                device = st.device_s[0] if st.device_s else float("nan")
                by_kind[kind].append((*(getattr(st, f) for f in STEP_FIELDS), device, now - last))
                graphs[kind].add(st.graph_num_tokens)
            last = now
    finally:
        engine.runner.time_device = False
    out: dict[str, Any] = {}
    for kind, rows in by_kind.items():
        if rows:
            med = np.median(np.array(rows), axis=0)
            names = (*STEP_FIELDS, "device_s", "wall_s")
            out[kind] = {"steps": len(rows), **{n: float(v) for n, v in zip(names, med, strict=True)}}
            out[kind]["mixed_graph_tokens"] = sorted(graphs[kind])  # 0: a decode graph or eager
    return out


def kernel_profile(llm: LLM, prompt: Any, max_tokens: int, speculate: bool, top: int = 20) -> dict[str, Any]:
    """One request under torch.profiler (CUDA activity: the kernels, those inside CUDA graphs included): each
    kernel's device time and launches per engine step, the `top` longest, and the device time a step. Which
    kernels make a verification step's forward pass longer than a decode step's."""
    from torch.profiler import ProfilerActivity, profile

    engine, spec = llm.engine, llm.engine.speculator
    spec.active = speculate
    llm.reset_prefix_cache()
    gpu_tokens_per_s(llm, [prompt], 8, speculate)  # the shapes compiled and captured before the profile
    engine.add(engine.process_inputs(f"kprof-{speculate}-{time.monotonic_ns()}", prompt, greedy(max_tokens)))
    steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            t = totals.setdefault(ev.name, [0.0, 0])
            t[0] += ev.device_time_total * 1e-6
            t[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        "steps": steps,
        "device_s_per_step": sum(t for t, _ in totals.values()) / steps,
        "top": [
            {"name": name, "s_per_step": t / steps, "calls_per_step": n / steps}
            for name, (t, n) in rows[:top]
        ],
    }


def gpu_part(args: argparse.Namespace) -> dict[str, Any]:
    """The H200 part: the oracle's speedup by k and by batch, then the INT4 self-draft's by k."""
    rng = np.random.default_rng(0)
    res: dict[str, Any] = {}
    oracle = {"method": "oracle", "num_speculative_tokens": 4, "acceptance_rate": args.alpha}
    llm = LLM(
        model=args.model, speculative_config=oracle, max_model_len=4096, gpu_memory_utilization=0.6, seed=0
    )
    vocab = llm.config.model_config.vocab_size
    prompts = [
        random_prompt(rng, args.prompt_len, vocab) for _ in range(max(*args.batches, args.batch1_prompts))
    ]
    solo = prompts[: args.batch1_prompts]  # batch 1: these, one at a time
    speculator = llm.engine.speculator
    speculator.switch = None  # a fixed k: these tables measure verification itself
    proposer = speculator.proposer
    base = gpu_tokens_per_s(llm, prompts[:1], 16, False)  # warm-up
    rows = {}
    for bsz in args.batches:
        # Batch 1: `--batch1-prompts` requests one at a time, so that the realized acceptance sits near its
        # expectation (256 tokens are about 75 verification steps: a standard deviation of 0.05 in acceptance).
        group = prompts[: args.batch1_prompts] if bsz == 1 else prompts[:bsz]
        base = gpu_tokens_per_s(llm, group, args.gen_tokens, False, one_at_a_time=bsz == 1)
        for prompt, out in zip(group, base["outputs"], strict=True):
            proposer.add_reference(prompt["prompt_token_ids"], out)
        by_k = {}
        for k in args.ks if bsz == 1 else [4]:
            speculator.spec = replace(speculator.spec, num_speculative_tokens=k)
            run = gpu_tokens_per_s(llm, group, args.gen_tokens, True, one_at_a_time=bsz == 1)
            pairs = zip(base["outputs"], run["outputs"], strict=True)
            agree = sum(a == b for o1, o2 in pairs for a, b in zip(o1, o2, strict=False))
            by_k[k] = {
                "tokens_per_s": run["tokens_per_s"],
                "speedup": run["tokens_per_s"] / base["tokens_per_s"],
                "acceptance_rate": run["acceptance_rate"],
                "expected_acceptance_rate": expected(args.alpha, k)[0],
                "ideal_speedup": expected(args.alpha, k)[1],
                "bf16_token_agreement": agree / sum(len(o) for o in base["outputs"]),
            }
        rows[bsz] = {"baseline_tokens_per_s": base["tokens_per_s"], "by_k": by_k}
        print(f"oracle batch {bsz}: {rows[bsz]}", flush=True)
    res["oracle"] = rows
    # Every proposal wrong: each step emits one token, so the slowdown is one plus k verified rows' cost (the
    # acceptance switch's VERIFY_ROW_COST["cuda"], an estimate until this measures it).
    proposer.alpha, base1, cost = 0.0, rows[args.batches[0]]["baseline_tokens_per_s"], {}
    for k in (1, 4):
        speculator.spec = replace(speculator.spec, num_speculative_tokens=k)
        first = args.batches[0]
        run = gpu_tokens_per_s(
            llm, solo if first == 1 else prompts[:first], args.gen_tokens, True, first == 1
        )
        cost[k] = (base1 / run["tokens_per_s"] - 1) / k
    res["verify_row_cost"] = cost
    print(f"one more verified row costs (k: one-row steps): {cost}", flush=True)
    proposer.alpha = args.alpha
    # Where a verification step's cost goes, at batch 1 and k = 4: StepStats' phases and the device's time.
    speculator.spec = replace(speculator.spec, num_speculative_tokens=4)
    res["step_profile"] = {
        "decode_only": step_profile(llm, prompts[0], args.gen_tokens, False),
        "speculative": step_profile(llm, prompts[0], args.gen_tokens, True),
    }
    print(f"step profile (medians, seconds): {res['step_profile']}", flush=True)
    res["host_profile"] = {}
    for kind, speculate in (("decode_only", False), ("speculative", True)):
        speculator.active = speculate
        llm.reset_prefix_cache()
        run = request_steps(llm, prompts[0], greedy(args.gen_tokens), f"hprof-{kind}")
        res["host_profile"][kind] = host_profile(llm, run)
        print_host_profile(kind, res["host_profile"][kind])
    res["graph_launch"] = graph_launch(llm, [GraphChoice(batch_size=1), GraphChoice(num_tokens=16)])
    llm.reset_prefix_cache()
    print(f"graph launch (us, medians): {res['graph_launch']}", flush=True)
    res["kernel_profile"] = {
        "decode_only": kernel_profile(llm, prompts[0], args.gen_tokens, False),
        "speculative": kernel_profile(llm, prompts[0], args.gen_tokens, True),
    }
    for kind, prof in res["kernel_profile"].items():
        print(f"kernels a step, {kind} ({prof['steps']} steps, {1e3 * prof['device_s_per_step']:.3f} ms):")
        for row in prof["top"]:
            print(f"  {1e6 * row['s_per_step']:9.1f} us {row['calls_per_step']:6.1f}x {row['name'][:90]}")
    pays = [b for b in args.batches if rows[b]["by_k"][4]["speedup"] > 1.0]
    res["oracle_pays_up_to_batch"] = max(pays) if pays else 0
    free_llm(llm)
    if args.skip_int4:
        return res
    draft = {
        "method": "draft_model",
        "quantization": "int4",
        "num_speculative_tokens": 4,
        "oracle_acceptance_rate": args.alpha,
    }
    llm = LLM(
        model=args.model, speculative_config=draft, max_model_len=4096, gpu_memory_utilization=0.6, seed=0
    )
    speculator = llm.engine.speculator
    speculator.switch = None  # the speedup by k, as set
    gpu_tokens_per_s(llm, prompts[:1], 16, True)  # warm-up
    base = gpu_tokens_per_s(llm, solo, args.gen_tokens, False, one_at_a_time=True)
    oracle_of_draft = speculator.proposer.oracle
    assert oracle_of_draft is not None
    for prompt, out in zip(solo, base["outputs"], strict=True):
        oracle_of_draft.add_reference(prompt["prompt_token_ids"], out)
    by_k = {}
    for k in args.ks:
        speculator.spec = replace(speculator.spec, num_speculative_tokens=k)
        run = gpu_tokens_per_s(llm, solo, args.gen_tokens, True, one_at_a_time=True)
        by_k[k] = {
            "tokens_per_s": run["tokens_per_s"],
            "speedup": run["tokens_per_s"] / base["tokens_per_s"],
            "acceptance_rate": run["acceptance_rate"],
        }
        print(f"int4 self-draft k={k}: {by_k[k]}", flush=True)
    res["int4_self_draft"] = {"baseline_tokens_per_s": base["tokens_per_s"], "by_k": by_k}
    res["int4_self_draft"]["graphs_vs_eager"] = draft_graphs_vs_eager(llm, solo[:1], args.gen_tokens // 2)
    print(f"int4 self-draft, graphs against eager: {res['int4_self_draft']['graphs_vs_eager']}", flush=True)
    free_llm(llm)
    return res


def draft_graphs_vs_eager(llm: LLM, prompts: list[Any], max_tokens: int) -> dict[str, Any]:
    """The draft's CUDA graphs against its eager passes at k = 4, batch 1: with the oracle's proposals (the
    speedup each gives over no speculation), then with the draft's own greedy proposals (the same proposals
    either way: the same outputs and acceptance; they share the INT4 kernels' tilings up to 16 rows)."""
    speculator = llm.engine.speculator
    proposer = speculator.proposer
    speculator.spec = replace(speculator.spec, num_speculative_tokens=4)
    base = gpu_tokens_per_s(llm, prompts, max_tokens, False, one_at_a_time=True)
    out: dict[str, Any] = {"baseline_tokens_per_s": base["tokens_per_s"]}
    graphs = proposer._graphs  # noqa: SLF001 - a benchmark's switch
    oracle = proposer.oracle
    for name, oracle_on in (("oracle", True), ("own", False)):
        proposer.oracle = oracle if oracle_on else None
        runs = {}
        for mode, g in (("graphs", graphs), ("eager", {})):
            proposer._graphs = g  # noqa: SLF001
            runs[mode] = gpu_tokens_per_s(llm, prompts, max_tokens, True, one_at_a_time=True)
        proposer._graphs = graphs  # noqa: SLF001
        out[name] = {
            **{f"{m}_speedup": r["tokens_per_s"] / base["tokens_per_s"] for m, r in runs.items()},
            **{f"{m}_acceptance": r["acceptance_rate"] for m, r in runs.items()},
            "same_outputs": runs["graphs"]["outputs"] == runs["eager"]["outputs"],
        }
    proposer.oracle = oracle
    return out


def table(res: dict[str, Any]) -> str:
    """The results as a table."""
    lines = []
    cpu = res.get("cpu")
    if isinstance(cpu, dict) and "copy_heavy" in cpu:
        label = "Q4_1 GGUF" if str(cpu.get("model", "")).endswith(".gguf") else "f32"
        lines.append(
            f"CPU, default model {label:9}, one stream  base tok/s  spec tok/s  speedup  accept  same"
        )
        for name in ("copy_heavy", "copy_heavy_eos", "random_tokens"):
            if name not in cpu:
                continue
            r = cpu[name]
            lines.append(
                f"  {name:<36} {r['baseline']['tokens_per_s']:10.2f} {r['speculative']['tokens_per_s']:11.2f}"
                f" {r['speedup']:7.2f}x {r['speculative']['acceptance_rate']:7.2f}  {r['identical']}"
            )
        if "verify_costs" in cpu:
            lines.append(
                f"  verification costs C(k) {cpu['verify_costs']}; float32 rows taken transposed "
                f"{cpu['cpu_transposed_rows']}"
            )
    if isinstance(cpu, dict) and "crossover" in cpu:
        cross = cpu["crossover"]
        lines.append("CPU oracle at alpha (crossover)   k  switch  speedup  accept  same")
        for r in cross["rows"].values():
            lines.append(
                f"  alpha {r['alpha']:<24.2f} {r['k']:2}  {str(r['switch']):6} {r['speedup']:7.2f}x"
                f" {r['acceptance_rate']:7.2f}  {r['identical']}"
            )
        if "verify_row_cost" in cross:
            lines.append(f"  one more verified row costs (k: one-row steps): {cross['verify_row_cost']}")
        if "crossover_alpha_k1" in cross:
            lines.append(f"  speculation pays at k = 1 from alpha = {cross['crossover_alpha_k1']:.2f}")
    if isinstance(cpu, dict):
        acc = cpu.get("int4_draft_acceptance")
        if acc:
            lines.append(f"INT4 copy as greedy draft: per-token agreement {acc['per_token_agreement']:.3f}")
            lines.append("  k  acceptance  tokens/pass  accepted by position")
            for k, r in acc["by_k"].items():
                rate, per_pass = r["acceptance_rate"], r["tokens_per_target_pass"]
                lines.append(f"  {k}  {rate:10.3f}  {per_pass:11.2f}  {r['accepted_by_position']}")
    gpu = res.get("gpu")
    if isinstance(gpu, dict) and "oracle" in gpu:
        lines.append(
            "H200 oracle (alpha fixed)  batch  k  base tok/s  spec tok/s  speedup  accept (expected)  ideal"
        )
        for b, row in gpu["oracle"].items():
            for k, r in row["by_k"].items():
                lines.append(
                    f"  {'':<24} {b:5} {k:2} {row['baseline_tokens_per_s']:11.1f} {r['tokens_per_s']:11.1f}"
                    f" {r['speedup']:7.2f}x {r['acceptance_rate']:7.2f} ({r.get('expected_acceptance_rate', 0):.2f})"
                    f"  {r.get('ideal_speedup', 0):5.2f}x"
                )
        lines.append(f"  speculation pays up to batch {gpu['oracle_pays_up_to_batch']}")
        if "verify_row_cost" in gpu:
            lines.append(f"  one more verified row costs (k: one-row steps): {gpu['verify_row_cost']}")
        d = gpu.get("int4_self_draft")
        if d:
            for k, r in d["by_k"].items():
                lines.append(
                    f"  INT4 self-draft k={k}: {r['speedup']:.2f}x (accept {r['acceptance_rate']:.2f})"
                )
            ge = d.get("graphs_vs_eager", {})
            for name in ("oracle", "own"):
                if name in ge:
                    r = ge[name]
                    lines.append(
                        f"  INT4 self-draft k=4, {name} proposals: graphs {r['graphs_speedup']:.2f}x, eager"
                        f" {r['eager_speedup']:.2f}x (accept {r['graphs_acceptance']:.2f} /"
                        f" {r['eager_acceptance']:.2f}, same outputs {r['same_outputs']})"
                    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("cpu", "gpu", "all"), default="cpu")
    ap.add_argument("--model", help="the GPU part's 8B model directory (tinypaged weights random ...)")
    ap.add_argument("--json")
    ap.add_argument("--copy-tokens", type=int, default=96)
    ap.add_argument(
        "--copy-until-eos", action="store_true", help="cpu: also the copy-heavy prompts ending at EOS"
    )
    ap.add_argument("--random-tokens", type=int, default=64)
    ap.add_argument("--random-prompts", type=int, default=4)
    ap.add_argument(
        "--skip-int4", action="store_true", help="leave out the INT4 draft (CPU: acceptance; GPU: speed)"
    )
    ap.add_argument("--skip-crossover", action="store_true")
    ap.add_argument(
        "--cost-table",
        action="store_true",
        help="CPU: measure the verification cost C(k), k = 0..6 (VERIFY_COSTS)",
    )
    ap.add_argument(
        "--served-gguf",
        action="store_true",
        help="CPU n-gram runs on the default model's Q4_1 GGUF (what `make serve` runs on a CPU; bf16 kernels)",
    )
    ap.add_argument("--skip-ngram", action="store_true", help="the crossover and INT4 parts only")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.5, 0.8])
    ap.add_argument("--crossover-prompts", type=int, default=2)
    ap.add_argument("--crossover-tokens", type=int, default=48)
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--batch1-prompts", type=int, default=4, help="GPU batch 1: requests one at a time")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = ap.parse_args()
    res: dict[str, Any] = {"header": header(args)}
    for part, fn in (("cpu", cpu_part), ("gpu", gpu_part)):
        if args.part in (part, "all"):
            try:
                res[part] = fn(args)
            except Exception as e:  # recorded; the other part still runs
                traceback.print_exc()
                res[part] = {"error": f"{type(e).__name__}: {e}"}
            if args.json:
                write_json(args.json, res)
    print(table(res))


if __name__ == "__main__":
    main()
