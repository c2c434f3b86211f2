"""Write a transformers MoE model (Qwen3-MoE, Mixtral) as a GGUF the way llama.cpp's
converter writes it: the experts of each layer stacked as ``ffn_gate_exps`` /
``ffn_up_exps`` [E, I, H] and ``ffn_down_exps`` [E, H, I], the router as ``ffn_gate_inp``,
Llama's q/k rows interleaved for the ``llama`` architecture."""

from __future__ import annotations

import gguf
import numpy as np
import torch

_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp"}
_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight",
            "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Llama converter: each head's rows as (0, d/2, 1, d/2 + 1, ...)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def write_moe_gguf(path, hf_model: torch.nn.Module, arch: str,
                   expert_quant: gguf.GGMLQuantizationType | None = None) -> str:
    """``arch`` is ``qwen3moe`` or ``llama`` (Mixtral). With ``expert_quant`` the expert
    tensors are stored in that block type and ``hf_model``'s experts are overwritten with
    gguf-py's dequantization of the stored blocks, so both sides run the same weights."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    state = hf_model.state_dict()
    for name, p in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name in _GLOBALS:
            w.add_tensor(_GLOBALS[name], p.float().numpy())
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            gate, up = p.float().chunk(2, dim=1)
            stacked = {"ffn_gate_exps": ("gate", gate), "ffn_up_exps": ("up", up)}
        elif rest == "mlp.experts.down_proj":
            stacked = {"ffn_down_exps": ("down", p.float())}
        else:
            module, suffix = rest.rsplit(".", 1)
            array = p.float().numpy()
            if arch == "llama" and module == "self_attn.q_proj":
                array = _interleave(array, cfg.num_attention_heads)
            if arch == "llama" and module == "self_attn.k_proj":
                array = _interleave(array, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{layer}.{_PARTS[module]}.{suffix}", np.ascontiguousarray(array))
            continue
        dequantized = {}
        for part, (kind, t) in stacked.items():
            array = np.ascontiguousarray(t.numpy())
            if expert_quant is None:
                w.add_tensor(f"blk.{layer}.{part}.weight", array)
                continue
            blocks = gguf.quants.quantize(array, expert_quant)
            w.add_tensor(f"blk.{layer}.{part}.weight", blocks, raw_dtype=expert_quant)
            dequantized[kind] = torch.from_numpy(
                np.asarray(gguf.quants.dequantize(blocks, expert_quant)).reshape(array.shape))
        if dequantized:
            with torch.no_grad():
                if "down" in dequantized:
                    p.copy_(dequantized["down"])
                else:
                    p.copy_(torch.cat((dequantized["gate"], dequantized["up"]), dim=1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
