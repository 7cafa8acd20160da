"""
Bisect the illegal memory access of kernels/lora_fused.py's Triton route at the toy model's shapes (H200,
2026-11-29): every (GEMM config x shape x direction) runs in its own process with CUDA_LAUNCH_BLOCKING=1, so a
crash names its kernel and the others still run. Each case is compared with the cuBLAS route (same codes, same
seed: the two routes must agree to bf16 output rounding). The plain nvfp4_gemm with the same layout and config
runs beside it, to tell the epilogue from the main loop.

    python scripts/debug_lora_fused.py                 # H200: ~1-2 min
    python scripts/debug_lora_fused.py --case dx 0 8192 1024 4096 32   # one case, in this process
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (T, in, out) of the toy config's linears (hidden 1024, 16 heads / 8 KV heads of 64, SwiGLU 4096), rank 32
SHAPES = [(8192, 1024, 1024), (8192, 1024, 512), (8192, 1024, 4096), (8192, 4096, 1024)]


def run_case(direction, cfg_index, T, d_in, d_out, r):
    import torch
    import nvfp4
    from kernels import lora_fused as lf
    from kernels import nvfp4_gemm as kg
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 smoke test
    W = torch.randn(d_out, d_in, device=dev) / d_in ** 0.5
    qw = nvfp4.quantize(W, block=(16, 16))
    bdt = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter's bf16 tl.dot is wrong
    L1 = (torch.randn(r, d_in, device=dev) / d_in ** 0.5).to(bdt)
    L2 = (torch.randn(d_out, r, device=dev) / r ** 0.5).to(bdt)
    cfg = lf._CONFIGS[cfg_index]  # every nvfp4_gemm config, the excluded 4-warp one too
    if direction == "gemm_dx":  # plain nvfp4_gemm, dX layout (trans_b), same config
        dy = torch.randn(T, d_out, device=dev, dtype=torch.bfloat16)
        q_dy = nvfp4.quantize(dy, block=(1, 16))
        out = kg._gemm_triton(q_dy, qw, False, True, torch.bfloat16, config={**cfg.kwargs, "num_warps": cfg.num_warps})
        ref = kg.grid_values_mm(kg.grid_values_bf16(q_dy), kg.grid_values_bf16(qw), q_dy.global_scale, qw.global_scale,
                                torch.bfloat16)
    elif direction == "fwd":
        x = torch.randn(T, d_in, device=dev, dtype=torch.bfloat16)
        qx, xl1 = lf.quantize_down_proj(x, L1, 1.0, "rtn")
        out = lf.nvfp4_matmul_up_proj(qx, qw, xl1, L2, torch.bfloat16, config=cfg)
        ref = lf._forward_cublas(x, qw, L1, L2, 1.0, False, torch.bfloat16)[1]
    else:  # dx
        dy = torch.randn(T, d_out, device=dev, dtype=torch.bfloat16)
        q_dy, dyl2 = lf.quantize_down_proj(dy, L2.t(), 1.0, "sr", seed=1234)
        out = lf.nvfp4_matmul_up_proj(q_dy, qw, dyl2, L1.t(), torch.bfloat16, True, config=cfg)
        ref = lf._dx_cublas(dy, qw, L1, L2, 1.0, False, torch.bfloat16, 1234)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    return dict(ok=err < 1e-2, rel_err=err)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        d, ci, T, i, o, r = sys.argv[2], *map(int, sys.argv[3:8])
        print("RESULT " + json.dumps(run_case(d, ci, T, i, o, r)), flush=True)
        return
    from kernels import lora_fused as lf
    cases = [(d, ci, *s, 32) for d in ("fwd", "dx", "gemm_dx") for ci in range(len(lf._CONFIGS)) for s in SHAPES]
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")

    def one(case):
        p = subprocess.run([sys.executable, __file__, "--case", *map(str, case)], env=env, capture_output=True,
                           text=True, timeout=300)
        res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if res:
            return case, json.loads(res[0][7:])
        tail = (p.stderr.strip().splitlines() or ["?"])
        return case, dict(ok=False, crash=" | ".join(tail[-3:])[:400])

    with ThreadPoolExecutor(8) as pool:
        for case, res in pool.map(one, cases):
            d, ci, T, i, o, r = case
            cfg = lf._CONFIGS[ci]
            print(f"{'OK  ' if res.get('ok') else 'FAIL'} {d:7s} cfg{ci} {cfg.kwargs} w{cfg.num_warps} "
                  f"T={T} in={i} out={o} r={r}: {res}", flush=True)


if __name__ == "__main__":
    main()
