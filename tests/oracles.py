"""Test oracles that the product does not need (the layers read stored operands transposed instead; the
kernels draw their own random bits)."""

import torch
import triton
import triton.language as tl

import nvfp4
from kernels import nvfp4_math


def transposed(t):
    """The transpose of a packed NVFP4Tensor's last two dims, re-packed: exact, no requantization ((1, 16)
    blocks become (16, 1), (16, 16) stay): the oracle for the GEMMs' transposed reads."""
    codes = t.unpack_codes().transpose(-1, -2).contiguous()
    return nvfp4.NVFP4Tensor(codes[..., 0::2] | (codes[..., 1::2] << 4), t.scales.transpose(-1, -2).contiguous(),
                             t.global_scale, codes.shape, t.block[::-1])


def uniforms16(shape, generator=None, device=None):
    """Uniforms on the SR contract's grid, u = h * 2^-16 for 16 random bits h (nvfp4.sr_uniforms'),
    from torch's generator: what the kernels' random words can carry (noise_bits)."""
    return torch.randint(0, 2**16, shape, generator=generator).to(device) * 2.0**-16


@triton.jit
def noise_bits(u):
    """Given uniforms u = h * 2^-16 (uniforms16) -> the random word nvfp4_math._sr_e2m1_value reads
    (nvfp4_math._sr_word of h), exactly: the same decisions as the reference's u."""
    return nvfp4_math._sr_word((u * 2.0 ** 16).to(tl.uint32))
