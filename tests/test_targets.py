"""The target matrix: every kernel specialization the fullstack step launches (quantize, dequantize,
the GEMMs, the fused AdamW, Root's Newton-Schulz, the flash kernels forward and backward under every
attention policy) compiles for each GPU generation of kernels/targets.py's table, through Triton's
ptxas on this CPU (tests/compile_for_target.py, one subprocess per target: the suite runs
interpreted), and

  * its shared memory (the compiled kernel's metadata) fits the target's (the table's bytes a
    block may use);
  * the FP4 products lower to the target's block-scaled FP4 MMA on the "fp4-mma" rows
        10.x  tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16
        12.x  mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X...ue4m3
    (kind::mxf4nvf4: FP4 operands with block scales; block16 / scale_vec::4X with ue4m3: one E4M3
    scale per 16 elements, the NVFP4 layout) and to bf16 MMAs everywhere else (no FP4 instruction);
  * on sm_90 (the H200's), the linear layers' quantize passes hold each block in one thread as
    written (no spill, shuffle or shared-memory store: compile_for_target.py --sass).

The interpreter does not type-check, so this is also where a launch that only a GPU would reject
shows (one did: the rows kernel's amax pre-pass loaded an unused bf16 dummy pointer as its fp32
amax). Compiled only: none of these targets but sm_90 has run the kernels (README's "GPUs" table).
`-k sm_120` selects the consumer Blackwell tests.
"""

import os
import re
import subprocess
import sys

import pytest

from kernels import targets

pytestmark = pytest.mark.targets  # ~80 compiles a target: its own run, `pytest -m targets`
SCRIPT = os.path.join(os.path.dirname(__file__), "compile_for_target.py")
# (test id, capability): the 'a' targets are what Triton builds for 9.0 and newer
HOPPER = (9, 0)  # the H200's
MATRIX = [("sm_80", (8, 0)), ("sm_86", (8, 6)), ("sm_89", (8, 9)), ("sm_90a", (9, 0)),
          ("sm_100a", (10, 0)), ("sm_103a", (10, 3)), ("sm_120a", (12, 0)), ("sm_121a", (12, 1))]
FP4_MMA = {10: re.compile(r"tcgen05\.mma\.cta_group::1\.kind::mxf4nvf4\.block_scale\.block16"),
           12: re.compile(r"mma\.sync\.aligned\.m16n8k64\.row\.col\.kind::mxf4nvf4\.block_scale"
                          r"\.scale_vec::4X\.f32\.e2m1\.e2m1\.f32\.ue4m3")}
BF16_MMA = {8: "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
            9: "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",  # (or another n)
            10: "tcgen05.mma.cta_group::1.kind::f16",
            12: "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}
FP4_POLICIES = ("fp4", "fp4_pv", "fp4_dov", "fp4_all")
GEMM_PRODUCTS = ("forward", "dgrad", "wgrad", "ns_xxt", "small_k")


@pytest.fixture(scope="module")
def compiled():
    """{capability: [(kernel, arch, shared, {MMA: count}, label)]}: every target's subprocess
    starts at once (each compiles its specializations once), and each test waits for its own."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the H200's target also with --sass: registers, spills, shuffles (test_hopper_quantize_...)
    procs = {cap: subprocess.Popen([sys.executable, SCRIPT, f"{cap[0]}{cap[1]}"]
                                   + (["--sass"] if cap == HOPPER else []), env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _, cap in MATRIX}
    results = {}

    def lines(cap):
        if cap not in results:
            out, err = procs[cap].communicate(timeout=1800)
            assert procs[cap].returncode == 0, err[-3000:]
            results[cap] = [_parse(line) for line in out.splitlines()]
        return results[cap]

    yield lines
    for proc in procs.values():
        proc.kill()


def _parse(line):
    """(kernel, arch, shared bytes, {MMA: count}, label), and with --sass sixth its counts
    {"regs", "stack", "sass", "shfl", "sts": int} and seventh its switches that are on."""
    kernel, arch, shared, mma, *sass, label = line.split(" ")
    pairs = [] if mma == "-" else (m.rsplit(":", 1) for m in mma.split(","))
    parsed = (kernel, arch, int(shared), {k: int(n) for k, n in pairs}, label)
    if not sass:
        return parsed
    *counts, switches = sass
    return parsed + ({k: int(n) for k, n in zip(counts[::2], counts[1::2])},
                     set(switches.split(",")))


@pytest.mark.parametrize("cap", [cap for _, cap in MATRIX], ids=[name for name, _ in MATRIX])
def test_every_specialization_compiles_and_fits(compiled, cap):
    """Each kernel of the step compiles for the target's arch and fits its shared memory."""
    t, lines = targets.target(cap), compiled(cap)
    arch = f"sm_{cap[0]}{cap[1]}" + ("a" if cap >= (9, 0) else "")
    kernels = {line[0] for line in lines}
    assert {"_quantize_rows_kernel", "_quantize_cols_kernel", "_quantize_kernel",
            "_dequantize_rows_kernel", "_dequantize_kernel", "_amax_pass", "_update_pass",
            "_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"} <= kernels, kernels
    assert {line[4].split(":")[-1] for line in lines} >= {"layers", "adamw", "root",
                                                            *FP4_POLICIES, "bf16"}
    for kernel, got_arch, shared, _, label, *_ in lines:
        assert got_arch == arch, (kernel, label, got_arch)
        assert shared <= t.shared, (kernel, label, shared, t.shared)


@pytest.mark.parametrize("cap", [cap for _, cap in MATRIX], ids=[name for name, _ in MATRIX])
def test_fp4_products_lower_to_the_targets_mma(compiled, cap):
    """FP4 MMA rows: each GEMM product (forward, dgrad, wgrad, Newton-Schulz's X X^T, the smallest
    K) is one kernel on the block-scaled FP4 MMA alone, and each flash kernel of an FP4 policy
    holds it beside the bf16 MMA (P V, dS K, dS^T Q); the dK/dV pass holds more of them under
    fp4_dov (+ dO V^T) and more again under fp4_all (+ P^T dO), the dQ pass more under fp4_dov.
    Other rows: no FP4 instruction anywhere, no GEMM kernel (cuBLAS multiplies the bf16 grid
    values) and the flash kernels on the bf16 MMA."""
    t, lines = targets.target(cap), compiled(cap)
    fp4 = FP4_MMA.get(cap[0])
    if t.route != "fp4-mma":
        assert not any("mxf4" in mma for line in lines for mma in line[3]), cap
        assert "_nvfp4_gemm_sm100_kernel" not in {line[0] for line in lines}
        for kernel, _, _, mma, label, *_ in lines:  # Hopper: wgmma of several shapes
            if kernel.startswith("_attn_"):
                assert mma and all(k.startswith(BF16_MMA[cap[0]].split(".m")[0]) and "bf16" in k
                                   for k in mma), (kernel, label, mma)
        return
    gemms = {label: mma for kernel, _, _, mma, label, *_ in lines
             if kernel == "_nvfp4_gemm_sm100_kernel"}
    assert set(GEMM_PRODUCTS) <= set(gemms), gemms
    for label, mma in gemms.items():
        assert len(mma) == 1 and fp4.fullmatch(next(iter(mma))), (label, mma)
    count = {}
    for kernel, _, _, mma, label, *_ in lines:
        policy = label.split(":")[-1]
        if not kernel.startswith("_attn_") or policy not in FP4_POLICIES:
            continue
        fp4_kinds = [k for k in mma if fp4.fullmatch(k)]
        assert len(fp4_kinds) == 1 and set(mma) == {fp4_kinds[0], BF16_MMA[cap[0]]}, (
            kernel, policy, mma)
        count[policy, kernel] = mma[fp4_kinds[0]]
    # each further FP4 product adds FP4 MMAs (none fell back to an upcast); not in proportion:
    # P^T dO contracts over the 64-query tile, the others over D = 128
    dkdv = [count[p, "_attn_bwd_dkdv"] for p in ("fp4", "fp4_dov", "fp4_all")]
    assert dkdv == sorted(set(dkdv)), dkdv
    assert count["fp4_dov", "_attn_bwd_dq"] > count["fp4", "_attn_bwd_dq"]


def test_hopper_attention_loops_show_the_ds_quantizer(compiled):
    """sm_90: each attention kernel's unmasked tile loop (compile_for_target's `loop`, the count
    docs/performance.md reasons with): the fp4 policy's forward is the bf16 policy's instruction for
    instruction (Q, K, V arrive as grid values, P is not quantized), and its dK/dV and dQ loops are
    longer by the dS quantizer; the quantize passes have no MMA loop."""
    loops = {(line[0], line[4]): line[5]["loop"] for line in compiled(HOPPER)
             if line[4] in ("attention:fp4", "attention:bf16", "layers")}
    assert loops[("_attn_fwd", "attention:fp4")] == loops[("_attn_fwd", "attention:bf16")] > 0
    for kernel in ("_attn_bwd_dkdv", "_attn_bwd_dq"):
        assert loops[(kernel, "attention:fp4")] > loops[(kernel, "attention:bf16")] > 0, loops
    assert loops[("_quantize_rows_kernel", "layers")] == 0


def test_hopper_quantize_passes_hold_each_block_in_one_thread(compiled):
    """sm_90, the route the H200 runs: the linear layers' quantize passes (the rows and cols
    kernels: X forward, dY for dX, eq. 2's two wgrad operands) compile as they are written, each
    block whole in one thread: no register spilled, no warp shuffle, no shared-memory store (the
    signs of Triton splitting blocks over threads and converting layouts through shared memory:
    kernels/nvfp4_quant.py's _load_by_blocks, whose access order follows Triton's version: CI
    compiles with 3.9, the H200 runs 3.6; both branches were checked offline with 3.6, 3.7 and
    3.9). Their amax pre-passes only spill nothing: their final maximum over the program's
    threads is a shuffle by nature."""
    passes = [line for line in compiled(HOPPER) if line[4] == "layers"
              and line[0] in ("_quantize_rows_kernel", "_quantize_cols_kernel")]
    assert {("AMAX_ONLY" in line[6], line[0]) for line in passes} == {
        (False, "_quantize_rows_kernel"), (False, "_quantize_cols_kernel"),
        (True, "_quantize_rows_kernel"), (True, "_quantize_cols_kernel")}, passes
    for kernel, _, _, _, _, counts, switches in passes:
        assert counts["stack"] == 0, (kernel, switches, counts)
        if "AMAX_ONLY" not in switches:
            assert counts["shfl"] == counts["sts"] == 0, (kernel, switches, counts)
