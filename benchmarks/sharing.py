"""KV block sharing: parallel sampling (n=4) and beam search (width 4) against independent copies.

The paper's figure (vLLM, section 6.3): sharing the prompt's blocks saves 6-10% of the KV memory for parallel
sampling and 37-55% for beam search on its workloads. Here each workload runs through the real engine on the
default model, all requests submitted at once, with enough blocks that nothing is preempted; the blocks in use
after every step come from the step's StepStats. Reported: the peak blocks in use, and block-steps (the blocks
in use summed over the steps, i.e. memory held over time), for the shared run and for the same requests as
independent copies (4 single-sequence requests per prompt, generating as many tokens as each shared
sequence).

    .venv/bin/python benchmarks/sharing.py [--prompts 8] [--max-tokens 48]
        [--out benchmarks/results/sharing-cpu.json]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from common import generate_with_stats, write_json

from tinypaged import LLM, SamplingParams

TEXT = (
    "PagedAttention divides the key-value cache of each sequence into blocks of a fixed number of tokens, "
    "stored in non-contiguous memory, and a block table maps each sequence's logical blocks to physical "
    "ones. "
    "Blocks are shared between sequences with reference counts and copied on write. "
)


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    """Submit all requests, step to completion; peak blocks in use, block-steps and steps."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    t0 = time.perf_counter()
    _, stats = generate_with_stats(
        llm, [{"prompt_token_ids": ids} for ids, _ in requests], [p for _, p in requests], time_device=False
    )
    elapsed = time.perf_counter() - t0
    engine.check_integrity()
    after = engine.stats()
    assert after.num_free_gpu_blocks == after.num_gpu_blocks
    assert after.num_preemptions == 0, "preempted: raise --blocks"
    used = [after.num_gpu_blocks - s.num_free_blocks for s in stats]
    return {"peak_blocks": max(used), "block_steps": sum(used), "steps": len(stats), "seconds": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the default model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--width", type=int, default=4, help="n for parallel sampling, beam width for beam search"
    )
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/sharing-cpu.json"))
    args = ap.parse_args()

    kwargs = {"model": args.model} if args.model else {}
    llm = LLM(**kwargs, num_gpu_blocks_override=args.blocks, max_num_seqs=256, max_model_len=1024)
    tok = llm.get_tokenizer()
    words = tok.encode(TEXT * 8, add_special_tokens=False)
    # Prompt lengths spread over 24..192 tokens.
    prompts = [words[: 24 + (168 * i) // max(1, args.prompts - 1)] for i in range(args.prompts)]
    w, m = args.width, args.max_tokens

    def sample(seed: int, n: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=m, ignore_eos=True)

    beam = SamplingParams(n=w, use_beam_search=True, temperature=0.0, max_tokens=m, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
    workloads = {
        "parallel_sampling": run(llm, [(p, sample(i, w)) for i, p in enumerate(prompts)]),
        "parallel_sampling_independent": run(
            llm, [(p, sample(i * w + j, 1)) for i, p in enumerate(prompts) for j in range(w)]
        ),
        "beam_search": run(llm, [(p, beam) for p in prompts]),
        "beam_search_independent": run(llm, [(p, greedy) for p in prompts for _ in range(w)]),
    }
    result = {
        "benchmark": "sharing",
        "platform": platform.platform(),
        "device": "cpu",
        "prompts": len(prompts),
        "prompt_lens": [len(p) for p in prompts],
        "max_tokens": m,
        "width": w,
        "block_size": llm.config.block_size,
        "workloads": workloads,
        "savings": {},
    }
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{m} new tokens, "
        f"width {w}, block size {llm.config.block_size}"
    )
    print(
        f"{'workload':<20}{'peak shared':>12}{'peak copies':>12}{'saved':>8}{'blk-steps sh':>14}"
        f"{'blk-steps cp':>14}{'saved':>8}"
    )
    for name in ("parallel_sampling", "beam_search"):
        shared, copies = workloads[name], workloads[name + "_independent"]
        peak_saved = 1 - shared["peak_blocks"] / copies["peak_blocks"]
        steps_saved = 1 - shared["block_steps"] / copies["block_steps"]
        result["savings"][name] = {"peak_blocks": peak_saved, "block_steps": steps_saved}
        print(
            f"{name:<20}{shared['peak_blocks']:>12}{copies['peak_blocks']:>12}{peak_saved:>8.1%}"
            f"{shared['block_steps']:>14}{copies['block_steps']:>14}{steps_saved:>8.1%}"
        )
    write_json(args.out, result)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
