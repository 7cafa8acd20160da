"""
NVFP4 decoding on the GPU: packed codes + E4M3 block scales (+ the global scale) -> dense values in
one pass, bit for bit what nvfp4.NVFP4Tensor.dequantize / grid_values compute. The grid values
q * s_b (no global scale) are exact in bf16: the operands of the bf16 GEMM route
(kernels/nvfp4_gemm.py).
"""


import torch
import triton
import triton.language as tl

from kernels.nvfp4_math import _decode_e2m1, _e4m3_value, _round_to_bf16, on_gpu

DEQUANT_ROWS_LAUNCH = (256, 8)  # (blocks per program, num_warps) of _dequantize_rows_kernel


@triton.jit
def _global_scale(gs_ptr, APPLY_GLOBAL: tl.constexpr):
    """s_g, or 1 for the grid values q * s_b (exact: _decode_e2m1's second product then rounds
    nothing)."""
    if APPLY_GLOBAL:
        return tl.load(gs_ptr)
    else:
        return 1.0


@triton.jit
def _dequant_store(v, out_ptr, offs, mask, ROUND_BF16: tl.constexpr, HW_BF16: tl.constexpr):
    if ROUND_BF16:
        v = _round_to_bf16(v, HW_BF16)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_rows_kernel(codes_ptr, scales_ptr, gs_ptr, out_ptr, n_blocks, NB: tl.constexpr,
                            APPLY_GLOBAL: tl.constexpr, ROUND_BF16: tl.constexpr,
                            HW_BF16: tl.constexpr):
    """1x16 blocks: NB consecutive blocks per program, each block's 16 codes read as two int32 words
    (element 0 in the low nibble) and its scale read once."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * NB
    blk = tl.arange(0, NB)
    bmask = blk < n_blocks - base
    words = tl.load(codes_ptr + base * 2 + blk[:, None] * 2 + tl.arange(0, 2)[None, :],
                    mask=bmask[:, None], other=0)                                   # (NB, 2) int32
    # code k of each word to bits 31..28 (_decode_e2m1 ignores the bits below)
    top = (words[:, :, None] << (28 - 4 * tl.arange(0, 8))[None, None, :]).reshape(NB, 16)
    s_b = _e4m3_value(tl.load(scales_ptr + base + blk, mask=bmask, other=0))
    v = _decode_e2m1(top, s_b[:, None], _global_scale(gs_ptr, APPLY_GLOBAL))       # (NB, 16)
    _dequant_store(v, out_ptr + base * 16, blk[:, None] * 16 + tl.arange(0, 16)[None, :],
                   bmask[:, None], ROUND_BF16, HW_BF16)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, gs_ptr, out_ptr, M, N, ld_out, BN: tl.constexpr,
                       SBN: tl.constexpr, APPLY_GLOBAL: tl.constexpr, ROUND_BF16: tl.constexpr,
                       HW_BF16: tl.constexpr):
    """16-row blocks ((16, 1) or (16, 16)): a (16, BN) tile shares one row of scales, loaded once
    per column (16x1) or once per 16 columns (16x16) and broadcast down the rows. Output rows ld_out
    elements apart (N, or a wider buffer's left columns: LoRA-SVD's [W_hat | L2])."""
    # rows on axis 0: no 65535 cap
    pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * 16 + tl.arange(0, 16)
    offs_c = pid_n * (BN // 2) + tl.arange(0, BN // 2)
    cmask = (offs_m[:, None] < M) & (offs_c[None, :] < N // 2)
    c = tl.load(codes_ptr + (pid_b.to(tl.int64) * M + offs_m[:, None]) * (N // 2) + offs_c[None, :],
                mask=cmask, other=0)
    c = c.to(tl.int32)  # the even element (low nibble) to bits 31..28, the odd one too
    top = tl.join(c << 28, c << 24).reshape(16, BN)
    offs_n = pid_n * BN + tl.arange(0, BN)
    s = tl.load(scales_ptr + (pid_b.to(tl.int64) * (M // 16) + pid_m) * (N // SBN) + offs_n // SBN,
                mask=offs_n < N, other=0)
    v = _decode_e2m1(top, _e4m3_value(s)[None, :], _global_scale(gs_ptr, APPLY_GLOBAL))
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    _dequant_store(v, out_ptr,
                   (pid_b.to(tl.int64) * M + offs_m[:, None]) * ld_out + offs_n[None, :], mask,
                   ROUND_BF16, HW_BF16)


def dequantize(codes, scales, global_scale, shape, block, dtype=torch.float32, out=None):
    """Packed NVFP4 -> dense tensor of `shape` in one pass: (q * s_b) * s_g rounded once to `dtype`,
    as nvfp4.NVFP4Tensor.dequantize computes it (bit-exact; bf16 rounding done explicitly, ties to
    even). global_scale None gives q * s_b, exact in bf16 (the grid values a bf16 GEMM
    multiplies). out: a 2-D (M, N) tensor of `dtype` to write into, returned (16-row blocks: its
    rows any stride apart, e.g. a wider buffer's left columns; 1x16: contiguous)."""
    M, N = shape[-2:]
    bm, bn = block
    codes = codes.reshape(-1, M, N // 2).contiguous()
    scales = scales.reshape(-1, M // bm, N // bn).contiguous().view(torch.uint8)
    out = _check_out(out, codes.shape[0], M, N, bm, dtype, codes.device)
    apply_global = global_scale is not None
    # (an unused pointer without a global scale)
    gs = global_scale.float().reshape(1) if apply_global else out
    flags = dict(APPLY_GLOBAL=apply_global, ROUND_BF16=dtype == torch.bfloat16,
                 HW_BF16=on_gpu())
    if bm == 1:  # 1x16
        NB, warps = DEQUANT_ROWS_LAUNCH
        # an int32 view needs 4-byte alignment
        codes = codes if codes.storage_offset() % 4 == 0 else codes.clone()
        n_blocks = out.numel() // 16
        _dequantize_rows_kernel[(triton.cdiv(n_blocks, NB),)](codes.view(torch.int32), scales, gs,
                                                            out, n_blocks, NB=NB, **flags,
                                                            num_warps=warps)
    else:
        BN = 256
        grid = (M // 16, triton.cdiv(N, BN), codes.shape[0])
        _dequantize_kernel[grid](codes, scales, gs, out, M, N, out.stride(-2), BN=BN, SBN=bn,
                                 **flags, num_warps=4)
    return out.reshape(shape) if out.dim() == 3 else out


def _check_out(out, B, M, N, bm, dtype, device):
    """dequantize's output: a new (B, M, N) tensor, or the caller's 2-D `out` (B == 1)."""
    if out is None:
        return torch.empty((B, M, N), device=device, dtype=dtype)
    if not (B == 1 and tuple(out.shape) == (M, N) and out.dtype == dtype and out.device == device
            and out.stride(-1) == 1 and out.stride(0) >= N and (bm == 16 or out.is_contiguous())):
        raise ValueError(f"dequantize: out must be a {dtype} ({M}, {N}) tensor on {device} with "
                         f"unit column stride (contiguous for 1x16 blocks), got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def grid_values_bf16(t, out=None):
    """q * s_b as bf16 (exact), in the stored layout (*, M, N), of a packed NVFP4 tensor t
    (anything with codes, scales, shape and block: nvfp4.NVFP4Tensor); out as dequantize's."""
    return dequantize(t.codes, t.scales, None, t.shape, t.block, torch.bfloat16, out)
