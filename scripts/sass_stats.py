"""
Static instruction counts of our Triton kernels, compiled for the H200 (sm_90) on any machine: Triton ships
ptxas and cuobjdump, so `triton.compile(..., target=GPUTarget("cuda", 90, 32))` needs no GPU. The count of SASS
instructions per element a thread handles is a proxy for an element-wise kernel's cost when it is
instruction-bound (the quantize kernels were: their time did not move across 13 tile shapes on the H200), and it
shows layout conversions (shared-memory LDS/STS, SHFL) the compiler inserted. Static counts include branches
that rarely run (the slow path of a correctly rounded division: CALL); timings on the GPU decide.

    python scripts/sass_stats.py            # the quantize kernels' variants (tests run this: they compile)
Other scripts import compile_sm90 / sass_stats.
"""

import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.pop("TRITON_INTERPRET", None)  # compile for real
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_sm90(fn, types, constexprs, div16=(), num_warps=4):
    """fn: a @triton.jit kernel. types: {arg: "*bf16" | "i32" | "fp32" ...} (default "i32"); constexprs:
    {arg: value}; div16: integer args known to be multiples of 16 (Triton specializes them so at launch;
    pointers are always marked 16-byte aligned, as torch's allocations are)."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name, "i32")
        if sig[name].startswith("*") or name in div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, enable_fp_fusion=False))


def sass_stats(kernel, elements, num_warps, label="", show_ops=0):
    """Print and return {total, per_elem, ops}: SASS instruction count, per element a thread handles."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    lines = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", l)]
    ops = collections.Counter(re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", l).group(1) for l in lines)
    per = len(lines) / (elements / (32 * num_warps))
    print(f"{label:44s} SASS {len(lines):6d}  per element {per:6.1f}  convert_layout "
          f"{kernel.asm['ttgir'].count('convert_layout'):2d}  LDS+STS {ops['LDS'] + ops['STS']:4d}  "
          f"SHFL {ops['SHFL']:4d}  CALL {ops['CALL']:3d}")
    if show_ops:
        print("   ", ops.most_common(show_ops))
    return dict(total=len(lines), per_elem=per, ops=ops)


if __name__ == "__main__":
    from kernels import nvfp4_quant as nq
    types = dict(x_ptr="*bf16", h_ptr="*fp32", noise_ptr="*fp32",
                 amax_ptr="*fp32", gs_out_ptr="*fp32", codes_ptr="*u8", scales_ptr="*u8", values_ptr="*bf16")
    base = dict(BM=16, BN=128, SBM=1, SBN=16, FP8_BOUND=448.0, FOUR_OVER_SIX=False, SR=False, USE_NOISE=False,
                HAD_DIM=0, WRITE_CODES=True, WRITE_VALUES=False, EXACT_FMA=True, stride_xn=1)
    for label, ce in [("tile kernel, RTN 1x16", {}), ("tile kernel, RTN 1x16 4/6", dict(FOUR_OVER_SIX=True)),
                      ("tile kernel, SR + Hadamard 1x16", dict(SR=True, HAD_DIM=1)),
                      ("tile kernel, SR + Hadamard 16x1 -> bf16 values", dict(SBM=16, SBN=1, SR=True, HAD_DIM=2,
                                                                        WRITE_CODES=False, WRITE_VALUES=True))]:
        k = compile_sm90(nq._quantize_kernel, types, dict(base, **ce), ("M", "N", "stride_xb", "stride_xm"))
        sass_stats(k, base["BM"] * base["BN"], 4, label)
    amax = {k: base[k] for k in ("BM", "BN", "stride_xn")}
    k = compile_sm90(nq._amax_kernel, dict(types, part_ptr="*fp32"), dict(amax, HAD_DIM=2, PLAIN_TOO=False),
                     ("M", "N", "stride_xb", "stride_xm"))
    sass_stats(k, base["BM"] * base["BN"], 4, "amax pre-pass with Hadamard 16x1")
    # 16x1 blocks of a row-major x (eq. 2's wgrad operands) go to the cols kernel
    C, warps = 32 * nq.COLS_WARPS, nq.COLS_WARPS
    cols = dict(C=C, FP8_BOUND=448.0, FOUR_OVER_SIX=False, SR=True, USE_NOISE=False, HADAMARD=True,
                WRITE_CODES=False, WRITE_VALUES=True, EXACT_FMA=True, AMAX_ONLY=False, PLAIN_TOO=False,
                PACKED_X=False, X_BF16=True)
    cols_types = dict(types, part_ptr="*fp32", xs_ptr="*u8", xgs_ptr="*fp32")
    for label, ce in [("cols kernel, SR + Hadamard 16x1 -> bf16 values", {}),
                      ("cols kernel, SR + Hadamard 16x1 -> codes", dict(WRITE_CODES=True, WRITE_VALUES=False)),
                      ("cols kernel, amax pair (plain + Hadamard 16x1), dY", dict(AMAX_ONLY=True, PLAIN_TOO=True)),
                      ("cols kernel, packed 1x16 X -> SR + Hadamard 16x1 bf16 values", dict(PACKED_X=True))]:
        k = compile_sm90(nq._quantize_cols_kernel, dict(cols_types, x_ptr="*u8") if ce.get("PACKED_X") else cols_types,
                         dict(cols, **ce), ("M", "N", "stride_xb", "stride_xm"), warps)
        sass_stats(k, 16 * 2 * C, warps, label)
    # the types nvfp4_quant._rows_launch passes (unused pointers get an fp32 dummy; tests compile these)
    rows_types = dict(x_ptr="*bf16", h_ptr="*fp32", noise_ptr="*fp32", amax_ptr="*fp32", gs_out_ptr="*fp32",
                      codes_ptr="*i32", scales_ptr="*u8", values_ptr="*bf16", part_ptr="*fp32", n_blocks="i64")
    amax_types = dict(rows_types, codes_ptr="*fp32", scales_ptr="*fp32", values_ptr="*fp32", amax_ptr="*fp32",
                      gs_out_ptr="*fp32")
    rows = dict(FP8_BOUND=448.0, FOUR_OVER_SIX=False, SR=False, USE_NOISE=False, HADAMARD=False,
                WRITE_CODES=True, WRITE_VALUES=False, EXACT_FMA=True, AMAX_ONLY=False)
    for label, ce in [("rows kernel, RTN 1x16", {}),
                      ("rows kernel, RTN 1x16 codes + bf16 values", dict(WRITE_VALUES=True)),
                      ("rows kernel, RTN 1x16 4/6", dict(FOUR_OVER_SIX=True)),
                      ("rows kernel, SR + Hadamard 1x16", dict(SR=True, HADAMARD=True)),
                      ("rows kernel, amax pre-pass with Hadamard", dict(HADAMARD=True, AMAX_ONLY=True,
                                                                        WRITE_CODES=False))]:
        NB, warps, chunks = nq.ROWS_LAUNCH_SR if ce.get("SR") or ce.get("FOUR_OVER_SIX") else nq.ROWS_LAUNCH
        k = compile_sm90(nq._quantize_rows_kernel, amax_types if ce.get("AMAX_ONLY") else rows_types,
                         dict(rows, NB=NB, CHUNKS=chunks, UNROLL=chunks, **ce), ("n_blocks",), warps)
        sass_stats(k, NB * chunks * 16, warps, label)
    from kernels import lora_fused as lf  # App. 9's quantize + down-projection (the Triton route's LoRA kernel)
    lf_types = dict(x_ptr="*bf16", l_ptr="*bf16", amax_ptr="*fp32", codes_ptr="*u8", scales_ptr="*u8",
                    xl_ptr="*bf16", beta="fp32")
    k = compile_sm90(lf._quantize_down_proj_kernel, lf_types,
                     dict(N=4096, BM=32, BN=128, BR=64, FP8_BOUND=256.0, FOUR_OVER_SIX=True, SR=False, DOT_FP32=False,
                          EXACT_FMA=True, NUM_STAGES=2, stride_xn=1), ("M", "stride_xm", "stride_xlm", "stride_lr"))
    sass_stats(k, 32 * 128, 4, "LoRA quantize + down-projection, RTN 4/6")
    dq_types = dict(codes_ptr="*i32", scales_ptr="*u8", gs_ptr="*fp32", out_ptr="*bf16", n_blocks="i64")
    NB, warps = nq.DEQUANT_ROWS_LAUNCH
    k = compile_sm90(nq._dequantize_rows_kernel, dq_types, dict(NB=NB, APPLY_GLOBAL=False, ROUND_BF16=True),
                     ("n_blocks",), warps)
    sass_stats(k, NB * 16, warps, "dequantize 1x16 -> bf16 grid values")
    k = compile_sm90(nq._dequantize_kernel, dict(dq_types, codes_ptr="*u8"),
                     dict(BN=256, SBN=1, APPLY_GLOBAL=False, ROUND_BF16=True), ("M", "N"), 4)
    sass_stats(k, 16 * 256, 4, "dequantize 16x1 -> bf16 grid values")
    # the flash attention dQ pass (bf16 / grid-value operands) with and without dS quantized in registers: the
    # difference is the in-register quantization's cost (two unrolled copies of the loop body: masked, unmasked)
    import triton.language as tl
    from kernels import flash_attention as fa
    fa_types = {n: "*bf16" for n in ("Q", "K", "V", "DO", "DOQ", "DQ")}
    fa_types.update(Qs="*u8", Ks="*u8", Vs="*u8", SG="*fp32", LSE="*fp32", DELTA="*fp32", SGDS="*fp32",
                    KEYS="*i32", qk_scale="fp32", sm_scale="fp32")
    cfg = fa.DQ_CONFIG  # one tile for both (the dS-quantizing default is smaller: fa.DQ_CONFIG_QUANT_DS)
    for quant_ds in (False, True):
        ce = dict(D=128, QD=128, CAUSAL=True, PACKED=False, QUANT_DS=quant_ds, QUANT_DOV=False, DTYPE=tl.bfloat16,
                  QK_DTYPE=tl.bfloat16, PREC="tf32", EMU=False, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"])
        k = compile_sm90(fa._attn_bwd_dq, fa_types, ce, ("T",), cfg["num_warps"])
        sass_stats(k, cfg["BLOCK_M"] * cfg["BLOCK_N"], cfg["num_warps"],
                   f"attention dQ pass {cfg['BLOCK_M']}x{cfg['BLOCK_N']}" + (", dS quantized (SR)" if quant_ds else ""))
