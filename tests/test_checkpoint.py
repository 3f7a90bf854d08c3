"""Checkpoint reading, strict loading, atomic deterministic saving, the weights hash and the config."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import tiny_mistral_config

import align.model
from align.model import checkpoint
from align.model.checkpoint import (
    hf_to_nmo,
    load_pretrained,
    nmo_to_hf,
    read_safetensors_state,
    save_hf_checkpoint,
)
from align.model.checkpoint_shapes import ShapeRefused
from align.model.hf_config import MistralConfig, load_hf_config
from align.model.mistral import NmoMistralForCausalLM
from align.utils.weights_hash import weights_hash

# These matrices are tiny: thread hand-offs would cost far more than the arithmetic.
torch.set_num_threads(1)

SHARD_BYTES = 30_000
INDEX = "model.safetensors.index.json"


def tiny_config(tied: bool = False) -> MistralConfig:
    return tiny_mistral_config(
        max_position_embeddings=32, sliding_window=None, tie_word_embeddings=tied
    )


@torch.no_grad()
def random_model(tied: bool = False, seed: int = 0) -> NmoMistralForCausalLM:
    model = NmoMistralForCausalLM(tiny_config(tied))
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def directory_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def shard_names(directory: Path) -> list[str]:
    return sorted(set(json.loads((directory / INDEX).read_text())["weight_map"].values()))


@pytest.fixture
def single_and_sharded(tmp_path) -> tuple[NmoMistralForCausalLM, Path, Path]:
    model = random_model()
    single = save_hf_checkpoint(model, tmp_path / "single")
    sharded = save_hf_checkpoint(model, tmp_path / "sharded", max_shard_bytes=SHARD_BYTES)
    return model, single, sharded


# --- reading and loading ---------------------------------------------------------------------


def test_sharded_and_single_file_checkpoints_load_equal(single_and_sharded):
    model, single, sharded = single_and_sharded
    assert (single / "model.safetensors").is_file() and not (single / INDEX).exists()
    assert len(shard_names(sharded)) > 1 and not (sharded / "model.safetensors").exists()
    assert state_equal(read_safetensors_state(single), read_safetensors_state(sharded))
    for directory in (single, sharded):
        assert state_equal(load_pretrained(directory).state_dict(), model.state_dict())


def test_index_total_size_counts_every_tensor_byte(single_and_sharded):
    model, _, sharded = single_and_sharded
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert json.loads((sharded / INDEX).read_text())["metadata"]["total_size"] == total


def test_missing_shard_is_named(single_and_sharded):
    _, _, sharded = single_and_sharded
    victim = shard_names(sharded)[1]
    (sharded / victim).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(victim)):
        read_safetensors_state(sharded)
    with pytest.raises(FileNotFoundError, match=re.escape(victim)):
        weights_hash(sharded)


def test_tensor_listed_in_index_but_absent_from_its_shard_is_named(single_and_sharded):
    _, _, sharded = single_and_sharded
    victim_shard = shard_names(sharded)[0]
    tensors = load_file(sharded / victim_shard)
    victim_tensor = sorted(tensors)[0]
    del tensors[victim_tensor]
    save_file(tensors, sharded / victim_shard, metadata={"format": "pt"})
    for reader in (read_safetensors_state, weights_hash):
        with pytest.raises(ValueError) as error:
            reader(sharded)
        assert victim_tensor in str(error.value) and victim_shard in str(error.value)


def test_tensor_in_shard_but_not_in_index_is_named(single_and_sharded):
    _, _, sharded = single_and_sharded
    index = json.loads((sharded / INDEX).read_text())
    victim = "model.norm.weight"
    shard = index["weight_map"].pop(victim)
    (sharded / INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError) as error:
        read_safetensors_state(sharded)
    assert victim in str(error.value) and shard in str(error.value)


def test_single_file_and_index_together_are_refused(single_and_sharded):
    _, single, sharded = single_and_sharded
    (single / INDEX).write_bytes((sharded / INDEX).read_bytes())
    with pytest.raises(ValueError, match="both"):
        read_safetensors_state(single)


def test_directory_without_weights_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        read_safetensors_state(tmp_path)


def rewrite_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(single_and_sharded):
    _, single, _ = single_and_sharded
    rewrite_weights(single, lambda tensors: tensors.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"
    ):
        load_pretrained(single)


@pytest.mark.parametrize(
    "extra", ["model.layers.2.mlp.up_proj.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"]
)
def test_unexpected_tensor_is_named(single_and_sharded, extra: str):
    _, single, _ = single_and_sharded

    def add_extra(tensors):
        tensors[extra] = torch.zeros(4)

    rewrite_weights(single, add_extra)
    with pytest.raises(ValueError, match=rf"unexpected tensors \['{re.escape(extra)}'\]"):
        load_pretrained(single)


def test_wrong_shape_is_refused_before_the_model_is_built(single_and_sharded):
    _, single, _ = single_and_sharded

    def shrink(tensors):
        tensors["model.norm.weight"] = torch.ones(16)

    rewrite_weights(single, shrink)
    with pytest.raises(ShapeRefused, match=r"norm\.weight"):
        load_pretrained(single)


def test_tied_checkpoint_loads_with_or_without_lm_head(tmp_path):
    model = random_model(tied=True)
    directory = save_hf_checkpoint(model, tmp_path / "tied")
    assert "lm_head.weight" not in read_safetensors_state(directory)
    without_head = load_pretrained(directory)
    assert without_head.lm_head.weight is without_head.embed.weight

    def add_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    rewrite_weights(directory, add_head)
    with_head = load_pretrained(directory)
    assert with_head.lm_head.weight is with_head.embed.weight
    assert state_equal(with_head.state_dict(), model.state_dict())
    assert with_head.num_parameters() == model.num_parameters()

    def corrupt_head(tensors):
        tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0

    rewrite_weights(directory, corrupt_head)
    with pytest.raises(ValueError, match=r"lm_head\.weight differs"):
        load_pretrained(directory)


def test_untied_checkpoint_needs_lm_head(single_and_sharded):
    _, single, _ = single_and_sharded
    rewrite_weights(single, lambda tensors: tensors.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['lm_head.weight'\]"):
        load_pretrained(single)


def test_load_pretrained_casts_and_records_dtype(single_and_sharded):
    model, single, _ = single_and_sharded
    loaded = load_pretrained(single, dtype="bfloat16", attn_implementation="eager")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert all(p.device.type == "cpu" and p.requires_grad for p in loaded.parameters())
    assert loaded.config.torch_dtype == "bfloat16" and loaded.attn_implementation == "eager"
    expected = model.state_dict()["embed.weight"].to(torch.bfloat16)
    assert torch.equal(loaded.embed.weight, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_load_pretrained_refuses_cuda_without_cuda(single_and_sharded):
    _, single, _ = single_and_sharded
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        load_pretrained(single, device="cuda")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "fp8", "bf16"])
def test_load_pretrained_refuses_unsupported_dtype(single_and_sharded, dtype):
    _, single, _ = single_and_sharded
    with pytest.raises(ValueError, match="dtype"):
        load_pretrained(single, dtype=dtype)


def test_load_pretrained_refuses_unsupported_device_and_backend(single_and_sharded):
    _, single, _ = single_and_sharded
    with pytest.raises(ValueError, match="not supported"):
        load_pretrained(single, device="meta")
    with pytest.raises(ValueError, match="flash_attention_2"):
        load_pretrained(single, attn_implementation="flash_attention_2")


# --- name maps -------------------------------------------------------------------------------


def test_name_maps_round_trip():
    hf_names = transformers.MistralForCausalLM(
        transformers.MistralConfig(**tiny_config().to_hf_dict())
    ).state_dict()
    nmo_state = hf_to_nmo(hf_names)
    assert set(nmo_state) == set(random_model().state_dict())
    assert set(nmo_to_hf(nmo_state)) == set(hf_names)


def test_name_maps_refuse_unknown_names():
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.bias"):
        hf_to_nmo({"model.layers.0.self_attn.bias": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q_proj\.weight"):
        nmo_to_hf({"layers.0.attn.q_proj.weight": torch.zeros(1)})


# --- saving ----------------------------------------------------------------------------------


def test_save_writes_config_and_safetensors_metadata(single_and_sharded, tmp_path):
    model, single, sharded = single_and_sharded
    assert load_hf_config(single) == model.config
    with open(single / "model.safetensors", "rb") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_length))
    assert header["__metadata__"] == {"format": "pt"}
    assert json.loads((single / "config.json").read_text())["architectures"] == [
        "MistralForCausalLM"
    ]
    assert shard_names(sharded)[0] == f"model-00001-of-{len(shard_names(sharded)):05d}.safetensors"


@pytest.mark.parametrize("max_shard_bytes", [None, SHARD_BYTES])
def test_save_is_deterministic(tmp_path, max_shard_bytes):
    first = save_hf_checkpoint(random_model(), tmp_path / "a", max_shard_bytes=max_shard_bytes)
    second = save_hf_checkpoint(random_model(), tmp_path / "b", max_shard_bytes=max_shard_bytes)
    assert directory_bytes(first) == directory_bytes(second)


def test_save_replaces_existing_directory_and_leaves_no_staging(tmp_path):
    out_dir = tmp_path / "ckpt"
    out_dir.mkdir()
    (out_dir / "stale.bin").write_bytes(b"old")
    save_hf_checkpoint(random_model(), out_dir, max_shard_bytes=SHARD_BYTES)
    assert not (out_dir / "stale.bin").exists()
    save_hf_checkpoint(random_model(seed=1), out_dir)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]
    assert not (out_dir / INDEX).exists() and (out_dir / "model.safetensors").is_file()
    assert state_equal(load_pretrained(out_dir).state_dict(), random_model(seed=1).state_dict())


def test_failed_save_keeps_the_old_directory(tmp_path, monkeypatch):
    out_dir = save_hf_checkpoint(random_model(), tmp_path / "ckpt")
    before = directory_bytes(out_dir)

    def failing_save_file(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(random_model(seed=1), out_dir)
    assert directory_bytes(out_dir) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt"]


def test_save_copies_tokenizer_files(tmp_path):
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text('{"version": "1.0"}')
    (tokenizer_dir / "tokenizer_config.json").write_text("{}")
    (tokenizer_dir / "unrelated.txt").write_text("no")
    out_dir = save_hf_checkpoint(random_model(), tmp_path / "ckpt", source_dir=tokenizer_dir)
    assert (out_dir / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (out_dir / "tokenizer_config.json").is_file()
    assert not (out_dir / "unrelated.txt").exists()
    with pytest.raises(FileNotFoundError, match="missing_tok"):
        save_hf_checkpoint(random_model(), tmp_path / "other", source_dir=tmp_path / "missing_tok")
    assert not (tmp_path / "other").exists()


def test_save_refuses_a_file_in_the_way_and_a_bad_shard_size(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        save_hf_checkpoint(random_model(), tmp_path / "file")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_hf_checkpoint(random_model(), tmp_path / "ckpt", max_shard_bytes=0)


def test_save_records_the_weights_dtype(tmp_path):
    model = random_model().to(torch.bfloat16)
    out_dir = save_hf_checkpoint(model, tmp_path / "bf16")
    assert load_hf_config(out_dir).torch_dtype == "bfloat16"
    assert read_safetensors_state(out_dir)["model.norm.weight"].dtype == torch.bfloat16


# --- weights hash ----------------------------------------------------------------------------


def test_weights_hash_ignores_sharding_and_file_names(single_and_sharded):
    _, single, sharded = single_and_sharded
    digest = weights_hash(single)
    assert len(digest) == 64 and digest == weights_hash(sharded)
    index = json.loads((sharded / INDEX).read_text())
    renames = {
        name: f"renamed-{number}.safetensors" for number, name in enumerate(shard_names(sharded))
    }
    for old, new in renames.items():
        (sharded / old).rename(sharded / new)
    index["weight_map"] = {tensor: renames[shard] for tensor, shard in index["weight_map"].items()}
    (sharded / INDEX).write_text(json.dumps(index))
    assert weights_hash(sharded) == digest


def test_weights_hash_matches_a_transformers_save_of_the_same_weights(tmp_path):
    model = random_model(tied=True)
    ours = save_hf_checkpoint(model, tmp_path / "ours")
    hf_model = transformers.MistralForCausalLM.from_pretrained(ours, dtype=torch.float32)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert weights_hash(tmp_path / "hf") == weights_hash(ours)


def test_weights_hash_sees_one_flipped_byte(single_and_sharded):
    _, single, _ = single_and_sharded
    path = single / "model.safetensors"
    digest = weights_hash(single)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    assert weights_hash(single) != digest


def test_weights_hash_refuses_a_truncated_file(single_and_sharded):
    _, single, _ = single_and_sharded
    path = single / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="outside the file"):
        weights_hash(single)


# --- package and config ----------------------------------------------------------------------


def test_importing_align_model_does_not_import_torch():
    code = (
        "import align.model, sys; assert 'torch' not in sys.modules; "
        "align.model.MistralConfig; align.model.load_hf_config; "
        "from align.utils import weights_hash; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_pretrained_is_exposed_lazily():
    assert align.model.load_pretrained is load_pretrained
    with pytest.raises(AttributeError, match="no_such_name"):
        align.model.no_such_name  # noqa: B018


def hf_config_dict(**changes) -> dict:
    config = tiny_config().to_hf_dict()
    config.update({"transformers_version": "5.24.0", "use_cache": True, "initializer_range": 0.02})
    config.update(changes)
    return config


def test_config_round_trips_through_transformers():
    config = MistralConfig.from_dict(hf_config_dict())
    assert config == tiny_config()
    hf_config = transformers.MistralConfig(**config.to_hf_dict())
    assert MistralConfig.from_dict(hf_config.to_diff_dict()) == config
    assert MistralConfig.from_dict(hf_config.to_dict()) == config


def test_config_accepts_the_older_flat_layout():
    older = hf_config_dict(rope_theta=500.0, torch_dtype="bfloat16")
    del older["rope_parameters"], older["dtype"]
    config = MistralConfig.from_dict(older)
    assert config.rope_theta == 500.0 and config.torch_dtype == "bfloat16"


def test_config_resolves_head_dim():
    assert MistralConfig.from_dict(hf_config_dict(head_dim=None)).head_dim == 32 // 4


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "llama"}, "model_type"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"is_encoder_decoder": True}, "is_encoder_decoder"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"torch_dtype": "float64", "dtype": None}, "torch_dtype"),
    ],
)
def test_config_refuses_what_it_cannot_honour(changes: dict, named: str):
    with pytest.raises(ValueError, match=named):
        MistralConfig.from_dict(hf_config_dict(**changes))


def test_load_hf_config_names_the_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "config.json"))):
        load_hf_config(tmp_path)
