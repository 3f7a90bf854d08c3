"""The Mistral decoder-only language model, numerically matching transformers' Mistral.

Pre-norm decoder layers (RMSNorm -> grouped-query self-attention with rotary
embeddings -> residual -> RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and
an lm_head optionally tied to the token embedding. Module names are this
package's own; checkpoint.py maps them to and from HF's.

Besides plain right-padded rows, forward takes a prefix-shared layout: one row holds
a shared prefix followed by several branches (e.g. prompt | chosen | rejected), with
`position_ids` restarting each branch after the prefix and `segment_ids` from which
the mask (align.kernels.segments) keeps every branch blind to the others. sdpa runs such
rows as one unpadded stream of exact attention pieces (align.kernels.pieces), its last
layer only where a label reads it; the other backends take them as padded rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from align.constants import PAD_SEGMENT, STREAMED_ATTENTION
from align.kernels.flex import build_flex_mask, plain_segments
from align.kernels.pieces import build_stream
from align.kernels.segments import build_segment_mask, pair_slot
from align.losses.fused import DEFAULT_CHUNK_SIZE, fused_sequence_logps
from align.model.attention import MASKED_DECODING, attention, select_attn_implementation
from align.model.hf_config import MistralConfig
from align.model.kv_cache import KVCache


class RMSNorm(nn.Module):
    """Root-mean-square normalisation computed in float32, scaled by a learned weight."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class SelfAttention(nn.Module):
    """Grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: MistralConfig, attn_implementation: str):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.attn_implementation = attn_implementation
        hidden = config.hidden_size
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        self.q = nn.Linear(hidden, q_width, bias=False)
        self.k = nn.Linear(hidden, kv_width, bias=False)
        self.v = nn.Linear(hidden, kv_width, bias=False)
        self.o = nn.Linear(q_width, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: tuple[KVCache, int] | None = None,
        queries: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`cache` is (the decoding cache, this layer's index) while generating; `queries`
        the positions whose output is wanted (all when None), every position still a key."""
        batch, length, _ = x.shape
        x_q, rope_q = (x, rope) if queries is None else _at(queries, x, rope)
        width = x_q.shape[1]
        q = self.q(x_q).view(batch, width, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope_q), apply_rope(k, rope)
        if cache is not None:
            k, v = cache[0].update(cache[1], k, v)
        out = attention(q, k, v, mask, self.attn_implementation)
        return self.o(out.transpose(1, 2).reshape(batch, width, self.o.in_features))


def _at(
    queries: torch.Tensor, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """x [B, T, H] and its rotary tables at the positions `queries` [Tq] only."""
    return x.index_select(1, queries), tuple(t.index_select(-2, queries) for t in rope)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, config: MistralConfig, attn_implementation: str):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = SelfAttention(config, attn_implementation)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: tuple[KVCache, int] | None = None,
        queries: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block's output at `queries` [Tq] (every position when None)."""
        residual = x if queries is None else x.index_select(1, queries)
        x = residual + self.attn(self.attn_norm(x), rope, mask, cache, queries)
        return x + self.mlp(self.mlp_norm(x))


class NmoMistralForCausalLM(nn.Module):
    """Mistral causal language model: token ids -> next-token logits."""

    def __init__(
        self,
        config: MistralConfig,
        attn_implementation: str = "sdpa",
        attn_device: torch.device | None = None,
    ):
        """`attn_device` is where the model will run, when it is built on the meta device."""
        super().__init__()
        self.config = config
        self.attn_implementation = select_attn_implementation(
            attn_implementation, attn_device or torch.get_default_device()
        )
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.attn_implementation) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def device(self) -> torch.device:
        """Where the model computes: its inputs must be here (the local device of a shard)."""
        return self.embed.weight.device

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied matrix counts once)."""
        return sum(parameter.numel() for parameter in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        return_hidden: bool = False,
        labels: torch.Tensor | None = None,
        loss_chunk_size: int = DEFAULT_CHUNK_SIZE,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, V], or the final normed hidden states [B, T, H] if `return_hidden`,
        or with shifted `labels` [B, T] (see align.losses.fused.shift_labels) the summed label
        log-probs and scored-token counts [B], chunk by chunk, never materializing [B, T, V].
        `labels` [K, B, T] are K label sets over the same hidden states: results [K * B],
        set 0's rows first; with `segment_ids`, each row's pairs are summed apart: results
        [K * B * S] for rows of up to S pairs, set-major, then row, then pair.

        `attention_mask` is [B, T], 1 for real tokens and 0 for right padding. The
        prefix-shared layout passes `position_ids` and `segment_ids` [B, T] together (see
        `build_segment_mask`); an `attention_mask` beside them must agree with them. The
        label path runs inside forward so a sharded lm_head is gathered while it is used.

        With a `cache` (greedy decoding, see align.model.kv_cache) the first call is the
        prefill of right-padded prompts; each later call takes one new token per row [B, 1].
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if (
            segment_ids is not None
            and cache is None
            and self.attn_implementation in STREAMED_ATTENTION
        ):
            self._check_layout(input_ids, attention_mask, position_ids, segment_ids)
            hidden = self._stream_hidden(input_ids, position_ids, segment_ids, labels)
            return self._head(hidden, labels, loss_chunk_size, segment_ids, return_hidden)
        decoding = cache is not None and cache.prefilled
        x = self.embed(input_ids)
        if decoding:
            rope = rope_cos_sin(self.config, 1, x.dtype, x.device, cache.positions())
            mask = cache.decode_mask(self.config.sliding_window)
        else:
            length = input_ids.shape[1]
            rope = rope_cos_sin(self.config, length, x.dtype, x.device, position_ids)
            mask = self._mask(input_ids, attention_mask, position_ids, segment_ids)
            if cache is not None:
                self._require_cacheable(segment_ids)
                cache.start(input_ids, attention_mask)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, mask, None if cache is None else (cache, index))
        if decoding:
            cache.advance()
        return self._head(self.norm(x), labels, loss_chunk_size, segment_ids, return_hidden)

    def _head(self, hidden, labels, chunk_size, segment_ids, return_hidden):
        """What forward returns from the final normed hidden states [B, T, H]."""
        if labels is not None:
            return self._label_logps(hidden, labels, chunk_size, segment_ids)
        return hidden if return_hidden else self.lm_head(hidden)

    def _stream_hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        labels: torch.Tensor | None,
    ) -> torch.Tensor:
        """Final normed hidden states [B, T, H] of prefix-shared rows run as one unpadded
        stream (align.kernels.pieces); zero where nothing reads them (padding, and with
        `labels` every position no label set scores)."""
        stream = build_stream(segment_ids, position_ids, self.config.sliding_window, labels)
        x = self.embed(input_ids.flatten().index_select(0, stream.real))[None]
        rope = rope_cos_sin(self.config, x.shape[1], x.dtype, x.device, stream.positions)
        *early, last = self.layers
        for layer in early:
            x = layer(x, rope, stream.every_layer)
        x = last(x, rope, stream.last_layer, queries=stream.labelled)
        read = stream.real if stream.labelled is None else stream.real[stream.labelled]
        hidden = self.norm(x)[0]
        rows = hidden.new_zeros(input_ids.numel(), hidden.shape[-1])
        return rows.index_copy(0, read, hidden).view(*input_ids.shape, -1)

    def _require_cacheable(self, segment_ids: torch.Tensor | None) -> None:
        if self.attn_implementation not in MASKED_DECODING:
            raise ValueError(
                f"attention backend {self.attn_implementation!r} takes no boolean mask, and a "
                "cached decoding step needs one: decode without a cache"
            )
        if segment_ids is not None:
            raise ValueError("the decoding cache takes plain right-padded rows, not segments")

    def _mask(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        segment_ids: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """What the backend takes as its mask, for plain or prefix-shared rows."""
        self._check_layout(input_ids, attention_mask, position_ids, segment_ids)
        if self.attn_implementation == "flex":
            if segment_ids is None:
                segment_ids, position_ids = plain_segments(
                    attention_mask, input_ids.shape, input_ids.device
                )
            return build_flex_mask(segment_ids, position_ids, self.config.sliding_window)
        if segment_ids is None:
            if self.attn_implementation == "triton_fa2":
                return build_key_lengths(
                    attention_mask, input_ids.shape, self.config.sliding_window
                )
            return build_attention_mask(
                attention_mask, input_ids.shape, self.config.sliding_window, input_ids.device
            )
        return build_segment_mask(segment_ids, position_ids, self.config.sliding_window)

    def _check_layout(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        segment_ids: torch.Tensor | None,
    ) -> None:
        """Refuse mask arguments that disagree, or a layout the backend cannot mask."""
        if (position_ids is None) != (segment_ids is None):
            raise ValueError(
                "position_ids and segment_ids come together (the prefix-shared layout); got "
                f"position_ids {'set' if position_ids is not None else 'None'}, "
                f"segment_ids {'set' if segment_ids is not None else 'None'}"
            )
        if segment_ids is not None:
            if self.attn_implementation == "triton_fa2":
                raise ValueError(
                    "attention backend 'triton_fa2' masks only causally and by key lengths; "
                    "the shared and packed layouts (segment_ids, batch.layout) need a "
                    "segment-aware mask: use 'sdpa', 'eager' or 'flex', or set "
                    "batch.layout = 'padded'"
                )
            if attention_mask is not None and not torch.equal(
                attention_mask.bool(), segment_ids != PAD_SEGMENT
            ):
                raise ValueError(
                    "attention_mask disagrees with segment_ids on which tokens are real"
                )
            if segment_ids.shape != input_ids.shape or position_ids.shape != input_ids.shape:
                raise ValueError(
                    f"segment_ids {tuple(segment_ids.shape)} and position_ids "
                    f"{tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}"
                )

    def _label_logps(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        segment_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.lm_head.weight
        if labels.dim() == 2:
            return fused_sequence_logps(hidden, weight, labels, chunk_size)
        if labels.dim() != 3:
            raise ValueError(f"labels must be [B, T] or [K, B, T], got {tuple(labels.shape)}")
        slots = None if segment_ids is None else pair_slot(segment_ids)
        # One call per set: sets may score the same position (a branch's first token is
        # predicted from the prefix's last), which one label per position cannot express.
        sets = [fused_sequence_logps(hidden, weight, s, chunk_size, slots) for s in labels]
        return torch.cat([logps for logps, _ in sets]), torch.cat([counts for _, counts in sets])


def rope_cos_sin(
    config: MistralConfig,
    length: int,
    dtype: torch.dtype,
    device: torch.device,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for positions 0..T-1, or [B, 1, T, head_dim] for
    `position_ids` [B, T]; computed in float32 then cast."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if position_ids is None:
        freqs = torch.arange(length, device=device).float()[:, None] * inv_freq[None, :]
    else:
        if position_ids.dim() != 2 or position_ids.shape[1] != length:
            raise ValueError(
                f"position_ids must be [B, {length}], got shape {tuple(position_ids.shape)}"
            )
        freqs = (position_ids.float()[..., None] * inv_freq)[:, None]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate [B, H, T, D] by position, rotate-half convention (as HF Mistral); cos and
    sin are [T, D] or [B, 1, T, D]."""
    cos, sin = rope
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def build_attention_mask(
    attention_mask: torch.Tensor | None,
    shape: torch.Size,
    sliding_window: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean [B, 1, T, T] mask (True = attend), or None when plain causal attention suffices.

    A query at position i attends to real keys j with i - sliding_window < j <= i.
    """
    batch, length = shape
    window_active = sliding_window is not None and sliding_window < length
    if attention_mask is not None:
        key_is_real, padded = _right_padded_keys(attention_mask, shape)
        if not padded:
            attention_mask = None
    if attention_mask is None and not window_active:
        return None
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    allowed = key <= query
    if window_active:
        allowed = allowed & (key > query - sliding_window)
    if attention_mask is None:
        return allowed.expand(batch, 1, length, length)
    # A padded query always sees itself, so no row is fully masked (which would give NaN).
    key_ok = key_is_real[:, None, None, :] | (key == query)
    return allowed & key_ok


def build_key_lengths(
    attention_mask: torch.Tensor | None, shape: torch.Size, sliding_window: int | None
) -> torch.Tensor | None:
    """Real tokens per row, int32 [B], or None when no row is padded: the triton_fa2 mask.

    Real queries see exactly what `build_attention_mask` lets them see; padded queries
    get zeros instead of attending to themselves, and the loss never reads them.
    """
    if sliding_window is not None and sliding_window < shape[1]:
        raise ValueError(
            f"attention backend 'triton_fa2' has no sliding window, and sliding_window="
            f"{sliding_window} < sequence length {shape[1]} would need one; use 'sdpa'"
        )
    if attention_mask is None:
        return None
    key_is_real, padded = _right_padded_keys(attention_mask, shape)
    return key_is_real.sum(dim=-1, dtype=torch.int32) if padded else None


def _right_padded_keys(
    attention_mask: torch.Tensor, shape: torch.Size
) -> tuple[torch.Tensor, bool]:
    """The mask as booleans [B, T] and whether any row is padded; refuses left padding."""
    if attention_mask.shape != shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(shape)}"
        )
    key_is_real = attention_mask.bool()
    padded, left_padded = torch.stack(
        [~key_is_real.all(), (key_is_real[:, 1:] > key_is_real[:, :-1]).any()]
    ).tolist()
    if left_padded:
        raise ValueError("attention_mask must be right-padded (no real token after padding)")
    return key_is_real, padded
