"""Offline generation on the default model: against the HF oracle, batched vs alone, sampling, bad input."""

from __future__ import annotations

import pytest
import torch

from tinypaged import LLM, RequestOutputKind, SamplingParams
from tinypaged.config import EngineConfig, ModelConfig
from tinypaged.errors import ConfigError, RequestError
from tinypaged.model import load_model
from tinypaged.weights import fetch as fetch_module

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
    "1, 2, 3, 4,",
]


def test_default_model_when_none_is_given(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("the complete default model must not be fetched again")

    monkeypatch.setattr(fetch_module, "_pip_download", fail)
    monkeypatch.setattr(fetch_module, "convert_gguf", fail)
    assert LLM(max_model_len=64, num_gpu_blocks_override=8).config.model == model_dir


@pytest.mark.parametrize(
    "kwargs,setting",
    [
        ({"num_gpu_blocks_override": 2**40}, "num_gpu_blocks_override"),
        ({"swap_space": 2.0**40}, "swap_space"),
    ],
)
def test_a_kv_cache_too_large_for_memory_is_one_clear_error(model_dir, kwargs: dict, setting: str) -> None:
    """A KV pool past the machine's memory names the setting that sized it (it was the allocator's message)."""
    with pytest.raises(
        ConfigError, match=rf"KV cache of \d+ blocks \(.* GiB\) cannot be allocated on cpu: lower {setting}"
    ):
        LLM(model=model_dir, max_model_len=64, **kwargs)


def test_a_cuda_device_this_machine_lacks_is_one_clear_error(model_dir) -> None:
    """Asked where the engine starts, not when the config is built (a replica set's HTTP front has no GPU)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    EngineConfig(model=model_dir, device=f"cuda:{count}")  # spelt right: the config takes it
    with pytest.raises(ConfigError, match=f"device cuda:{count}: this machine has {count} CUDA device"):
        LLM(model=model_dir, max_model_len=64, device=f"cuda:{count}")


def test_logits_match_gguf_oracle(model_dir, oracle_model, llm: LLM, run_paged) -> None:
    tok = llm.get_tokenizer()
    model = load_model(ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"), 512)
    prompts = [tok.encode(p) for p in PROMPTS]
    got = run_paged(model, prompts, 16, [[] for _ in prompts])
    worst = 0.0
    for ids, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = oracle_model(torch.tensor([ids])).logits[0]
        worst = max(worst, (logits - want).abs().max().item())
    assert worst < 1e-3, f"max-abs logit difference {worst}"


def test_greedy_continuations_match_gguf_oracle(oracle_model, llm: LLM) -> None:
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)
        want: list[int] = []
        step, past = torch.tensor([ids]), None
        with torch.no_grad():  # a plain argmax loop: the oracle must neither stop at EOS nor suppress it
            for _ in range(32):
                res = oracle_model(step, past_key_values=past, use_cache=True)
                past = res.past_key_values
                want.append(int(res.logits[0, -1].argmax()))
                step = torch.tensor([[want[-1]]])
        assert out.outputs[0].token_ids == want, prompt
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
        assert out.outputs[0].finish_reason == "length"


def test_warm_logits_runs_every_row_count_a_step_samples(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU runner runs the LM head at each row count from 1 to max_num_seqs before any step (a first matmul
    of a new shape loads its kernel and waits for the device); here it is called on the CPU runner."""
    runner = llm.engine.runner
    rows: list[int] = []
    real = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda h: rows.append(h.shape[0]) or real(h))
    runner._warm_logits()
    assert rows == list(range(1, llm.config.max_num_seqs + 1))
    assert runner.stats.warm_logits_s > 0


def test_batched_equals_alone(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    together = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together, strict=True):
        alone = llm.generate(prompt, params)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_token_id_prompts_and_eos(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hello."}])
    ids = tok.encode(chat)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=200))[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].finish_reason == "stop"  # the instruct model ends its answer with <|im_end|>
    assert 0 < len(out.outputs[0].token_ids) < 200
    assert out.outputs[0].token_ids[-1] == tok.eos_token_id


def test_seeded_sampling_repeats_and_differs(llm: LLM) -> None:
    def sample(seed: int) -> list[int]:
        p = SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=16, ignore_eos=True)
        return llm.generate("My favourite animal is", p)[0].outputs[0].token_ids

    a, b, c = sample(1), sample(1), sample(2)
    assert a == b
    assert a != c
    # The seed fixes a request's draw whatever else is in the batch.
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=16, ignore_eos=True)
    batch = llm.generate(
        ["My favourite animal is", "Another prompt entirely"], [p, SamplingParams(temperature=1.0)]
    )
    assert batch[0].outputs[0].token_ids == a


def test_stop_strings_and_token_ids(llm: LLM) -> None:
    free = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=20))[0].outputs[0]
    assert " 6" in free.text
    cut = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=20, stop=[" 6"]))[0].outputs[
        0
    ]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 6"
    assert cut.text == free.text[: free.text.index(" 6")]
    first = free.token_ids[2]
    by_id = llm.generate(
        "1, 2, 3, 4,", SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[first])
    )
    assert by_id[0].outputs[0].token_ids == free.token_ids[:3]
    assert by_id[0].outputs[0].stop_reason == first


def test_final_only_outputs_equal_cumulative_ones(llm: LLM) -> None:
    """FINAL_ONLY (LLM.generate's kind): no output until a request finishes, and then the same one as
    CUMULATIVE's last, however its text was found (at the end, or each step for stop strings)."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=1.0, seed=7, n=2, best_of=3, max_tokens=30, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["\n", " the"]),
        SamplingParams(temperature=0.9, seed=3, max_tokens=25, min_tokens=5, stop_token_ids=[13, 198]),
        SamplingParams(temperature=0.0, max_tokens=12, n=2, use_beam_search=True),
        SamplingParams(temperature=1.2, seed=11, max_tokens=64, ignore_eos=True, skip_special_tokens=False),
    ]
    engine = llm.engine

    def run(kind: RequestOutputKind) -> dict[str, object]:
        last = {}
        for i, (prompt, sp) in enumerate(zip(PROMPTS + PROMPTS[:1], kinds, strict=True)):
            params = SamplingParams(**{**sp.__dict__, "output_kind": kind})
            engine.add(engine.process_inputs(f"{kind.name}-{i}", prompt, params))
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                assert out.finished or kind is RequestOutputKind.CUMULATIVE
                last[out.request_id.split("-")[1]] = out
        return last

    cumulative, final = run(RequestOutputKind.CUMULATIVE), run(RequestOutputKind.FINAL_ONLY)
    assert sorted(final) == sorted(cumulative) == [str(i) for i in range(len(kinds))]
    for i, out in final.items():
        want = cumulative[i]
        assert want.finished and [o.__dict__ for o in out.outputs] == [o.__dict__ for o in want.outputs]
    assert any(o.finish_reason == "stop" and o.stop_reason in ("\n", " the") for o in final["2"].outputs)


def test_request_metrics(llm: LLM) -> None:
    """RequestOutput.metrics: the arrival, the steps that gave the first and the latest tokens, and the end, in
    that order; each output holds a snapshot; a final-only output the same milestones; an abort stamps the end."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    final = SamplingParams(**{**greedy.__dict__, "output_kind": RequestOutputKind.FINAL_ONLY})
    engine.add(engine.process_inputs("m-cumulative", PROMPTS[0], greedy))
    engine.add(engine.process_inputs("m-final", PROMPTS[1], final))
    seen: dict[str, list] = {"m-cumulative": [], "m-final": []}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            seen[out.request_id].append(out)
    steps, (last,) = seen["m-cumulative"], seen["m-final"]
    assert len(steps) >= 2
    assert len({o.metrics.first_token_time for o in steps}) == 1  # set once, copied into each output
    latest = [o.metrics.last_token_time for o in steps]
    assert latest == sorted(latest) and latest[-1] > latest[0] == steps[0].metrics.first_token_time
    assert all(o.metrics.finished_time is None for o in steps[:-1])
    for out in (steps[-1], last):
        m = out.metrics
        assert out.finished and m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time

    engine.add(engine.process_inputs("m-aborted", PROMPTS[2], SamplingParams(max_tokens=50)))
    engine.step()
    aborted = engine.abort_request("m-aborted")
    assert aborted is not None and aborted.finished and aborted.metrics.finished_time is not None
    while engine.has_unfinished_requests():
        engine.step()


def test_logprobs(llm: LLM) -> None:
    out = llm.generate("The sky is", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_prompt_logprobs_match_gguf_oracle(oracle_model, llm: LLM) -> None:
    # Batched with a request that does not want them: the runner returns the logits of that one's chunk only.
    tok = llm.get_tokenizer()
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    outs = llm.generate(
        PROMPTS[:3], [plain, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2), plain]
    )
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    ids = tok.encode(PROMPTS[1])
    got = outs[1].prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    with torch.no_grad():
        want = torch.log_softmax(oracle_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for pos, (token, entry) in enumerate(zip(ids[1:], got[1:], strict=True)):
        assert entry is not None and token in entry and len(entry) in (2, 3)
        assert entry[token].logprob == pytest.approx(want[pos, token].item(), abs=1e-3)
        assert entry[token].rank == int((want[pos] > want[pos, token]).sum()) + 1


def test_prompt_logprobs_with_its_prefix_cached(model_dir) -> None:
    # A scored prompt runs whole although its blocks are in the cache.
    llm = LLM(model=model_dir, seed=0, enable_prefix_caching=True)
    prompt = " ".join(PROMPTS * 6)  # several full blocks
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    [first] = llm.generate([prompt], [scored])
    [plain] = llm.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=1)])  # its blocks hit
    hits = llm.engine.stats().prefix_cache_hits_total
    assert hits > 0
    [again] = llm.generate([prompt], [scored])
    assert llm.engine.stats().prefix_cache_hits_total == hits  # not read for the scored prompt
    assert first.prompt_logprobs is not None and again.prompt_logprobs is not None
    assert len(again.prompt_logprobs) == len(first.prompt_logprobs) == len(first.prompt_token_ids)
    for a, b in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None and a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache()  # nothing running: the cache empties, and the prompt hits nothing
    llm.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=1)])
    assert llm.engine.stats().prefix_cache_hits_total == hits


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "empty"),
        ({"prompt_token_ids": [1, 10**9]}, SamplingParams(), "out of range"),
        ("hi " * 9000, SamplingParams(), "maximum context length"),
        (["fine", {"prompt": "no ids"}], SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": 5}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [1, True]}, SamplingParams(), "out of range"),
        ({"prompt_token_ids": [1], "prompt": 3}, SamplingParams(), "text is a string"),
        ([42], SamplingParams(), "got int"),
        ("fine", SamplingParams(stop_token_ids=[10**9]), "stop token id"),
        ("fine", SamplingParams(n=300), "max_num_seqs"),
    ],
)
def test_bad_prompts(llm: LLM, prompt, params, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        llm.generate(prompt, params)
    assert err.value.param is not None
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(logprobs=99), "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs: dict, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        SamplingParams(**kwargs)
    assert err.value.param == message


@pytest.fixture(scope="module")
def small_steps(model_dir) -> LLM:
    """Steps of at most 48 tokens under async scheduling: a batch of a few prompts spans several steps."""
    return LLM(model=model_dir, seed=0, max_num_batched_tokens=48, max_num_seqs=8, async_scheduling=True)


def batch(n: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(5, 40, (n,), generator=gen).tolist()
    prompts = [{"prompt_token_ids": torch.randint(0, 1000, (k,), generator=gen).tolist()} for k in lens]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True, temperature=0.8, seed=i)
              for i, m in enumerate(torch.randint(1, 8, (n,), generator=gen))]  # fmt: skip
    return prompts, params


def step_shapes(
    llm: LLM, prompts: list[dict], params: list[SamplingParams], whole: bool
) -> tuple[list, list]:
    """The steps' shapes and the outputs, the batch queued by `generate` (`whole` False) or all of it queued first."""
    engine = llm.engine
    llm.reset_prefix_cache()
    if whole:
        ids = [f"whole-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, params, strict=True):
            engine.add(engine.process_inputs(rid, p, sp))
        results = []
        while engine.has_unfinished_requests():
            results.append(engine.step())
    else:
        ids = []
        results = list(llm.batch_steps(prompts, params, ids))
    done = {o.request_id: o for r in results for o in r.outputs if o.finished}
    shapes = [(r.stats.num_seqs, r.stats.num_prefill_tokens, r.stats.num_decode_tokens) for r in results]
    return shapes, [done[rid].outputs[0].token_ids for rid in ids]


def logging(obj: object, name: str, log: list[str], monkeypatch) -> None:
    """Record each call of `obj.name` in `log`."""
    f = getattr(obj, name)

    def logged(*args, **kwargs):
        log.append(name)
        return f(*args, **kwargs)

    monkeypatch.setattr(obj, name, logged)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_first_step_runs_while_the_rest_is_checked(small_steps: LLM, seed: int, monkeypatch) -> None:
    """generate() checks just enough requests to fill a step, launches the step, then checks the rest; the steps
    (and tokens) are those of the batch queued whole."""
    prompts, params = batch(12, seed)
    want = step_shapes(small_steps, prompts, params, whole=True)
    log: list[str] = []
    for name in ("process_inputs", "step"):
        logging(small_steps.engine, name, log, monkeypatch)
    assert step_shapes(small_steps, prompts, params, whole=False) == want
    k = log.index("step")
    tokens = [len(p["prompt_token_ids"]) for p in prompts]
    assert sum(tokens[: k - 1]) <= 48 < sum(tokens[:k])
    rest = len(prompts) - k
    assert log[: k + rest + 2] == ["process_inputs"] * k + ["step"] + ["process_inputs"] * rest + ["step"]


def test_a_bad_request_after_the_first_step_leaves_nothing(small_steps: LLM) -> None:
    prompts, params = batch(10, 2)
    bad = len(prompts) - 2
    prompts[bad] = {"prompt_token_ids": [1, 10**9]}
    engine = small_steps.engine
    with pytest.raises(RequestError, match="out of range"):
        small_steps.generate(prompts, params)
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    prompts[bad] = {"prompt_token_ids": [1, 2, 3]}
    assert len(small_steps.generate(prompts, params)) == len(prompts)  # the engine goes on as before
