"""The batched sampler against small hand-computed torch references; SamplingParams checks; stop strings."""

from __future__ import annotations

import pytest
import torch

from tinypaged import ops
from tinypaged.core.sequence import Sequence
from tinypaged.engine.request import SeqState, visible_text
from tinypaged.engine.sampling.sampler import Sampler, SamplingRow, seq_seed
from tinypaged.engine.step.output_processor import check_stop
from tinypaged.sampling_params import SamplingParams
from tinypaged.tokenizer import IncrementalDetokenizer, Tokenizer

V = 8


def _row(**kw) -> SamplingRow:
    prompt = kw.pop("prompt", [])
    output = kw.pop("output", [])
    seed_key = kw.pop("seed_key", None)
    return SamplingRow(SamplingParams(**kw), prompt, output, seed_key)


def test_penalties_match_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, -0.5]])
    row = _row(
        repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2, prompt=[0, 1], output=[3, 3, 4]
    )
    got = Sampler().process(logits, [row])[0]
    want = logits[0].clone()
    for t in (0, 1, 3, 4):  # seen in prompt or output: positive / 1.5, negative * 1.5
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    want[3] -= 0.2 * 2 + 0.3  # output twice
    want[4] -= 0.2 * 1 + 0.3
    torch.testing.assert_close(got, want)


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's warper order: temperature, top-k, top-p over the renormalised rest, min-p; then renormalise."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    keep = set(order[: p.top_k or len(order)])
    mass = sum(probs[t].item() for t in keep)
    acc, kept_p = 0.0, set()
    for t in order:
        if t in keep and acc < p.top_p:
            kept_p.add(t)
            acc += probs[t].item() / mass
    keep &= kept_p
    keep = {t for t in keep if probs[t] >= p.min_p * probs.max()}
    out = torch.zeros_like(probs)
    for t in keep:
        out[t] = probs[t]
    return out / out.sum()


# (params, logits scale): peaked and flat distributions, each filter alone and together.
DIST_CASES = [
    (dict(temperature=1.0), 1.0),
    (dict(top_k=3), 1.0),
    (dict(top_p=0.6), 1.0),
    (dict(top_p=0.95, temperature=0.8), 0.1),
    (dict(top_k=5, top_p=0.7), 1.0),
    (dict(min_p=0.3), 1.0),
    (dict(top_k=6, min_p=0.05), 3.0),
    (dict(temperature=0.5, top_k=4, top_p=0.9, min_p=0.05), 1.0),
    (dict(top_p=0.05), 0.01),  # a near-flat row whose nucleus is one token: many rejection rounds
]
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # chi-square, p = 0.001


def draw(logits: torch.Tensor, p: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """`n` draws from one row of logits under `p`, each with its own key."""
    keys = torch.randint(0, 1 << 62, (n,), generator=torch.Generator().manual_seed(seed))

    def full(v: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((n,), v, dtype=dtype)

    top_k = p.top_k if p.top_k < logits.shape[-1] else 0
    params = ops.SampleParams(
        full(p.temperature), full(top_k, torch.int64), full(p.top_p), full(p.min_p), keys
    )
    return ops.ref_sample(logits.repeat(n, 1), params)


@pytest.mark.parametrize("kw,scale", DIST_CASES)
def test_sampling_follows_the_exact_distribution(kw: dict, scale: float) -> None:
    """Chi-square of 20,000 draws against HF's filtered distribution (computed by sorting, independently):
    tokens outside the kept set never come, the kept ones as often as their probability says."""
    logits = torch.tensor([1.0, 2.5, 0.3, 2.0, -1.0, 1.7, 0.9, 2.2]) * scale
    p = SamplingParams(**kw)
    n = 20_000
    counts = torch.bincount(draw(logits, p, n), minlength=V).double()
    want = _reference_probs(logits, p).double()
    assert counts[want == 0].sum() == 0, (counts, want)
    kept = want > 0
    expected = want[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    df = int(kept.sum()) - 1
    assert df == 0 or chi2 < CHI2_999[df], (chi2, df, counts, want)


def test_flat_distribution_top_p_keeps_the_nucleus() -> None:
    """A flat row of 3,000 tokens (top-p's nucleus is most of the vocabulary, where a candidate cap or a sort
    would be the cost): every draw in the nucleus, and the nucleus's likelier half drawn as often as its mass."""
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(0)) * 0.1
    p = SamplingParams(top_p=0.9)
    probs = torch.softmax(logits.double(), dim=-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    nucleus = order[before < 0.9]
    got = draw(logits, p, 20_000)
    assert torch.isin(got, nucleus).all()
    half = nucleus[: len(nucleus) // 2]
    share = probs[half].sum() / probs[nucleus].sum()
    seen = torch.isin(got, half).double().mean()
    assert abs(seen - share) < 4 * (share * (1 - share) / 20_000) ** 0.5, (seen, share)


def test_mixed_batch_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    rows = [_row(temperature=0.0), _row(temperature=0.9, top_p=0.8)] * 3
    out = Sampler()(logits, rows).token_ids
    assert out[0::2] == logits[0::2].argmax(dim=-1).tolist()


def test_greedy_banned_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 0.0, 0.0, 0.0, 0.0]])
    row = _row(temperature=0.0, logprobs=2)
    row.banned_ids = (1,)
    out = Sampler()(logits, [row])
    assert out.token_ids == [3]
    logp = torch.log_softmax(logits[0], -1)  # logprobs are the model's raw distribution
    assert out.logprobs == pytest.approx([logp[3].item()])
    assert out.ranks == [2] and out.top_ids == [[1, 3]]


def test_seeded_rows_repeat_whatever_the_batch() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    key = seq_seed(7, 0)
    alone = [Sampler()(logits, [_row(seed_key=key, output=[1] * i)]).token_ids[0] for i in range(20)]
    batch_logits = torch.cat([torch.randn(3, 1000), logits])
    mixed = [
        Sampler()(
            batch_logits,
            [_row(), _row(seed=1, seed_key=seq_seed(1, 0)), _row(), _row(seed_key=key, output=[1] * i)],
        ).token_ids[3]
        for i in range(20)
    ]
    assert alone == mixed
    assert len(set(alone)) > 5  # the stream moves on with the output length
    other = [
        Sampler()(logits, [_row(seed_key=seq_seed(7, 1), output=[1] * i)]).token_ids[0] for i in range(20)
    ]
    assert other != alone  # sequence 1 of the same request has its own stream


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(n=0), "n must be"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(stop=[""]), "stop strings"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed=1.5), "seed"),
        (dict(use_beam_search=True, n=1), "beam width"),
        (dict(use_beam_search=True, n=2, temperature=0.7), "temperature must be 0"),
        (dict(use_beam_search=True, n=2, temperature=0.0, top_k=5), "top_p, top_k and min_p"),
        (dict(use_beam_search=True, n=2, temperature=0.0, early_stopping="sometimes"), "early_stopping"),
        (dict(length_penalty=0.5), "length_penalty only applies"),
        (dict(early_stopping=True), "early_stopping only applies"),
    ],
)
def test_bad_params(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_valid_params() -> None:
    p = SamplingParams(n=2, best_of=4, stop="x", top_k=-1)
    assert p.num_seqs == 4 and p.stop == ["x"] and p.top_k == 0
    b = SamplingParams(n=2, use_beam_search=True, temperature=0.0, length_penalty=0.7, early_stopping="never")
    assert b.num_seqs == 2


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


def _stream(tok: Tokenizer, text: str, params: SamplingParams) -> tuple[list[str], SeqState, object]:
    """Feed `text`'s tokens one at a time; the visible text after each, the final state and status."""
    ids = tok.encode(text, add_special_tokens=False)
    seq = Sequence(0, [1])
    state = SeqState(0, IncrementalDetokenizer(tok, [1], True))
    shown, status = [], None
    for t in ids:
        seq.append_token(t)
        status = check_stop(params, seq, state, t, frozenset(), 10_000)
        shown.append(visible_text(params, state, status is not None))
        if status is not None:
            break
    return shown, state, status


def test_stop_string_across_tokens_is_cut_and_held_back(tok: Tokenizer) -> None:
    text = "The answer is forty-two, said the computer."
    stop = "two, said"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces), "the stop string must span several tokens"
    shown, state, status = _stream(tok, text, SamplingParams(stop=[stop]))
    assert status is not None and state.stop_reason == stop
    assert shown[-1] == "The answer is forty-"
    for s in shown:  # the stream only grows, and never shows a piece of the stop string
        assert shown[-1].startswith(s)
    shown2, _, _ = _stream(tok, text, SamplingParams(stop=[stop], include_stop_str_in_output=True))
    assert shown2[-1] == "The answer is forty-two, said"


def test_partial_stop_prefix_is_released_when_it_does_not_match(tok: Tokenizer) -> None:
    shown, state, status = _stream(tok, "Hello world, hello there", SamplingParams(stop=["world peace"]))
    assert status is None
    assert "world" not in shown[1] or shown[-1].endswith("there")
    assert any(s.endswith("Hello") for s in shown)  # " world" was held back while it could start the stop
    assert shown[-1] == state.text == "Hello world, hello there"
