"""Compile the project's Triton kernels for a GPU this machine does not have (run as a script,
without TRITON_INTERPRET: the test suite itself runs interpreted). The launchers run on CPU
tensors with Triton's launch replaced by a recorder, and with kernels/targets.py answering for the
target (its route, tiles and E4M3 path), so each kernel is compiled with exactly the argument types
and options its launcher passes on that GPU; then triton.compile builds it for the target through
ptxas and this prints one line per kernel specialization:
    <kernel> <arch> <shared bytes> <MMA instruction>:<count>,... (or -) <what launched it>
Usage: python tests/compile_for_target.py <capability, e.g. 80 90 120 121> [--sass]
tests/test_targets.py runs it for every target in its matrix. --sass adds each specialization's
registers and stack (spills) per thread, its static SASS instructions (NOPs left out; Triton's
bundled cuobjdump), of them the shuffles and shared-memory stores, and the launch's switches that
are on: the counts docs/performance.md reasons with (these kernels have no loops but unrolled
ones, so static = executed per thread)."""

import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["NANOFP4_ROUTE"] = "kernels"  # the public calls take their kernel routes on CPU tensors
os.environ["TRITON_INTERPRET"] = "0"  # compiled, not interpreted (kernels/__init__ would choose it)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

LAUNCHES, LABEL = [], ["quantize"]  # (kernel, args, kwargs, what launched it)
JITFunction.run = lambda self, *args, grid, warmup, **kwargs: LAUNCHES.append(
    (self, args, kwargs, LABEL[0]))
# the recorded launches write nothing: outputs start as zeros, so that the public calls' checks on
# CPU tensors (finite inputs) pass
_empty, _empty_like = torch.empty, torch.empty_like
torch.empty = lambda *a, **k: _empty(*a, **k).zero_()
torch.empty_like = lambda *a, **k: _empty_like(*a, **k).zero_()

import triton.language as tl  # noqa: E402

from kernels import nvfp4_dequant, nvfp4_gemm, nvfp4_math, nvfp4_quant, targets  # noqa: E402

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


def specialization(fn, args, kwargs):
    """(signature, constexprs, attrs, options) of a launch, as Triton's launcher derives them."""
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
    return signature, constexprs, attrs, options


def compile_launch(fn, args, kwargs, target):
    signature, constexprs, attrs, options = specialization(fn, args, kwargs)
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
    nvfp4_quant.cast_bf16_amax(x.float())                                 # a shared input's cast
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
    nvfp4_gemm.scale_(torch.zeros(4096, dtype=torch.bfloat16), s_g, s_g)  # GEMM outputs: n % 16 == 0
    nvfp4_gemm.scale_(torch.zeros(4096, dtype=torch.bfloat16), s_g, s_g, out=torch.zeros(4096))  # dX
    nvfp4_gemm.scale_(torch.zeros(4096, dtype=torch.bfloat16), s_g, s_g, out=torch.zeros(4096),
                      accumulate=True)  # dX added into the sum of the layers reading one input


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


def record_gemms():
    """nvfp4_gemm.nvfp4_gemm for each product (the LoRA-SVD residual and the other Newton-Schulz
    GEMMs launch the same specializations as forward / dgrad and ns_xxt): on the FP4 MMA one
    launch of _nvfp4_gemm_sm100_kernel labelled with the product; elsewhere the grid values'
    dequantize launches and cuBLAS."""
    for label, (sa, ba), (sb, bb), out_dtype, trans_a, trans_b in BLACKWELL_PRODUCTS:
        LABEL[0] = label
        nvfp4_gemm.nvfp4_gemm(_packed(sa, ba), _packed(sb, bb), out_dtype, trans_a, trans_b)


def record_layers():
    """Every launch the layers' kernel routes make: the direct NVFP4 linear and LoRA-SVD, forward
    and backward, with the contract's 4/6, SR and Hadamard (on the FP4 MMA: the packed-only
    quantize passes, eq. 2's X_hat decoded inside the cols kernel, the GEMMs)."""
    import nvfp4
    from kernels import nvfp4_linear
    LABEL[0] = "layers"
    c = nvfp4.linear_contract(True)
    # bf16 activations and gradients, as under train.py's autocast; the fp32 master weight
    x, w = torch.zeros(64, 256, dtype=torch.bfloat16), torch.zeros(128, 256)
    dy = torch.zeros(64, 128, dtype=torch.bfloat16)
    H, need = nvfp4.random_hadamard(device="cpu"), (True, True)  # eq. 2's H: its launch recorded
    w_used = nvfp4_linear.weight(w, c["forward.w"], 2)
    qx = nvfp4_linear.activation(x, c["forward.x"], 1)
    nvfp4_linear.forward(x, qx, w_used)
    xq = Packed(*qx[:3], x.shape, (1, 16))
    nvfp4_linear.backward(dy, xq, w_used, c, need, 3, H, (4, 5), torch.float32)
    L1, L2 = torch.zeros(16, 256), torch.zeros(128, 16)  # rank 16: [X_hat | branch] rows 16-aligned
    w_used = nvfp4_linear.weight(w, c["forward.w"], 2, L1, L2)
    nvfp4_linear.forward(x, nvfp4_linear.activation(x, c["forward.x"], 1, 16), w_used, L1, L2, 0.5)
    nvfp4_linear.backward(dy, xq, w_used, c, need, 3, H, (4, 5), torch.float32, L1, L2, 0.5)


def record_attention(policy, D=128, B=1, H=4, Hkv=2, T=256):
    """attention.attention's forward and backward under one policy (GQA, causal; D = 128, the
    1b / 3b head dim: the largest tiles' shared memory)."""
    import attention
    LABEL[0] = f"attention:{policy}"
    xs = [torch.zeros(B, h, T, D, dtype=torch.bfloat16, requires_grad=True) for h in (H, Hkv, Hkv)]
    o = attention.attention(*xs, causal=True, policy=policy)  # NANOFP4_ROUTE=kernels
    torch.autograd.grad(o, xs, torch.zeros_like(o))


def record_optimizers():
    """One step of QuantizedAdamW's fused kernel (§3.3) and of Root with NVFP4 states and
    Newton-Schulz (§3.4), as the fullstack recipe builds them."""
    import optim
    for label, make in (("adamw", optim.QuantizedAdamW), ("root", optim.Root)):
        LABEL[0] = label
        p = torch.nn.Parameter(torch.zeros(128, 384))
        p.grad = torch.zeros_like(p)
        opt = make([p], states="nvfp4")
        opt.cuda_graphs = False  # Root's captured NS: no graphs when only recording launches
        opt.step()


def record_fullstack():
    """Every kernel launch of the fullstack step, as the target's routes make them."""
    record_quantize_launches()
    record_gemms()
    record_layers()
    for policy in __import__("attention").POLICIES:
        record_attention(policy)
    record_optimizers()


def set_target(capability):
    """This process takes capability's routes for CPU tensors (kernels/targets.py) and its E4M3
    path (nvfp4_math.HW_E4M3, read when a kernel compiles) -> the Target."""
    targets.capability = lambda device: capability
    t = targets.target(capability)
    nvfp4_math.HW_E4M3 = tl.constexpr(t.hw_e4m3)
    return t


MMA = re.compile(r"\b(?:tcgen05\.mma|wgmma\.mma_async|mma\.sync)[\w.:]*")


def mma_loop(code):
    """Instructions (without NOPs) of the shortest innermost loop that issues a tensor-core MMA, a
    loop being a branch back to an earlier address (code: (address, instruction) pairs): an
    attention kernel's unmasked tile loop, its instructions per thread and tile (the masked copies
    add the masks' compares); 0 for a kernel without one."""
    at = {a: i for i, (a, _) in enumerate(code)}
    op = lambda c: c.split()[0 if c[0] != "@" else 1]
    spans = [(at[int(m.group(1), 16)], i) for i, (a, c) in enumerate(code)
             if op(c).startswith("BRA") and (m := re.search(r"0x([0-9a-f]+)", c))
             and int(m.group(1), 16) in at and int(m.group(1), 16) <= a]
    mma = [(s, e) for s, e in spans
           if any(op(c).startswith(("HGMMA", "HMMA", "UTCMMA", "UTCQMMA")) for _, c in code[s:e])]
    inner = [(s, e) for s, e in mma if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e)
                                               for s2, e2 in mma)]
    return min((sum("NOP" not in c for _, c in code[s:e + 1]) for s, e in inner), default=0)


def sass_counts(cubin):
    """(registers per thread, bytes of stack per thread (spilled registers), static SASS
    instructions without NOPs, of them warp shuffles and shared-memory stores (a layout conversion
    where a kernel meant none), and its unmasked MMA loop's instructions per thread and tile
    (mma_loop)) of a compiled kernel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage, sass = (subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                                      check=True).stdout for flag in ("-res-usage", "-sass"))
    lines = [(int(a, 16), c) for a, c in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(\S.*)$", sass,
                                                     re.M)]
    code = [c for _, c in lines]
    reg, stack = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK"))
    count = lambda op: sum(c.split()[0 if c[0] != "@" else 1].startswith(op) for c in code)
    return (reg, stack, sum("NOP" not in c for c in code), count("SHFL"), count("STS"),
            mma_loop(lines))


def compile_all(capability, sass=False):
    """Compile each recorded specialization once for capability's GPU; print a line for each
    (specialization, what launched it), with --sass its registers and instructions."""
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    compiled, printed = {}, set()
    for fn, args, kwargs, label in LAUNCHES:
        key = fn.__name__ + repr(specialization(fn, args, kwargs))
        if (key, label) in printed:
            continue
        printed.add((key, label))
        if key not in compiled:
            kernel = compile_launch(fn, args, kwargs, target)
            ptx = kernel.asm["ptx"]
            mma = collections.Counter(MMA.findall(ptx))
            compiled[key] = (re.search(r"\.target (\S+)", ptx).group(1), kernel.metadata.shared,
                             ",".join(f"{k}:{n}" for k, n in sorted(mma.items())) or "-")
            if sass:  # and the launch's switches that are on (which variant it is)
                on = ",".join(k for k, v in sorted(kwargs.items()) if v is True) or "-"
                compiled[key] += ("regs %d stack %d sass %d shfl %d sts %d loop %d"
                                  % sass_counts(kernel.asm["cubin"]), on)
        print(fn.__name__, *compiled[key], label, flush=True)


if __name__ == "__main__":
    cap = int(sys.argv[1])
    capability = (cap // 10, cap % 10)
    set_target(capability)
    record_fullstack()
    compile_all(capability, sass="--sass" in sys.argv[2:])


