"""How long a row may be: the row limit every build applies and the bounds its readers hold.

The row limit, in characters, is `ROW_LIMIT_SEQ_LENS` (16) x seq_len x the UTF-8 length of
the tokenizer's longest vocabulary token. It is measured on the rendered prompt plus the
longer response: the text of the longest sequence the pair makes. Why 16 x seq_len x
that length:

- No token covers more input bytes than its own vocabulary string has UTF-8 bytes (a
  byte-level symbol is one or two bytes for one input byte, sentencepiece's "▁" three for
  one space, a byte-fallback "<0xNN>" six for one byte), and a character is at least one
  byte. So a text of c characters has at least c / longest tokens, for the tokenizers align
  loads (byte-level BPE, sentencepiece with byte fallback: no token stands for a run of
  unknown text).
- A pair over the limit therefore has more than 16 x seq_len tokens: it cannot fit in
  seq_len, and `prompt_left_response_right` would keep under a sixteenth of it (the end
  of the prompt, the start of the responses), no longer the pair that was rated. Every
  pair of at most 16 x seq_len tokens is left to truncation, as before.
- Real text runs far below the limit: Mistral's longest token is 48 bytes and its
  tokens average 3 to 4 characters. The embedded default's longest pair is 160
  characters against its limit of 16,896 (16 x 96 x 11), so its build keeps the same rows.

A row over the limit is removed as `row_over_length` before it is tokenized, and counted.

Readers hold one row at a time, never more than `line_bytes` of it: 12 bytes per
character (the longest JSON escape of one character, a pair of \\uXXXX) x 8 copies of the
row limit (argilla's raw rows repeat each text up to four times: the columns, the
generations, the originals and the judge's prompt) + 64 KiB of keys, numbers and fixed
text. A row of the public schemas within the limit is not refused by it; a line over
it is refused (exit 4) without being held. Readers that tokenize nothing hold at most
`DEFAULT_LINE_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass

ROW_LIMIT_SEQ_LENS = 16
JSON_BYTES_PER_CHAR = 12
LINE_TEXT_COPIES = 8
LINE_OVERHEAD_BYTES = 64 << 10
DEFAULT_LINE_BYTES = 64 << 20
# A Parquet row group is read whole: its uncompressed column data must stay under this.
PARQUET_ROW_GROUP_BYTES = 1 << 30


def longest_token_bytes(tokenizer) -> int:
    """The UTF-8 length of the tokenizer's longest vocabulary token, added tokens included."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max(len(token.encode("utf-8")) for token in vocab)


@dataclass(frozen=True)
class RowBounds:
    """The row limit in characters (None: no limit) and the bytes a reader holds per row."""

    chars: int | None
    line_bytes: int
    basis: str
    line_basis: str

    @classmethod
    def of(cls, tokenizer, seq_len: int) -> RowBounds:
        """The bounds of rows tokenized by `tokenizer` into sequences of `seq_len` tokens."""
        token_bytes = longest_token_bytes(tokenizer)
        chars = ROW_LIMIT_SEQ_LENS * seq_len * token_bytes
        return cls(
            chars=chars,
            line_bytes=JSON_BYTES_PER_CHAR * LINE_TEXT_COPIES * chars + LINE_OVERHEAD_BYTES,
            basis=(
                f"{ROW_LIMIT_SEQ_LENS} x seq_len {seq_len} x {token_bytes} bytes, the "
                "tokenizer's longest token"
            ),
            line_basis=(
                f"{JSON_BYTES_PER_CHAR} bytes per character x {LINE_TEXT_COPIES} copies of "
                f"the {chars}-character row limit + {LINE_OVERHEAD_BYTES}"
            ),
        )

    def over(self, chars: int) -> bool:
        return self.chars is not None and chars > self.chars

    def describe(self) -> str:
        """One line for a terminal: the limit, how it was derived and what a longer row gets."""
        return (
            f"row limit {self.chars} characters ({self.basis}); longer rows are removed as "
            "row_over_length, lines over "
            f"{self.line_bytes} bytes are refused"
        )


UNTOKENIZED = RowBounds(
    chars=None,
    line_bytes=DEFAULT_LINE_BYTES,
    basis="no row limit",
    line_basis="the bound of a reader that tokenizes nothing",
)
