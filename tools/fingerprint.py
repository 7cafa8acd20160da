"""
The bits of the FP4 layers, one hash per part: run it in two trees (a worktree of the commit before
a refactor, and after) on the same machine, and equal lines say the refactor moved no bit.

    python tools/fingerprint.py                    # the route in force (kernels on a GPU)
    python tools/fingerprint.py --route reference  # the PyTorch reference
    (cd ../old_tree && python tools/fingerprint.py) | diff - <(python tools/fingerprint.py)

Each part runs from fixed seeds a forward and a backward (the loss: the output's sum of squares)
and hashes the output, the input's gradient and every parameter's gradient: NVFP4Linear (fp32 and
under bf16 autocast, with and without 4/6), LoRASVDLinear, FP4 attention under each policy (k and v
distinct, and one tensor as both), and one micro-step of the `tiny` fullstack GPT.
"""

import argparse
import hashlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(b"none" if t is None else t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def grads(module):
    """Every parameter's gradient; one autograd gives none (LoRA-SVD's L1, L2: project_gradients
    writes theirs) as the zeros the optimizer's zero_grad leaves, which older trees returned."""
    import torch
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in module.parameters()]


def parts(device):
    """(name, tensors) of each part, in a fixed order."""
    import torch

    import attention
    import lora_svd
    import nvfp4
    from model import GPT, RECIPES, config_from_name

    def run(module, x, fn=None, autocast=False):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = (fn or module)(x)
        y.float().square().sum().backward()
        return [y, x.grad] + grads(module)

    T, n_in, n_out = 64, 128, 64
    layers = {"NVFP4Linear": lambda: nvfp4.NVFP4Linear(n_in, n_out),
              "NVFP4Linear 4/6": lambda: nvfp4.NVFP4Linear(n_in, n_out, four_over_six=True),
              "LoRASVDLinear r16": lambda: lora_svd.LoRASVDLinear(n_in, n_out, 16)}
    for name, make in layers.items():
        for autocast in (False, True):
            torch.manual_seed(0)  # each part from its own seed: a diff names the part that moved
            with torch.device(device):
                module, x = make(), torch.randn(T, n_in, requires_grad=True)
            yield f"{name} {'bf16 autocast' if autocast else 'fp32'}", run(module, x,
                                                                           autocast=autocast)
    for policy in attention.POLICIES:
        torch.manual_seed(0)
        with torch.device(device):
            q = torch.randn(2, 4, 128, 64, dtype=torch.bfloat16, requires_grad=True)
            k, v = (torch.randn(2, 2, 128, 64, dtype=torch.bfloat16, requires_grad=True)
                    for _ in "kv")
        o = attention.attention(q, k, v, policy=policy)
        o.float().square().sum().backward()
        yield f"attention {policy}", [o, q.grad, k.grad, v.grad]
        q.grad = k.grad = None
        torch.manual_seed(1)
        o = attention.attention(q, k, k, policy=policy)
        o.float().square().sum().backward()
        yield f"attention {policy}, k as v", [o, q.grad, k.grad]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config_from_name("tiny", recipe=RECIPES["fullstack"]))
        idx = torch.randint(0, model.cfg.vocab_size, (2, 128))
    with torch.autocast(device, dtype=torch.bfloat16):
        _, loss = model(idx, torch.roll(idx, -1, dims=1))
    loss.backward()
    yield "GPT tiny fullstack micro-step", [loss] + grads(model)


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--route", choices=("auto", "reference", "kernels"), default=None,
                   help="nvfp4's route (default: NANOFP4_ROUTE, else auto)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = p.parse_args()
    if args.route:
        os.environ["NANOFP4_ROUTE"] = args.route
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # (nothing newer than the trees it compares: an older tree's modules must run it too)
    print(f"# NANOFP4_ROUTE={os.environ.get('NANOFP4_ROUTE', 'auto')}, {device}, torch "
          f"{torch.__version__}")
    for name, tensors in parts(device):
        print(f"{digest(tensors)}  {name}")


if __name__ == "__main__":
    main()
