# Without a GPU every Triton kernel runs in Triton's interpreter. TRITON_INTERPRET is read when a
# kernel is decorated, so it must be set before any kernels/ module is imported: conftest runs first.
import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_loop_bounds():
    """Triton 3.6's interpreter holds scalars as shape-(1,) numpy arrays and turns them into loop
    bounds with int(array), which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be
    converted"): every `range(lo, hi)` with runtime bounds fails. Convert through .item() instead.
    A no-op on older NumPy and on Triton 3.9 (which needs no patch)."""
    import triton.runtime.interpreter as interp
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_loop_bounds()
# A private inductor cache per session: the shared /tmp/torchinductor_<user> served graphs compiled
# against an earlier signature of the nanofp4:: custom ops (the ops' names stay when their bodies
# change), which failed tests/test_compile.py on a machine that had run older code.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="nanofp4_inductor_"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (tools/gpu_check.sh runs them on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Every test starts from the same global RNG state: a test that draws from torch's global generator (SR
    seeds, Hadamard signs, inits) is then deterministic, so a run passes or fails the same way every time."""
    torch.manual_seed(0)
