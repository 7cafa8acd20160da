"""
What runs where: one table from an NVIDIA GPU's compute capability to the route each kernel family
takes. Every route choice asks it (nvfp4.use_kernels, nvfp4_gemm.use_dot_scaled and through it the
linear, LoRA-SVD, Newton-Schulz and attention kernels, the GEMM and flash tiles, the E4M3 path of
nvfp4_math.HW_E4M3).

  FP4 products  "fp4-mma": tl.dot_scaled on the block-scaled FP4 tensor cores (Blackwell: tcgen05
                kind::mxf4nvf4 on 10.x, mma.sync kind::mxf4nvf4 on 12.x); "grid-values": the bf16
                grid values q * s_b through a bf16 GEMM (exact: at most 6 significant bits); every
                route gives the reference's numbers up to fp32 summation order
  E4M3          the hardware conversion (cvt ... e4m3x2, sm_89+) or exact integer arithmetic (the
                interpreter's path); the same bits
  shared        bytes of shared memory a block may use (the opt-in maximum): tiles must fit it
  tiles         which tile table the FP4 kernels take ("sm100": 228 KB parts, "sm120": ~100 KB)

Older than sm_80 (no bf16 tensor cores, no bf16 conversions): the reference route everywhere. What
was run on hardware and what was only compiled: README's "GPUs" table.
"""

import collections

import torch

# route: the FP4 products' route ("reference": no kernel runs); hw_e4m3: E4M3 conversions in
# hardware; shared: bytes a block may use; tiles: the FP4 tile table
Target = collections.namedtuple("Target", "arch route hw_e4m3 shared tiles")

# (major, minor) -> (route, hw_e4m3, shared, tiles); a capability takes its major's highest row at
# or below it (8.7 -> 8.6)
TABLE = {
    (8, 0): ("grid-values", False, 166912, None),       # Ampere: A100, A800
    (8, 6): ("grid-values", False, 101376, None),       # Ampere: A6000, RTX 3090
    (8, 9): ("grid-values", True, 101376, None),        # Ada: L40S, RTX 4090
    (9, 0): ("grid-values", True, 232448, None),        # Hopper: H100, H200
    (10, 0): ("fp4-mma", True, 232448, "sm100"),        # Blackwell: B200, GB200
    (10, 3): ("fp4-mma", True, 232448, "sm100"),        # Blackwell: B300, GB300
    (12, 0): ("fp4-mma", True, 101376, "sm120"),        # consumer Blackwell: RTX 5090, RTX PRO 6000
    (12, 1): ("fp4-mma", True, 101376, "sm120"),        # consumer Blackwell: DGX Spark (GB10)
}


def target(capability):
    """The Target of a compute capability (major, minor); None (not a CUDA GPU) and anything
    older than sm_80 (no bf16): the reference route. A major the table does not know (11.x, 13+)
    gets the grid-value route on the smallest shared memory: nothing it was not built for."""
    if capability is None:
        return Target(None, "reference", False, 0, None)
    cap, arch = tuple(capability), f"sm_{capability[0]}{capability[1]}"
    if cap < (8, 0):
        return Target(arch, "reference", False, 0, None)
    rows = [c for c in TABLE if c[0] == cap[0] and c <= cap]
    if not rows:
        return Target(arch, "grid-values", True, 101376, None)
    return Target(arch, *TABLE[max(rows)])


def capability(device):
    """(major, minor) of a CUDA device, None for any other device."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def of(device):
    """The Target of a device (a CPU: the reference route)."""
    return target(capability(device))


def describe(device):
    """One line for a run's log: "kernels: sm_120 fp4-mma (NVIDIA GeForce RTX 5090)", and why where
    the kernels do not run."""
    t = of(device)
    if t.arch is None:
        return f"kernels: none on {device.type} (the reference route)"
    name = torch.cuda.get_device_name(device)
    if t.route == "reference":
        return (f"kernels: {t.arch} reference ({name}: the kernels need bf16, sm_80 or newer; "
                "the PyTorch reference runs instead)")
    return f"kernels: {t.arch} {t.route} ({name})"
