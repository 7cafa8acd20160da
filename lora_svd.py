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

On CUDA the branch rides on the NVFP4 GEMMs (App. 9, kernels/nvfp4_linear.py): r extra columns of
the residual's bf16 grid-value GEMM, so Y and dX are written once. The seam is nvfp4.use_kernels
(train.py --route). Parameters may be FSDP2 DTensors: projection and realignment gather them and write
back the local shards.

NaiveLoRALinear is the ablation baseline (Table 3, "naive LoRA"): an NVFP4 main weight plus an
ordinary BF16 LoRA branch trained by plain autograd.
"""

import math
import warnings

import torch
import torch.nn as nn

import nvfp4

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
# eqs. 1-2: the LoRA-SVD linear is the direct layer's op with the branch beside it


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


def lora_svd_linear(x, weight_res, L1, L2, beta=1.0, four_over_six=True, cache=None):
    """Functional LoRASVDLinear (no bias): x (..., in) -> (..., out), eq. 1's
        Y  = Q1x16(X) Q16x16(W_res)^T + beta (X L1^T) L2^T
        dX = Q1x16(dY) Q16x16(W_res) + beta (dY L2) L1,  dW = eq. 2's wgrad (fp32)
    as nvfp4.nvfp4_linear computes them (nvfp4.linear_forward / linear_backward: the direct layer's
    three GEMMs, the branch in BRANCH added before Y's and dX's one rounding; on CUDA the branch
    rides the residual's GEMM, kernels/nvfp4_linear.py). L1 and L2 get no gradient here; their
    true ones come from project_gradients (eqs. 3-4): App. 8 takes them from dW instead of from a
    second large GEMM with the high-precision X, which is why neither X nor X L1^T is saved. Under
    autocast X is cast to the autocast dtype."""
    return nvfp4.nvfp4_linear(x, weight_res, four_over_six, L1, L2, beta, branch_dtype(), cache,
                              sum_dx=True)


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
        self.weight_cache = nvfp4.WeightCache()
        self.set_weight(weight)

    def quantized_weight(self):
        return self.weight_cache.get(self.weight_res, self.L1, self.L2, self.four_over_six)

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

    @torch.no_grad()
    def effective_weight(self):
        """W_res + beta L2 L1 in fp32 (out, in); the full matrix also when FSDP2 shards the
        parameters."""
        W_res, L1, L2 = (full_tensor(p).float() for p in (self.weight_res, self.L1, self.L2))
        return W_res + self.beta * (L2 @ L1)

    def forward(self, x):
        y = lora_svd_linear(x, self.weight_res, self.L1, self.L2, self.beta, self.four_over_six,
                            self.weight_cache)
        return y if self.bias is None else y + self.bias.to(y.dtype)

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
        self.weight_cache = nvfp4.WeightCache()

    def quantized_weight(self):
        return self.weight_cache.get(self.weight, None, None, self.four_over_six)

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
        y = nvfp4.nvfp4_linear(x, self.weight, self.four_over_six, cache=self.weight_cache)
        y = y + nvfp4.low_rank(x, self.L1, self.L2, branch_dtype()).to(y.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, bias={self.bias is not None}, "
                f"four_over_six={self.four_over_six}")


# -----------------------------------------------------------------------------
# eqs. 3-4: subspace projection of the accumulated gradient (once per optimizer step)

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
    Once per step: train.py calls project_all before clipping, so the clipped norm is that of the
    gradients applied. FSDP2 (DTensor parameters and grads, sharded): gathers dW, L1, L2 (every rank
    computes the same projection) and updates the local shards. Simple, at the cost of one
    all-gather of dW per layer per step; a sharded Cholesky-QR (all-reduce the r x r Gram matrices
    and Lambda) would avoid it."""
    _project_layers([layer])


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
    """eqs. 3-4 on every layer with a gradient, the bases of same-shaped layers from one batched
    Cholesky-QR."""
    groups = {}
    for layer in layers:
        if layer.weight_res.grad is not None:
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
