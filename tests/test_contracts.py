"""The precision contracts: nvfp4.LINEAR (eqs. 1-2), lora_svd.BRANCH (eq. 1's branch),
optim.CONTRACT (§3.3-3.4); attention.POLICIES is tested the same way in test_attention.py
(test_triton_equals_reference).

0. The shipped tables are the paper's choices and the documented ones of docs/nvfp4_format.md and
   docs/optim.md, written out literally below (not read from the modules): a changed default is
   red here.

1. Every kernel route, run in Triton's interpreter on a CPU (NANOFP4_ROUTE=kernels), equals the
   reference function on fresh seeded inputs with the same random draws: for the default table and
   for a changed entry per operation. A change to the reference alone, or a kernel that ignores an
   entry, turns one of these red.
2. The reference is Transformer Engine's NVFP4 arithmetic bit for bit (RTN, 1x16 and 16x16), written
   here from TE's published formulas (its PyTorch reference quantizer, NVFP4QuantizerRef), including
   grid ties, block maxima on E4M3 ties, subnormal block scales and all-zero blocks.
"""

import dataclasses
import warnings

import pytest
import torch

import attention
import lora_svd
import nvfp4
import optim

DEFAULT_LINEAR, DEFAULT_CONTRACT = dict(nvfp4.LINEAR), dict(optim.CONTRACT)  # the tables as shipped
# --------------------------------------------------------------------------------------------------
# the shipped tables, stated once

Q = nvfp4.Quant
SHIPPED = {
    "nvfp4.LINEAR": {
        "forward.x": Q((1, 16), "rtn"),              # eq. 1: activations 1x16, RTN (the forward)
        "forward.w": Q((16, 16), "rtn"),             # eq. 1: weights 16x16 (W^T reused for dX), RTN
        "dgrad.dy": Q((1, 16), "sr"),                # eq. 1's dX: gradients 1x16, SR
        "wgrad.dy": Q((16, 1), "sr", "random"),      # eq. 2: 16x1 along tokens after a random
        "wgrad.x": Q((16, 1), "sr", "random"),       # Hadamard, SR, both operands
    },
    "lora_svd.BRANCH": "bf16",                       # §3.2: the rank-r branch in BF16
    "attention.POLICIES": {                          # §3.5, Table 2; Fig. 5's variants; App. 13
        "bf16": dict(qkv=False, ds=False, p=False, dov=False, pdo=False),
        "fp4": dict(qkv=True, ds=True, p=False, dov=False, pdo=False),
        "fp4_pv": dict(qkv=True, ds=True, p=True, dov=False, pdo=False),
        "fp4_dov": dict(qkv=True, ds=True, p=False, dov=True, pdo=False),
        "fp4_all": dict(qkv=True, ds=True, p=True, dov=True, pdo=True),
    },
    "optim.CONTRACT": {
        # §3.3: m H16 -> NVFP4 with SR and 4/6; v's pipeline the same encoding (SR: our choice)
        "adamw.m": Q((1, 16), "sr", "fixed", four_over_six=True),
        "adamw.v": Q((1, 16), "sr", "fixed", four_over_six=True),
        "adamw.v.tile": 128,                         # ours (the paper gives no tile)
        "adamw.v.floor": 0.25,                       # ours
        # ours, by measurement (docs/optim.md): two RTN levels, not AdamW's one SR level
        "root.momentum": Q((1, 16), "rtn", "fixed", four_over_six=True),
        "root.momentum.levels": 2,
        "newton_schulz": Q((1, 16), "rtn", "random", four_over_six=True),  # §3.4: RTN + 4/6 + H
    },
}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_the_shipped_tables_are_the_stated_choices(name):
    module, table = name.split(".")
    shipped = getattr({"nvfp4": nvfp4, "lora_svd": lora_svd, "attention": attention,
                       "optim": optim}[module], table)
    stated = SHIPPED[name]
    if isinstance(stated, dict):
        assert set(shipped) == set(stated), (name, sorted(set(shipped) ^ set(stated)))
        wrong = {k: (shipped[k], stated[k]) for k in stated if shipped[k] != stated[k]}
        assert not wrong, (name, "shipped vs stated", wrong)
    else:
        assert shipped == stated, (name, shipped, stated)


# --------------------------------------------------------------------------------------------------
# helpers


def both_routes(monkeypatch, fn, seed=7):
    """fn() on the reference route, then on the kernel route, each from the same global RNG state
    (so both draw the same SR seeds and Hadamard signs)."""
    out = []
    for route in ("reference", "kernels"):
        monkeypatch.setenv("NANOFP4_ROUTE", route)
        torch.manual_seed(seed)
        out.append(fn())
    return out


def set_entries(monkeypatch, table, **changes):
    """Change contract entries as a fork would (dataclasses.replace on an nvfp4.Quant, or a new
    value)."""
    for name, change in changes.items():
        value = dataclasses.replace(table[name], **change) if isinstance(change, dict) else change
        monkeypatch.setitem(table, name.replace("__", "."), value)


def on_grid(shape, gen, scale=8):
    """Random values k / scale with |k| <= 127 (exact in bf16): 16-term Hadamard sums of them are
    exact in fp32 in any order, so the kernels' butterfly and the reference's matmul rotate to the
    same bits."""
    return (torch.randint(-127, 128, shape, generator=gen).float() / scale).bfloat16()


def close(a, b, rel=1e-6):
    """Equal up to summation order: max error within rel of the result's largest entry."""
    err = (a.double() - b.double()).abs().max().item()
    assert err <= rel * b.double().abs().max().item(), (err, b.double().abs().max().item())


# --------------------------------------------------------------------------------------------------
# eqs. 1-2: the NVFP4 linear layer

SR_UP = dict(rounding="sr_up")
RTN = dict(rounding="rtn")
LINEAR_CHANGES = {
    "default": {},
    "dgrad RTN": {"dgrad.dy": RTN},
    "wgrad RTN": {"wgrad.dy": RTN, "wgrad.x": RTN},
    "wgrad without Hadamard": {"wgrad.dy": dict(hadamard="none"), "wgrad.x": dict(hadamard="none")},
    "gradients sr_up": {"dgrad.dy": SR_UP, "wgrad.dy": SR_UP, "wgrad.x": SR_UP},
    "forward SR, W without 4/6": {"forward.x": dict(rounding="sr"),
                                  "forward.w": dict(four_over_six=False)},
}


def linear_step(layer, x, dy):
    x = x.clone().requires_grad_()
    layer.weight.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("change", list(LINEAR_CHANGES))
def test_linear_kernel_route_equals_the_reference(change, monkeypatch):
    for name, c in LINEAR_CHANGES[change].items():
        set_entries(monkeypatch, nvfp4.LINEAR, **{name: c})
    g = torch.Generator().manual_seed(list(LINEAR_CHANGES).index(change))
    layer = nvfp4.NVFP4Linear(48, 32, four_over_six=True)
    x, dy = on_grid((64, 48), g), on_grid((64, 32), g, scale=64)
    ref, ker = both_routes(monkeypatch, lambda: linear_step(layer, x, dy))
    for name, r, k in zip(("Y", "dX", "dW"), ref, ker):
        assert r.dtype == k.dtype, name
        close(k, r)
    if change != "default":  # the change is real: the reference computes other numbers with it
        monkeypatch.setattr(nvfp4, "LINEAR", dict(DEFAULT_LINEAR))
        monkeypatch.setenv("NANOFP4_ROUTE", "reference")
        torch.manual_seed(7)
        default = linear_step(layer, x, dy)
        assert any(not torch.equal(d, r) for d, r in zip(default, ref))


def test_linear_contract_refuses_what_eqs_1_2_forbid(monkeypatch):
    layer, x = nvfp4.NVFP4Linear(32, 16), torch.randn(16, 32)
    set_entries(monkeypatch, nvfp4.LINEAR, **{"forward.w": dict(block=(1, 16))})
    with pytest.raises(ValueError, match=r"LINEAR\['forward.w'\].block must be \(16, 16\)"):
        layer(x)
    monkeypatch.setitem(nvfp4.LINEAR, "forward.w", nvfp4.Quant((16, 16), "rtn"))
    set_entries(monkeypatch, nvfp4.LINEAR, **{"wgrad.x": dict(hadamard="none")})
    with pytest.raises(ValueError, match="same hadamard"):
        layer(x)
    with pytest.raises(ValueError, match="rounding one of"):
        nvfp4.Quant((1, 16), "nearest")


# --------------------------------------------------------------------------------------------------
# eq. 1 with the LoRA-SVD branch

def lora_step(layer, x, dy):
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight_res.grad


@pytest.mark.parametrize("change", ["default", "dgrad RTN", "wgrad RTN"])
def test_lora_svd_kernel_route_equals_the_reference(change, monkeypatch):
    for name, c in LINEAR_CHANGES[change].items():
        set_entries(monkeypatch, nvfp4.LINEAR, **{name: c})
    g = torch.Generator().manual_seed(11)
    torch.manual_seed(3)
    layer = lora_svd.LoRASVDLinear(48, 32, rank=8, beta=0.5)
    x, dy = on_grid((64, 48), g), on_grid((64, 32), g, scale=64)
    (y_r, dx_r, dw_r), (y_k, dx_k, dw_k) = both_routes(monkeypatch, lambda: lora_step(layer, x, dy))
    close(dw_k, dw_r)  # eq. 2: the same quantizations
    # bf16 outputs; the branch's bf16 intermediate is rounded after the scaling on the kernels: a
    # few bf16 roundings apart (a different quantization of X or dY would be ~10% apart)
    close(y_k, y_r, rel=2**-6)
    close(dx_k, dx_r, rel=2**-6)


def test_lora_svd_kernels_refuse_another_branch_precision(monkeypatch):
    monkeypatch.setattr(lora_svd, "BRANCH", "fp32")
    layer = lora_svd.LoRASVDLinear(32, 16, rank=4)
    monkeypatch.setenv("NANOFP4_ROUTE", "kernels")
    with pytest.raises(ValueError, match="fused branch runs in bf16"):
        layer(torch.randn(16, 32))


# --------------------------------------------------------------------------------------------------
# §3.3-3.4: the optimizer states and Root

STATE = optim.CONTRACT["adamw.m"]
OPTIM_CHANGES = {
    "default": {},
    "v RTN": {"adamw.v": dataclasses.replace(STATE, rounding="rtn")},
    "m RTN, v sr_up": {"adamw.m": dataclasses.replace(STATE, rounding="rtn"),
                       "adamw.v": dataclasses.replace(STATE, rounding="sr_up")},
    "floor 1/8": {"adamw.v.floor": 1 / 8},
    "v tile 64": {"adamw.v.tile": 64},
}


def adamw_steps(states="nvfp4", steps=3):
    g = torch.Generator().manual_seed(5)
    p = torch.nn.Parameter(torch.randn(48, 256, generator=g))
    opt = optim.QuantizedAdamW([p], lr=1e-2, states=states)
    for _ in range(steps):
        p.grad = torch.randn(48, 256, generator=g) * torch.exp(torch.randn(48, 1, generator=g))
        opt.step()
    return p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}


@pytest.mark.parametrize("change", list(OPTIM_CHANGES))
def test_quantized_adamw_fused_kernel_equals_the_reference(change, monkeypatch):
    for name, value in OPTIM_CHANGES[change].items():
        monkeypatch.setitem(optim.CONTRACT, name, value)
    (p_r, st_r), (p_k, st_k) = both_routes(monkeypatch, adamw_steps)
    assert torch.equal(p_k, p_r)
    for key in st_r:
        a, b = st_r[key], st_k[key]
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), key
    if change != "default":  # the change is real
        monkeypatch.setattr(optim, "CONTRACT", dict(DEFAULT_CONTRACT))
        monkeypatch.setenv("NANOFP4_ROUTE", "reference")
        torch.manual_seed(7)
        assert not torch.equal(adamw_steps()[0], p_r)


def test_fused_adamw_falls_back_to_the_reference_where_it_cannot_honour_the_contract(monkeypatch):
    monkeypatch.setitem(optim.CONTRACT, "adamw.m", dataclasses.replace(STATE, hadamard="none"))
    monkeypatch.setenv("NANOFP4_ROUTE", "reference")
    torch.manual_seed(7)
    p_r, _ = adamw_steps()
    monkeypatch.setenv("NANOFP4_ROUTE", "kernels")
    torch.manual_seed(7)
    with pytest.warns(UserWarning,
                      match="fused kernel implements adamw.m / adamw.v with hadamard 'fixed'"):
        p_k, _ = adamw_steps()
    assert torch.equal(p_k, p_r)


def root_steps(steps=2):
    g = torch.Generator().manual_seed(9)
    p = torch.nn.Parameter(torch.randn(64, 128, generator=g) * 0.02)
    opt = optim.Root([p], lr=1e-2, states="nvfp4")
    for _ in range(steps):
        p.grad = torch.randn(64, 128, generator=g)
        opt.step()
    return p.detach().clone(), opt


@pytest.mark.parametrize("change", ["default", "momentum fp32", "newton_schulz fp32"])
def test_root_kernel_route_equals_the_reference(change, monkeypatch):
    if change != "default":
        monkeypatch.setitem(optim.CONTRACT,
                            change.split()[0].replace("momentum", "root.momentum"), "fp32")
    (p_r, opt_r), (p_k, opt_k) = both_routes(monkeypatch, root_steps)
    close(p_k, p_r, rel=1e-5)  # NS's GEMMs: the same quantizations, summation order apart
    st = opt_r.state[opt_r.param_groups[0]["params"][0]]
    assert ("momentum_buffer" in st) == (change == "momentum fp32")
    assert opt_r.quantized == (change != "newton_schulz fp32")


def test_optim_contract_refuses_what_the_states_cannot_store(monkeypatch):
    monkeypatch.setitem(optim.CONTRACT, "adamw.v", nvfp4.Quant((16, 1), "sr"))
    with pytest.raises(ValueError, match=r"CONTRACT\['adamw.v'\]"):
        optim.encode_second_moment(torch.rand(32, 64))
    monkeypatch.setitem(optim.CONTRACT, "adamw.m", "int8")
    with pytest.raises(ValueError, match=r"CONTRACT\['adamw.m'\]"):
        optim.encode_first_moment(torch.randn(32, 64))


def test_fp32_adamw_states_by_contract(monkeypatch):
    """CONTRACT["adamw.m"] (or "adamw.v") = "fp32": QuantizedAdamW keeps both moments in fp32,
    exactly torch.optim.AdamW's update (the ablation's "NVFP4 Root momentum only" row)."""
    monkeypatch.setitem(optim.CONTRACT, "adamw.v", "fp32")
    p, state = adamw_steps()
    assert "exp_avg" in state and "m.codes" not in state


# --------------------------------------------------------------------------------------------------
# Transformer Engine's arithmetic, bit for bit

FLT_MAX = torch.finfo(torch.float32).max


def te_cast_to_e2m1(x):
    """E2M1 codes of clipped values x in [-6, 6] by Transformer Engine's interval table
    (its cast_to_fp4x2): ties go to the even code, -0.0 to code 0, a negative value that rounds to
    zero to code 8."""
    a, neg = x.abs(), x < 0
    idx = torch.zeros_like(x, dtype=torch.int64)
    # the bounds between codes; at a bound TE's intervals go up where the upper code is even
    for b, tie_up in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                      (3.5, True), (5.0, False)):
        idx += ((a > b) | ((a == b) & tie_up)).long()
    return (idx | (neg.long() << 3)).to(torch.uint8)


def te_quantize(x, tile):
    """(codes, block scales, S_dec) of x (m, n) as Transformer Engine's NVFP4 reference quantizer
    computes them (NVFP4QuantizerRef._quantize_blockwise_reference, 448-bound, no 4/6), written from
    its formulas."""
    x = x.float()
    m, n = x.shape
    if tile == (16, 16):
        blocks = x.abs().reshape(m // 16, 16, n // 16, 16).amax((1, 3))
        vec_max = blocks.repeat_interleave(16, 0).unsqueeze(-1)            # (m, n/16, 1)
    else:
        vec_max = x.abs().reshape(m, n // 16, 16).amax(-1, keepdim=True)
    amax = x.abs().amax()
    s_enc = torch.minimum(torch.div(torch.tensor(448.0 * 6.0), amax), torch.tensor(FLT_MAX))
    s_enc = torch.where(s_enc == 0, torch.tensor(1.0), s_enc)
    s_dec = torch.div(torch.tensor(1.0), s_enc)
    decode = vec_max * (s_enc * torch.reciprocal(torch.tensor(6.0)))
    decode = (torch.minimum(decode, torch.tensor(FLT_MAX)).clamp(-448.0, 448.0)
              .to(torch.float8_e4m3fn))
    encode = torch.minimum(torch.div(torch.tensor(1.0), decode.float() * s_dec),
                           torch.tensor(FLT_MAX))
    scaled = (x.reshape(m, n // 16, 16) * encode).clamp(-6.0, 6.0).reshape(m, n)
    scales = decode.squeeze(-1)
    if tile == (16, 16):
        scales = scales[::16]
    return te_cast_to_e2m1(scaled), scales, s_dec


def e4m3_tie_block_maxima(s_enc, count, gen):
    """count fp32 block maxima b with fp32(b * (S_enc * RN(1/6))) exactly halfway between two E4M3
    values."""
    mult = s_enc * torch.reciprocal(torch.tensor(6.0))
    # positive finite values
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    mids = mids[torch.randint(0, len(mids), (4 * count,), generator=gen)]
    found = []
    for t in mids:
        b = (t / mult).float()
        for _ in range(8):  # the neighbours of t / mult: one of them usually lands on t exactly
            if (b * mult).item() == t.item():
                found.append(b)
                break
            b = torch.nextafter(b, torch.tensor(float("inf")) if (b * mult) < t
                                else torch.tensor(0.0))
        if len(found) == count:
            break
    return torch.stack(found)


def hard_input(tile, gen):
    """(64, 128) fp32: Gaussian blocks, blocks whose max sits on an E4M3 tie, grid ties
    (0.25, 0.75, ... of the block's step), a block of subnormal scale, an all-zero block and signed
    zeros."""
    x = torch.randn(64, 128, generator=gen)
    x[0, 0] = 8.0                                                          # the global amax
    s_enc = torch.div(torch.tensor(448.0 * 6.0), torch.tensor(8.0))
    ties = e4m3_tie_block_maxima(s_enc, 48, gen)
    rows, cols = (16, 16) if tile == (16, 16) else (1, 16)
    for i, b in enumerate(ties):  # block maxima on E4M3 ties
        r, c = (16 + rows * (i // 8)) % 64, 16 * (i % 8)
        blk = x[r:r + rows, c:c + 16]
        blk.mul_(0.9 * b / blk.abs().max())
        blk[(7 * i) % rows, i % 16] = b * (1 if i % 2 else -1)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[48, 0:16] = torch.cat([mids, -mids]) * (8.0 / 6.0)  # scale 448 * S_dec: grid ties
    x[49, 16:32] *= 1e-5  # a subnormal block scale
    x[50, 32:48] = 0.0                                                      # an all-zero block
    x[51, 48:64] = torch.tensor([-0.0, 0.0] * 8)  # signed zeros (and the block is zero)
    x[52, 64:80] = torch.tensor([1e-30, -1e-30] * 8)  # rounds to zero, keeps its sign
    x[52, 64] = 0.5
    return x


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
@pytest.mark.parametrize("kind", ["hard", "gaussian", "heavy-tailed bf16"])
def test_rtn_equals_transformer_engine_bit_for_bit(tile, kind):
    gen = torch.Generator().manual_seed(3 + (tile == (16, 16)))
    if kind == "hard":
        x = hard_input(tile, gen)
    elif kind == "gaussian":
        x = torch.randn(64, 128, generator=gen)
    else:
        x = (torch.randn(64, 128, generator=gen)
             * torch.exp(2 * torch.randn(64, 128, generator=gen))).bfloat16()
    codes, scales, s_dec = te_quantize(x, tile)
    for t in (nvfp4.quantize_reference(x, tile), nvfp4.quantize(x, tile)):
        assert torch.equal(t.scales.view(torch.uint8), scales.view(torch.uint8))
        assert torch.equal(t.unpack_codes(), codes)
        assert torch.equal(t.global_scale, s_dec)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_gpu_rtn_equals_transformer_engine_on_the_tie_blocks(tile):
    """On the GPU the block scales are the hardware's E4M3 conversion (kernels/nvfp4_math.HW_E4M3):
    the same codes and scales as TE on every E4M3-tie block maximum, grid tie and subnormal
    scale. Rows and tile kernels (an fp32 input, a bf16 one, a transposed view)."""
    x = hard_input(tile, torch.Generator().manual_seed(3 + (tile == (16, 16))))
    for xs in (x, x.bfloat16().float()):
        codes, scales, s_dec = te_quantize(xs, tile)
        # contiguous (rows / tile kernel) and a transposed view (the strided tile kernel)
        for xg in (xs.cuda(), xs.t().contiguous().cuda().t()):
            t = nvfp4.quantize(xg, tile)
            assert torch.equal(t.scales.view(torch.uint8).cpu(), scales.view(torch.uint8))
            assert torch.equal(t.unpack_codes().cpu(), codes)
            assert torch.equal(t.global_scale.cpu(), s_dec)


def test_the_tie_inputs_tell_te_from_the_division_by_the_global_scale():
    """The hard input separates the two arithmetics: the previous
    s_b = e4m3(amax_b / 6 / s_g), s_g = amax / 2688, differs from TE's on the tie blocks
    (so the test above can fail)."""
    x = hard_input((1, 16), torch.Generator().manual_seed(3))
    _, scales, _ = te_quantize(x, (1, 16))
    s_g = x.abs().amax() / torch.tensor(2688.0)
    block_amax = x.abs().reshape(64, 8, 16).amax(-1)
    divided = nvfp4.to_e4m3(block_amax / torch.tensor(6.0) / s_g)
    differ = (divided.view(torch.uint8) != scales.view(torch.uint8)).sum().item()
    assert differ >= 10, differ


def test_all_zero_tensor_encodes_to_zeros_with_unit_scales():
    """TE saturates S_enc at FLT_MAX for an all-zero tensor; nvfp4 uses 1 (docs/nvfp4_format.md).
    Codes, block scales and values agree; only the stored global scale differs."""
    for tile in ((1, 16), (16, 16)):
        t = nvfp4.quantize(torch.zeros(32, 64), tile)
        assert t.global_scale.item() == 1.0 and not t.codes.any() and not t.scales.float().any()
        assert not t.dequantize().any()


def test_train_numerics_flag_changes_one_entry_and_refuses_bad_ones(monkeypatch, capsys):
    """train.py --numerics KEY=VALUE: the ablation's rows change contract entries, not code
    paths."""
    import train
    monkeypatch.setattr(nvfp4, "LINEAR", dict(DEFAULT_LINEAR))
    monkeypatch.setattr(optim, "CONTRACT", dict(DEFAULT_CONTRACT))
    monkeypatch.setattr(lora_svd, "BRANCH", lora_svd.BRANCH)
    for spec in ("linear.wgrad.dy.rounding=rtn", "linear.forward.w.four_over_six=false",
                 "optim.root.momentum=fp32", "optim.adamw.v.floor=1/8", "lora.branch=fp32"):
        train.set_numerics(spec)
    assert nvfp4.LINEAR["wgrad.dy"] == nvfp4.Quant((16, 1), "rtn", "random")
    assert nvfp4.LINEAR["forward.w"].four_over_six is False
    assert optim.CONTRACT["root.momentum"] == "fp32" and optim.CONTRACT["adamw.v.floor"] == 0.125
    assert lora_svd.BRANCH == "fp32"
    for bad in ("linear.foo.rounding=rtn", "linear.dgrad.dy.rounding=nearest",
                "optim.adamw.v.tile=big", "optim.root.momentum.rounding=rtn", "nothing"):
        with pytest.raises(SystemExit) as e:
            train.set_numerics(bad)
        assert e.value.code == 2
        assert capsys.readouterr().err.count("\n") == 1  # one line
