"""Without CUDA, the Triton kernels run under Triton's interpreter. Triton reads the
variable when it is first imported, so it is set here, before any test module (or the
package code they import) can import Triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
