"""Time the CPU quantized matmuls of ``vllmpy.ops.cpu_quant`` against the dense F.linear
of the dequantized weight, on the matrix shapes of Qwen2.5-Coder-1.5B.

    python benchmarks/investigations/cpu_quant_kernels.py --gguf Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf

For each (shape, GGUF type) it times, at each token count M: the dense weight in bfloat16
and in float32, and ``cpu_quant.linear`` with bfloat16 activations. ``--refs`` adds
``cpu_quant.linear`` with float32 activations and PyTorch's other ways to run a weight of
that kind: Q6_K as four 4-bit passes over the plain input (each 32-group with half its
codes masked), the per-channel int8 matmul (``_weight_int8pack_mm``, which cannot hold a
per-group scale) and ``_dyn_quant_matmul_4bit`` (activations quantized to int8 on the
fly); those two run random codes, only their time is of interest.

Weights come from the file where it holds a tensor of that type and shape, and are random
well-formed blocks otherwise. Every variant keeps enough copies of its weight that the
copies together exceed the last-level cache, and cycles through them, so each call reads
its weight from memory as a model's forward pass does. Variants are timed round-robin,
and each figure is the median over the rounds (and, in brackets, the fastest round: the
machine is shared), in milliseconds per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from vllmpy.loader.gguf_file import open_gguf_file
from vllmpy.ops import cpu_quant

# Hugging Face orientation: (name, out_features, in_features).
SHAPES = [("q_proj / o_proj", 1536, 1536), ("k_proj / v_proj", 256, 1536),
          ("qkv_proj (fused)", 2048, 1536), ("gate / up", 8960, 1536),
          ("gate_up (fused)", 17920, 1536), ("down_proj", 1536, 8960),
          ("lm_head", 151936, 1536)]
# A GGUF tensor of the file per (rows, cols), for the types it has.
FILE_TENSORS = {(1536, 1536): "blk.0.attn_q.weight", (256, 1536): "blk.0.attn_v.weight",
                (8960, 1536): "blk.0.ffn_gate.weight", (1536, 8960): "blk.0.ffn_down.weight",
                (151936, 1536): "output.weight"}
BLOCK = {"Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_0": (32, 34)}
TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q8_0"]
CACHE_BYTES = 96 << 20  # the copies of one weight together exceed this (a few last-level caches)


def random_blocks(qtype: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random codes with small positive fp16 scales where each type keeps them."""
    weights, nbytes = BLOCK[qtype]
    b = torch.randint(0, 256, (rows, cols // weights, nbytes), dtype=torch.uint8,
                      generator=gen)
    half = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    fields = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q8_0": [0]}[qtype]
    for at in fields:
        b[..., at:at + 2] = half
    if qtype == "Q6_K":  # int8 sub-block scales of a sane size
        b[..., 192:208] = torch.randint(1, 64, b[..., 192:208].shape, dtype=torch.uint8,
                                        generator=gen)
    return b.reshape(rows, -1)


def file_blocks(gguf_file, name: str, qtype: str, rows: int, cols: int) -> torch.Tensor | None:
    """The blocks of tensor ``name`` if the file has it as ``qtype`` [rows, cols]."""
    for t in gguf_file.tensors:
        if t.name == name and t.tensor_type.name == qtype and t.shape == (cols, rows):
            return torch.from_numpy(np.array(t.data))
    return None


def dequantize(blocks: torch.Tensor, qtype: str, rows: int, cols: int) -> torch.Tensor:
    import gguf

    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.quants.dequantize(blocks.numpy().reshape(rows, -1), qt)
    return torch.from_numpy(np.ascontiguousarray(w)).reshape(rows, cols)


def q6_k_four_passes(blocks: torch.Tensor, rows: int, cols: int, dtype: torch.dtype):
    """Q6_K as four exact 4-bit passes: {even, odd} sub-blocks x {low 4 bits, high 2}.

    A pass keeps one of each 32-group's two 16-wide sub-blocks and gives the other code
    c with w = 0: the low-bit pass (scale s, zero 8s) gives them c = 0, the high-bit pass
    (c = hi + 6, scale 16s, zero 0, which also carries the -32 offset) c = 8."""
    b = blocks.view(rows, -1, 210)
    ql = b[..., 0:128].reshape(rows, -1, 2, 1, 64)
    lo = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(rows, -1, 16, 16)
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    hi = ((qh >> shifts) & 3).reshape(rows, -1, 16, 16)
    d = b[..., 208:210].contiguous().view(torch.float16).float()
    s = (d * b[..., 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    s = s.reshape(rows, -1, 8, 2, 1)  # [rows, blocks, group, parity, 1]
    lo, hi = lo.reshape(rows, -1, 8, 2, 16), hi.reshape(rows, -1, 8, 2, 16)
    passes = []
    for parity in (0, 1):
        keep = torch.zeros(2, 1, dtype=torch.bool)
        keep[parity] = True
        sp = s[..., parity, :].reshape(rows, -1)
        for codes, scale, zero, masked in ((lo, sp, 8 * sp, 0), (hi + 6, 16 * sp, 0 * sp, 8)):
            c = torch.where(keep, codes, torch.full_like(codes, masked)).reshape(rows, cols)
            packed = torch._convert_weight_to_int4pack_for_cpu(c.to(torch.int32), 1)
            sz = torch.stack([scale, zero], -1).transpose(0, 1).to(dtype).contiguous()
            passes.append((packed, sz))
    return cpu_quant.CpuQuantWeight("Q6_K", rows, cols, tuple(passes))


def variants(qtype: str, blocks: torch.Tensor, rows: int, cols: int, refs: bool
             ) -> dict[str, tuple[Callable[[], object], torch.dtype, int]]:
    """name -> (a maker of one copy of the weight with its call, activation dtype, the
    largest M to time it at).

    With ``refs`` also the 4-bit kernel with float32 activations, and the other kernels.
    The float32 4-bit path (and ``_dyn_quant_matmul_4bit``) is tens of times slower than
    the dense matmul already at M=1 and worse per token at larger M, so it is timed at M=1
    only."""
    dense = dequantize(blocks, qtype, rows, cols)
    out: dict[str, tuple[Callable[[], object], torch.dtype, int]] = {}
    for dt, tag, top in ((torch.bfloat16, "bf16", 1 << 30), (torch.float32, "fp32", 1)):
        out[f"dense {tag}"] = (lambda dt=dt: _call_dense(dense.to(dt, copy=True)), dt,
                                 1 << 30)
        if dt == torch.bfloat16 or refs:
            out[f"cpu_quant {tag}"] = (
                lambda dt=dt: _call_quant(cpu_quant.pack(blocks, qtype, rows, cols, dt)),
                dt, top)
        if qtype == "Q6_K" and refs:
            out[f"4 passes {tag}"] = (
                lambda dt=dt: _call_quant(q6_k_four_passes(blocks, rows, cols, dt)), dt, top)
    if qtype == "Q6_K" and refs:
        out["int8pack bf16 (ref)"] = (lambda: _call_int8(rows, cols), torch.bfloat16, 1 << 30)
        out["dyn_quant_4bit fp32 (ref)"] = (lambda: _call_dyn4(rows, cols), torch.float32, 1)
    return out


def _call_dense(w: torch.Tensor):
    return w, lambda x: F.linear(x, w)


def _call_quant(w: cpu_quant.CpuQuantWeight):
    return w, lambda x: cpu_quant.linear(x, w)


def _call_int8(rows: int, cols: int):
    w = torch.randint(-128, 128, (rows, cols), dtype=torch.int8)
    s = torch.rand(rows, dtype=torch.bfloat16)
    return w, lambda x: torch._weight_int8pack_mm(x, w, s)


def _call_dyn4(rows: int, cols: int):
    codes = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8)
    sz = torch.rand(rows, cols // 32)
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(codes, sz, None, 32, cols, rows)
    return packed, lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, packed, 32, cols, rows)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return obj.nbytes


def time_shape(qtype: str, blocks: torch.Tensor, rows: int, cols: int, ms: list[int],
               rounds: int, calls: int, refs: bool
               ) -> dict[tuple[str, int], tuple[float, float]]:
    """(variant, M) -> (median, min) over the rounds of ms per call."""
    built = {}
    for name, (make, dt, top) in variants(qtype, blocks, rows, cols, refs).items():
        first, fn = make()
        copies = [(first, fn)]
        while sum(_nbytes(c[0]) for c in copies) < CACHE_BYTES:
            copies.append(make())
        built[name] = ([c[1] for c in copies], dt, top)
    gen = torch.Generator().manual_seed(0)
    xs = {m: torch.randn(m, cols, generator=gen) for m in ms}
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for m in ms:
            for name, (fns, dt, top) in built.items():
                if m > top:
                    continue
                x = xs[m].to(dt)
                n = max(calls // m, len(fns)) if m > 1 else max(calls, len(fns))
                fns[0](x)
                t0 = time.perf_counter()
                for i in range(n):
                    fns[i % len(fns)](x)
                samples.setdefault((name, m), []).append((time.perf_counter() - t0) / n * 1e3)
    return {k: (statistics.median(v), min(v)) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", help="Qwen2.5-Coder-1.5B GGUF to take real blocks from")
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--shapes", default="all",
                   help="comma-separated shape names' first words, or 'all'")
    p.add_argument("--tokens", default="1,128", help="token counts M")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="calls per timing at M=1")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--refs", action="store_true",
                   help="also the float32 4-bit path and PyTorch's other CPU kernels")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    reader = open_gguf_file(args.gguf) if args.gguf else None
    ms = [int(m) for m in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    wanted = None if args.shapes == "all" else set(args.shapes.split(","))
    load = os.getloadavg()[0]
    print(f"threads {torch.get_num_threads()}, ms per call: median (min) of {args.rounds} "
          f"rounds; load average at the start {load:.1f}")
    print("| shape | rows x cols | type | source | M | variant: ms |")
    for label, rows, cols in SHAPES:
        if wanted is not None and label.split()[0] not in wanted:
            continue
        for qtype in args.types.split(","):
            blocks = None
            if reader is not None and (rows, cols) in FILE_TENSORS:
                blocks = file_blocks(reader, FILE_TENSORS[rows, cols], qtype, rows, cols)
            source = "file" if blocks is not None else "random"
            if blocks is None:
                blocks = random_blocks(qtype, rows, cols, gen)
            res = time_shape(qtype, blocks, rows, cols, ms, args.rounds, args.calls,
                             args.refs)
            for m in ms:
                cells = "; ".join(f"{name} {t[0]:.3f} ({t[1]:.3f})"
                                  for (name, mm), t in res.items() if mm == m)
                print(f"| {label} | {rows}x{cols} | {qtype} | {source} | {m} | {cells} |")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
