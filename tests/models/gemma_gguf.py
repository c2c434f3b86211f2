"""Write a transformers Gemma 2 / Gemma 3 model as llama.cpp's converter does
(``convert_hf_to_gguf.py`` ``Gemma2Model`` / ``Gemma3Model``, llama.cpp b6000s): the same
metadata keys, the tensor names from gguf-py's own name map (not the loader's table),
every ``*norm.weight`` stored as ``w + 1``, no ``lm_head`` for Gemma 2, and a
SentencePiece-style vocabulary of placeholder tokens (the tests run on token ids)."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

ARCHS = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}


def _rope_parameters(cfg: Any) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None) or {}
    return params if "full_attention" in params else {"full_attention": params}


def _write_metadata(w: gguf.GGUFWriter, arch: str, cfg: Any, file_type: int,
                    write_swa_base: bool) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(file_type)
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters: no rope keys at all
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
        return
    # Gemma3Model: TextModel's keys (rope of the global layers, scaling), then its own
    rope = _rope_parameters(cfg)
    full = rope["full_attention"]
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base(full.get("rope_theta", 1_000_000.0))
    if write_swa_base and "sliding_attention" in rope:  # newer converters only
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)


def _write_vocab(w: gguf.GGUFWriter, vocab_size: int) -> None:
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<t{i}>" for i in range(vocab_size)])
    w.add_token_scores([0.0] * vocab_size)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab_size)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_space_prefix(False)


def write_gemma_gguf(path: str, model: torch.nn.Module, arch: str, *,
                     matrix_type: QType = QType.F32, write_swa_base: bool = True,
                     sliding_window_pattern: int | list[bool] | None = None) -> str:
    """``model`` (Gemma2ForCausalLM / Gemma3ForCausalLM) as a ``.gguf`` at ``path``.
    Matrices are stored as ``matrix_type`` (F32, F16 or Q8_0), 1-D tensors as F32.
    ``write_swa_base=False`` leaves out ``rope.freq_base_swa`` as converters before it did
    (the real Gemma-3-270M file); ``sliding_window_pattern`` writes that key."""
    cfg = model.config
    file_type = {QType.F32: gguf.LlamaFileType.ALL_F32, QType.F16: gguf.LlamaFileType.MOSTLY_F16,
                 QType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0}[matrix_type]
    w = gguf.GGUFWriter(path, arch)
    _write_metadata(w, arch, cfg, file_type, write_swa_base)
    if sliding_window_pattern is not None:
        w.add_sliding_window_pattern(sliding_window_pattern)
    _write_vocab(w, cfg.vocab_size)
    names = gguf.get_tensor_name_map(ARCHS[arch], cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and (arch == "gemma2" or cfg.tie_word_embeddings):
            continue  # Gemma2Model filters it; a tied checkpoint does not save it
        if hf_name.endswith(("rotary_emb.inv_freq", "embed_scale")):
            continue
        data = tensor.detach().float().numpy()
        if hf_name.endswith("norm.weight"):
            data = data + 1  # what llama.cpp's RMSNorm multiplies by
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if data.ndim == 2 and matrix_type == QType.F16:
            w.add_tensor(name, data.astype(np.float16))
        elif data.ndim == 2 and matrix_type == QType.Q8_0:
            w.add_tensor(name, gguf.quants.quantize(data, QType.Q8_0), raw_dtype=QType.Q8_0)
        else:
            w.add_tensor(name, data.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
