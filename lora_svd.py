"""
LoRA-SVD linear layers (paper §3.2, App. 8-9).

A weight W (out, in) is split into a high-precision low-rank principal part and an NVFP4 residual:

    W = W_res + beta * L2 @ L1          L2 (out, r), L1 (r, in), both BF16 compute / fp32 master

The forward (eq. 1) runs the residual through the NVFP4 GEMM and the principal part in BF16:

    Y  = Q1x16(X) Q16x16(W_res)^T + beta * (X L1^T) L2^T
    dX = Q1x16(dY, SR) Q16x16(W_res) + beta * (dY L2) L1      (W_res's quantization reused from fwd)
    dW = Q1x16(dY^T H, SR) Q16x1(H^T Q1x16(X), SR)             (eq. 2, fresh random Hadamard H)

The backward pass stops at dW (stored in weight_res.grad). App. 8 takes the LoRA gradients from that
same dW instead of from a second large GEMM with the high-precision X, and §3.2 defers the subspace
split (eqs. 3-4) to the optimizer so that it runs once per optimizer step, after gradient
accumulation:

    Q_L2 R_L2 = L2,  Q_L1 R_L1 = L1^T                              (Cholesky-QR, eq. 3)
    Lambda = Q_L2^T dW Q_L1,  dW_LoRA = Q_L2 Lambda Q_L1^T
    dW_res = dW - dW_LoRA,  dL1 = beta L2^T dW_LoRA,  dL2 = beta dW_LoRA L1^T     (eq. 4)

`project_all(model)` does that for every LoRA-SVD layer; call it after the last backward of a step
and before gradient clipping and optimizer.step(). Every few thousand steps `realign_model(model,
optimizer)` re-derives (W_res, L1, L2) from a randomized SVD of the total weight (subspace drift,
§3.2).

On CUDA the branch rides on the NVFP4 GEMMs (App. 9, kernels/lora_fused.py): r extra columns of the
residual's bf16 grid-value GEMM, so Y and dX are written once. The seam is nvfp4.use_kernels
(NANOFP4_ROUTE). Parameters may be FSDP2 DTensors: projection and realignment gather them and write
back the local shards.

NaiveLoRALinear is the ablation baseline (Table 3, "naive LoRA"): an NVFP4 main weight plus an
ordinary BF16 LoRA branch trained by plain autograd.
"""

import math
import warnings
import weakref

import torch
import torch.nn as nn

import nvfp4
from kernels import lora_fused

# -----------------------------------------------------------------------------
# SVD split: W -> (W_res, L1, L2)


def check_shape(rank, in_features, out_features):
    if in_features % 16 or out_features % 16:
        raise ValueError(f"in_features ({in_features}) and out_features ({out_features}) must be "
                         "multiples of 16 (the 16x16 NVFP4 weight blocks)")
    if not isinstance(rank, int) or rank <= 0 or rank > min(in_features, out_features):
        raise ValueError(f"LoRA rank must be an int in [1, min(in_features, out_features)] = "
                         f"[1, {min(in_features, out_features)}], got rank={rank!r}")


def split_from_svd(W, U, S, Vh, beta):
    """Top-r singular triplets (U (out, r), S (r,), Vh (r, in)) of W -> (W_res, L1, L2) in fp32.

    The singular values are split evenly, L2 = U sqrt(S/beta), L1 = sqrt(S/beta) Vh, because
      - L1 and L2 then have the same norms, so their gradients dL1 = beta L2^T dW_LoRA and
        dL2 = beta dW_LoRA L1^T have comparable scales and one LoRA learning rate fits both;
      - cond(L1) = cond(L2) = sqrt(S_1/S_r): the Cholesky-QR of eq. 3 factors the Gram matrix
        A^T A whose condition number is cond(A)^2 = S_1/S_r, instead of (S_1/S_r)^2 if all of S
        went to one side.
    W_res is then W - beta L2 L1 computed in fp32 from the rounded fp32 L1, L2, so that
    W_res + beta L2 L1 reproduces W up to one fp32 rounding per element (whatever the SVD's
    accuracy).
    """
    root = (S.double() / beta).sqrt()
    L2 = (U.double() * root).float()  # (out, r)
    L1 = (root[:, None] * Vh.double()).float()  # (r, in)
    W_res = W.float() - beta * (L2 @ L1)  # (out, in), fp32
    return W_res, L1, L2


def top_r_svd(W, rank):
    """Exact top-r SVD (init and Fig. 3), fp32 on W's device. Not the randomized SVD below: a
    freshly initialized weight has a flat spectrum, where a sketch with a few power iterations
    misses part of the top-r energy (docs/lora_svd.md)."""
    U, S, Vh = torch.linalg.svd(W.float(), full_matrices=False)
    return U[:, :rank], S[:rank], Vh[:rank]


def randomized_svd(W, rank, oversample=10, power_iters=4, generator=None):
    """Top-r SVD by Halko, Martinsson & Tropp (2011), Alg. 4.4 + 5.1: a Gaussian sketch with
    `oversample` extra columns, `power_iters` subspace iterations (re-orthonormalized each time: the
    spectrum of a trained weight decays slowly, so plain W @ Omega would mix in the tail), then an
    exact SVD of the small (r + p, in) projection. Cost O(out * in * (r + p) * (2 q + 2)), a few
    small GEMMs."""
    out_f, in_f = W.shape
    A = W.float()
    k = min(rank + oversample, min(out_f, in_f))
    omega = torch.randn(in_f, k, generator=generator, device="cpu").to(A.device)  # (in, k)
    Q, _ = torch.linalg.qr(A @ omega)  # (out, k)
    for _ in range(power_iters):
        Z, _ = torch.linalg.qr(A.t() @ Q)  # (in, k)
        Q, _ = torch.linalg.qr(A @ Z)  # (out, k)
    B = Q.t() @ A  # (k, in)
    Ub, S, Vh = torch.linalg.svd(B, full_matrices=False)
    U = Q @ Ub  # (out, k)
    return U[:, :rank], S[:rank], Vh[:rank]


def full_tensor(t):
    """The whole tensor: gathered from its shards for an FSDP2 DTensor, else t itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_like(t, full):
    """`full` laid out like t: t's local shard of it for an FSDP2 DTensor (every rank holds the same
    `full`), else `full` itself."""
    if not hasattr(t, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full, t.device_mesh, t.placements)


# -----------------------------------------------------------------------------
# eqs. 1-2: the LoRA-SVD linear as one autograd function


# The precision contract of eq. 1: the NVFP4 residual's three GEMMs are nvfp4.LINEAR's entries (the
# direct layer's); the rank-r branch (beta X L1^T) L2^T and dX's (beta dY L2) L1 run on BRANCH
# operands (X or dY, L1, L2 and the rank-r intermediate) with fp32 accumulation, on every route.
BRANCH = "bf16"
BRANCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def branch_dtype():
    if BRANCH not in BRANCH_DTYPES:
        raise ValueError(f"lora_svd.BRANCH must be one of {', '.join(BRANCH_DTYPES)}, "
                         f"got {BRANCH!r}")
    return BRANCH_DTYPES[BRANCH]


def _branch(x, A, B, dt):
    """(x A^T) B^T on dt operands (the intermediate rounded to dt too), fp32 accumulation: the GPU's
    BF16 GEMMs."""
    t = (x.to(dt).float() @ A.to(dt).float().t()).to(dt)
    return t.float() @ B.to(dt).float().t()


# eqs. 1-2 written once, in lora_forward and lora_backward; eager runs them through
# LoRASVDFunction, torch.compile through the custom ops nanofp4::lora_svd and lora_svd_backward
# (nvfp4's direct layer says why: the same split, the draws made inside the bodies).

@nvfp4.without_autocast
def lora_forward(x, weight_res, L1, L2, beta, c):
    """eq. 1's Y = Q1x16(X) Q16x16(W_res)^T + beta (X L1^T) L2^T, the residual as the resolved
    contract c (nvfp4.linear_contract) says, the branch in BRANCH. x (..., in), weight_res
    (out, in), L1 (r, in), L2 (out, r) -> (Y (..., out) in x's dtype, the packed Q1x16(X) (T, in)
    and Q16x16(W_res) the backward reads). Leading dims are flattened into tokens T inside, so Y
    is not a view (FSDP2 wants that)."""
    x2, bdt = x.reshape(-1, x.shape[-1]), branch_dtype()  # (T, in)
    seed_x, seed_w = (nvfp4.draws(c[k], x.device) for k in ("forward.x", "forward.w"))
    qw = nvfp4.quantize_as(weight_res.detach(), c["forward.w"], seed_w, name="weight W_res")
    if nvfp4.use_kernels(x2):  # App. 9: the branch rides the residual's GEMM, Y is written once
        y, qx = lora_fused.forward(x2, qw, L1, L2, beta, c["forward.x"], seed_x, bdt, x.dtype)
        qx = nvfp4.NVFP4Tensor(*qx, x2.shape, (1, 16))
    else:
        qx = nvfp4.quantize_as(x2, c["forward.x"], seed_x, name="activation X")  # Q1x16(X)
        y = nvfp4.nvfp4_matmul(qx, qw, out_dtype=torch.float32)  # (T, out)
        y = (y + beta * _branch(x2, L1, L2, bdt)).to(x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1]), qx, qw


@nvfp4.without_autocast
def lora_backward(dy, qx, qw, L1, L2, beta, c, need):
    """eq. 1's dX = Q1x16(dY) Q16x16(W_res) + beta (dY L2) L1 (the forward's qw reused) and eq.
    2's dW (fp32) from the forward's qx; need: (dX, dW) wanted. -> (dX (..., in) in dY's dtype or
    None, dW (out, in) or None)."""
    lead, dy, bdt = dy.shape[:-1], dy.reshape(-1, dy.shape[-1]), branch_dtype()  # (T, out)
    seed_dx, H, seeds_dw = nvfp4.backward_draws(c, *need, dy.device)
    if nvfp4.use_kernels(dy):
        dx, dw = lora_fused.backward(dy, qx, qw, L1, L2, beta, c, need, seed_dx, H, seeds_dw, bdt)
    else:
        dx = dw = None
        # eq. 1's dX, the forward's Q16x16(W_res) reused (read transposed, not requantized)
        if need[0]:
            q_dy = nvfp4.quantize_as(dy, c["dgrad.dy"], seed_dx,
                                     name="gradient dY")  # Q1x16(dY)
            dx = nvfp4.nvfp4_matmul(q_dy, qw, out_dtype=torch.float32, trans_b=True)  # (T, in)
            dx = (dx + beta * _branch(dy, L2.t(), L1.t(), bdt)).to(dy.dtype)
        if need[1]:
            dw = nvfp4.wgrad(dy, qx, c, H, seeds_dw)  # eq. 2, (out, in) fp32
    return (dx.reshape(*lead, -1) if dx is not None else None), dw


class LoRASVDFunction(torch.autograd.Function):
    """Eager's autograd of eqs. 1-2: lora_forward, lora_backward. Inputs x (..., in), weight_res
    (out, in), L1 (r, in), L2 (out, r). Returns y (..., out).

    The residual path is NVFP4Linear's (nvfp4._NVFP4LinearFn): the same contract (nvfp4.LINEAR), the
    packed Q1x16(X) and Q16x16(W_res) saved for backward, nvfp4.wgrad for eq. 2, the same random
    draws (nvfp4.backward_draws). Saved besides: L1, L2; neither X nor X L1^T, since dX needs only
    dY, W_res, L1, L2 and the LoRA gradients come from dW (App. 8). Gradients returned: dX, dW for
    weight_res, and zeros for L1 and L2. The zeros keep every parameter "used" for DDP (no
    find_unused_parameters) and give project_gradients a grad to add into; the true dL1, dL2 come
    from project_gradients (eqs. 3-4).
    """

    @staticmethod
    def forward(ctx, x, weight_res, L1, L2, beta, four_over_six):
        c = nvfp4.linear_contract(four_over_six)
        y, ctx.qx, ctx.qw = lora_forward(x, weight_res, L1, L2, beta, c)
        ctx.beta, ctx.c = beta, c
        ctx.save_for_backward(L1, L2)
        return y

    @staticmethod
    def backward(ctx, dy):
        L1, L2 = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dw = lora_backward(dy, ctx.qx, ctx.qw, L1, L2, ctx.beta, ctx.c, need[:2])
        ctx.qx = ctx.qw = None
        return dx, dw, _zeros(L1, need[2]), _zeros(L2, need[3]), None, None


def _zeros(L, needed):
    """The L1 / L2 gradient the backward returns: zeros (LoRASVDFunction says why)."""
    return torch.zeros_like(L) if needed else None


@torch.library.custom_op(
    "nanofp4::lora_svd", mutates_args=(),
    schema="(Tensor x, Tensor weight_res, Tensor L1, Tensor L2, float beta, "
           "bool four_over_six) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def _lora_op(x, weight_res, L1, L2, beta, four_over_six):
    """lora_forward as a custom op (LINEAR and BRANCH read when it runs) -> (Y, then the packed
    Q1x16(X) and Q16x16(W_res) as codes, scales, global scale each)."""
    y, qx, qw = lora_forward(x, weight_res, L1, L2, beta, nvfp4.linear_contract(four_over_six))
    return y, qx.codes, qx.scales, qx.global_scale, qw.codes, qw.scales, qw.global_scale


@torch.library.custom_op(
    "nanofp4::lora_svd_backward", mutates_args=(),
    schema="(Tensor dy, Tensor x_codes, Tensor x_scales, Tensor x_scale, Tensor w_codes, "
           "Tensor w_scales, Tensor w_scale, Tensor L1, Tensor L2, float beta, "
           "bool four_over_six, bool need_dx, bool need_dw) -> (Tensor, Tensor)")
def _lora_backward_op(dy, x_codes, x_scales, x_scale, w_codes, w_scales, w_scale, L1, L2, beta,
                      four_over_six, need_dx, need_dw):
    """lora_backward as a custom op -> (dX, dW), an empty tensor where not needed."""
    qx = nvfp4.packed(x_codes, x_scales, x_scale, (1, 16))
    qw = nvfp4.packed(w_codes, w_scales, w_scale, (16, 16))
    dx, dw = lora_backward(dy, qx, qw, L1, L2, beta, nvfp4.linear_contract(four_over_six),
                           (need_dx, need_dw))
    return nvfp4.empty_if_none(dx, dy), nvfp4.empty_if_none(dw, dy)


@_lora_op.register_fake
def _(x, weight_res, L1, L2, beta, four_over_six):
    (K, N), e4m3 = (x.shape[-1], weight_res.shape[0]), torch.float8_e4m3fn
    T = x.numel() // K
    shapes = [((*x.shape[:-1], N), x.dtype), ((T, K // 2), torch.uint8), ((T, K // 16), e4m3),
              ((), torch.float32), ((N, K // 2), torch.uint8), ((N // 16, K // 16), e4m3),
              ((), torch.float32)]
    return tuple(x.new_empty(s, dtype=d) for s, d in shapes)


@_lora_backward_op.register_fake
def _(dy, x_codes, x_scales, x_scale, w_codes, w_scales, w_scale, L1, L2, beta, four_over_six,
      need_dx, need_dw):
    N, K = dy.shape[-1], 2 * x_codes.shape[1]
    return (dy.new_empty((*dy.shape[:-1], K) if need_dx else (0,)),
            dy.new_empty((N, K), dtype=torch.float32) if need_dw else dy.new_empty(0))


def _lora_setup_context(ctx, inputs, output):
    x, weight_res, L1, L2, beta, four_over_six = inputs
    ctx.save_for_backward(*output[1:], L1, L2)
    ctx.beta, ctx.four_over_six = beta, four_over_six


def _lora_autograd(ctx, dy, *_):
    need, (L1, L2) = ctx.needs_input_grad, ctx.saved_tensors[-2:]
    dx, dw = _lora_backward_op(dy, *ctx.saved_tensors, ctx.beta, ctx.four_over_six, *need[:2])
    dx, dw = (dx if need[0] else None), (dw if need[1] else None)
    return dx, dw, _zeros(L1, need[2]), _zeros(L2, need[3]), None, None


torch.library.register_autograd("nanofp4::lora_svd", _lora_autograd,
                                setup_context=_lora_setup_context)


def lora_svd_linear(x, weight_res, L1, L2, beta=1.0, four_over_six=True):
    """Functional LoRASVDLinear (no bias): x (..., in) -> (..., out). Under autocast X is cast to
    the autocast dtype, as in nvfp4.nvfp4_linear."""
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    if torch.compiler.is_compiling():
        return _lora_op(x, weight_res, L1, L2, float(beta), four_over_six)[0]
    return LoRASVDFunction.apply(x, weight_res, L1, L2, float(beta), four_over_six)


# -----------------------------------------------------------------------------
# modules


class LoRASVDLinear(nn.Module):
    """A linear layer W = weight_res + beta * L2 @ L1 trained as in §3.2 (see the module
    docstring).

    Parameters: weight_res (out, in), L1 (rank, in), L2 (out, rank), optional bias; fp32 masters.
    `beta` is a plain float (a constructor argument, not in the state dict). Init: the dense W
    (`weight`, else nn.Linear's kaiming-uniform init) split by its exact top-r SVD. That SVD is
    O(out * in * min(out, in)): seconds per 2048-wide layer on a CPU, so build big models on the
    GPU. To re-initialize from another dense weight, call `layer.set_weight(W)`.
    """

    def __init__(self, in_features, out_features, rank, beta=1.0, bias=False, four_over_six=True,
                 weight=None, device=None):
        super().__init__()
        check_shape(rank, in_features, out_features)
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.beta, self.four_over_six = float(beta), four_over_six
        if weight is None:
            weight = torch.empty(out_features, in_features, device=device)
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's default
        device = weight.device
        self.weight_res = nn.Parameter(torch.empty(out_features, in_features, device=device))
        self.L1 = nn.Parameter(torch.empty(rank, in_features, device=device))
        self.L2 = nn.Parameter(torch.empty(out_features, rank, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        self.set_weight(weight)

    @classmethod
    def from_linear(cls, linear, rank, beta=1.0, four_over_six=True):
        layer = cls(linear.in_features, linear.out_features, rank, beta=beta,
                    bias=linear.bias is not None, four_over_six=four_over_six,
                    weight=linear.weight.detach())
        if linear.bias is not None:
            with torch.no_grad():
                layer.bias.copy_(linear.bias.float())
        return layer

    @torch.no_grad()
    def set_weight(self, W, svd=None):
        """(W_res, L1, L2) from the dense W (out, in) and its top-r singular triplets `svd` =
        (U, S, Vh) (default: the exact SVD)."""
        if W.shape != self.weight_res.shape:
            raise ValueError(f"W has shape {tuple(W.shape)}, "
                             f"expected {tuple(self.weight_res.shape)}")
        U, S, Vh = top_r_svd(W, self.rank) if svd is None else svd
        W_res, L1, L2 = split_from_svd(W, U, S, Vh, self.beta)
        for p, full in ((self.weight_res, W_res), (self.L1, L1), (self.L2, L2)):
            p.copy_(shard_like(p, full))
        self._projected = None

    @torch.no_grad()
    def effective_weight(self):
        """W_res + beta L2 L1 in fp32 (out, in); the full matrix also when FSDP2 shards the
        parameters."""
        W_res, L1, L2 = (full_tensor(p).float() for p in (self.weight_res, self.L1, self.L2))
        return W_res + self.beta * (L2 @ L1)

    def forward(self, x):
        y = lora_svd_linear(x, self.weight_res, self.L1, self.L2, self.beta, self.four_over_six)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _mark_projected(self, grad):
        """project_gradients remembers the grad it projected; a backward that then adds a new dW
        into weight_res.grad makes the layer forget it (eqs. 3-4 needed again). The forgetting is a
        post-accumulate-grad hook on the parameter in use (FSDP2 swaps in its own and runs these
        hooks too): the autograd engine runs it outside any compiled graph, so the forward has no
        hook to trace."""
        p = self.weight_res
        if getattr(self, "_watched", lambda: None)() is not p:
            p.register_post_accumulate_grad_hook(lambda _: setattr(self, "_projected", None))
            self._watched = weakref.ref(p)
        self._projected = weakref.ref(grad)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, beta={self.beta}, bias={self.bias is not None}, "
                f"four_over_six={self.four_over_six}")


class NaiveLoRALinear(nn.Module):
    """Ablation baseline ("naive LoRA", Table 3): y = NVFP4Linear(x; weight) + (x L1^T) L2^T, the
    branch in BF16 (lora_svd.BRANCH) with ordinary autograd, so dL1, dL2 use the high-precision X it
    saves. Standard LoRA init: L1 like nn.Linear (kaiming-uniform, a=sqrt(5)), L2 = 0, so the layer
    starts equal to its main weight. The main weight is trained too; no SVD, projection or
    realignment."""

    def __init__(self, in_features, out_features, rank, four_over_six=True, bias=False):
        super().__init__()
        check_shape(rank, in_features, out_features)
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.four_over_six = four_over_six
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.L1 = nn.Parameter(torch.empty(rank, in_features))
        self.L2 = nn.Parameter(torch.zeros(out_features, rank))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        nn.init.kaiming_uniform_(self.L1, a=math.sqrt(5))

    @classmethod
    def from_linear(cls, linear, rank, four_over_six=True):
        layer = cls(linear.in_features, linear.out_features, rank, four_over_six=four_over_six,
                    bias=linear.bias is not None).to(linear.weight.device)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.float())
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.float())
        return layer

    def forward(self, x):
        y = nvfp4.nvfp4_linear(x, self.weight, self.four_over_six)
        y = y + _branch(x, self.L1, self.L2, branch_dtype()).to(y.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, bias={self.bias is not None}, "
                f"four_over_six={self.four_over_six}")


# -----------------------------------------------------------------------------
# eqs. 3-4: subspace projection of the accumulated gradient (run by the optimizer, once per step)

_warned_householder = False


def orthonormal_basis(A):
    """Cholesky-QR (eq. 3, App. 8): R = chol(A^T A)^T, Q = A R^-1 for a tall-thin A (d, r), or a
    batch of them (..., d, r) (project_all stacks the layers that share a shape). The r x r Gram
    matrix and the solve run in fp64 (negligible cost at r << d): Cholesky-QR's loss of
    orthogonality grows like eps * cond(A)^2, which fp32 reaches for cond(A) ~ 3e3 but fp64 only at
    ~1e8. Falls back to Householder QR (warning once) if a Gram matrix is not numerically positive
    definite or a Q comes out non-orthonormal."""
    global _warned_householder
    A64 = A.detach().double()
    L, info = torch.linalg.cholesky_ex(A64.mT @ A64)  # A^T A = L L^T, R = L^T
    Q = torch.linalg.solve_triangular(L.mT, A64, upper=True, left=False)  # (..., d, r) = A R^-1
    eye = torch.eye(A.shape[-1], dtype=torch.float64, device=A.device)
    ok = (info == 0).all() & torch.isfinite(Q).all() & ((Q.mT @ Q - eye).abs().max() < 1e-6)
    if ok:  # one device->host sync per call (per group of same-shaped layers in project_all)
        return Q.float()
    if not _warned_householder:
        warnings.warn("lora_svd: Cholesky-QR failed (L1 or L2 is rank deficient or ill "
                      "conditioned); using Householder QR for the subspace projection "
                      "(warned once)")
        _warned_householder = True
    Q, _ = torch.linalg.qr(A64)
    return Q.float()


@torch.no_grad()
def project_gradients(layer):
    """eqs. 3-4 on one LoRASVDLinear, in place, after all backward passes of a step (and after DDP's
    all-reduce: the projection is linear in dW, so projecting the averaged dW is the same as
    averaging the projections). Reads weight_res.grad = dW, writes
        weight_res.grad = dW - dW_LoRA,  L1.grad += beta L2^T dW_LoRA,
        L2.grad += beta dW_LoRA L1^T.
    Idempotent: a second call on the same gradient is skipped (and would find Lambda ~ 0 anyway), so
    both train.py (before gradient clipping) and the optimizer may call it. "The same gradient"
    survives in-place scaling (clip_grad_norm_: a scaled projected gradient is still projected, eqs.
    3-4 being linear in dW): the layer remembers the grad tensor it projected, and forgets it when a
    backward through the layer adds a new dW (a hook on weight_res) or when the grad is replaced by
    another tensor. FSDP2 (DTensor parameters and grads, sharded): gathers dW, L1, L2 (every rank
    computes the same projection) and updates the local shards. Simple, at the cost of one
    all-gather of dW per layer per step; a sharded Cholesky-QR (all-reduce the r x r Gram matrices
    and Lambda) would avoid it."""
    _project_layers([layer])


def _needs_projection(layer):
    g = layer.weight_res.grad
    # weakref to the grad tensor projected last, None after a backward
    done = getattr(layer, "_projected", None)
    return g is not None and not (done is not None and done() is g)


def _project(layer, L1, L2, Q1, Q2):
    """eqs. 3-4 given the bases Q1 (in, r) of span(L1^T) and Q2 (out, r) of span(L2)."""
    g = layer.weight_res.grad
    dW = full_tensor(g).float()
    lam = (Q2.t() @ dW) @ Q1  # (r, r) Lambda
    core = lam @ Q1.t()  # (r, in): dW_LoRA = Q2 @ core, never formed for the small grads below
    dL1 = layer.beta * ((L2.t() @ Q2) @ core)  # (r, in)   = beta L2^T dW_LoRA
    dL2 = layer.beta * (Q2 @ (core @ L1.t()))  # (out, r)  = beta dW_LoRA L1^T
    for p, d in ((layer.L1, dL1), (layer.L2, dL2)):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.add_(shard_like(p.grad, d.to(p.grad.dtype)))
    if hasattr(g, "device_mesh"):
        g.sub_(shard_like(g, (Q2 @ core).to(g.dtype)))
    else:
        g.addmm_(Q2.to(g.dtype), core.to(g.dtype), alpha=-1.0)  # dW_res = dW - dW_LoRA, in place
    layer._mark_projected(g)


def lora_svd_layers(model):
    return [m for m in model.modules() if isinstance(m, LoRASVDLinear)]


@torch.no_grad()
def project_all(model):
    """project_gradients on every LoRASVDLinear of `model` (call once per optimizer step). Layers
    whose L1, L2 share shapes get their bases from one batched Cholesky-QR: a 28-layer model has ~7
    shapes, so ~14 small fp64 factorizations (and host syncs) per step instead of two per layer.
    Each layer gets the numbers of project_gradients alone (bit for bit on the CPU, tested; on CUDA
    the batched solver may differ in the last fp64 bits)."""
    _project_layers(lora_svd_layers(model))


def _project_layers(layers):
    """eqs. 3-4 on every layer that still needs it, the bases of same-shaped layers from one batched
    Cholesky-QR."""
    groups = {}
    for layer in layers:
        if _needs_projection(layer):
            L1, L2 = full_tensor(layer.L1).float(), full_tensor(layer.L2).float()
            groups.setdefault((L1.shape, L2.shape, L1.device), []).append((layer, L1, L2))
    for group in groups.values():
        Q1s = orthonormal_basis(torch.stack([L1.t() for _, L1, _ in group]))  # (n, in, r)
        Q2s = orthonormal_basis(torch.stack([L2 for _, _, L2 in group]))      # (n, out, r)
        for (layer, L1, L2), Q1, Q2 in zip(group, Q1s, Q2s):
            _project(layer, L1, L2, Q1, Q2)


# -----------------------------------------------------------------------------
# periodic realignment (§3.2): randomized SVD of the total weight


@torch.no_grad()
def realign(layer, oversample=10, power_iters=4, generator=None):
    """Re-split the total weight W = W_res + beta L2 L1 along its current top-r singular directions.
    The effective weight is preserved up to fp32 rounding (only its NVFP4 quantization in the
    forward changes, since a different part of W now goes through the residual). The sketch's
    generator defaults to a fixed seed: every DDP / FSDP rank (seeded differently by train.py) must
    compute the same split."""
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    W = layer.effective_weight()  # (out, in) fp32
    layer.set_weight(W, randomized_svd(W, layer.rank, oversample, power_iters, generator))


@torch.no_grad()
def realign_model(model, optimizer=None, oversample=10, power_iters=4, generator=None):
    """realign() every LoRASVDLinear and reset the optimizer state of weight_res, L1 and L2.

    Why reset rather than carry the state over: the new L1, L2 live in a new basis, so their old
    moments point in meaningless directions, and Adam's elementwise second moment cannot be rotated
    into a new basis; weight_res's old momentum contains components inside the new principal
    subspace, which eqs. 3-4 are meant to keep out of the residual. Zeroed moments re-warm within
    ~1/(1 - beta2) steps, a small cost every 4k steps. Works with the optimizers of optim.py (their
    `reset_state(param)`) and with plain torch.optim ones (deleting optimizer.state[p] makes them
    re-initialize the state, Adam's step counter included)."""
    layers = lora_svd_layers(model)
    for layer in layers:
        realign(layer, oversample, power_iters, generator)
        if optimizer is None:
            continue
        for p in (layer.weight_res, layer.L1, layer.L2):
            if hasattr(optimizer, "reset_state"):
                optimizer.reset_state(p)
            else:
                optimizer.state.pop(p, None)
                if p in optimizer.state:  # e.g. a wrapper whose .state is a fresh merged dict
                    raise ValueError(f"realign_model: could not reset the optimizer state of "
                                     f"{tuple(p.shape)} params: give {type(optimizer).__name__} "
                                     "a reset_state(param) method")
    return len(layers)


# -----------------------------------------------------------------------------
# Fig. 3: output error of LoRA-SVD vs direct NVFP4


@torch.no_grad()
def lora_svd_error(W, X, rank, beta=1.0, four_over_six=True):
    """Relative MSE (MSE(y - y_hat) / mean(y^2), §3.2) of a layer's forward output against the
    exact y = X W^T, for direct NVFP4 (Q(X) Q(W)^T) and for LoRA-SVD
    (Q(X) Q(W_res)^T + beta (X L1^T) L2^T), both RTN with 4/6. The branch runs in fp32 here, so
    this isolates the quantization error."""
    W, X = W.float(), X.float()
    y = X @ W.t()  # (T, out)
    qx = nvfp4.quantize(X, block=(1, 16), rounding="rtn", four_over_six=four_over_six)
    q = lambda w: nvfp4.quantize(w, block=(16, 16), rounding="rtn", four_over_six=four_over_six)
    y_direct = nvfp4.nvfp4_matmul(qx, q(W))
    U, S, Vh = top_r_svd(W, rank)
    W_res, L1, L2 = split_from_svd(W, U, S, Vh, beta)
    y_lora = nvfp4.nvfp4_matmul(qx, q(W_res)) + beta * ((X @ L1.t()) @ L2.t())
    e_direct, e_lora = nvfp4.relative_mse(y, y_direct), nvfp4.relative_mse(y, y_lora)
    return {"nvfp4": e_direct, "lora_svd": e_lora, "reduction": 1.0 - e_lora / e_direct}
