"""Parallel sampling and beam search on the default model: shared blocks, seeds, HF's beams, a clean pool."""

from __future__ import annotations

import pytest
import torch

from tinypaged import LLM, SamplingParams
from tinypaged.engine.step.llm_engine import LLMEngine
from tinypaged.engine.step.queued_step import StepError


def _idle_and_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_parallel_sampling_shares_prompt_blocks(llm: LLM) -> None:
    engine = llm.engine
    _idle_and_clean(engine)
    bs = engine.kv.block_size
    prompt = list(range(1000, 1000 + 2 * bs + 8))  # two full blocks and a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    engine.add_request("par", {"prompt_token_ids": prompt}, params)
    free0 = engine.kv.num_free_gpu_blocks
    engine.step()  # prefill, then the group forks into 4 sequences
    group = engine.scheduler.get_seq_group("par")
    assert group is not None and len(group.seqs) == 4
    tables = [engine.kv.get_block_table(s.seq_id) for s in group.seqs]
    assert all(t == tables[0] for t in tables)  # the children share every block of the prompt
    assert free0 - engine.kv.num_free_gpu_blocks == 3
    assert all(engine.kv.gpu_pool.ref_count(b) == 4 for b in tables[0])
    engine.step()  # each writes into the partial block: copy-on-write for three, in place for the last
    tables = [engine.kv.get_block_table(s.seq_id) for s in group.seqs]
    assert all(t[:2] == tables[0][:2] for t in tables) and len({t[2] for t in tables}) == 4
    assert free0 - engine.kv.num_free_gpu_blocks == 2 + 4  # unshared copies would hold 4 * 3
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step().outputs
    first = outs[-1]
    assert first.finished and len(first.outputs) == 4
    assert len({tuple(o.token_ids) for o in first.outputs}) == 4  # distinct samples
    _idle_and_clean(engine)
    again = llm.generate({"prompt_token_ids": prompt}, params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    _idle_and_clean(engine)


def test_best_of_returns_the_most_likely(llm: LLM) -> None:
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=8, logprobs=0)
    out = llm.generate("My favourite animal is", params)[0]
    assert len(out.outputs) == 2
    lps = [o.cumulative_logprob for o in out.outputs]
    assert lps == sorted(lps, reverse=True)
    _idle_and_clean(llm.engine)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


BEAM_CASES = [
    ("The capital of France is", 16, True, 1.0),
    ("def fibonacci(n):\n    ", 16, False, 1.0),
    ("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n", 16, False, 0.6),
    ("Water boils at a temperature of", 12, "never", 1.0),
]


@pytest.mark.parametrize("prompt,max_tokens,early_stopping,length_penalty", BEAM_CASES)
def test_beam_search_matches_hf(
    llm: LLM, hf_model, prompt, max_tokens, early_stopping, length_penalty
) -> None:
    engine = llm.engine
    ids = engine.tokenizer.encode(prompt)
    params = SamplingParams(
        n=4,
        use_beam_search=True,
        temperature=0.0,
        max_tokens=max_tokens,
        early_stopping=early_stopping,
        length_penalty=length_penalty,
    )
    got = llm.generate({"prompt_token_ids": ids}, params)[0]
    eos = sorted(engine.eos_ids)
    with torch.no_grad():
        want = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            num_beams=4,
            num_return_sequences=4,
            max_new_tokens=max_tokens,
            early_stopping=early_stopping,
            length_penalty=length_penalty,
            eos_token_id=eos,
            pad_token_id=eos[0],
            output_scores=True,
            return_dict_in_generate=True,
        )
    for rank, out in enumerate(got.outputs):
        hf = want.sequences[rank, len(ids) :].tolist()
        hf = hf[: hf.index(eos[0]) + 1] if eos[0] in hf else hf  # HF pads finished beams with EOS
        assert out.token_ids == hf, (prompt, rank)
        score = out.cumulative_logprob / len(out.token_ids) ** length_penalty
        assert score == pytest.approx(want.sequences_scores[rank].item(), abs=1e-3)
    assert got.outputs[0].text == engine.tokenizer.decode(got.outputs[0].token_ids)
    _idle_and_clean(engine)


def test_beams_share_blocks_and_free_them(llm: LLM) -> None:
    engine = llm.engine
    bs = engine.kv.block_size
    prompt = list(range(2000, 2000 + 3 * bs))
    params = SamplingParams(n=4, use_beam_search=True, temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("beam", {"prompt_token_ids": prompt}, params)
    group = engine.scheduler.get_seq_group("beam")
    assert group is not None
    peak_used = peak_seqs = 0
    while engine.has_unfinished_requests():
        engine.step()
        used = engine.kv.num_gpu_blocks - engine.kv.num_free_gpu_blocks
        peak_used = max(peak_used, used)
        peak_seqs = max(peak_seqs, len(group.seqs))
        engine.kv.check_integrity()
    assert peak_seqs <= 4  # beams left behind leave the group (10 steps fork far more than 4)
    # Four beams of 3 prompt blocks + 1 generated block each, the prompt's blocks shared: 3 + 4 at most.
    assert peak_used <= 3 + 4
    _idle_and_clean(engine)


def test_abort_and_step_error_leave_a_clean_pool(llm: LLM, monkeypatch) -> None:
    engine = llm.engine
    for params in (
        SamplingParams(n=3, temperature=1.0, max_tokens=50, ignore_eos=True),
        SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=50, ignore_eos=True),
    ):
        engine.add_request("a", "Tell me a story about", params)
        engine.add_request("b", "Tell me a story about", SamplingParams(max_tokens=50, ignore_eos=True))
        for _ in range(3):
            engine.step()
        out = engine.abort_request("a")
        assert out is not None and out.finished and all(o.finish_reason == "abort" for o in out.outputs)
        engine.kv.check_integrity()
        real = engine.runner.execute

        def boom(out, *rest):  # noqa: ANN001, ANN002
            raise RuntimeError("device fell over")

        monkeypatch.setattr(engine.runner, "execute", boom)
        with pytest.raises(StepError, match="internal error") as err:
            engine.step()
        assert err.value.request_ids == ["b"]
        monkeypatch.setattr(engine.runner, "execute", real)
        _idle_and_clean(engine)
