"""Triton kernels and the PyTorch references they are tested against.

Each module holds its kernels, a launcher per kernel that checks shapes, dtypes and
devices, and a plain PyTorch reference. Modules import Triton, so import them directly
(``from vllmpy.ops.paged_attention import paged_attention``) where Triton is installed;
importing this package alone pulls in nothing.
"""
