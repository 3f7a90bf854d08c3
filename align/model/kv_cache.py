"""The key/value cache of greedy decoding: every layer's rotated keys and values, so each
decoding step runs one token per row instead of the whole sequence.

Rows stay right-padded as the prompts came: row b's real keys fill slots
[0, lengths[b]), and its next token is written at slot lengths[b], which is also that
token's position. The real keys of a row are so always one contiguous prefix, and a
decoding step's mask is a length (and the sliding window) per row.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values [B, H_kv, capacity, D] per layer, filled by one prefill forward and
    then one slot per row per decoding step (see NmoMistralForCausalLM.forward)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: torch.Tensor | None = None
        # Slots a decoding step attends over, up to the longest row's new token: kept as an
        # int so that no layer reads it back from the device.
        self.width = 0

    @property
    def prefilled(self) -> bool:
        return self.lengths is not None

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Begin the prefill of right-padded rows `input_ids` [B, T]."""
        batch, length = input_ids.shape
        if length > self.capacity:
            raise ValueError(f"a prefill of {length} tokens exceeds the cache's {self.capacity}")
        if attention_mask is None:
            self.lengths = torch.full((batch,), length, dtype=torch.long, device=input_ids.device)
        else:
            self.lengths = attention_mask.sum(dim=1).long()
        self.width = int(self.lengths.max()) + 1

    def positions(self) -> torch.Tensor:
        """The position of each row's next token [B, 1] (a decoding step's position_ids)."""
        return self.lengths[:, None]

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """Boolean [B, 1, 1, width] mask of the keys a decoding step's one query sees."""
        slots = torch.arange(self.width, device=self.lengths.device)[None, :]
        query = self.lengths[:, None]
        allowed = slots <= query
        if sliding_window is not None:
            allowed &= slots > query - sliding_window
        return allowed[:, None, None, :]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys and values; return the keys and values to attend over."""
        if layer == len(self.keys):  # the prefill: the prompt's keys are all there is
            batch, heads, length, dim = k.shape
            self.keys.append(k.new_zeros(batch, heads, self.capacity, dim))
            self.values.append(v.new_zeros(batch, heads, self.capacity, dim))
            self.keys[layer][:, :, :length] = k
            self.values[layer][:, :, :length] = v
            return k, v
        if k.shape[2] != 1:
            raise ValueError(f"a decoding step takes one token per row, got {k.shape[2]}")
        if self.width > self.capacity:
            raise ValueError(f"decoding past the cache's {self.capacity} slots")
        slot = self.lengths[:, None, None, None].expand(-1, k.shape[1], 1, k.shape[3])
        self.keys[layer].scatter_(2, slot, k)
        self.values[layer].scatter_(2, slot, v)
        return self.keys[layer][:, :, : self.width], self.values[layer][:, :, : self.width]

    def advance(self) -> None:
        """After a decoding step: every row holds one more token."""
        self.lengths = self.lengths + 1
        self.width += 1
