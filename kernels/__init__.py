# NANOFP4_ROUTE=kernels where no CUDA GPU is present runs every kernel in Triton's interpreter,
# which TRITON_INTERPRET switches on only when it is set before a kernel is decorated: so here,
# before any kernels/ module is imported (train.py refuses the route on a CPU of a GPU machine
# without it).
import os

if os.environ.get("NANOFP4_ROUTE") == "kernels" and "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
