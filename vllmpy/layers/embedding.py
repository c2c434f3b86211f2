"""Token embeddings and the language-model head.

``VocabEmbedding`` is ``nn.Embedding`` with Hugging Face's parameter name (``weight``), an
uninitialised weight (the loader fills it) and an optional scale in the model's dtype
(Gemma multiplies by sqrt(hidden_size)).
``head_logits`` is the head every causal LM shares: ``lm_head`` or the tied embedding, then
the final transforms some families apply to the logits (a scale, a soft cap).
"""

from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.linear import Linear


class VocabEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        # An uninitialised weight: Embedding's own random init would pull in the
        # compiler stack on the meta device (over a second of start-up) for nothing.
        super().__init__(vocab_size, hidden_size,
                         _weight=torch.empty(vocab_size, hidden_size))
        self.weight.requires_grad_(False)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
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
    if lm_head is not None and lm_head.int4 is not None:
        logits = lm_head(hidden_states)  # a 4-bit head (see layers.linear)
        logits = logits if out is None else out.copy_(logits)
    else:
        weight = embed_tokens.weight if lm_head is None else lm_head.weight
        assert weight is not None  # a head without a 4-bit copy keeps its dense weight
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
