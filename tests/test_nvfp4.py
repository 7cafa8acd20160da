"""The NVFP4 reference (nvfp4.py): grid, scales, packing, rounding, 4/6, edge cases, RHT, NVFP4Linear."""
import dataclasses
import math

import pytest
import torch

import nvfp4
from nvfp4 import E2M1_VALUES, NVFP4Tensor, quantize
from oracles import transposed

BLOCKS = [(1, 16), (16, 1), (16, 16)]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def unit_scale(values):
    """A (2, 16*k) tensor whose row 0 holds 2688 = 448*6 (so s_g = 1) and row 1 the test values with a block max
    of 6 (so s_b = 1): the scaled values are the values themselves."""
    row1 = torch.tensor(values, dtype=torch.float32)
    row0 = torch.zeros_like(row1)
    row0[0] = 448 * 6
    return torch.stack([row0, row1])


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("four_over_six", [False, True])
def test_values_on_grid_and_scales_follow_the_convention(block, four_over_six):
    x = randn(3, 64, 96, seed=1) * torch.logspace(-3, 2, 96)  # blocks of very different magnitude
    t = quantize(x, block, four_over_six=four_over_six)
    bm, bn = block
    assert t.codes.dtype == torch.uint8 and t.codes.shape == (3, 64, 48)
    assert t.scales.dtype == torch.float8_e4m3fn and t.scales.shape == (3, 64 // bm, 96 // bn)
    s_g = x.abs().amax() / ((256 if four_over_six else 448) * 6)
    assert torch.equal(t.global_scale, s_g.float())
    # every element is an E2M1 value times its block scale times the global scale
    s = t.scales.float().repeat_interleave(bm, -2).repeat_interleave(bn, -1)
    assert torch.equal(t.dequantize(), t.grid_values() * s_g)
    q = (t.grid_values() / s)[s > 0]
    assert torch.isin(q.abs(), E2M1_VALUES).all()
    # block scale = e4m3(block_amax / 6 / s_g) (or / 4 with 4/6)
    amax = x.reshape(3, 64 // bm, bm, 96 // bn, bn).abs().amax((-3, -1))
    s6 = nvfp4.to_e4m3(amax / 6 / s_g).float()
    if four_over_six:
        s4 = nvfp4.to_e4m3(amax / 4 / s_g).float()
        assert ((t.scales.float() == s6) | (t.scales.float() == s4)).all()
        if block != (16, 16):  # with 256 elements per block the max->6 candidate almost always wins
            assert (t.scales.float() == s4).any() and (t.scales.float() == s6).any()
    else:
        assert torch.equal(t.scales.float(), s6)
    # RTN error is at most half the widest grid step (2 -> 1 * scale), plus the clamp at 6 when a normal E4M3
    # scale rounded down (relative step 2^-3); subnormal scales are coarser and are not bounded here
    err = (t.dequantize() - x).abs()
    normal = s >= 2**-6
    assert (err <= s * s_g + x.abs() * 2**-3)[normal].all()


def test_packing_even_element_in_low_nibble():
    x = unit_scale([0.5, -1.0, 6.0, -6.0] + [0.0] * 12)
    t = quantize(x)
    assert t.codes[1, 0].item() == (1 | ((8 | 2) << 4))  # 0.5 -> code 1 low, -1.0 -> code 0b1010 high
    assert t.codes[1, 1].item() == (7 | ((8 | 7) << 4))
    assert torch.equal(t.unpack_codes()[1, :4], torch.tensor([1, 10, 7, 15], dtype=torch.uint8))


def test_round_to_nearest_ties_to_even():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    x = unit_scale(mids + [-m for m in mids])
    got = quantize(x).dequantize()[1]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert got.tolist() == want + [-w for w in want]
    # just off the midpoints it is plain nearest
    eps = 1e-3
    got = quantize(unit_scale([m + eps for m in mids[:7]] + [m - eps for m in mids[:7]] + [6.0, 6.0])).dequantize()[1]
    assert got.tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0]


def test_values_beyond_six_after_scale_rounding_saturate():
    # block max 6.4 with s_g = 1: s_b = e4m3(6.4/6) = 1.0625 -> 6.4/1.0625 = 6.02 must clamp to 6, not overflow
    t = quantize(unit_scale([6.4] + [1.0] * 15))
    assert t.dequantize()[1, 0].item() == pytest.approx(6 * t.scales[1, 0].float().item())


@pytest.mark.parametrize("block", [(1, 16), (16, 1)])
def test_sr_clamps_block_maxima_and_sr_up_does_not(block):
    """"sr" (Transformer Engine's SR): when a block's E4M3 scale rounds down, its max lands above 6 and is clamped,
    so the SR mean of the block maxima falls short of x (measured: -1.2% on average, up to -6%). "sr_up" rounds the
    block scale up: nothing clamps and the maxima are unbiased, for a coarser grid (a larger error per draw)."""
    x = randn(64, 256, seed=4)
    bm, bn = block
    xb = x.abs().reshape(64 // bm, bm, 256 // bn, bn)
    is_max = (xb == xb.amax(dim=(1, 3), keepdim=True)).reshape(x.shape)
    n, bias, err = 100, {}, {}
    for mode in ("sr", "sr_up"):
        g = torch.Generator().manual_seed(1)
        draws = [quantize(x, block, mode, generator=g).dequantize() for _ in range(n)]
        mean = torch.stack(draws).double().mean(0)
        bias[mode] = ((mean - x.double()) / x.double())[is_max].mean().item()
        err[mode] = sum(nvfp4.relative_mse(x, d) for d in draws) / n
        s_b = quantize(x, block, mode).scales.float().repeat_interleave(bm, 0).repeat_interleave(bn, 1)
        inv = nvfp4.element_scale(s_b, nvfp4.global_scales(x.abs().amax())[1])
        clamped = (x.abs() * inv > 6)[is_max].float().mean().item()
        assert (clamped > 0.3) if mode == "sr" else (clamped == 0)
    assert bias["sr"] < -0.006 and abs(bias["sr_up"]) < 0.002, bias
    assert err["sr"] < err["sr_up"] < 1.5 * err["sr"], err


def test_stochastic_rounding_is_unbiased_and_reproducible():
    x = randn(16, 256, seed=2)
    g = torch.Generator().manual_seed(0)
    n = 400
    draws = torch.stack([quantize(x, rounding="sr", generator=g).dequantize() for _ in range(n)])
    mean, std = draws.mean(0), draws.std(0)
    # z-scores of the mean across draws: unbiased means |z| is O(1); RTN's bias would give z in the tens
    z = (mean - x) / (std / math.sqrt(n)).clamp(min=1e-12)
    moving = std > 0
    assert z[moving].abs().mean() < 1.0 and z[moving].abs().max() < 6
    rtn_bias = (quantize(x).dequantize() - x).abs().mean()
    assert (mean - x).abs().mean() < rtn_bias / 5
    # values exactly on the grid never move
    grid = quantize(x).dequantize()
    assert torch.equal(quantize(grid, rounding="sr", generator=g).dequantize(), grid)
    a = quantize(x, rounding="sr", generator=torch.Generator().manual_seed(7))
    b = quantize(x, rounding="sr", generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.float(), b.scales.float())


def test_four_over_six_never_worse_per_block():
    x = randn(64, 256, seed=3) ** 3  # heavy tails: blocks where 4 wins and blocks where 6 wins
    t46 = quantize(x, four_over_six=True)
    # the max->6 candidate under the same (256-bound) global scale
    s_enc, s_dec = nvfp4.global_scales(x.abs().amax(), True)
    xb = x.reshape(64, 16, 16)
    s6 = nvfp4.block_scale(xb.abs().amax(-1, keepdim=True), s_enc).float()
    a6 = (xb.abs() * nvfp4.element_scale(s6, s_dec)).clamp(max=6)
    q6 = E2M1_VALUES[nvfp4.rtn_e2m1(a6).long()] * s6 * s_dec * xb.sign()
    err6 = (q6 - xb).pow(2).sum(-1)
    err46 = (t46.dequantize().reshape(64, 16, 16) - xb).pow(2).sum(-1)
    assert (err46 <= err6 * (1 + 1e-6)).all()
    assert (err46 < err6).float().mean() > 0.1  # and it does pick 4 often on such data
    assert nvfp4.relative_mse(x, t46.dequantize()) < nvfp4.relative_mse(x, quantize(x).dequantize())


def test_zeros_subnormal_scales_and_huge_values():
    z = torch.zeros(16, 32)
    t = quantize(z)
    assert t.global_scale.item() == 1.0 and (t.codes == 0).all() and (t.scales.float() == 0).all()
    assert torch.equal(t.dequantize(), z)
    x = randn(2, 32, seed=4)
    x[0, :16] = 0.0                               # an all-zero block inside a non-zero tensor
    x[1, :16] *= 1e-5                             # a block far below the tensor's max: subnormal E4M3 scale
    t = quantize(x)
    assert t.scales[0, 0].float() == 0 and not torch.isnan(t.dequantize()).any()
    assert 0 < t.scales[1, 0].float() < 2**-6     # kept subnormal (Transformer Engine), not lifted to 2^-6
    assert (t.dequantize()[0, :16] == 0).all()
    big = randn(16, 32, seed=5) * 1e37
    assert nvfp4.relative_mse(big, quantize(big).dequantize()) < 0.02


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"shape \(4, 24\).*block \(1, 16\)"):
        quantize(torch.randn(4, 24))
    with pytest.raises(ValueError, match="block"):
        quantize(torch.randn(8, 32), block=(16, 16))
    with pytest.raises(ValueError, match="last two dims"):
        quantize(torch.randn(32))
    with pytest.raises(ValueError, match=r"multiples of \(16, 2\)"):  # two codes a byte
        quantize(torch.randn(16, 3), block=(16, 1))
    bad = torch.randn(4, 32)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"grad.*non-finite"):
        quantize(bad, name="grad")
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(bad)
    with pytest.raises(ValueError, match="rounding"):
        quantize(torch.randn(4, 32), rounding="nearest")
    with pytest.raises(ValueError, match="multiples of 16"):
        nvfp4.NVFP4Linear(24, 32)


def test_matmul_applies_the_global_scales_once_after_the_block_products():
    """As a native NVFP4 GEMM: the products of grid values (E2M1 x E4M3) accumulate unscaled and
    s_g(A) s_g(B) multiplies the sum once. With K = 16, one block of each operand, that sum is
    exact in fp32, so each output is it times fl(s_g(A) s_g(B)), rounded once."""
    torch.manual_seed(0)
    a = quantize(torch.randn(32, 16) * 3, (1, 16))
    b = quantize(torch.randn(48, 16) / 7, (16, 16))
    exact = a.grid_values().double() @ b.grid_values().double().t()
    scale = (a.global_scale * b.global_scale).double()
    assert torch.equal(nvfp4.nvfp4_matmul(a, b), (exact * scale).float())


def test_bf16_input_and_grid_values_exact_in_bf16():
    x = randn(32, 64, seed=6).bfloat16()
    t = quantize(x, (16, 16))
    g = t.grid_values()
    assert torch.equal(g.bfloat16().float(), g)  # q * s_b has at most 6 significant bits
    assert torch.equal(t.dequantize(), quantize(x.float(), (16, 16)).dequantize())


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_transpose_is_exact(block):
    x = randn(48, 32, seed=7)
    t = quantize(x, block)
    assert torch.equal(transposed(t).dequantize(), t.dequantize().t())
    assert transposed(t).block == block[::-1]
    assert torch.equal(transposed(transposed(t)).codes, t.codes)


def test_hadamard_is_orthogonal_random_and_blockwise():
    g = torch.Generator().manual_seed(0)
    H = nvfp4.random_hadamard(g)
    assert torch.allclose(H @ H.t(), torch.eye(16), atol=1e-6)
    assert torch.equal(H.abs(), torch.full((16, 16), 0.25))
    assert not torch.equal(H, nvfp4.random_hadamard(g))
    x = randn(32, 48, seed=8)
    y = nvfp4.hadamard_transform(x, H, dim=-1)
    assert torch.allclose(y[:, 16:32], x[:, 16:32] @ H, atol=1e-6)
    assert torch.allclose(nvfp4.hadamard_transform(y, H.t(), dim=-1), x, atol=1e-5)
    assert torch.allclose(nvfp4.hadamard_transform(x, H, dim=0)[:16], H.t() @ x[:16], atol=1e-6)
    assert torch.allclose(y.norm(), x.norm())
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.hadamard_transform(torch.randn(4, 20), H)


def test_matmul_matches_dequantized_product():
    a, b = quantize(randn(48, 64, seed=10)), quantize(randn(32, 64, seed=11), (16, 16))
    ref = a.dequantize() @ b.dequantize().t()
    assert torch.allclose(nvfp4.nvfp4_matmul(a, b), ref, rtol=1e-5, atol=1e-5)
    # operands stored transposed are read as such: a^T (64, 48) blocked 16x1, b^T (64, 32) blocked 16x16
    at, bt = quantize(randn(64, 48, seed=10), (16, 1)), transposed(b)
    assert torch.allclose(nvfp4.nvfp4_matmul(at, bt, trans_a=True, trans_b=True), at.dequantize().t() @ b.dequantize().t(),
                          rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="blocked along K"):
        nvfp4.nvfp4_matmul(a, quantize(randn(32, 64), (16, 1)))


def test_linear_forward_is_the_quantized_product_and_saves_packed_x():
    torch.manual_seed(0)
    layer = nvfp4.NVFP4Linear(64, 48)
    x = randn(2, 16, 64, seed=12, ).requires_grad_()
    y = layer(x)
    want = nvfp4.fake_quantize(x.detach()) @ nvfp4.fake_quantize(layer.weight.detach(), (16, 16)).t()
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)
    saved = nvfp4.packed(*y.grad_fn.saved_tensors[:3], (1, 16))   # Q1x16(X), then W's three tensors
    assert saved.shape == (32, 64) and saved.codes.dtype == torch.uint8
    assert saved.nbytes < x.numel() * 4 / 7  # 0.5625 byte/element + the global scale vs 4 bytes


@pytest.mark.parametrize("sr", ["sr", "sr_up"])
def test_linear_backward_replays_eqs_1_2(sr, monkeypatch):
    for name in ("dgrad.dy", "wgrad.dy", "wgrad.x"):  # the gradients' SR mode, as a fork sets it
        monkeypatch.setitem(nvfp4.LINEAR, name, dataclasses.replace(nvfp4.LINEAR[name], rounding=sr))
    torch.manual_seed(0)
    layer = nvfp4.NVFP4Linear(64, 32, four_over_six=True)
    x = randn(32, 64, seed=13).requires_grad_()
    dy = randn(32, 32, seed=14)
    y = layer(x)
    torch.manual_seed(123)
    y.backward(dy)
    # the same computation written out with the same RNG draws, in the order the backward makes them
    torch.manual_seed(123)
    seed_dx, H, seed_dy, seed_x = nvfp4.sr_seed(), nvfp4.random_hadamard(), nvfp4.sr_seed(), nvfp4.sr_seed()
    W = nvfp4.quantize(layer.weight.detach(), (16, 16), four_over_six=True)
    dx = nvfp4.quantize(dy, rounding=sr, four_over_six=True, seed=seed_dx).dequantize() @ W.dequantize()
    xq = nvfp4.fake_quantize(x.detach(), four_over_six=True)
    Hbig = torch.block_diag(*[H] * 2)  # H_16^r on every 16 tokens
    q = lambda t, seed: nvfp4.quantize(t, (16, 1), sr, True, seed=seed).dequantize()
    a = q(Hbig.t() @ dy, seed_dy).t()                                                     # Q1x16(dY^T H)
    b = q(Hbig.t() @ xq, seed_x)                                                          # Q16x1(H^T Q(X))
    assert torch.allclose(x.grad, dx, rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer.weight.grad, a @ b, rtol=1e-4, atol=1e-4)


def test_linear_gradients_are_unbiased_estimates_of_the_straight_through_gradients():
    """E[dX] = dY Q(W) and E[dW] = dY^T Q(X): SR is unbiased and H H^T = I (eq. 2), so averaging many backward
    passes converges to autograd's gradient of the fake-quantized forward."""
    torch.manual_seed(1)
    layer = nvfp4.NVFP4Linear(32, 16)
    x = randn(32, 32, seed=15).requires_grad_()
    dy = randn(32, 16, seed=16)
    xf = x.detach().clone().requires_grad_()
    wf = layer.weight.detach().clone().requires_grad_()
    (nvfp4.fake_quantize(xf) @ nvfp4.fake_quantize(wf, (16, 16)).t()).backward(dy)  # straight-through
    # torch's fake_quantize path has no autograd through rounding; STE grads are dy @ Wq and dy^T Xq:
    ste_dx = dy @ nvfp4.fake_quantize(layer.weight.detach(), (16, 16))
    ste_dw = dy.t() @ nvfp4.fake_quantize(x.detach())
    n = 300
    dxs, dws = torch.zeros_like(ste_dx), torch.zeros_like(ste_dw)
    for _ in range(n):
        x.grad = layer.weight.grad = None
        layer(x).backward(dy)
        dxs += x.grad / n
        dws += layer.weight.grad / n
    one_dw = layer.weight.grad
    assert nvfp4.relative_mse(ste_dw, dws) < nvfp4.relative_mse(ste_dw, one_dw) / 30
    assert nvfp4.relative_mse(ste_dx, dxs) < 2e-4
    assert nvfp4.relative_mse(ste_dw, dws) < 5e-4


def test_linear_under_bf16_autocast_and_bad_token_count():
    layer = nvfp4.NVFP4Linear(32, 16)
    x = randn(16, 32, seed=17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    x = randn(10, 32, seed=18).requires_grad_()
    with pytest.raises(ValueError, match="multiple of 16"):
        layer(x).sum().backward()


@pytest.mark.parametrize("route,device", [("reference", "cpu"), ("kernels", "cpu"),
                                          pytest.param("kernels", "cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("lora", [False, True])
def test_weight_cache_quantizes_w_once_while_it_stands_and_keeps_the_bits(route, device, lora,
                                                                         monkeypatch):
    # an optimizer step's micro-steps reuse one Q16x16(W) (nvfp4.WeightCache); a change of W in
    # place (as the optimizer makes it) quantizes it again. Y and every gradient: the bits of the
    # uncached call, before and after the change
    import lora_svd
    monkeypatch.setenv("NANOFP4_ROUTE", route)
    calls, quantized_weight = [], nvfp4.quantized_weight
    monkeypatch.setattr(nvfp4, "quantized_weight", lambda *a: calls.append(1) or quantized_weight(*a))
    torch.manual_seed(0)
    layer = (lora_svd.LoRASVDLinear(64, 32, 8, device=device) if lora else
             nvfp4.NVFP4Linear(64, 32, four_over_six=True, device=device))
    params = dict(layer.named_parameters())
    uncached = (lambda x: lora_svd.lora_svd_linear(x, *params.values(), layer.beta)) if lora else \
        (lambda x: nvfp4.nvfp4_linear(x, layer.weight, True))

    def fwd_bwd(fn, seed):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)).to(device)
        x.requires_grad_()
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(seed)  # the backward's SR and Hadamard draws
        y = fn(x)
        y.float().square().sum().backward()
        return [y, x.grad] + [p.grad for p in params.values()]

    # after each step one parameter changes in place (W, then L1, then L2: LoRA-SVD's branch rides
    # W's GEMM operand on the Hopper kernels, so a change of L1 or L2 alone quantizes again)
    for step in range(len(params) + 1):
        for seed in (1, 2):  # two micro-steps
            want = fwd_bwd(uncached, seed)
            n = len(calls)
            got = fwd_bwd(layer, seed)
            assert len(calls) == n + (seed == 1), (step, seed)  # quantized on the first only
            for a, b in zip(got, want):
                assert (a is b is None) or torch.equal(a, b)
        with torch.no_grad():  # the optimizer's step
            p = list(params.values())[step % len(params)]
            p.add_(0.01 * torch.randn_like(p))


def test_an_sr_weight_is_drawn_afresh_each_call(monkeypatch):
    # the cache keeps RTN weights only: under an SR forward.w every call draws new bits
    monkeypatch.setitem(nvfp4.LINEAR, "forward.w", nvfp4.Quant((16, 16), "sr"))
    torch.manual_seed(0)
    layer = nvfp4.NVFP4Linear(64, 32)
    x = randn(32, 64, seed=19)
    with torch.no_grad():
        assert not torch.equal(layer(x), layer(x))


@pytest.mark.parametrize("route", ["reference", "kernels"])
def test_refresh_weights_rewrites_the_cache_where_a_cuda_graph_reads_it(route, monkeypatch):
    # --cuda_graphs captures a forward that reads each layer's cached W_hat by address, and
    # train.GraphedMicroStep calls refresh_weights before each replay: after W changes, the cache
    # holds the new quantization in the same memory
    import lora_svd
    monkeypatch.setenv("NANOFP4_ROUTE", route)
    torch.manual_seed(0)
    model = torch.nn.Sequential(nvfp4.NVFP4Linear(64, 64, four_over_six=True),
                                lora_svd.LoRASVDLinear(64, 32, 8))
    model(torch.randn(16, 64))
    before = [[t.data_ptr() for t in m.weight_cache.tensors] for m in model]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    nvfp4.refresh_weights(model)
    for m, ptrs in zip(model, before):
        assert [t.data_ptr() for t in m.weight_cache.tensors] == ptrs
        L = (m.L1, m.L2) if isinstance(m, lora_svd.LoRASVDLinear) else (None, None)
        w = m.weight_res if L[0] is not None else m.weight
        fresh = nvfp4.quantized_weight(w, *L, m.four_over_six)
        (N, K), r = w.shape, 0 if L[0] is None else L[0].shape[0]
        for a, b in zip(m.weight_cache.tensors, fresh):
            if r and a.shape == (N + r, K + r):  # [W_hat | L2 ; L1 | unused]: the parts read
                a, b = (torch.cat((t[:N].flatten(), t[N:, :K].flatten())) for t in (a, b))
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_weight_cache_sees_the_fused_optimizer_step(device, monkeypatch):
    # QuantizedAdamW's fused kernel writes W behind torch's back (kernels/optim_fused.py): it bumps
    # W's version counter, so the next forward quantizes the new W (the uncached call's Y)
    import optim
    monkeypatch.setenv("NANOFP4_ROUTE", "kernels")
    torch.manual_seed(0)
    layer = nvfp4.NVFP4Linear(128, 64, four_over_six=True, device=device)
    opt = optim.QuantizedAdamW(layer.parameters(), lr=0.1)
    x = torch.randn(32, 128, device=device)
    layer(x).float().square().sum().backward()
    opt.step()
    assert opt._fused(layer.weight) and "m.codes" in opt.state[layer.weight]  # the kernel ran
    assert torch.equal(layer(x), nvfp4.nvfp4_linear(x, layer.weight, True))


@pytest.mark.parametrize("kind", ["nvfp4", "lora_svd"])
@pytest.mark.parametrize("route,device", [("reference", "cpu"), ("kernels", "cpu"),
                                          pytest.param("kernels", "cuda", marks=pytest.mark.gpu)])
def test_layers_reading_one_input_share_its_cast_and_quantization(kind, route, device,
                                                                  monkeypatch):
    # q, k and v read one normalized x, fp32 under autocast: it is cast to bf16 once, not once a
    # layer (on the kernels by one pass that also takes the copy's amax: no amax pass of its own),
    # and its copy quantized once (one quantize pass on the kernels, each LoRA-SVD layer writing
    # its own branch columns into the shared operand); Y and dX are the bits
    # of three separate casts (each layer's dX goes back to fp32 and autograd adds the three as it
    # added the casts'), and the three layers save one packed X
    from torch.utils._python_dispatch import TorchDispatchMode

    import lora_svd
    from kernels import nvfp4_quant

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func).startswith("aten._to_copy") and out.dtype == torch.bfloat16 \
                    and out.shape == x0.shape:
                self.n += 1
            return out

    monkeypatch.setenv("NANOFP4_ROUTE", route)
    made, quantized_input = [], nvfp4.quantized_input
    monkeypatch.setattr(nvfp4, "quantized_input", lambda x, *a: made.append("X") or
                        quantized_input(x, *a))
    global_amax = nvfp4_quant._global_amax  # X's amax pass (bf16), not W's (fp32)
    monkeypatch.setattr(nvfp4_quant, "_global_amax", lambda x3, *a: made.append(
        getattr(x3, "dtype", None)) or global_amax(x3, *a))
    cast_bf16_amax = nvfp4_quant.cast_bf16_amax
    monkeypatch.setattr(nvfp4_quant, "cast_bf16_amax", lambda x: made.append("cast")
                        or cast_bf16_amax(x))
    torch.manual_seed(0)
    make = ((lambda: nvfp4.NVFP4Linear(64, 32, four_over_six=True, device=device))
            if kind == "nvfp4" else (lambda: lora_svd.LoRASVDLinear.from_linear(
                torch.nn.Linear(64, 32, bias=False, device=device), 8)))
    layers = [make() for _ in range(3)]
    x0 = torch.randn(32, 64, device=device)

    def run(shared):
        x = x0.clone().requires_grad_()
        torch.manual_seed(1)  # the backward's draws
        casts = Casts()
        casts.n = 0
        made.clear()
        with casts, torch.autocast(device, dtype=torch.bfloat16):
            ys = [layer(x if shared else x.to(torch.bfloat16)) for layer in layers]
        counts = casts.n, made.count("X"), made.count(torch.bfloat16), made.count("cast")
        saved = {y.grad_fn.saved_tensors[0].data_ptr() for y in ys}  # the packed X's codes
        sum(y.float().square().sum() for y in ys).backward()
        return counts, len(saved), ys, x.grad

    (n_shared, saved, ys, dx), (n_each, saved_each, want_ys, want_dx) = run(True), run(False)
    kernels = route == "kernels"  # torch's casts, quantizations, amax passes, cast + amax passes
    assert n_shared == ((0, 1, 0, 1) if kernels else (1, 1, 0, 0))
    assert n_each == (3, 3, 3 * kernels, 0)
    assert (saved, saved_each) == (1, 3)
    assert all(torch.equal(a, b) for a, b in zip(ys, want_ys)) and torch.equal(dx, want_dx)


@pytest.mark.parametrize("route", ["reference", "kernels"])
def test_an_input_changed_in_place_between_its_readers_is_quantized_again(route, monkeypatch):
    """The shared quantization is keyed by x's version counter: a layer that reads x after an
    in-place change multiplies the new x's quantization (as a fresh copy of it would), not the
    one the previous layer made."""
    monkeypatch.setenv("NANOFP4_ROUTE", route)
    torch.manual_seed(0)
    first, second = nvfp4.NVFP4Linear(64, 32), nvfp4.NVFP4Linear(64, 32)
    x = torch.randn(16, 64)
    first(x)
    x.add_(torch.randn(16, 64))
    assert torch.equal(second(x), second(x.clone()))


@pytest.mark.parametrize("route", ["reference", "kernels"])
def test_layers_that_quantize_one_input_differently_each_get_their_own(route, monkeypatch):
    """The shared cast is keyed by its dtype and the shared quantization by what makes it (4/6, a
    LoRA-SVD branch's columns), and an SR forward.x is drawn afresh by every reader: a layer that
    reads x after another one made these for other settings multiplies what a fresh copy of x gets."""
    import dataclasses

    import lora_svd
    monkeypatch.setenv("NANOFP4_ROUTE", route)
    torch.manual_seed(0)
    plain, four_six = nvfp4.NVFP4Linear(64, 32), nvfp4.NVFP4Linear(64, 32, four_over_six=True)
    branch = lora_svd.LoRASVDLinear.from_linear(torch.nn.Linear(64, 32, bias=False), 8)
    x = torch.randn(16, 64)
    for first, second in [(plain, four_six), (four_six, branch)]:
        first(x)
        assert torch.equal(second(x), second(x.clone()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x)
    with torch.autocast("cpu", dtype=torch.float16):
        y, want = plain(x), plain(x.clone())
    assert y.dtype == torch.float16 and torch.equal(y, want)
    sr = dataclasses.replace(nvfp4.LINEAR["forward.x"], rounding="sr")
    monkeypatch.setitem(nvfp4.LINEAR, "forward.x", sr)
    assert not torch.equal(plain(x), plain(x))


@pytest.mark.parametrize("kind", ["nvfp4", "lora_svd"])
@pytest.mark.parametrize("route,device", [("reference", "cpu"), ("kernels", "cpu"),
                                          pytest.param("kernels", "cuda", marks=pytest.mark.gpu)])
def test_layers_reading_one_input_sum_their_dx_in_place(kind, route, device, monkeypatch):
    # the layers reading one x: the first of a backward pass returns its dX, the others add theirs
    # into it (on the kernels in the GEMM's scale pass) and return none; x's gradient has the bits
    # of autograd's own sum of three returned dX, and again in a second backward of the same graph
    # (retain_graph: a new sum, not added to the first's). Where x also feeds another op, nothing
    # is lost (the sum in another order)
    import lora_svd
    monkeypatch.setenv("NANOFP4_ROUTE", route)
    returned, gradient_sum = [], nvfp4._GradientSum.returned
    monkeypatch.setattr(nvfp4._GradientSum, "returned",
                        lambda self, dx: returned.append(dx is not None) or gradient_sum(self, dx))
    torch.manual_seed(0)
    make = ((lambda: nvfp4.NVFP4Linear(64, 32, four_over_six=True, device=device))
            if kind == "nvfp4" else (lambda: lora_svd.LoRASVDLinear.from_linear(
                torch.nn.Linear(64, 32, bias=False, device=device), 8)))
    layers = [make() for _ in range(3)]
    x0, w = torch.randn(32, 64, device=device), torch.randn(32, 32, device=device)

    def run(also=False):
        x = x0.clone().requires_grad_()
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the backward's draws
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = sum((layer(x).float() * w).sum() for layer in layers)
        loss = loss + (x * 3).square().sum() if also else loss
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
        return first, x.grad, [p.grad.clone() for layer in layers for p in layer.parameters()
                               if p.grad is not None]

    got = run()
    assert returned == [True, False, False] * 2
    monkeypatch.setattr(nvfp4._SharedInput, "summing", lambda self, x: (x, None))
    want = run()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    assert not torch.equal(got[1], 2 * got[0])  # the second backward's draws are new
    monkeypatch.undo()
    monkeypatch.setenv("NANOFP4_ROUTE", route)
    assert torch.allclose(run(also=True)[0], want[0] + 18 * x0, rtol=1e-5, atol=1e-6)


def test_a_finished_backward_keeps_nothing_of_its_forward(monkeypatch):
    # the view the layers reading one x share (their in-place dX sum) is let go once a backward
    # reaches them: held on, it kept x and the whole autograd graph behind it alive, with the
    # parameters' gradient accumulators, which the next forward reused (a CUDA graph captured
    # after an eager step then failed: tests/test_graphs.py)
    import gc
    import weakref
    monkeypatch.setenv("NANOFP4_ROUTE", "reference")
    layers = [nvfp4.NVFP4Linear(64, 32) for _ in range(3)]

    def step():
        x = torch.randn(16, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sum(layer(x).float().sum() for layer in layers)
        loss.backward()
        return weakref.ref(x), x.grad

    x, dx = step()
    gc.collect()
    assert dx is not None and x() is None


def test_an_inference_mode_call_leaves_nothing_training_cannot_save(monkeypatch):
    # tensors made under torch.inference_mode have no version counter and cannot be saved for a
    # backward: neither the weight cache nor the shared autocast copy keeps one
    monkeypatch.setenv("NANOFP4_ROUTE", "reference")
    layer = nvfp4.NVFP4Linear(64, 32)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(16, 64))
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).float().sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_quantization_mse_grows_linearly_with_hidden_dim():
    rows = nvfp4.matmul_quant_error((256, 1024, 4096), tokens=64, out_features=64)
    growth = rows[-1]["mse"] / rows[0]["mse"]
    assert 12 < growth < 20  # 16x the contraction length -> ~16x the error (App. 7: Theta(N))
    assert rows[-1]["rel_mse"] < 2 * rows[0]["rel_mse"]


# --------------------------------------------------------------------------------------------------
# SR's random bits: the contract of nvfp4.sr_uniforms (16 bits per element, half a Philox word)

def _documented_uniforms(seed, shape, block):
    """sr_uniforms as its docstring states it, element by element: counter c, word k, half hh."""
    *lead, M, N = shape
    rows = math.prod(lead) * M
    if tuple(block) == (1, 16):
        i = torch.arange(rows * N)
        c, k, hh = i // 8, (i % 8) // 2, i % 2
    else:
        row, col = torch.meshgrid(torch.arange(rows), torch.arange(N), indexing="ij")
        row, col = row.flatten(), col.flatten()
        c, k, hh = (row // 8) * N + col, (row % 8) // 2, row % 2
    w = nvfp4.philox(seed, c).gather(0, k[None])[0]                 # word k of counter c
    return (((w >> (16 * hh)) & 0xFFFF).float() * 2.0**-16).reshape(shape)


@pytest.mark.parametrize("block", BLOCKS)
def test_sr_uniforms_are_the_documented_half_words(block):
    """Element i (1x16: of the flat tensor; 16x1, 16x16: row i over the flattened leading dims)
    draws half i % 2 (even: low) of word (i % 8) // 2 of Philox counter i // 8 (1x16) or
    (i // 8) * N + col: u = h * 2^-16. Every element has its own bits, and neighbours' draws are
    distinct and uncorrelated."""
    shape, seed = (2, 32, 48), 987654321
    u = nvfp4.sr_uniforms(seed, shape, block)
    assert torch.equal(u, _documented_uniforms(seed, shape, block))
    assert ((u * 2**16) == (u * 2**16).round()).all() and (u >= 0).all() and (u < 1).all()
    assert not torch.equal(u, nvfp4.sr_uniforms(seed + 1, shape, block))
    # the 8 neighbours along the block that share one Philox call
    along = u.reshape(-1, 48) if block == (1, 16) else u.transpose(-1, -2).reshape(-1, 64)
    for lag in range(1, 9):
        a, b = along[:, :-lag].flatten(), along[:, lag:].flatten()
        assert (a == b).sum() <= 2, lag        # ~3000 pairs of 16-bit draws: ~0.05 coincide
        assert abs(torch.corrcoef(torch.stack((a, b)))[0, 1].item()) < 0.1, lag


def _unit_scale_grid(block, values, shape=(32, 64)):
    """x of `shape` whose scaled values are x itself (s_g = 1 from one 2688 = 448 * 6; a 6 first in
    every other block, so s_b = 1), with the test `values` cycled over every other position;
    returns x and the mask of the test positions."""
    (M, N), (bm, bn) = shape, block
    firsts = ((torch.arange(M) % bm == 0)[:, None] & (torch.arange(N) % bn == 0)[None, :])
    x = torch.zeros(shape)
    x[firsts] = 6.0
    x[0, 0] = 448 * 6
    test = ~firsts
    test[:bm, :bn] = False                       # the block of 2688 has its own scale
    n = int(test.sum())
    x[test] = values.repeat(n // len(values) + 1)[:n]
    return x, test


def _sr_ups(x, block, test, seeds):
    """Per test position, how many of the seeds' SR draws rounded x up."""
    up = 0
    for seed in seeds:
        q = nvfp4.quantize_reference(x, block, "sr", False, seed).dequantize()
        up = up + (q[test] > x[test]).long()
    return up


@pytest.mark.parametrize("block", BLOCKS)
def test_sr_mean_over_seeds_is_unbiased_within_the_16_bit_bound(block):
    """What the contract promises: P(up) = ceil(d 2^16) 2^-16 for a fractional distance d, so
    over seeds SR's mean is within 2^-16 of a grid step of x (plus sampling error), also for d that
    are no multiple of 2^-16. And the 16-bit grid shows: d = 2^-20 rounds up 16 times as often as
    an exact SR would (2^-16 instead of 2^-20)."""
    lo = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0])
    gap = torch.tensor([0.5, 0.5, 0.5, 1.0, 2.0])
    d = torch.tensor([2.0**-20, 1 / 3, 0.5, 0.7, (12345 - 2.0**-4) * 2.0**-16, 0.999])
    x, test = _unit_scale_grid(block, (lo[:, None] + d[None, :] * gap[:, None]).flatten())
    vals, n_seeds = x[test], 300
    up = _sr_ups(x, block, test, range(n_seeds))
    g_lo = E2M1_VALUES[(vals[:, None] >= E2M1_VALUES[None, 1:]).sum(-1)].double()
    g_gap = torch.where(g_lo < 2, 0.5, torch.where(g_lo < 4, 1.0, 2.0)).double()
    frac = (vals.double() - g_lo) / g_gap                    # exact: fp32 a, power-of-two gaps
    p = torch.ceil(frac * 2**16) * 2.0**-16                  # the contract's P(up)
    assert ((p - frac >= 0) & (p - frac < 2.0**-16)).all()
    assert (frac * 2**16 != (frac * 2**16).round()).any()   # d off the 2^-16 grid among them
    for value in vals.unique():                              # pool the positions of one value
        at = vals == value
        n, k = at.sum().item() * n_seeds, up[at].sum().item()
        pv, fv = p[at][0].item(), frac[at][0].item()
        sampling = 6 * math.sqrt(pv * (1 - pv) / n) + 3 / n
        assert abs(k / n - fv) <= 2.0**-16 + sampling, (value.item(), k / n, fv)
    # the 2^-16 grid made visible: ~2^16 positions x 16 seeds of d = 2^-20 (a = 1 + 2^-21)
    x, test = _unit_scale_grid(block, torch.tensor([1 + 2.0**-21]), (256, 256))
    ups = int(_sr_ups(x, block, test, range(16)).sum())
    # ~15 expected (0.94 * 2^20 draws at 2^-16); an exact SR: ~1 (P(>= 4) < 2%)
    assert 4 <= ups <= 36, ups


def test_the_capability_table_routes_every_generation(monkeypatch):
    """kernels/targets.py: the reference below sm_80 (no bf16), bf16 grid values on Ampere to Hopper
    (integer E4M3 where the fp8 type is missing), the FP4 MMA on 10.x and 12.x (12.x's tiles), and
    nvfp4.use_kernels follows it on a CUDA tensor."""
    from kernels import nvfp4_gemm, targets
    # shared: the opt-in bytes a block may use, the CUDA guide's per-capability table (163, 99, 227 KB)
    want = {(7, 5): ("reference", False, None, 0), (8, 0): ("grid-values", False, None, 166912),
            (8, 6): ("grid-values", False, None, 101376), (8, 9): ("grid-values", True, None, 101376),
            (9, 0): ("grid-values", True, None, 232448), (10, 0): ("fp4-mma", True, "sm100", 232448),
            (10, 3): ("fp4-mma", True, "sm100", 232448), (12, 0): ("fp4-mma", True, "sm120", 101376),
            (12, 1): ("fp4-mma", True, "sm120", 101376)}
    for cap, row in want.items():
        t = targets.target(cap)
        assert (t.route, t.hw_e4m3, t.tiles, t.shared) == row, cap
    assert targets.target(None).route == "reference"
    # a minor takes its major's row at or below it; a major the table does not know, nothing it was
    # not built for (no FP4 MMA, the smallest shared memory)
    assert targets.target((8, 7))[1:] == targets.target((8, 6))[1:]
    for cap in ((11, 0), (13, 0)):
        assert targets.target(cap)[1:] == ("grid-values", True, 101376, None), cap
    x = torch.zeros(1, device="meta")  # stands in for a CUDA tensor: is_cuda is all use_kernels reads
    monkeypatch.setattr(type(x), "is_cuda", property(lambda self: True))
    monkeypatch.setenv("NANOFP4_ROUTE", "auto")
    for cap, (route, *_) in want.items():
        monkeypatch.setattr(targets, "capability", lambda device, cap=cap: cap)
        assert nvfp4.use_kernels(x) == (route != "reference"), cap
        assert nvfp4_gemm.use_dot_scaled(x.device) == (route == "fp4-mma"), cap


def test_sylvester_hadamard_is_its_definition():
    """H[i, j] = (-1)^popcount(i & j) exactly, in fp32, for every power of two up to 256 (16 is
    eq. 2's)."""
    for n in (1, 2, 4, 8, 16, 32, 256):
        want = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)])
        got = nvfp4.sylvester_hadamard(n)
        assert got.dtype == torch.float32 and torch.equal(got, want), n
