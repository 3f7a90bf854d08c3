"""Checkpoint directories shaped like hub downloads: Mistral's real tokenizer, sharded weights.

The tokenizer is Mistral v0.1's own sentencepiece model (32,000 tokens with byte
fallback), shipped in the mistral-common wheel and converted to tokenizer.json by
transformers, with no pad token and Mistral-Instruct v0.1's `[INST]` chat template,
which refuses a system turn. The weights are a small random MistralForCausalLM that
transformers' save_pretrained writes as several shards plus the index, with its
generation_config.json.

`layout` gives the file conventions of either transformers generation, as
downloads of either age have them: "v5" is what save_pretrained writes here
(`rope_parameters`, `dtype`, chat_template.jinja); "v4" rewrites it as transformers
4 wrote it (`rope_theta` and `torch_dtype` in config.json, the chat template inside
tokenizer_config.json, a special_tokens_map.json).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

SENTENCEPIECE_V1 = "tokenizer.model.v1"
# Mistral v0.3's: 32,768 tokens, [INST] and [/INST] among the control tokens.
SENTENCEPIECE_V3 = "mistral_instruct_tokenizer_240323.model.v3"
# Mistral-7B-Instruct-v0.1's template as first published: roles must alternate from a user turn.
MISTRAL_INSTRUCT_V01_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# Mistral's basic instruct template for its v2 and v3 tokenizers (Mistral-7B-Instruct-v0.3 and
# later; mistralai/cookbook, concept-deep-dive/tokenization/templates.md): no space before
# [/INST], and, like v0.1's, no system turn. mistral-common puts a system prompt before the
# last user message with a blank line, which is what data.merge_system_into_user renders.
MISTRAL_INSTRUCT_V3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + '[/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# Small enough that both workflow chains train in seconds; embeddings and lm_head dominate.
HUB_SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
# Each 32,000 x 32 bfloat16 matrix (2 MB) gets a shard of its own, the layers share a third.
MAX_SHARD_SIZE = "1MB"


def mistral_sentencepiece_model(name: str = SENTENCEPIECE_V1) -> Path:
    """One of Mistral's sentencepiece models as the mistral-common wheel ships it."""
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("mistral-common is not installed (pip install -e '.[test]')")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / name
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the mistral-common wheel")
    return path


def write_mistral_tokenizer(
    out_dir: Path,
    model: str = SENTENCEPIECE_V1,
    chat_template: str | None = MISTRAL_INSTRUCT_V01_TEMPLATE,
) -> Path:
    """tokenizer.model, tokenizer.json, tokenizer_config.json and (with a template)
    chat_template.jinja in out_dir; the base models' tokenizers have no template."""
    from transformers import LlamaTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(mistral_sentencepiece_model(model), out_dir / "tokenizer.model")
    tokenizer = LlamaTokenizer.from_pretrained(
        str(out_dir), add_bos_token=True, add_eos_token=False
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_hub_checkpoint(
    out_dir: Path, tokenizer_dir: Path, layout: str = "v5", seed: int = 0
) -> Path:
    """A random Mistral with `tokenizer_dir`'s tokenizer, saved sharded in `layout` ("v4"/"v5")."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    if layout not in ("v4", "v5"):
        raise ValueError(f"layout {layout!r}: expected 'v4' or 'v5'")
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = MistralConfig(vocab_size=len(vocab), bos_token_id=1, eos_token_id=2, **HUB_SIZES)
    torch.manual_seed(seed)
    model = MistralForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, max_shard_size=MAX_SHARD_SIZE)
    for source in tokenizer_dir.iterdir():
        shutil.copyfile(source, out_dir / source.name)
    if layout == "v4":
        _as_transformers_4(out_dir)
    return out_dir


def _as_transformers_4(directory: Path) -> None:
    """Rewrite the v5 files in the conventions transformers 4 wrote."""
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["torch_dtype"] = config.pop("dtype")
    config["transformers_version"] = "4.34.0"
    config_path.write_text(json.dumps(config, indent=2))
    template = directory / "chat_template.jinja"
    tokenizer_config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["chat_template"] = template.read_text()
    template.unlink()
    tokenizer_config.update(pad_token=None, add_bos_token=True, add_eos_token=False, legacy=True)
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, indent=2))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def write_hf_cache_snapshot(source: Path, cache_dir: Path, repo_id: str) -> Path:
    """`source` laid out as the Hugging Face cache holds a download, returning its snapshot:
    each file's bytes under blobs/ named by their sha256 (as the hub names an LFS file's),
    the snapshot a directory of relative symlinks into ../../blobs/, refs/main its commit."""
    import hashlib

    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, repo / "blobs" / digest)
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot
