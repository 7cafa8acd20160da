"""Test oracles that the product does not need (the layers read stored operands transposed instead; the
kernels draw their own random bits)."""

import triton
import triton.language as tl

import nvfp4


def transposed(t):
    """The transpose of a packed NVFP4Tensor's last two dims, re-packed: exact, no requantization ((1, 16)
    blocks become (16, 1), (16, 16) stay): the oracle for the GEMMs' transposed reads."""
    codes = t.unpack_codes().transpose(-1, -2).contiguous()
    return nvfp4.NVFP4Tensor(codes[..., 0::2] | (codes[..., 1::2] << 4), t.scales.transpose(-1, -2).contiguous(),
                             t.global_scale, codes.shape, t.block[::-1])


@triton.jit
def noise_bits(u):
    """Given uniforms u = k * 2^-24 (torch.rand's fp32 grid, k < 2^24) -> the 32 random bits
    nvfp4_math._sr_e2m1_value reads: k << 8, exactly (the same decisions as the reference's u)."""
    return (u * 2.0 ** 24).to(tl.uint32) << 8
