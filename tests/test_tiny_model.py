"""make_tiny_model writes a seeded, reproducible checkpoint that both loaders accept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import TINY_SIZES
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from align.model.checkpoint import load_pretrained
from align.model.hf_config import load_hf_config
from align.model.tiny import make_tiny_model
from align.utils.weights_hash import weights_hash

# These matrices are tiny: thread hand-offs would cost far more than the arithmetic.
torch.set_num_threads(1)

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a preference pair has a chosen and a rejected answer",
    "direct preference optimisation needs a frozen reference model",
    "small models make fast tests",
]


def train_tokenizer(directory: Path, special_tokens: list[str]) -> Path:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=special_tokens, show_progress=False
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture
def tokenizer_dir(tmp_path) -> Path:
    return train_tokenizer(tmp_path / "tokenizer", ["<unk>", "<s>", "</s>", "<pad>"])


def directory_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_same_seed_gives_identical_bytes_and_a_new_seed_new_weights(tmp_path, tokenizer_dir):
    first = make_tiny_model(tmp_path / "a", tokenizer_dir, seed=7, **TINY_SIZES)
    second = make_tiny_model(tmp_path / "b", tokenizer_dir, seed=7, **TINY_SIZES)
    other = make_tiny_model(tmp_path / "c", tokenizer_dir, seed=8, **TINY_SIZES)
    assert first == tmp_path / "a"
    assert directory_bytes(first) == directory_bytes(second)
    assert weights_hash(first) == weights_hash(second) != weights_hash(other)
    assert (first / "tokenizer.json").read_bytes() == (
        tokenizer_dir / "tokenizer.json"
    ).read_bytes()


def test_config_comes_from_the_tokenizer_and_arguments(tmp_path, tokenizer_dir):
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out_dir = make_tiny_model(
        tmp_path / "m", tokenizer_dir, seed=0, rope_theta=500.0, sliding_window=8, **TINY_SIZES
    )
    config = load_hf_config(out_dir)
    assert config.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 3)
    assert (config.rope_theta, config.sliding_window, config.torch_dtype) == (500.0, 8, "float32")
    assert config.hidden_size == 32 and not config.tie_word_embeddings


@pytest.mark.parametrize("tied", [False, True])
@torch.no_grad()
def test_tiny_model_loads_in_align_and_transformers(tmp_path, tokenizer_dir, tied: bool):
    out_dir = make_tiny_model(
        tmp_path / "m",
        tokenizer_dir,
        seed=3,
        tie_word_embeddings=tied,
        sliding_window=6,
        **TINY_SIZES,
    )
    model = load_pretrained(out_dir)
    assert model.embed.weight.std().item() == pytest.approx(0.02, rel=0.2)
    assert torch.equal(model.norm.weight, torch.ones(32))
    assert (model.lm_head.weight is model.embed.weight) == tied

    hf_model = transformers.MistralForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator())
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0
    ours = model(input_ids, attention_mask=attention_mask)
    theirs = hf_model(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    assert (ours[real] - theirs[real]).abs().max().item() <= 1e-5


def test_refuses_a_tokenizer_without_the_special_tokens(tmp_path):
    tokenizer_dir = train_tokenizer(tmp_path / "no_pad", ["<unk>", "<s>", "</s>"])
    with pytest.raises(ValueError, match="<pad>"):
        make_tiny_model(tmp_path / "m", tokenizer_dir, seed=0, **TINY_SIZES)
    assert not (tmp_path / "m").exists()


def test_refuses_a_directory_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        make_tiny_model(tmp_path / "m", tmp_path, seed=0, **TINY_SIZES)
