"""Compile the project's Triton kernels for a GPU this machine does not have (run as a script,
without TRITON_INTERPRET: the test suite itself runs interpreted). The launchers run on CPU
tensors with Triton's launch replaced by a recorder, so each kernel is compiled with exactly
the argument types and options its launcher passes; then triton.compile builds it for the
target and this prints one line per kernel specialization:
    <kernel name> <target> <the MMA instructions in its PTX, comma-separated, or -> [<product>]
(blackwell: the FP4 product of the fullstack step that the launch computes).
Usage: python tests/compile_for_target.py {hopper|blackwell}"""

import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

LAUNCHES = []
JITFunction.run = lambda self, *args, grid, warmup, **kwargs: LAUNCHES.append((self, args, kwargs))

from kernels import nvfp4_dequant, nvfp4_gemm, nvfp4_quant  # noqa: E402

TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
         torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64",
         torch.float8_e4m3fn: "*fp8e4nv"}
# a packed operand as nvfp4_gemm takes it (the fields of nvfp4.NVFP4Tensor)
Packed = collections.namedtuple("Packed", "codes scales global_scale shape block")


def type_of(v):
    if torch.is_tensor(v):
        return TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    return "fp32"


def aligned(v, param):
    """What a GPU launch assumes of an argument: a pointer 16-byte aligned, an integer (unless
    do_not_specialize) a multiple of 16; without these attributes the compiler picks other layouts
    (scalar loads, shuffles) than the GPU runs."""
    if torch.is_tensor(v):
        return v.data_ptr() % 16 == 0
    return (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0
            and not param.do_not_specialize)


def compile_launch(fn, args, kwargs, target):
    bound = dict(zip(fn.arg_names, args), **{k: v for k, v in kwargs.items() if k in fn.arg_names})
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs or bound[name] is None:  # None: a constexpr, as Triton's launcher
            signature[name], constexprs[(i,)] = "constexpr", bound[name]
            continue
        signature[name] = type_of(bound[name])
        if aligned(bound[name], fn.params[i]):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options)


def record_quantize_launches():
    """Every quantize / dequantize launch the layers make: rows, cols and tile kernels, RTN /
    SR / 4/6 / Hadamard, the amax pre-passes, grid values, bf16 and fp32 inputs."""
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    H = torch.eye(16)
    qd, one = nvfp4_quant.quantize_dequant, torch.ones(())
    for fos in (False, True):
        qd(x, (1, 16), "rtn", fos, return_tensor=True)                        # forward X
        qd(x.float(), (16, 16), "rtn", fos)                                   # forward W
        qd(x, (1, 16), "sr", fos, seed=1, global_amax=one)                    # dX's dY
        qd(x, (16, 1), "sr", fos, seed=1, hadamard=H)                         # eq. 2's operands
        nvfp4_quant.quantize(x, (1, 16), "sr", fos, seed=1, hadamard=H)       # rows + amax pass
        nvfp4_quant.quantize(x.t(), (1, 16), "rtn", fos)                      # the tile kernel
    nvfp4_quant.global_amax_pair(x, H)
    buf = torch.zeros(64, 256 + 8, dtype=torch.bfloat16)  # LoRA-SVD's [X_hat | branch]
    for fos in (False, True):
        qd(x, (1, 16), "rtn", fos, return_tensor=True, out=buf[:, :256])
        qd(x, (1, 16), "sr", fos, seed=1, global_amax=one, out=buf[:, :256])
    xq = _packed((64, 256), (1, 16))  # eq. 2's X_hat decoded from the packed X in the cols kernel
    qd(xq, (16, 1), "sr", False, seed=1, hadamard=H, source_dtype=torch.bfloat16)
    codes, s_g = torch.zeros(64, 128, dtype=torch.uint8), torch.ones(())
    for block, n_scales in (((1, 16), (64, 16)), ((16, 16), (4, 16))):
        scales = torch.zeros(n_scales, dtype=torch.uint8).view(torch.float8_e4m3fn)
        for dtype in (torch.float32, torch.bfloat16):
            nvfp4_dequant.dequantize(codes, scales, s_g, (64, 256), block, dtype)
    nvfp4_gemm.scale_(torch.zeros(100, dtype=torch.bfloat16), s_g, s_g)


def _packed(stored, block):
    """A zero operand as the quantize pass stores it: codes (R, C / 2), E4M3 scales
    (R / bm, C / bn)."""
    (R, C), (bm, bn) = stored, block
    scales = torch.zeros(R // bm, C // bn, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return Packed(torch.zeros(R, C // 2, dtype=torch.uint8), scales, torch.ones(()), stored, block)


# every FP4 product of the fullstack step as nvfp4_gemm launches it on Blackwell: (label,
# (a as stored, its block), (b as stored, its block), out dtype, trans_a, trans_b), at 1b-like
# shapes (T tokens, a 6144 x 2048 weight) and at the smallest K
BLACKWELL_PRODUCTS = (
    ("forward", ((256, 2048), (1, 16)), ((6144, 2048), (16, 16)), torch.bfloat16, False, False),
    ("dgrad", ((256, 6144), (1, 16)), ((6144, 2048), (16, 16)), torch.bfloat16, False, True),
    ("wgrad", ((256, 6144), (16, 1)), ((256, 2048), (16, 1)), torch.float32, True, True),
    ("ns_xxt", ((128, 384), (1, 16)), ((128, 384), (1, 16)), torch.float32, False, False),
    ("small_k", ((48, 16), (1, 16)), ((32, 16), (16, 16)), torch.float32, False, False),
)


def record_blackwell_gemms():
    """nvfp4_gemm's Blackwell route for each product (the LoRA-SVD residual and the other
    Newton-Schulz GEMMs launch the same specializations as forward / dgrad and ns_xxt)."""
    labels = []
    for label, (sa, ba), (sb, bb), out_dtype, trans_a, trans_b in BLACKWELL_PRODUCTS:
        nvfp4_gemm._gemm_sm100(_packed(sa, ba), _packed(sb, bb), out_dtype, trans_a, trans_b)
        labels.append(label)
    return labels


def record_blackwell_layers():
    """Every launch the layers' kernel routes make on a Blackwell GPU (use_dot_scaled forced): the
    direct NVFP4 linear and LoRA-SVD, forward and backward, with the contract's 4/6, SR and
    Hadamard (the packed-only quantize passes, eq. 2's X_hat decoded inside the cols kernel, the
    GEMMs)."""
    import nvfp4
    from kernels import lora_fused, nvfp4_linear
    for module in (nvfp4_gemm, nvfp4_linear, lora_fused):
        module.use_dot_scaled = lambda device: True
    c = nvfp4.linear_contract(True)
    x, w, dy = torch.zeros(64, 256), torch.zeros(128, 256), torch.zeros(64, 128)
    H, need, n = torch.eye(16), (True, True), len(LAUNCHES)
    y, xq, w_used = nvfp4_linear.forward(x, w, c["forward.x"], c["forward.w"], (1, 2))
    xq = Packed(*xq, x.shape, (1, 16))
    nvfp4_linear.backward(dy, xq, w_used, c, need, 3, H, (4, 5), torch.float32)
    L1, L2 = torch.zeros(8, 256), torch.zeros(128, 8)
    _, _, w_used = lora_fused.forward(x, w, L1, L2, 0.5, c["forward.x"], c["forward.w"], (1, 2),
                                      torch.bfloat16, torch.float32)
    lora_fused.backward(dy, xq, w_used, L1, L2, 0.5, c, need, 3, H, (4, 5), torch.bfloat16)
    return ["layers"] * (len(LAUNCHES) - n)


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "hopper":
        record_quantize_launches()
        labels, target = [None] * len(LAUNCHES), GPUTarget("cuda", 90, 32)
    else:
        labels = record_blackwell_gemms() + record_blackwell_layers()
        target = GPUTarget("cuda", 100, 32)
    seen = set()
    for (fn, args, kwargs), label in zip(LAUNCHES, labels):
        options = tuple(sorted((k, str(v)) for k, v in kwargs.items()))
        key = (fn.__name__, tuple(map(type_of, args)), options)
        if key in seen:
            continue
        seen.add(key)
        ptx = compile_launch(fn, args, kwargs, target).asm["ptx"]
        mma = sorted(set(re.findall(r"\b(?:tcgen05\.mma|wgmma\.mma_async|mma\.sync)[\w.:]*", ptx)))
        arch = re.search(r"\.target (\S+)", ptx).group(1)
        print(fn.__name__, arch, ",".join(mma) or "-", *([label] if label else []), flush=True)
