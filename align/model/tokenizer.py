"""Tokenizer files of a checkpoint: training the default byte-level BPE, loading, hashing.

Owns `tokenizer.json` and `tokenizer_config.json` in a checkpoint directory and the
special-token ids every other stage reads through `AlignTokenizer`. Any tokenizer
that `tokenizers` reads works, byte-level BPE and sentencepiece conversions with byte
fallback (Mistral v0.1, v0.3) alike. Special tokens come from the checkpoint's own
`tokenizer_config.json`, completed by its `special_tokens_map.json` where the config
leaves one out, as transformers does.

Padding: a checkpoint without a pad token (Mistral's) pads with its eos token.
Padded positions are masked by length everywhere, so the pad id never reaches a
loss; `AlignTokenizer.pad_source` says which rule chose it, and the manifest
records it beside the pad id. This module never imports torch, so data and gate
stages can use it cheaply.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from align.model.tokenizer_hash import (  # noqa: F401  (re-exported)
    CHAT_TEMPLATE_FILE,
    CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_FILE,
    tokenizer_files,
    tokenizer_hash,
)
from align.receipts import atomic_path
from align.utils.untrusted import (
    CHECKPOINT_GATE,
    UntrustedFileRefused,
    parse_json_object,
    read_json_object,
    read_untrusted_text,
)

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
BYTE_ALPHABET_SIZE = 256
DEFAULT_MODEL_MAX_LENGTH = 2048
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# AlignTokenizer.pad_source: the config's own pad token, or eos for a tokenizer without one.
PAD_FROM_CONFIG = "pad_token"
PAD_FROM_EOS = "eos_token (the tokenizer names no pad_token)"
TOKENIZER_EXPECTED = "a JSON object that the tokenizers library reads as a Tokenizer"


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike,
    *,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> Path:
    """Train a byte-level BPE on `texts`, write its two files into `out_dir`, return `out_dir`.

    Special tokens get ids 0..3 in the order unk, bos, eos, pad. The same texts give a
    byte-identical `tokenizer.json`.
    """
    minimum = len(SPECIAL_TOKENS) + BYTE_ALPHABET_SIZE
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be at least {minimum} (bytes + special tokens), got {vocab_size}"
        )
    tokenizer = _untrained_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out = Path(out_dir)
    _write_text_atomic(out / TOKENIZER_FILE, tokenizer.to_str(pretty=True) + "\n")
    config_text = json.dumps(default_tokenizer_config(model_max_length), indent=2, sort_keys=True)
    _write_text_atomic(out / CONFIG_FILE, config_text + "\n")
    return out


def default_tokenizer_config(model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> dict[str, Any]:
    """The `tokenizer_config.json` written beside a trained tokenizer; it has no chat template."""
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "model_max_length": model_max_length,
        # Lets transformers load the same files; without it decode would rewrite " ." to ".".
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }


def _untrained_byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    # Splitting digits one by one lets a small model see every number as its digits.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


class AlignTokenizer:
    """A `tokenizers.Tokenizer` with the checkpoint's special-token ids resolved once."""

    def __init__(
        self,
        backend: Tokenizer,
        config: Mapping[str, Any],
        chat_template: str | None = None,
    ):
        self.backend = backend
        self._chat_template = chat_template
        self._model_max_length = config.get("model_max_length")
        self._bos_id = self._required_special_id(config, "bos_token")
        self._eos_id = self._required_special_id(config, "eos_token")
        unk_token = special_token_content(config.get("unk_token"))
        self._unk_id = self._special_id(unk_token, "unk_token") if unk_token else None
        pad_token = special_token_content(config.get("pad_token"))
        self._pad_source = PAD_FROM_CONFIG if pad_token else PAD_FROM_EOS
        self._pad_id = self._special_id(pad_token, "pad_token") if pad_token else self._eos_id

    def _required_special_id(self, config: Mapping[str, Any], key: str) -> int:
        token = special_token_content(config.get(key))
        if not token:
            raise ValueError(f"{CONFIG_FILE} has no {key}")
        return self._special_id(token, key)

    def _special_id(self, token: str, key: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} ({key}) is not in the tokenizer vocabulary")
        return token_id

    @property
    def bos_id(self) -> int:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def pad_source(self) -> str:
        """Which rule chose the pad id: PAD_FROM_CONFIG or PAD_FROM_EOS."""
        return self._pad_source

    @property
    def pad_is_eos(self) -> bool:
        return self._pad_id == self._eos_id

    def special_tokens(self) -> dict[str, str]:
        """The special tokens by name (`bos_token`, ...), as a chat template sees them."""
        ids = {"bos_token": self._bos_id, "eos_token": self._eos_id, "unk_token": self._unk_id}
        if self._pad_source == PAD_FROM_CONFIG:
            ids["pad_token"] = self._pad_id
        return {
            name: self.backend.id_to_token(token_id)
            for name, token_id in ids.items()
            if token_id is not None
        }

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def model_max_length(self) -> int | None:
        return self._model_max_length

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, with no special tokens added."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens dropped."""
        return self.backend.decode(list(ids), skip_special_tokens=True)


def special_token_content(value: Any) -> str | None:
    """A special token as written in `tokenizer_config.json`: a string, or HF's dict form."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def load_tokenizer(checkpoint_dir: str | os.PathLike) -> AlignTokenizer:
    """Load the tokenizer of a checkpoint directory (ours or an HF one).

    A missing tokenizer.json or tokenizer_config.json is a FileNotFoundError; any of the
    files that is there but malformed is refused (exit 3) naming it.
    """
    directory = Path(checkpoint_dir)
    tokenizer_path = _existing_file(directory / TOKENIZER_FILE)
    config = _tokenizer_config(directory)
    backend = _backend(tokenizer_path)
    try:
        return AlignTokenizer(backend, config, chat_template=_chat_template(directory, config))
    except ValueError as err:
        raise UntrustedFileRefused(CHECKPOINT_GATE, directory / CONFIG_FILE, str(err)) from None


def _backend(path: Path) -> Tokenizer:
    """tokenizer.json as a `tokenizers.Tokenizer`; JSON it cannot be is refused first, in
    Python, so the refusal reads the same as every other file's."""
    text = read_untrusted_text(path, TOKENIZER_EXPECTED)
    parse_json_object(text, path, TOKENIZER_EXPECTED)
    try:
        return Tokenizer.from_str(text)
    except Exception as err:  # tokenizers raises a bare Exception for every malformed file
        raise UntrustedFileRefused(
            CHECKPOINT_GATE, path, f"expected {TOKENIZER_EXPECTED}, found {err}"
        ) from None


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json, with the special tokens it leaves out from special_tokens_map.json.

    Where both files name a special token they must agree: which one a reader would
    honour is not worth guessing.
    """
    config_path = _existing_file(directory / CONFIG_FILE)
    config = read_json_object(config_path, "a JSON object of tokenizer settings")
    _check_special_tokens(config, config_path)
    map_path = directory / SPECIAL_TOKENS_MAP_FILE
    if not map_path.is_file():
        return config
    special = read_json_object(map_path, "a JSON object of special tokens")
    _check_special_tokens(special, map_path)
    for key in SPECIAL_TOKEN_KEYS:
        in_config = special_token_content(config.get(key))
        in_map = special_token_content(special.get(key))
        if in_map and not in_config:
            config[key] = in_map
        elif in_map and in_config != in_map:
            raise UntrustedFileRefused(
                CHECKPOINT_GATE,
                map_path,
                f"{key} is {in_config!r} in {CONFIG_FILE} but {in_map!r} in "
                f"{SPECIAL_TOKENS_MAP_FILE}",
            )
    return config


def _check_special_tokens(fields: Mapping[str, Any], path: Path) -> None:
    """Each special token is absent, null, a string, or HF's object with a string content."""
    for key in SPECIAL_TOKEN_KEYS:
        value = fields.get(key)
        content = value.get("content") if isinstance(value, Mapping) else value
        if content is not None and not isinstance(content, str):
            raise UntrustedFileRefused(
                CHECKPOINT_GATE,
                path,
                f"{key} expected a string or an object with a string content, found {value!r:.100}",
            )


def _existing_file(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(errno.ENOENT, "tokenizer file missing", str(path))
    return path


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    # Newer transformers save the template as its own file, which wins over the config key.
    template_file = directory / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return read_untrusted_text(template_file, "a Jinja chat template")
    template = config.get("chat_template")
    if isinstance(template, list) and all(
        isinstance(entry, Mapping) and isinstance(entry.get("template"), str) for entry in template
    ):
        named = {entry.get("name"): entry["template"] for entry in template}
        return named.get("default")
    if template is not None and not isinstance(template, str):
        raise UntrustedFileRefused(
            CHECKPOINT_GATE,
            directory / CONFIG_FILE,
            f"chat_template expected a string or a list of {{name, template}} objects, found "
            f"{template!r:.100}",
        )
    return template
