"""Argument checks the kernel launchers share; each failure names the tensor."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float(name: str, t: torch.Tensor, kernels: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; the {kernels} take "
                         f"float32, bfloat16 or float16")


def check_same_device(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")
