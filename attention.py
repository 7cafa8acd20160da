"""
Mixed-precision FP4 attention (paper §3.5, Table 2, App. 10-11).

Attention has 7 matmuls: S = Q K^T and O = P V in the forward; the backward recomputes S = Q K^T,
then dV = P^T dO, dP = dO V^T, dQ = dS K and dK = dS^T Q, with dS = P o (dP - D) and
D = rowsum(dO o O).

The paper's policy ("fp4") quantizes what is IO- and compute-heavy and keeps the sensitive paths in
BF16:
- Q, K, V in NVFP4, quantized ONCE in the forward; the backward reads the same 4-bit values
  (forward-backward consistency: a backward that re-quantized would differentiate a function the
  forward never computed). Blocks 1x16 along D, the contraction dim of Q K^T; RTN, as every forward
  tensor. The saved activations are 4-bit.
- dS in NVFP4 in the backward, 1x16 blocks along each matmul's contraction dim: along the keys for
  dQ = dS K, along the queries for dK = dS^T Q (two quantizations of one dS, each per tile in
  registers). Stochastic rounding, as every gradient: dQ and dK stay unbiased (up to the block-max
  clamp of nvfp4.quantize's "sr"), where RTN would deterministically flush the many small tail
  entries (P ~ 0) whose sum balances the peaks (each row of dS sums to 0).
- So 4 of the 7 matmuls take NVFP4 operands (Q K^T twice, dS K, dS^T Q). PV and dO V^T stay BF16
  because App. 10 shows they are the sensitive ones: quantized P rows leave the probability simplex
  (10.1, `simplex_violation`), and noise in dP = dO V^T lands on dS scaled by P, i.e. on the
  attention peaks (eq. 6, `ds_error`). P^T dO stays BF16 too, so that dV sees the same P as the
  forward. V enters PV and dO V^T at its dequantized NVFP4 value, which BF16 holds exactly.

The variants of Fig. 5 (`policy_errors` gives its numbers) quantize one more path each, see
POLICIES.

Choices the paper leaves open:
- Blocks along T. PV, dS K and dS^T Q contract over T, where V, K, Q are blocked along D: they
  multiply the one 1x16 quantization's exact dequantized values (on Hopper, which has no FP4 tensor
  cores, every NVFP4 product does; on Blackwell Q K^T, and dO V^T / P^T dO where a policy quantizes
  dO, run on the FP4 tensor cores: kernels/flash_attention.py). A second quantization along T would
  change the numbers and break forward-backward consistency.
- dS's SR uniforms come from a counter hash of (seed, head, query, key, pass), so the reference and
  the kernels draw the same bits for any tiling; 16 bits each (one 32-bit hash serves two
  neighbours), which biases a rounding decision by < 2^-16 of an E2M1 step.
- dS's global scale: a tiled kernel cannot know amax(dS) before it is done, so s_g(dS) per (batch,
  head) comes from a bound that holds by construction: |dS_ij| = P_ij |dP_ij - D_i| <= max_i
  ||dO_i|| max_j ||V_j|| + max_i |D_i| (P <= 1, Cauchy-Schwarz), with max_j ||V_j|| <= sqrt(D)
  amax(V) read off V's global scale. No block scale ever saturates; the price is a few bits of E4M3
  range (the bound is loose by ~10-100x).
- P (fp4_pv, fp4_all): 1x16 along the keys for PV (along the queries for P^T dO), RTN, s_g =
  1/(448*6) since P <= 1. The online-softmax forward quantizes P~ = exp(S - running max), as a fused
  kernel must, so those two variants depend on the key tile (kernels.flash_attention.P_BLOCK_N,
  shared by the reference). The softmax normalizer uses the exact P~: the quantized rows leave the
  simplex (App. 10.1).
- dO (fp4_dov, fp4_all): 1x16 along D for dO V^T, 16x1 along T for P^T dO; SR.
"""

import math

import torch
from torch import Tensor

import nvfp4
from kernels import flash_attention
from kernels.nvfp4_dequant import grid_values_bf16
from kernels.nvfp4_quant import quantize_dequant

# policy -> which matmul operands are NVFP4; every other operand stays BF16 (or the input dtype).
# qkv: Q, K, V everywhere; ds: dS in dS K and dS^T Q; p: P in PV; dov: dO in dO V^T; pdo: P and dO
# in P^T dO
POLICIES = {
    # exact attention, our flash kernels
    "bf16":    dict(qkv=False, ds=False, p=False, dov=False, pdo=False),
    # the paper (§3.5, Table 2)
    "fp4":     dict(qkv=True,  ds=True,  p=False, dov=False, pdo=False),
    "fp4_pv":  dict(qkv=True,  ds=True,  p=True,  dov=False, pdo=False),  # Fig. 5 variant
    "fp4_dov": dict(qkv=True,  ds=True,  p=False, dov=True,  pdo=False),  # Fig. 5 variant
    # every matmul (App. 13's naive baseline)
    "fp4_all": dict(qkv=True,  ds=True,  p=True,  dov=True,  pdo=True),
}
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634
P_GLOBAL_SCALE = nvfp4.global_scales(torch.tensor(1.0))[1].item()  # S_dec of P: amax(P) <= 1
M32 = 0xFFFFFFFF


def attention(q, k, v, causal=True, policy="fp4"):
    """Scaled dot-product attention softmax(Q K^T / sqrt(D)) V with the precision `policy` (see
    POLICIES). q (B, H, T, D), k, v (B, Hkv, T, D) with H % Hkv == 0 (GQA), D in {64, 128}. The
    route is the project's seam, nvfp4.use_kernels (train.py --route): the flash kernels of
    kernels/flash_attention.py (CPU tensors in Triton's interpreter) or this file's tiled PyTorch
    reference (fp32)."""
    if policy not in POLICIES:
        raise ValueError(f"attention: policy must be one of {list(POLICIES)}, got {policy!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4 or not x.is_floating_point():
            raise ValueError(f"attention: {name} must be a 4-D float tensor (B, heads, T, D), got "
                             f"{x.dtype} {tuple(x.shape)}")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(f"attention: k and v must be (B, Hkv, T, D) = ({B}, Hkv, {T}, {D}) "
                         f"like q; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if D not in HEAD_DIMS:
        raise ValueError(f"attention: head dim D = {D} is not supported; use one of {HEAD_DIMS}")
    if H % k.shape[1]:
        raise ValueError(f"attention: query heads H = {H} must be a multiple of kv heads "
                         f"Hkv = {k.shape[1]} (GQA)")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    # one tensor given twice (k as v, say): a view makes the inputs distinct, as torch.compile
    # cannot trace an autograd.Function that takes a tensor twice (eager does not care)
    k = k.view_as(k) if k is q else k
    v = v.view_as(v) if v is q or v is k else v
    return AttentionFunction.apply(q, k, v, causal, policy)


# --------------------------------------------------------------------------------------------------
# Attention as autograd sees it (eager and compiled), its forward and backward bodies, and the
# bodies as torch.library custom ops for torch.compile. The draws (dS's stream seed, dO's SR
# seeds) are made inside the backward body when it runs, in eager's order.

class AttentionFunction(torch.autograd.Function):
    """Saved for the backward: o, lse, the packed NVFP4 Q, K, V, and the BF16 q, k, v only where
    the policy does not quantize them (empty tensors in their place otherwise). Under torch.compile
    the bodies run as the opaque custom ops below; eager calls them directly (a custom op's dispatch
    costs host time: nvfp4.LinearFunction)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, policy):
        body = attention_op if torch.compiler.is_compiling() else attention_forward
        with torch.autocast(q.device.type, enabled=False):  # the policy's arithmetic
            o, lse, *fp4 = body(q, k, v, causal, policy)
        qkv = [q.new_empty(0) for _ in "qkv"] if POLICIES[policy]["qkv"] else (q, k, v)
        ctx.save_for_backward(o, lse, *fp4, *qkv)
        ctx.causal, ctx.policy = causal, policy
        return o

    @staticmethod
    def backward(ctx, do):
        body = attention_backward_op if torch.compiler.is_compiling() else attention_backward_saved
        with torch.autocast(do.device.type, enabled=False):
            dq, dk, dv = body(do, *ctx.saved_tensors, ctx.causal, ctx.policy)
        return dq, dk, dv, None, None


def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, policy: str
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                 Tensor, Tensor, Tensor]:
    """-> (o, lse, then the NVFP4 Q, K, V the backward reads, as (codes, scales, global scale)
    each (the saved activations are 4-bit), empty tensors where the policy keeps them in BF16:
    then the backward reads q, k, v)."""
    pol, kernels = POLICIES[policy], nvfp4.use_kernels(q)
    sm_scale = 1.0 / math.sqrt(q.shape[-1])
    dtype = q.dtype
    fp4 = None
    if pol["qkv"]:  # quantized ONCE: the backward reads these very codes (fwd-bwd consistency)
        (qq, qv), (kq, kv), (vq, vv) = [_quantize_qkv(x, n, kernels)
                                        for x, n in ((q, "Q"), (k, "K"), (v, "V"))]
        ops, fp4 = (qv, kv, vv), (qq, kq, vq)
    else:
        ops = (q, k, v) if kernels else (q.float(), k.float(), v.float())
    if kernels:
        # fp4: Q K^T on the FP4 tensor cores of a Blackwell GPU (flash_attention's FP4_MMA)
        o, lse = flash_attention.flash_forward(*ops, _qkv_global_scales(fp4, q.device), causal,
                                               sm_scale, P_GLOBAL_SCALE if pol["p"] else None,
                                               dtype, packed=fp4)
    else:
        o, lse = reference_forward(*ops, causal, pol["p"], sm_scale, dtype)
        o = o.to(dtype)
    fp4 = ([t for x in fp4 for t in (x.codes, x.scales, x.global_scale)] if fp4 is not None
           else [q.new_empty(0) for _ in range(9)])
    return o, lse, *fp4


def _ds_inputs(do, do_dov, do_norm, delta, vq, kernels):
    """dS in NVFP4 (§3.5, SR): its bound ds_bound and its stream keys (one seed drawn on the
    device, nvfp4.sr_seed); on the kernels the same bits from flash_attention.ds_setup in one
    launch, with the element-scale tables the passes read."""
    B, H, T, D = do.shape
    seed = nvfp4.sr_seed(device=do.device)
    do_eff_norm = do_dov.dequantize().norm(dim=-1) if do_dov is not None else do_norm
    if kernels:
        return flash_attention.ds_setup(seed, do_eff_norm, delta, vq.global_scale, D)
    keys = sr_keys(seed, B * H, device=do.device).reshape(B, H, 2)
    # >= every |V_hat| (s_b <= 448)
    v_amax = vq.global_scale * (nvfp4.E4M3_MAX * nvfp4.FP4_MAX)
    return ds_bound(do_eff_norm, v_amax, delta, D, H // vq.shape[1]), keys


def attention_backward(do, o, lse, fp4, qkv, causal, policy):
    """(dQ, dK, dV) from dO, the forward's o and lse, and fp4: its NVFP4 (Q, K, V) where the
    policy quantizes them (None: qkv, the BF16 inputs, are read instead)."""
    pol, kernels = POLICIES[policy], nvfp4.use_kernels(o)
    B, H, T, D = o.shape
    dtype = o.dtype
    sm_scale = 1.0 / math.sqrt(D)
    do = do.to(dtype)  # as it arrives (heads-inner from the output projection): read in place
    do_dov = do_pdo = None
    if pol["dov"]:   # dO V^T in NVFP4: dO in 1x16 blocks along D (the contraction), SR
        do_dov = nvfp4.quantize(do, (1, 16), "sr", name="attention dO")
    # P^T dO in NVFP4: dO in 16x1 blocks along T (the contraction), SR; T zero-padded
    if pol["pdo"]:
        pad = -T % 16
        do_pdo = nvfp4.quantize(torch.nn.functional.pad(do, (0, 0, 0, pad)), (16, 1), "sr",
                                name="attention dO")
    if kernels:
        delta, do_norm = flash_attention.bwd_preprocess(o, do)
    else:
        delta = (o.float() * do.float()).sum(-1)
        do_norm = do.float().norm(dim=-1)
    ds = _ds_inputs(do, do_dov, do_norm, delta, fp4[2], kernels) if pol["ds"] else None
    if kernels:
        ops = [grid_values_bf16(t) for t in fp4] if pol["qkv"] else qkv
        sg = (*_qkv_global_scales(fp4, do.device),
              do_dov.global_scale if pol["dov"] else None,
              do_pdo.global_scale if pol["pdo"] else None,
              P_GLOBAL_SCALE if pol["pdo"] else None)
        dq, dk, dv = flash_attention.flash_backward(
            *ops, sg, do, lse, delta,
            do_dov.grid_values().to(dtype) if pol["dov"] else None,
            do_pdo.grid_values()[:, :, :T].to(dtype) if pol["pdo"] else None,
            ds, causal, sm_scale, dtype,
            packed=(*fp4, do_dov, do_pdo) if pol["qkv"] else None)
    else:
        ops = [t.dequantize() for t in fp4] if pol["qkv"] else [x.float() for x in qkv]
        ds_amax, keys = ds if ds is not None else (None, None)
        dq, dk, dv = reference_backward(
            *ops, o, lse, do, causal, sm_scale, dtype,
            do_dov=do_dov.dequantize() if pol["dov"] else None,
            do_pdo=do_pdo.dequantize()[:, :, :T] if pol["pdo"] else None,
            ds_amax=ds_amax, keys=keys)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def attention_backward_saved(do: Tensor, o: Tensor, lse: Tensor, q_codes: Tensor, q_scales: Tensor,
                             q_scale: Tensor, k_codes: Tensor, k_scales: Tensor, k_scale: Tensor,
                             v_codes: Tensor, v_scales: Tensor, v_scale: Tensor, q: Tensor,
                             k: Tensor, v: Tensor, causal: bool, policy: str
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """attention_backward from the tensors the forward saved: (dQ, dK, dV). q, k, v: the BF16
    inputs where the policy keeps them (empty tensors where it quantizes them: then the packed ones
    are read)."""
    fp4 = None
    if POLICIES[policy]["qkv"]:
        fp4 = (nvfp4.packed(q_codes, q_scales, q_scale, (1, 16)),
               nvfp4.packed(k_codes, k_scales, k_scale, (1, 16)),
               nvfp4.packed(v_codes, v_scales, v_scale, (1, 16)))
    return attention_backward(do, o, lse, fp4, (q, k, v), causal, policy)


# What torch.compile sees: the bodies as custom ops (schemas from their annotations), each with a
# fake that gives its outputs' shapes and dtypes (tests: torch.library.opcheck)
attention_op = torch.library.custom_op("nanofp4::attention", attention_forward, mutates_args=())
attention_backward_op = torch.library.custom_op("nanofp4::attention_backward",
                                                attention_backward_saved, mutates_args=())


@attention_op.register_fake
def _(q, k, v, causal, policy):
    """attention_forward's outputs, empty, in the layouts the route gives them (the kernels write o
    heads-inner: flash_forward): what torch.compile plans with."""
    (B, H, T, D), Hkv = q.shape, k.shape[1]
    o = q.new_empty(B, T, H, D).transpose(1, 2) if nvfp4.use_kernels(q) else q.new_empty(q.shape)
    fp4 = ([t for h in (H, Hkv, Hkv)  # codes, scales, global scale of Q, K, V
            for t in (q.new_empty(B, h, T, D // 2, dtype=torch.uint8),
                      q.new_empty(B, h, T, D // 16, dtype=torch.float8_e4m3fn),
                      q.new_empty((), dtype=torch.float32))]
           if POLICIES[policy]["qkv"] else [q.new_empty(0) for _ in range(9)])
    return o, q.new_empty(B, H, T, dtype=torch.float32), *fp4


@attention_backward_op.register_fake
def _(do, o, lse, q_codes, q_scales, q_scale, k_codes, k_scales, k_scale, v_codes, v_scales,
      v_scale, q, k, v, causal, policy):
    (B, H, T, D), Hkv = o.shape, (k_codes if POLICIES[policy]["qkv"] else k).shape[1]
    # the kernels write dV heads-inner (flash_backward)
    dv = o.new_empty(B, T, Hkv, D).transpose(1, 2) if nvfp4.use_kernels(o) else o.new_empty(
        B, Hkv, T, D)
    return o.new_empty(o.shape), o.new_empty(B, Hkv, T, D), dv


# The bodies: forward and backward of one policy, on the kernels or the reference

def _quantize_qkv(x, name, kernels):
    """Q, K or V in NVFP4: 1x16 blocks along D, RTN. Returns the packed tensor (what the backward
    reads) and this forward's matmul operand: the bf16 grid values q * s_b written by the same pass
    for the kernels (which apply s_g to their fp32 accumulators), the dequantized fp32 values for
    the reference."""
    if kernels:
        values, s_g, codes, scales = quantize_dequant(x.detach(), (1, 16), "rtn",
                                                      return_tensor=True, name=f"attention {name}")
        return nvfp4.NVFP4Tensor(codes, scales, s_g, x.shape, (1, 16)), values
    t = nvfp4.quantize(x.detach(), (1, 16), "rtn", name=f"attention {name}")
    return t, t.dequantize()


def _qkv_global_scales(fp4, device):
    """The kernels' (s_g(Q), s_g(K), s_g(V)): the NVFP4 tensors' own 0-d fp32 scales, no copy; for
    BF16 operands (fp4 None) ones, by one fill: not torch.tensor (a copy from pageable host
    memory synchronizes the stream) and not a cache (a tensor first made inside a CUDA graph's
    capture would stay in its memory pool, which torch.compile's graphs refuse)."""
    if fp4 is not None:
        return tuple(t.global_scale for t in fp4)
    one = torch.ones((), dtype=torch.float32, device=device)
    return one, one, one


# --------------------------------------------------------------------------------------------------
# NVFP4 pieces the fused kernels do in registers (torch mirrors of kernels/flash_attention.py)

def fake_quantize_rows(x, amax, rounding="rtn", u=None):
    """x (..., N) as the kernels quantize P and dS in registers, dequantized (fp32): nvfp4's
    reference quantizer in 1x16 blocks along the last dim, with the global scale derived from a
    GIVEN amax (a bound on |x|: 0-d or (B, H, 1, 1)) and, for "sr", the uniforms u (like x). N is
    zero-padded to a multiple of 16 (exact: zeros change no block's amax)."""
    N, pad = x.shape[-1], (0, -x.shape[-1] % 16)
    t = nvfp4.quantize_reference(torch.nn.functional.pad(x.float(), pad), (1, 16), rounding,
                                 global_amax=amax,
                                 uniforms=None if u is None else torch.nn.functional.pad(u, pad))
    return (t.grid_values() * t.global_scale)[..., :N]


def _fmix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def sr_keys(seed, n_heads, device=None):
    """(n_heads, 2) stream keys for dS's SR: column 0 for the dQ pass, column 1 for the dK pass."""
    i = torch.arange(2 * n_heads, dtype=torch.int64, device=device)
    return _fmix32((seed * 0x9E3779B9 + i) & M32).reshape(n_heads, 2)


def sr_uniforms(keys, rows, cols, T, query_pairs=False):
    """U[0, 1) on a 2^-16 grid for dS elements (query rows, key cols) of each head: keys (B, H) ->
    (B, H, R, C). The kernels' `_ds_random_words`: one fmix32((i * T + j) * golden + key) per pair
    of neighbours along the keys (j even; the dQ pass) or along the queries (i even; the dK pass,
    query_pairs=True), the even element taking the low 16 bits and the odd one the high 16."""
    rows, cols = rows[:, None].long(), cols[None, :].long()
    odd = (rows if query_pairs else cols) & 1
    counter = ((rows - odd if query_pairs else rows) * T
               + (cols if query_pairs else cols - odd)) & M32
    x = _fmix32((counter * 0x9E3779B1 + keys[..., None, None]) & M32)
    return torch.where(odd.bool(), x >> 16, x & 0xFFFF).float() * 2.0 ** -16


def ds_bound(do_eff_norm, v_amax, delta, D, G):
    """A bound on |dS| per (batch, head), dS's amax for its global scales: |dS_ij| <= max_i ||dO_i||
    * sqrt(D) * amax(V) + max_i |D_i|. do_eff_norm (B, H, T): row norms of the dO that enters dP;
    v_amax: amax of V's operand (0-d, or (B, Hkv) for the unquantized policies); delta (B, H, T).
    -> (B, H) fp32."""
    v_amax = torch.as_tensor(v_amax, dtype=torch.float32, device=delta.device)
    if v_amax.dim() == 2:
        v_amax = v_amax.repeat_interleave(G, 1)
    return do_eff_norm.amax(-1) * (math.sqrt(D) * v_amax) + delta.abs().amax(-1)


# --------------------------------------------------------------------------------------------------
# Reference: tiled FlashAttention in fp32 (App. 11, Algorithm 8), one key tile at a time

def reference_forward(q, k, v, causal, quant_p, sm_scale, dtype):
    """q (B, H, T, D), k, v (B, Hkv, T, D): operand values in fp32 (dequantized NVFP4 or the
    inputs). Online softmax over key tiles; returns o (B, H, T, D) fp32 and lse2 = m + log2(l)
    (B, H, T), log2 units. Non-NVFP4 operands of the BF16 matmuls are rounded to `dtype` as a tensor
    core would see them. The key tile is the kernels' forward tile: quantized P~ (fp4_pv, fp4_all)
    depends on it."""
    block_n = flash_attention.P_BLOCK_N
    B, H, T, D = q.shape
    G = H // k.shape[1]
    # GQA (the kernels index kv head h // G)
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    rows = torch.arange(T, device=q.device)
    m = torch.full((B, H, T), float("-inf"), device=q.device)
    l = torch.zeros(B, H, T, device=q.device)
    acc = torch.zeros(B, H, T, D, device=q.device)
    for j0 in range(0, T, block_n):
        cols = rows[j0:j0 + block_n]
        # (B, H, T, n) log2 units
        s = (q @ k[:, :, cols].transpose(-1, -2)) * (sm_scale * LOG2E)
        if causal:
            s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        p = torch.exp2(s - m_new[..., None])                                      # P~ = exp(S - m)
        alpha = torch.exp2(m - m_new)
        # exact P~ in the normalizer
        l = l * alpha + p.sum(-1)
        if quant_p:
            # 1x16 along keys, RTN
            p = fake_quantize_rows(p, 1.0)
        else:
            p = p.to(dtype).float()
        acc = acc * alpha[..., None] + p @ v[:, :, cols]
        m = m_new
    return acc / l[..., None], m + torch.log2(l)


def reference_backward(q, k, v, o, lse, do, causal, sm_scale, dtype, do_dov=None, do_pdo=None,
                       ds_amax=None, keys=None):
    """App. 11's backward: recompute S and P = exp2(S2 - lse2) per key tile, D = rowsum(dO o O).
    q, k, v: fp32 operand values (the forward's); do: the incoming gradient (dtype); do_dov /
    do_pdo: the dequantized NVFP4 dO for dO V^T / P^T dO (or None: BF16); ds_amax (B, H) and keys
    (B, H, 2): dS in NVFP4 (or None: BF16). Returns dq (B, H, T, D), dk, dv (B, Hkv, T, D), fp32.
    Any key tile gives the same numbers."""
    block_n = 64
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    do = do.float()
    # D_i = rowsum(dO o O)
    delta = (o.float() * do).sum(-1)
    rows = torch.arange(T, device=q.device)
    dq = torch.zeros(B, H, T, D, device=q.device)
    dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
    if ds_amax is not None:
        bound = ds_amax[..., None, None]                                         # (B, H, 1, 1)
    for j0 in range(0, T, block_n):
        cols = rows[j0:j0 + block_n]
        s = (q @ k[:, :, cols].transpose(-1, -2)) * (sm_scale * LOG2E)
        p = torch.exp2(s - lse[..., None])                                        # (B, H, T, n)
        if causal:
            p = p.masked_fill(cols[None, :] > rows[:, None], 0.0)
        # P^T dO in NVFP4: P^T in 1x16 blocks along the queries (contraction), RTN
        if do_pdo is not None:
            pT = fake_quantize_rows(p.transpose(-1, -2), 1.0)
            dv[:, :, cols] = pT @ do_pdo
        else:
            dv[:, :, cols] = p.to(dtype).float().transpose(-1, -2) @ do           # dV = P^T dO
        dp = (do if do_dov is None else do_dov) @ v[:, :, cols].transpose(-1, -2)  # dP = dO V^T
        # dS = P o (dP - D)
        ds = p * (dp - delta[..., None])
        if ds_amax is not None:
            # dQ = dS K: 1x16 along the keys; dK = dS^T Q: 1x16 along the queries. SR, the kernels'
            # uniforms.
            u = sr_uniforms(keys[..., 0], rows, cols, T)
            ds_q = fake_quantize_rows(ds, bound, "sr", u)
            u = sr_uniforms(keys[..., 1], rows, cols, T, query_pairs=True).transpose(-1, -2)
            ds_kT = fake_quantize_rows(ds.transpose(-1, -2), bound, "sr", u)
        else:
            ds_q = ds.to(dtype).float()
            ds_kT = ds_q.transpose(-1, -2)
        dq += ds_q @ k[:, :, cols]
        dk[:, :, cols] = ds_kT @ q
    # GQA: sum the group
    dk = dk.reshape(B, Hkv, G, T, D).sum(2)
    dv = dv.reshape(B, Hkv, G, T, D).sum(2)
    return dq * sm_scale, dk * sm_scale, dv



# --------------------------------------------------------------------------------------------------
# App. 10 and Fig. 5 as numbers (errors are nvfp4.relative_mse, the paper's Rel. MSE)

def exact_attention(q, k, v, causal=True):
    """float64 softmax(Q K^T / sqrt(D)) V (materialized; for analysis and tests). Returns (o, p)."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    p = torch.softmax(s, -1)
    return p @ v, p


@torch.no_grad()
def simplex_violation(p):
    """App. 10.1. p (..., Tq, Tk): attention rows on the probability simplex. Quantize them to NVFP4
    as the fp4_pv policy does (1x16 along the keys, RTN, s_g = 1/(448*6)) and measure how far the
    rows leave the simplex. Returns row_sum_dev_mean / _max (|1 - sum_j P_hat_ij|), zeroed_mass
    (mean per row of the probability mass in entries that quantize to 0) and rel_mse (of P_hat
    against P)."""
    p = p.float()
    p_hat = fake_quantize_rows(p, 1.0)
    dev = (1.0 - p_hat.double().sum(-1)).abs()
    zeroed = torch.where((p_hat == 0) & (p > 0), p, 0.0).double().sum(-1)
    return {"row_sum_dev_mean": dev.mean().item(), "row_sum_dev_max": dev.max().item(),
            "zeroed_mass": zeroed.mean().item(), "rel_mse": nvfp4.relative_mse(p, p_hat)}


@torch.no_grad()
def ds_error(q, k, v, do, causal=True, peak=0.1):
    """App. 10.2 (eq. 6). dS = P o (dP - D) with dP = dO V^T computed from BF16 operands vs from
    NVFP4 operands (dO and V in 1x16 blocks along D; V RTN as the forward quantizes it, dO SR), both
    against float64. Returns for each: rel_mse over all of dS, and at probability peaks (P >= peak)
    vs the tail: eq. 6's P * Delta dP lands where dS itself is small, so the peaks' relative error
    is the larger."""
    o, p = exact_attention(q, k, v, causal)
    G = q.shape[1] // k.shape[1]
    v64 = v.double().repeat_interleave(G, 1)
    do64 = do.double()
    delta = (o * do64).sum(-1, keepdim=True)
    ds = p * (do64 @ v64.transpose(-1, -2) - delta)
    v_fp4 = nvfp4.fake_quantize(v.float(), (1, 16), "rtn").double().repeat_interleave(G, 1)
    do_fp4 = nvfp4.fake_quantize(do.float(), (1, 16), "sr").double()
    dp_variants = {
        "bf16": (do.bfloat16().double()
                 @ v.bfloat16().double().repeat_interleave(G, 1).transpose(-1, -2)),
        "nvfp4": do_fp4 @ v_fp4.transpose(-1, -2),
    }
    peaks, tail = p >= peak, (p < peak) & (p > 0)
    out = {}
    for name, dp in dp_variants.items():
        ds_hat = p * (dp - delta)
        out[name] = {"rel_mse": nvfp4.relative_mse(ds, ds_hat),
                     "rel_mse_peaks": nvfp4.relative_mse(ds[peaks], ds_hat[peaks]),
                     "rel_mse_tail": nvfp4.relative_mse(ds[tail], ds_hat[tail]),
                     "peak_fraction": peaks.double().mean().item()}
    return out


def policy_errors(q, k, v, do, causal=True, policies=tuple(POLICIES)):
    """Fig. 5: relative MSE of O, dQ, dK, dV for each policy against float64 attention on the same
    inputs. q (B, H, T, D), k, v (B, Hkv, T, D), do (B, H, T, D). Returns {policy: {"o": .., "dq":
    .., "dk": .., "dv": ..}}."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, _ = exact_attention(*leaves, causal)
    grads_ref = torch.autograd.grad(o_ref, leaves, do.double())
    results = {}
    for policy in policies:
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = attention(*xs, causal=causal, policy=policy)
        grads = torch.autograd.grad(o, xs, do.to(o.dtype))
        results[policy] = {name: nvfp4.relative_mse(ref, ours)
                           for name, ours, ref in zip(("o", "dq", "dk", "dv"), (o, *grads),
                                                      (o_ref, *grads_ref))}
    return results
