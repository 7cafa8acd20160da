"""Compile the project's Triton kernels for a GPU this machine does not have (run as a script, without
TRITON_INTERPRET: the test suite itself runs interpreted). The launchers run on CPU tensors with Triton's launch
replaced by a recorder, so each kernel is compiled with exactly the argument types and options its launcher
passes; then triton.compile builds it for the target and this prints one line per kernel:
    <kernel name> <target> <the MMA instructions in its PTX, comma-separated, or ->
Usage: python tests/compile_for_target.py {hopper|blackwell}"""

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

from kernels import nvfp4_gemm, nvfp4_quant  # noqa: E402
from kernels.nvfp4_linear import Packed  # noqa: E402

TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.uint8: "*u8",
         torch.int32: "*i32", torch.float8_e4m3fn: "*fp8e4nv"}


def type_of(v):
    if torch.is_tensor(v):
        return TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    return "fp32"


def compile_launch(fn, args, kwargs, target):
    bound = dict(zip(fn.arg_names, args), **{k: v for k, v in kwargs.items() if k in fn.arg_names})
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            signature[name], constexprs[(i,)] = "constexpr", bound[name]
        else:
            signature[name] = type_of(bound[name])
    return triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)


def record_quantize_launches():
    """Every quantize / dequantize launch the layers make: rows, cols and tile kernels, RTN / SR / 4/6 / Hadamard,
    the amax pre-passes, grid values, bf16 and fp32 inputs."""
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    H = torch.eye(16)
    for fos in (False, True):
        nvfp4_quant.quantize_dequant(x, (1, 16), "rtn", fos, return_tensor=True)              # forward X
        nvfp4_quant.quantize_dequant(x.float(), (16, 16), "rtn", fos)                       # forward W
        nvfp4_quant.quantize_dequant(x, (1, 16), "sr", fos, seed=1, global_amax=torch.ones(()))  # dX's dY
        nvfp4_quant.quantize_dequant(x, (16, 1), "sr", fos, seed=1, hadamard=H)              # eq. 2's operands
        nvfp4_quant.quantize(x, (1, 16), "sr", fos, seed=1, hadamard=H)                      # rows + its amax pass
        nvfp4_quant.quantize(x.t(), (1, 16), "rtn", fos)                                     # the tile kernel
    nvfp4_quant.global_amax_pair(x, H)
    codes, scales, s_g = torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(64, 16, dtype=torch.uint8), torch.ones(())
    for block, n_scales in (((1, 16), (64, 16)), ((16, 16), (4, 16))):
        scales = torch.zeros(n_scales, dtype=torch.uint8).view(torch.float8_e4m3fn)
        for dtype in (torch.float32, torch.bfloat16):
            nvfp4_quant.dequantize(codes, scales, s_g, (64, 256), block, dtype)
    nvfp4_gemm.scale_(torch.zeros(100, dtype=torch.bfloat16), s_g, s_g)


def record_blackwell_gemm():
    """The Blackwell GEMM as nvfp4_gemm launches it for Q1x16(X) Q16x16(W)^T."""
    a = Packed(torch.zeros(256, 512, dtype=torch.uint8), torch.zeros(256, 64, dtype=torch.uint8).view(torch.float8_e4m3fn),
          torch.ones(()), (256, 1024), (1, 16))
    b = Packed(torch.zeros(512, 512, dtype=torch.uint8), torch.zeros(32, 64, dtype=torch.uint8).view(torch.float8_e4m3fn),
          torch.ones(()), (512, 1024), (16, 16))
    nvfp4_gemm._gemm_sm100(a, b, torch.bfloat16)


if __name__ == "__main__":
    which = sys.argv[1]
    if which == "hopper":
        record_quantize_launches()
        target = GPUTarget("cuda", 90, 32)
    else:
        record_blackwell_gemm()
        target = GPUTarget("cuda", 100, 32)
    seen = set()
    for fn, args, kwargs in LAUNCHES:
        key = (fn.__name__, tuple(map(type_of, args)), tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        compiled = compile_launch(fn, args, kwargs, target)
        mma = sorted(set(re.findall(r"\b(?:tcgen05\.mma|wgmma\.mma_async|mma\.sync)[\w.:]*", compiled.asm["ptx"])))
        arch = re.search(r"\.target (\S+)", compiled.asm["ptx"]).group(1)
        print(fn.__name__, arch, ",".join(mma) or "-", flush=True)
