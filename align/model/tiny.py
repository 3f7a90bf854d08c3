"""Small, randomly initialised Mistral checkpoints for tests and smoke runs.

The vocabulary and special-token ids come from a real tokenizer.json, and the
initialisation is seeded, so the same seed writes a byte-identical directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from align.model.checkpoint import save_hf_checkpoint
from align.model.hf_config import MistralConfig
from align.model.mistral import NmoMistralForCausalLM, RMSNorm

SPECIAL_TOKENS = {"bos_token_id": "<s>", "eos_token_id": "</s>", "pad_token_id": "<pad>"}
INIT_STD = 0.02


def make_tiny_model(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    max_position_embeddings: int,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a seeded random Mistral checkpoint (with the tokenizer files) to out_dir."""
    config = MistralConfig(
        **tokenizer_vocabulary(Path(tokenizer_dir)),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        sliding_window=sliding_window,
        tie_word_embeddings=tie_word_embeddings,
        torch_dtype="float32",
    )
    # Pinned to CPU float32 so a process-wide default device or dtype cannot change the draws.
    with torch.device("cpu"):
        model = NmoMistralForCausalLM(config).float()
    initialize_weights(model, torch.Generator(device="cpu").manual_seed(seed))
    return save_hf_checkpoint(model, out_dir, source_dir=tokenizer_dir)


def tokenizer_vocabulary(tokenizer_dir: Path) -> dict[str, int]:
    """vocab_size and the bos/eos/pad ids of the tokenizer.json in tokenizer_dir."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    tokenizer = Tokenizer.from_file(str(path))
    vocabulary = {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}
    for field, token in SPECIAL_TOKENS.items():
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer {path} has no {token} token (needed for {field})")
        vocabulary[field] = token_id
    return vocabulary


@torch.no_grad()
def initialize_weights(model: NmoMistralForCausalLM, generator: torch.Generator) -> None:
    """Normal(0, 0.02) for linear and embedding weights, ones for norms, in module order."""
    initialized: set[int] = set()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, nn.Linear | nn.Embedding):
            if id(module.weight) in initialized:
                continue  # the tied lm_head already holds the embedding's draw
            module.weight.normal_(0.0, INIT_STD, generator=generator)
            initialized.add(id(module.weight))
