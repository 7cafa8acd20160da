"""The Blackwell path, verified as far as a machine without Blackwell allows: Triton compiles the native NVFP4 GEMM
(kernels/nvfp4_gemm.py, tl.dot_scaled with e2m1 operands and e4m3 block-16 scales) for sm_100a on any machine,
and its PTX must use the block-scaled FP4 tensor-core MMA:

    tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X

(kind::mxf4nvf4: FP4 operands with block scales; scale_vec::4X: four scales per 64-element K step, i.e. one per 16
elements, the NVFP4 layout; MXFP4 would be 2X, one E8M0 scale per 32). The numbers it computes stay untested here.
"""

import importlib.util
import os
import subprocess
import sys

import pytest
import triton

SCRIPT = os.path.join(os.path.dirname(__file__), "compile_for_target.py")


def compile_for(which):
    """Lines "<kernel> <arch> <MMA instructions>" from tests/compile_for_target.py (a subprocess: the suite runs
    in the interpreter, which cannot compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, SCRIPT, which], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line.split(" ") for line in out.stdout.splitlines()]


def _can_target_blackwell():
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return False
    return (major, minor) >= (3, 3)  # tcgen05 block-scaled MMA lowering


@pytest.mark.skipif(not _can_target_blackwell(), reason="this Triton cannot compile tl.dot_scaled for sm_100a "
                    "(needs Triton >= 3.3 with its NVIDIA backend)")
def test_blackwell_nvfp4_gemm_lowers_to_the_block_scaled_fp4_mma():
    (kernel, arch, mma), = compile_for("blackwell")
    assert kernel == "_nvfp4_gemm_sm100_kernel" and arch == "sm_100a"
    assert mma.split(",") == ["tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.scale_vec::4X"]
