"""Training, loading and hashing of checkpoint tokenizers (align.model.tokenizer)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from align.data.synthetic import default_texts, write_default_data
from align.model.tokenizer import (
    CHAT_TEMPLATE_FILE,
    CONFIG_FILE,
    SPECIAL_TOKENS,
    TOKENIZER_FILE,
    load_tokenizer,
    tokenizer_hash,
    train_bpe_tokenizer,
)

VOCAB_SIZE = 400


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> list[str]:
    paths = write_default_data(tmp_path_factory.mktemp("data"), seed=0)
    return list(default_texts(paths))


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory, texts) -> Path:
    return train_bpe_tokenizer(texts, VOCAB_SIZE, tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def checkpoint_copy(tmp_path, trained_dir) -> Path:
    copy = tmp_path / "checkpoint"
    shutil.copytree(trained_dir, copy)
    return copy


def _edit_config(checkpoint: Path, **changes) -> None:
    config_path = checkpoint / CONFIG_FILE
    config = json.loads(config_path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_path.write_text(json.dumps(config))


def test_training_twice_gives_byte_identical_files(tmp_path, texts, trained_dir):
    again = train_bpe_tokenizer(texts, VOCAB_SIZE, tmp_path / "again")
    for name in (TOKENIZER_FILE, CONFIG_FILE):
        assert (again / name).read_bytes() == (trained_dir / name).read_bytes()


def test_training_leaves_only_the_two_files(trained_dir):
    assert sorted(p.name for p in trained_dir.iterdir()) == sorted([TOKENIZER_FILE, CONFIG_FILE])


def test_too_small_vocab_is_refused(tmp_path, texts):
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe_tokenizer(texts, 100, tmp_path)


def test_special_tokens_have_ids_zero_to_three(trained_dir):
    tokenizer = load_tokenizer(trained_dir)
    assert [tokenizer.backend.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 3)
    assert not tokenizer.pad_is_eos
    assert tokenizer.vocab_size <= VOCAB_SIZE


def test_config_names_the_special_tokens_and_has_no_chat_template(trained_dir):
    config = json.loads((trained_dir / CONFIG_FILE).read_text())
    assert config["bos_token"] == "<s>"
    assert config["eos_token"] == "</s>"
    assert config["pad_token"] == "<pad>"
    assert config["unk_token"] == "<unk>"
    assert isinstance(config["model_max_length"], int)
    assert "chat_template" not in config
    assert load_tokenizer(trained_dir).chat_template is None


@pytest.mark.parametrize("number", ["123", "2024", "7"])
def test_digits_are_split_one_by_one(trained_dir, number):
    assert len(load_tokenizer(trained_dir).encode(number)) == len(number)


def test_decode_inverts_encode_on_the_default_texts(trained_dir, texts):
    tokenizer = load_tokenizer(trained_dir)
    batch = tokenizer.encode_batch(texts)
    assert batch == [tokenizer.encode(text) for text in texts]
    assert all(tokenizer.decode(ids) == text for ids, text in zip(batch, texts, strict=True))


def test_encode_adds_no_special_tokens_and_decode_drops_them(trained_dir):
    tokenizer = load_tokenizer(trained_dir)
    ids = tokenizer.encode("What is 3 + 4?")
    assert not {tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id} & set(ids)
    wrapped = [tokenizer.bos_id, *ids, tokenizer.eos_id, tokenizer.pad_id]
    assert tokenizer.decode(wrapped) == "What is 3 + 4?"


def test_pad_falls_back_to_eos_when_config_has_none(checkpoint_copy):
    _edit_config(checkpoint_copy, pad_token=None)
    tokenizer = load_tokenizer(checkpoint_copy)
    assert tokenizer.pad_id == tokenizer.eos_id == 2
    assert tokenizer.pad_is_eos


def test_special_tokens_in_hf_dict_form_are_read(checkpoint_copy):
    _edit_config(
        checkpoint_copy,
        bos_token={"content": "<s>", "lstrip": False, "normalized": False, "special": True},
        eos_token={"content": "</s>", "lstrip": False, "normalized": False, "special": True},
    )
    tokenizer = load_tokenizer(checkpoint_copy)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)


def test_missing_tokenizer_json_names_the_path(checkpoint_copy):
    (checkpoint_copy / TOKENIZER_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=TOKENIZER_FILE) as info:
        load_tokenizer(checkpoint_copy)
    assert str(checkpoint_copy / TOKENIZER_FILE) in str(info.value)


def test_special_token_absent_from_vocab_names_it(checkpoint_copy):
    _edit_config(checkpoint_copy, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match=r"<\|im_end\|>"):
        load_tokenizer(checkpoint_copy)


def test_chat_template_comes_from_config_or_its_own_file(checkpoint_copy):
    _edit_config(checkpoint_copy, chat_template="{{ messages }}")
    assert load_tokenizer(checkpoint_copy).chat_template == "{{ messages }}"
    (checkpoint_copy / CHAT_TEMPLATE_FILE).write_text("{{ bos_token }}")
    assert load_tokenizer(checkpoint_copy).chat_template == "{{ bos_token }}"


def test_hash_depends_on_content_not_location(checkpoint_copy, trained_dir):
    assert tokenizer_hash(checkpoint_copy) == tokenizer_hash(trained_dir)


def test_hash_changes_when_one_merge_changes(checkpoint_copy, trained_dir):
    tokenizer_path = checkpoint_copy / TOKENIZER_FILE
    content = json.loads(tokenizer_path.read_text())
    merges = content["model"]["merges"]
    merges[-1] = list(reversed(merges[-1])) if isinstance(merges[-1], list) else merges[-1][::-1]
    tokenizer_path.write_text(json.dumps(content, indent=2))
    assert tokenizer_hash(checkpoint_copy) != tokenizer_hash(trained_dir)


def test_hash_changes_with_the_config(checkpoint_copy, trained_dir):
    _edit_config(checkpoint_copy, model_max_length=64)
    assert tokenizer_hash(checkpoint_copy) != tokenizer_hash(trained_dir)


def test_importing_the_module_does_not_import_torch():
    code = "import sys, align.model.tokenizer; sys.exit('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr or "align.model.tokenizer imported torch"
