"""NmoMistralForCausalLM reproduces transformers' MistralForCausalLM, and checkpoints cross over."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
import transformers

from align.model.checkpoint import hf_to_nmo, load_pretrained, save_hf_checkpoint
from align.model.hf_config import MistralConfig
from align.model.mistral import NmoMistralForCausalLM

# These matrices are tiny: thread hand-offs would cost far more than the arithmetic.
torch.set_num_threads(1)

TOLERANCE = 1e-5
LENGTH = 24
VOCAB = 97


def random_config(seed: int, grouped: bool, windowed: bool, tied: bool) -> MistralConfig:
    rng = random.Random(seed)
    heads = rng.choice([4, 8])
    return MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=rng.choice([96, 128, 160]),
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads // rng.choice([2, 4]) if grouped else heads,
        head_dim=rng.choice([None, 8, 24]),
        max_position_embeddings=64,
        rms_norm_eps=rng.choice([1e-5, 1e-6]),
        rope_theta=rng.choice([500.0, 10000.0, 1e6]),
        sliding_window=rng.randint(3, LENGTH - 4) if windowed else None,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


CASES = {
    f"{'gqa' if grouped else 'mha'}-{'window' if windowed else 'full'}-"
    f"{'tied' if tied else 'untied'}": random_config(seed, grouped, windowed, tied)
    for seed, (grouped, windowed, tied) in enumerate(itertools.product([True, False], repeat=3))
}


@torch.no_grad()
def random_hf_model(config: MistralConfig, attn_implementation: str, seed: int = 0):
    hf_config = transformers.MistralConfig(
        **config.to_hf_dict(), attn_implementation=attn_implementation
    )
    model = transformers.MistralForCausalLM(hf_config).eval()
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator)
        parameter.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model


def nmo_from_hf(hf_model, config: MistralConfig, attn_implementation: str) -> NmoMistralForCausalLM:
    model = NmoMistralForCausalLM(config, attn_implementation).eval()
    model.load_state_dict(hf_to_nmo(hf_model.state_dict()))
    return model


def inputs(batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (batch, LENGTH), generator=generator)
    lengths = torch.tensor([LENGTH, LENGTH - 5, LENGTH - 11][:batch])
    attention_mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    return input_ids, attention_mask


def max_diff_on_real_tokens(a: torch.Tensor, b: torch.Tensor, attention_mask) -> float:
    real = attention_mask.bool()
    return (a[real] - b[real]).abs().max().item()


@pytest.mark.parametrize("hf_attn", ["eager", "sdpa"])
@pytest.mark.parametrize("nmo_attn", ["eager", "sdpa"])
@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_logits_match_transformers(case: str, hf_attn: str, nmo_attn: str):
    config = CASES[case]
    hf_model = random_hf_model(config, hf_attn)
    model = nmo_from_hf(hf_model, config, nmo_attn)
    input_ids, attention_mask = inputs()

    unpadded = model(input_ids)
    assert unpadded.shape == (3, LENGTH, VOCAB) and unpadded.dtype == torch.float32
    assert (unpadded - hf_model(input_ids).logits).abs().max().item() <= TOLERANCE

    padded = model(input_ids, attention_mask=attention_mask)
    reference = hf_model(input_ids, attention_mask=attention_mask).logits
    assert torch.isfinite(padded).all()
    assert max_diff_on_real_tokens(padded, reference, attention_mask) <= TOLERANCE


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_align_backends_agree(case: str):
    config = CASES[case]
    hf_model = random_hf_model(config, "eager")
    eager, sdpa = (nmo_from_hf(hf_model, config, impl) for impl in ("eager", "sdpa"))
    assert eager.attn_implementation == "eager" and sdpa.attn_implementation == "sdpa"
    input_ids, attention_mask = inputs()
    for mask in (None, attention_mask):
        difference = eager(input_ids, attention_mask=mask) - sdpa(input_ids, attention_mask=mask)
        assert difference.abs().max().item() <= TOLERANCE


@torch.no_grad()
def test_sliding_window_changes_logits_only_beyond_the_window():
    windowed = CASES["gqa-window-untied"]
    full = dataclasses.replace(windowed, sliding_window=None)
    hf_model = random_hf_model(windowed, "eager")
    input_ids, _ = inputs(batch=1)
    window_logits = nmo_from_hf(hf_model, windowed, "sdpa")(input_ids)
    full_logits = nmo_from_hf(hf_model, full, "sdpa")(input_ids)
    inside = windowed.sliding_window
    assert (window_logits[:, :inside] - full_logits[:, :inside]).abs().max() <= TOLERANCE
    assert (window_logits[:, inside:] - full_logits[:, inside:]).abs().max() > 1e-3


@torch.no_grad()
def test_all_ones_mask_matches_no_mask_and_left_padding_is_refused():
    config = CASES["gqa-full-untied"]
    model = nmo_from_hf(random_hf_model(config, "eager"), config, "sdpa")
    input_ids, attention_mask = inputs()
    ones = torch.ones_like(attention_mask)
    assert torch.equal(model(input_ids, attention_mask=ones), model(input_ids))
    with pytest.raises(ValueError, match="right-padded"):
        model(input_ids, attention_mask=attention_mask.flip(-1))


@pytest.mark.parametrize("case", ["gqa-window-untied", "mha-full-tied"])
@torch.no_grad()
def test_return_hidden_times_lm_head_is_logits(case: str):
    config = CASES[case]
    model = nmo_from_hf(random_hf_model(config, "eager"), config, "sdpa")
    input_ids, attention_mask = inputs()
    hidden = model(input_ids, attention_mask=attention_mask, return_hidden=True)
    assert hidden.shape == (3, LENGTH, config.hidden_size)
    logits = model(input_ids, attention_mask=attention_mask)
    assert (hidden @ model.lm_head.weight.T - logits).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
@pytest.mark.parametrize("case", ["gqa-window-untied", "mha-full-tied"])
@torch.no_grad()
def test_saved_checkpoint_loads_in_transformers(tmp_path, case: str, max_shard_bytes):
    config = CASES[case]
    model = nmo_from_hf(random_hf_model(config, "eager"), config, "sdpa")
    save_hf_checkpoint(model, tmp_path / "ckpt", max_shard_bytes=max_shard_bytes)
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists() == bool(max_shard_bytes)

    hf_model = transformers.MistralForCausalLM.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert hf_model.config.sliding_window == config.sliding_window
    assert hf_model.config.rope_parameters["rope_theta"] == config.rope_theta
    input_ids, attention_mask = inputs()
    difference = max_diff_on_real_tokens(
        model(input_ids, attention_mask=attention_mask),
        hf_model(input_ids, attention_mask=attention_mask).logits,
        attention_mask,
    )
    assert difference <= TOLERANCE


@pytest.mark.parametrize("max_shard_size", [None, "20KB"])
@pytest.mark.parametrize("case", ["gqa-window-untied", "mha-full-tied", "gqa-full-tied"])
@torch.no_grad()
def test_transformers_checkpoint_loads_with_load_pretrained(tmp_path, case: str, max_shard_size):
    config = CASES[case]
    hf_model = random_hf_model(config, "eager")
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf_model.save_pretrained(tmp_path / "hf", **kwargs)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == bool(max_shard_size)

    model = load_pretrained(tmp_path / "hf")
    assert model.config == config
    input_ids, attention_mask = inputs()
    assert (model(input_ids) - hf_model(input_ids).logits).abs().max().item() <= TOLERANCE
    difference = max_diff_on_real_tokens(
        model(input_ids, attention_mask=attention_mask),
        hf_model(input_ids, attention_mask=attention_mask).logits,
        attention_mask,
    )
    assert difference <= TOLERANCE
