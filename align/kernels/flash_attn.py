"""This package's Triton FlashAttention-2: causal, grouped-query, right-padded attention.

Layout q [B, Hq, T, D], k/v [B, Hkv, T, D], any strides; query head h reads K/V head
h // (Hq // Hkv) in place, K/V are never repeated. `seq_lens` [B] is each row's real
length: keys at positions >= len are masked, query rows >= len give zeros and zero
gradients. Softmax runs online in float32 and saves its base-2 log-sum-exp; the
backward pass recomputes the probabilities block by block in two kernels (dK/dV per
K/V block, summed over the query heads of its group, and dQ per query block), so no
gradient needs atomics. Importing this module decorates the kernels, which is when
Triton reads TRITON_INTERPRET.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from align.kernels.contract import check_gqa_shapes
from align.utils.dtypes import TORCH_DTYPES

SUPPORTED_DTYPES = tuple(TORCH_DTYPES.values())
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
LOG2_E = 1.4426950408889634
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension, which indexes (batch, head)
# Decorating reads the same knob, so this is what the kernels below run under.
INTERPRETED = bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Fixed per head dim so the equivalence gate proves exactly the blocking that runs later.
_GPU_CONFIGS: dict[str, dict[int, LaunchConfig]] = {
    "forward": {
        16: LaunchConfig(64, 64, 4, 3),
        32: LaunchConfig(64, 64, 4, 3),
        64: LaunchConfig(128, 64, 4, 3),
        128: LaunchConfig(128, 64, 8, 3),
    },
    "dkdv": {
        16: LaunchConfig(32, 64, 4, 3),
        32: LaunchConfig(32, 64, 4, 3),
        64: LaunchConfig(32, 128, 4, 3),
        128: LaunchConfig(32, 64, 4, 3),
    },
    "dq": {
        16: LaunchConfig(64, 32, 4, 3),
        32: LaunchConfig(64, 32, 4, 3),
        64: LaunchConfig(128, 32, 4, 3),
        128: LaunchConfig(64, 32, 4, 3),
    },
}
# Tiny unequal blocks keep the interpreter fast and still cross every block boundary case.
_INTERPRETER_CONFIGS: dict[str, LaunchConfig] = {
    "forward": LaunchConfig(32, 16, 1, 1),
    "dkdv": LaunchConfig(16, 32, 1, 1),
    "dq": LaunchConfig(32, 16, 1, 1),
}


def launch_config(phase: str, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """Block sizes, warps and pipeline stages of one kernel for one head dim and dtype."""
    if INTERPRETED:
        return _INTERPRETER_CONFIGS[phase]
    config = _GPU_CONFIGS[phase][head_dim]
    if dtype == torch.float32:
        # Twice the bytes per tile: fewer stages (and forward query rows) fit shared memory.
        block_m = config.block_m // 2 if phase == "forward" else config.block_m
        return LaunchConfig(block_m, config.block_n, config.num_warps, 2)
    return config


@triton.jit
def _tile(base, rows, cols, stride_row, stride_col):
    """Pointers to the [rows, cols] tile of a row-major view starting at `base`."""
    return base + rows[:, None] * stride_row + cols[None, :] * stride_col


@triton.jit
def _load_rows(ptrs, offs, limit, MASKED: tl.constexpr):
    """A tile whose rows `offs` at or past `limit` load as zeros when MASKED."""
    if MASKED:  # noqa: SIM108  (a constexpr branch: only the taken load is compiled)
        tile = tl.load(ptrs, mask=(offs < limit)[:, None], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _visible_keys(offs_m, offs_n, seq_len, CAUSAL: tl.constexpr):
    """[queries, keys] mask: real keys, and under CAUSAL none after the query."""
    allowed = (offs_n < seq_len)[None, :]
    if CAUSAL:
        allowed = allowed & (offs_n[None, :] <= offs_m[:, None])
    return allowed


@triton.jit
def _forward_blocks(
    acc,
    row_sum,
    row_max,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_kd,
    stride_vt,
    stride_vd,
    offs_m,
    offs_d,
    seq_len,
    qk_scale,
    lo,
    hi,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(_tile(k_base, offs_n, offs_d, stride_kt, stride_kd), offs_n, seq_len, MASKED)
        v = _load_rows(_tile(v_base, offs_n, offs_d, stride_vt, stride_vd), offs_n, seq_len, MASKED)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if MASKED:
            scores = tl.where(_visible_keys(offs_m, offs_n, seq_len, CAUSAL), scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        p = tl.math.exp2(scores - new_max[:, None])
        rescale = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * rescale[:, None], input_precision=PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit
def _query_block_key_ranges(
    start_m, seq_len, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr
):
    """Keys [0, full_end) need no mask for any row of the block; [full_end, end) do."""
    if CAUSAL:
        end = tl.minimum(seq_len, start_m + BLOCK_M)
        full_end = (tl.minimum(start_m + 1, seq_len) // BLOCK_N) * BLOCK_N
    else:
        end = seq_len
        full_end = (seq_len // BLOCK_N) * BLOCK_N
    # A block of padding rows only; its outputs are zeros.
    end = tl.where(start_m < seq_len, end, 0)
    full_end = tl.where(start_m < seq_len, full_end, 0)
    return full_end, end


@triton.jit
def _attention_forward_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    SEQ_LENS,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    num_q_heads,
    group,
    T,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    b = (batch_head // num_q_heads).to(tl.int64)
    h = (batch_head % num_q_heads).to(tl.int64)
    kv_h = h // group
    seq_len = tl.load(SEQ_LENS + b)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_real = offs_m < seq_len
    q_ptrs = _tile(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qt, stride_qd)
    q = _load_rows(q_ptrs, offs_m, seq_len, True)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    full_end, end = _query_block_key_ranges(start_m, seq_len, BLOCK_M, BLOCK_N, CAUSAL)
    acc, row_sum, row_max = _forward_blocks(
        acc, row_sum, row_max, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, offs_d, seq_len, qk_scale, 0, full_end, BLOCK_N, CAUSAL, False, PRECISION,
    )  # fmt: skip
    acc, row_sum, row_max = _forward_blocks(
        acc, row_sum, row_max, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, offs_d, seq_len, qk_scale, full_end, end, BLOCK_N, CAUSAL, True, PRECISION,
    )  # fmt: skip

    # Every real row saw key 0, so only padding rows can have a zero sum.
    safe_sum = tl.where(row_real, row_sum, 1.0)
    out = tl.where(row_real[:, None], acc / safe_sum[:, None], 0.0)
    lse = tl.where(row_real, row_max + tl.math.log2(safe_sum), 0.0)
    row_in = offs_m < T
    o_ptrs = _tile(OUT + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_ot, stride_od)
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_in[:, None])
    tl.store(LSE + batch_head.to(tl.int64) * T + offs_m, lse, mask=row_in)


@triton.jit
def _row_dot_kernel(
    OUT,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dod,
    num_q_heads,
    T,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(O * dO) in float32, the softmax-backward correction term."""
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    b = (batch_head // num_q_heads).to(tl.int64)
    h = (batch_head % num_q_heads).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_in = offs_m < T
    o = _load_rows(
        _tile(OUT + b * stride_ob + h * stride_oh, offs_m, offs_d, stride_ot, stride_od),
        offs_m,
        T,
        True,
    )
    do = _load_rows(
        _tile(DO + b * stride_dob + h * stride_doh, offs_m, offs_d, stride_dot, stride_dod),
        offs_m,
        T,
        True,
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + batch_head.to(tl.int64) * T + offs_m, delta, mask=row_in)


@triton.jit
def _dkdv_blocks(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_qt,
    stride_qd,
    stride_dot,
    stride_dod,
    offs_n,
    offs_d,
    seq_len,
    qk_scale,
    lo,
    hi,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_rows(_tile(q_base, offs_m, offs_d, stride_qt, stride_qd), offs_m, seq_len, MASKED)
        do = _load_rows(
            _tile(do_base, offs_m, offs_d, stride_dot, stride_dod), offs_m, seq_len, MASKED
        )
        if MASKED:
            row_real = offs_m < seq_len
            lse = tl.load(lse_base + offs_m, mask=row_real, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_real, other=0.0)
        else:
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # Transposed [keys, queries] tiles, so dK and dV accumulate without transposes.
        scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
        p_t = tl.math.exp2(scores_t - lse[None, :])
        if MASKED:
            allowed = row_real[None, :] & (offs_n[:, None] < seq_len)
            if CAUSAL:
                allowed = allowed & (offs_m[None, :] >= offs_n[:, None])
            p_t = tl.where(allowed, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attention_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    SEQ_LENS,
    qk_scale,
    softmax_scale,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dod,
    num_q_heads,
    num_kv_heads,
    group,
    T,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    batch_head = tl.program_id(1)
    b = (batch_head // num_kv_heads).to(tl.int64)
    kv_h = (batch_head % num_kv_heads).to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b)

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_rows(
        _tile(K + b * stride_kb + kv_h * stride_kh, offs_n, offs_d, stride_kt, stride_kd),
        offs_n,
        seq_len,
        True,
    )
    v = _load_rows(
        _tile(V + b * stride_vb + kv_h * stride_vh, offs_n, offs_d, stride_vt, stride_vd),
        offs_n,
        seq_len,
        True,
    )

    # Query blocks [lo, diag_end) straddle the diagonal, [diag_end, full_end) need no mask,
    # [full_end, end) hold the last real rows; rows >= seq_len contribute nothing.
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        diag_end = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    else:
        lo = 0
        diag_end = 0
    end = tl.where(start_n < seq_len, seq_len, lo)
    diag_end = tl.minimum(diag_end, end)
    full_end = tl.where(
        start_n + BLOCK_N <= seq_len,
        tl.maximum((seq_len // BLOCK_M) * BLOCK_M, diag_end),
        diag_end,
    )

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for g in range(group):
        h = kv_h * group + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        row_base = (b * num_q_heads + h) * T
        lse_base = LSE + row_base
        delta_base = DELTA + row_base
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_qd,
            stride_dot, stride_dod, offs_n, offs_d, seq_len, qk_scale, lo, diag_end,
            BLOCK_M, CAUSAL, True, PRECISION,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_qd,
            stride_dot, stride_dod, offs_n, offs_d, seq_len, qk_scale, diag_end, full_end,
            BLOCK_M, CAUSAL, False, PRECISION,
        )  # fmt: skip
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_qd,
            stride_dot, stride_dod, offs_n, offs_d, seq_len, qk_scale, full_end, end,
            BLOCK_M, CAUSAL, True, PRECISION,
        )  # fmt: skip

    # DK and DV are fresh contiguous [B, Hkv, T, D] tensors.
    out_offsets = (batch_head.to(tl.int64) * T + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    key_in = offs_n[:, None] < T
    tl.store(DK + out_offsets, (dk * softmax_scale).to(DK.dtype.element_ty), mask=key_in)
    tl.store(DV + out_offsets, dv.to(DV.dtype.element_ty), mask=key_in)


@triton.jit
def _dq_blocks(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    stride_kt,
    stride_kd,
    stride_vt,
    stride_vd,
    offs_m,
    offs_d,
    seq_len,
    qk_scale,
    lo,
    hi,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(_tile(k_base, offs_n, offs_d, stride_kt, stride_kd), offs_n, seq_len, MASKED)
        v = _load_rows(_tile(v_base, offs_n, offs_d, stride_vt, stride_vd), offs_n, seq_len, MASKED)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        p = tl.math.exp2(scores - lse[:, None])
        if MASKED:
            p = tl.where(_visible_keys(offs_m, offs_n, seq_len, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _attention_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    SEQ_LENS,
    qk_scale,
    softmax_scale,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dod,
    num_q_heads,
    group,
    T,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    b = (batch_head // num_q_heads).to(tl.int64)
    h = (batch_head % num_q_heads).to(tl.int64)
    kv_h = h // group
    seq_len = tl.load(SEQ_LENS + b)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_real = offs_m < seq_len
    # Padding rows load as zeros, which keeps their (discarded) arithmetic finite.
    q = _load_rows(
        _tile(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, stride_qt, stride_qd),
        offs_m,
        seq_len,
        True,
    )
    do = _load_rows(
        _tile(DO + b * stride_dob + h * stride_doh, offs_m, offs_d, stride_dot, stride_dod),
        offs_m,
        seq_len,
        True,
    )
    row_offsets = batch_head.to(tl.int64) * T + offs_m
    lse = tl.load(LSE + row_offsets, mask=row_real, other=0.0)
    delta = tl.load(DELTA + row_offsets, mask=row_real, other=0.0)
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end, end = _query_block_key_ranges(start_m, seq_len, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, offs_d, seq_len, qk_scale, 0, full_end, BLOCK_N, CAUSAL, False, PRECISION,
    )  # fmt: skip
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
        offs_m, offs_d, seq_len, qk_scale, full_end, end, BLOCK_N, CAUSAL, True, PRECISION,
    )  # fmt: skip

    dq = tl.where(row_real[:, None], dq * softmax_scale, 0.0)
    # DQ is a fresh contiguous [B, Hq, T, D] tensor.
    out_offsets = row_offsets[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(DQ + out_offsets, dq.to(DQ.dtype.element_ty), mask=(offs_m < T)[:, None])


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise go through TF32 on tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_options(config: LaunchConfig) -> dict[str, int]:
    return {"num_warps": config.num_warps, "num_stages": config.num_stages}


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, q_heads, length, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, q_heads, length), dtype=torch.float32, device=q.device)
    config = launch_config("forward", head_dim, q.dtype)
    grid = (triton.cdiv(length, config.block_m), batch * q_heads)
    _attention_forward_kernel[grid](
        q, k, v, out, lse, seq_lens, softmax_scale * LOG2_E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        q_heads, q_heads // k.shape[1], length,
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        CAUSAL=causal, PRECISION=_dot_precision(q.dtype), **_launch_options(config),
    )  # fmt: skip
    return out, lse


def _backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    seq_lens: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, q_heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    precision = _dot_precision(q.dtype)
    qk_scale = softmax_scale * LOG2_E

    delta = torch.empty_like(lse)
    config = launch_config("forward", head_dim, q.dtype)
    _row_dot_kernel[(triton.cdiv(length, config.block_m), batch * q_heads)](
        out, grad_out, delta, *out.stride(), *grad_out.stride(), q_heads, length,
        HEAD_DIM=head_dim, BLOCK_M=config.block_m,
    )  # fmt: skip

    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    config = launch_config("dkdv", head_dim, q.dtype)
    _attention_dkdv_kernel[(triton.cdiv(length, config.block_n), batch * kv_heads)](
        q, k, v, grad_out, lse, delta, dk, dv, seq_lens, qk_scale, softmax_scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(),
        q_heads, kv_heads, group, length,
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        CAUSAL=causal, PRECISION=precision, **_launch_options(config),
    )  # fmt: skip

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    config = launch_config("dq", head_dim, q.dtype)
    _attention_dq_kernel[(triton.cdiv(length, config.block_m), batch * q_heads)](
        q, k, v, grad_out, lse, delta, dq, seq_lens, qk_scale, softmax_scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(),
        q_heads, group, length,
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        CAUSAL=causal, PRECISION=precision, **_launch_options(config),
    )  # fmt: skip
    return dq, dk, dv


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_lens, causal, softmax_scale):
        out, lse = _forward(q, k, v, seq_lens, causal, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse, seq_lens)
        ctx.causal = causal
        ctx.softmax_scale = softmax_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, seq_lens = ctx.saved_tensors
        with _on_device(q):
            dq, dk, dv = _backward(
                grad_out, q, k, v, out, lse, seq_lens, ctx.causal, ctx.softmax_scale
            )
        return dq, dk, dv, None, None, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """softmax(scale * Q K^T + mask) V for q [B, Hq, T, D], k/v [B, Hkv, T, D]; returns [B, Hq, T, D].

    `seq_lens` [B] (integers in 0..T) right-pads each row: keys >= len are masked and
    query rows >= len are zero. `softmax_scale` defaults to 1 / sqrt(D). Differentiable
    in q, k and v.
    """
    _check_tensors(q, k, v)
    lengths = _checked_lengths(seq_lens, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    with _on_device(q):
        return _FlashAttention.apply(q, k, v, lengths, bool(causal), scale)


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_gqa_shapes(q, k, v)
    if q.shape[2] == 0 or q.shape[0] == 0:
        raise ValueError(f"flash_attention needs B >= 1 and T >= 1, got q {tuple(q.shape)}")
    if q.shape[0] * q.shape[1] > MAX_GRID_Y:
        raise ValueError(f"B * Hq = {q.shape[0] * q.shape[1]} exceeds the grid limit {MAX_GRID_Y}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {q.shape[-1]} not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q, k, v must share one dtype of {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"flash_attention runs on CUDA tensors, got {q.device}; CPU tensors run only "
            "under the Triton interpreter (TRITON_INTERPRET=1 before this module is imported)"
        )


def _checked_lengths(seq_lens: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    batch, length = q.shape[0], q.shape[2]
    if seq_lens is None:
        return torch.full((batch,), length, dtype=torch.int32, device=q.device)
    if (
        seq_lens.shape != (batch,)
        or seq_lens.dtype.is_floating_point
        or seq_lens.dtype == torch.bool
    ):
        raise ValueError(
            f"seq_lens must be an integer tensor of shape ({batch},), "
            f"got {seq_lens.dtype} {tuple(seq_lens.shape)}"
        )
    if seq_lens.device != q.device:
        raise ValueError(f"seq_lens is on {seq_lens.device}, q on {q.device}")
    low, high = torch.stack(torch.aminmax(seq_lens)).tolist()
    if low < 0 or high > length:
        raise ValueError(f"seq_lens must lie in [0, {length}], got values in [{low}, {high}]")
    return seq_lens.to(torch.int32).contiguous()


def _on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device, which need not be the tensor's.
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()
