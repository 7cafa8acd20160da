"""Why this file exists: Triton's interpreter (TRITON_INTERPRET=1, how CI runs every kernel)
executes tl.dot_scaled from Triton 3.8 on, but decodes every scale as E8M0, a bare exponent
(triton.runtime.interpreter._dot_scaled_scale_to_f32 shifts the byte into fp32's exponent
field), the float8e4nv (E4M3) scales of NVFP4 included. Blackwell's MMA (tcgen05.mma
kind::mxf4nvf4, one E4M3 scale per 16 elements) decodes them as E4M3, so in the interpreter
kernels/nvfp4_gemm.py's Blackwell kernel computes silently wrong products (off by the whole
magnitude of the result). This helper decodes float8e4nv scales as E4M3 while a test runs;
E8M0 (uint8) scales keep Triton's own decoding, and nothing changes outside the `with`:

    with e4m3_dot_scaled_scales():
        out = kernels.nvfp4_gemm._gemm_sm100(a, b, torch.float32)  # CPU tensors, interpreted

tests/test_blackwell.py checks that the interpreter still needs it (delete this file when it
does not).
"""

import contextlib

import numpy as np
import torch
import triton


def interpreter_dot_scaled_skip_reason():
    """None if this Triton's interpreter runs tl.dot_scaled (3.8 and later) with the function
    this helper replaces, else why the interpreted Blackwell tests skip."""
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    if (major, minor) < (3, 8):
        return (f"Triton {triton.__version__}'s interpreter has no tl.dot_scaled (needs "
                "Triton >= 3.8; CI installs 3.9.0: .ci/run)")
    from triton.runtime import interpreter
    if not hasattr(interpreter, "_dot_scaled_scale_to_f32"):
        return (f"Triton {triton.__version__}'s interpreter has no _dot_scaled_scale_to_f32: "
                "see whether it decodes E4M3 scales now and adapt "
                "tests/interpreter_nvfp4_scales.py")
    return None


def _e4m3_to_f32(scale_handle):
    """The scale bytes of a float8e4nv handle decoded as E4M3 (torch's float8_e4m3fn), as
    float32 numpy."""
    data = np.ascontiguousarray(scale_handle.data).view(np.uint8)
    return torch.from_numpy(data).view(torch.float8_e4m3fn).float().numpy()


@contextlib.contextmanager
def e4m3_dot_scaled_scales():
    """Inside: the interpreter's tl.dot_scaled decodes float8e4nv scales as E4M3."""
    import triton.language as tl
    from triton.runtime import interpreter
    triton_decode = interpreter._dot_scaled_scale_to_f32

    def decode(scale_handle, compute_type):
        if scale_handle.dtype == tl.float8e4nv:
            return _e4m3_to_f32(scale_handle)
        return triton_decode(scale_handle, compute_type)

    interpreter._dot_scaled_scale_to_f32 = decode
    try:
        yield
    finally:
        interpreter._dot_scaled_scale_to_f32 = triton_decode
