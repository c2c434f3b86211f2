"""Without CUDA, the Triton kernels run under Triton's interpreter. The variable is read
when the kernels are decorated, so it is set here, before any test module imports them."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
