"""Token embeddings and the language-model head.

``VocabEmbedding`` is ``nn.Embedding`` with Hugging Face's parameter name (``weight``), an
uninitialised weight (the loader fills it) and an optional scale in the model's dtype
(Gemma multiplies by sqrt(hidden_size)).
``head_logits`` is the head every causal LM shares: ``lm_head`` or the tied embedding, then
the final transforms some families apply to the logits (a scale, a soft cap).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllmpy.layers.linear import Linear, default_weight_loader
from vllmpy.layers.quantization.dense import (
    DenseMethod,
    bf16_rows_linear,
    cpu_bf16_rows,
    cpu_packs,
    pack_cpu,
    packed_linear,
)


class VocabEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        # An uninitialised weight: Embedding's own random init would pull in the
        # compiler stack on the meta device (over a second of start-up) for nothing.
        super().__init__(vocab_size, hidden_size,
                         _weight=torch.empty(vocab_size, hidden_size))
        self.weight.requires_grad_(False)
        self.scale = scale
        # On CUDA a GGUF embedding stays in its blocks (``vllmpy.ops.gguf_quants``): the rows
        # of a step are gathered and dequantized, and a tied head runs on the same blocks.
        self.quantized: Any = None

    def load_tensor(self, suffix: str, loaded: torch.Tensor, shard_id: Any = None,
                    name: str = "") -> None:
        """The checkpoint's table: block-quantized ones are kept in their blocks where a
        kernel takes them (CUDA), dense otherwise."""
        weight = self.weight
        qtype = getattr(loaded, "quant_type", None)
        if qtype is not None and weight.device.type == "cuda":
            from vllmpy.layers.quantization.gguf import cuda_types
            from vllmpy.ops.gguf_quants import prepare

            if qtype in cuda_types():
                if tuple(loaded.shape) != tuple(weight.shape):
                    raise ValueError(f"weight {name}: checkpoint shape {tuple(loaded.shape)} "
                                     f"does not match the model's {tuple(weight.shape)}")
                self.dtype = weight.dtype
                self.quantized = prepare(loaded.blocks.to(weight.device), qtype,
                                         *weight.shape)
                del self.weight  # the dense table is not needed
                self.register_parameter("weight", None)
                return
        default_weight_loader(weight, loaded, name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            from vllmpy.ops.gguf_quants import embedding

            x = embedding(input_ids, self.quantized, self.dtype)
        else:
            x = super().forward(input_ids)  # [num_tokens, hidden_size]
        if self.scale is not None:
            # the scale rounded to the model's dtype first, as Hugging Face does; a Python
            # number, so that no host-to-device copy stands in a CUDA graph
            x = x * float(torch.tensor(self.scale, dtype=x.dtype))
        return x


def head_logits(lm_head: Linear | None, embed_tokens: nn.Embedding,
                hidden_states: torch.Tensor, out: torch.Tensor | None = None, *,
                scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """A causal LM's logits: ``lm_head``, or the tied embedding when it is None, into
    ``out`` when given; then times ``scale`` and soft-capped to ``softcap * tanh(x /
    softcap)`` when those are set."""
    quantized = getattr(embed_tokens, "quantized", None)
    if lm_head is None and quantized is not None:  # a tied head on the embedding's blocks
        from vllmpy.layers.quantization.gguf import Segment

        logits = Segment(0, quantized.rows, "gguf", quantized.quant_type, quantized).run(
            hidden_states, out)
    elif lm_head is not None and not isinstance(lm_head.method, DenseMethod):
        logits = lm_head(hidden_states)  # the head's quantization method
        logits = logits if out is None else out.copy_(logits)
    elif lm_head is not None and (lm_head.method.packed is not None
                                  or cpu_packs(lm_head.weight)
                                  or cpu_bf16_rows(lm_head.weight)):
        logits = lm_head(hidden_states)  # through its packed copy or the C kernel
        logits = logits if out is None else out.copy_(logits)
    elif lm_head is None and cpu_bf16_rows(embed_tokens.weight):
        logits = bf16_rows_linear(hidden_states, embed_tokens.weight, None, out)
    elif lm_head is None and cpu_packs(embed_tokens.weight):
        # a tied head on a CPU that packs its dtype: a packed copy beside the embedding
        # (which keeps its rows for the lookups)
        packed = getattr(embed_tokens, "packed_head", None)
        if packed is None:
            packed = embed_tokens.packed_head = pack_cpu(embed_tokens.weight)
        logits = packed_linear(hidden_states, packed, None, embed_tokens.weight.shape[0], out)
    else:
        weight = embed_tokens.weight if lm_head is None else lm_head.weight
        if out is not None:
            logits = torch.mm(hidden_states, weight.t(), out=out)
        else:
            logits = torch.nn.functional.linear(hidden_states, weight)
        if lm_head is not None and lm_head.bias is not None:
            logits += lm_head.bias
    if scale is not None:
        logits.mul_(scale)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits
