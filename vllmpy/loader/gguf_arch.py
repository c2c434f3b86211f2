"""How one llama.cpp architecture maps onto its Hugging Face model: the seam a model
family fills (as ``GGUF_ARCH`` in its model file) to load from a ``.gguf`` file.

The GGUF loader builds the config keys every llama.cpp architecture spells alike
(``<arch>.embedding_length``, ``<arch>.block_count``, ...) and maps the tensor names every
one shares (``blk.N.attn_q`` -> ``model.layers.N.self_attn.q_proj``); a family adds its own
config keys, block parts and global names, and any fix-up llama.cpp's converter applied to
its tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class GGUFMetadata(Protocol):
    """What an architecture's config hook may read of an opened GGUF file."""

    path: str
    architecture: str

    def metadata(self, key: str, default: Any = None) -> Any: ...

    @property
    def tensor_names(self) -> set[str]: ...


@dataclass(frozen=True)
class GGUFArch:
    # (file, the common config dict) -> the keys this architecture adds or overrides
    config: Callable[[GGUFMetadata, dict[str, Any]], dict[str, Any]] | None = None
    # blk.N.<gguf part> -> <hf part> (joined as f"{layer_prefix}.N.<hf part>.<suffix>")
    block_parts: Mapping[str, str] = field(default_factory=dict)
    # whole GGUF tensor names -> Hugging Face names, beside (or replacing) the common ones
    global_names: Mapping[str, str] = field(default_factory=dict)
    layer_prefix: str = "model.layers"
    # llama.cpp's Llama converter interleaves the rows of attn_q / attn_k (undone on load)
    permute_qk: bool = False
    # (Hugging Face name, dense tensor) -> the tensor as the Hugging Face model holds it
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    # GGUF tensors that hold no parameter (read into the config instead)
    skip: frozenset[str] = frozenset()


def moe_config(meta: GGUFMetadata, count_key: str = "num_experts") -> dict[str, Any]:
    """The MoE keys llama.cpp writes for every MoE architecture, as Hugging Face names them
    (the expert count under ``count_key``: ``num_experts`` or ``num_local_experts``)."""
    arch = meta.architecture
    keys = ((f"{arch}.expert_count", count_key),
            (f"{arch}.expert_used_count", "num_experts_per_tok"),
            (f"{arch}.expert_feed_forward_length", "moe_intermediate_size"),
            (f"{arch}.expert_shared_feed_forward_length", "shared_expert_intermediate_size"))
    return {hf: int(value) for key, hf in keys if (value := meta.metadata(key)) is not None}
