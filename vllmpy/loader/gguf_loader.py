"""Read a single ``.gguf`` file as a Hugging Face config plus Hugging Face named weights.

A GGUF file carries its model config as key/value metadata (``llama.block_count``, ...)
and its tensors under llama.cpp names (``blk.0.attn_q.weight``), possibly quantized.
This module turns both into what the rest of the engine already understands:

* ``open_gguf(path)`` reads the metadata and builds a config.json-shaped dict;
* ``iter_gguf_weights(ckpt, dtype)`` yields ``(hf_name, tensor)`` pairs, each tensor
  dequantized to ``dtype`` in the Hugging Face layout ``[out_features, in_features]``
  (for a block-quantized matrix, a ``QuantizedTensor`` that stands for it).

Everything the loader does not understand (architecture, tensor type, tensor name,
metadata it cannot express) is refused with a ``GGUFLoadError`` that names the thing,
before any weight is yielded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from vllmpy.config import log
from vllmpy.layers.quantization.gguf import QUANT_TYPES, QuantizedTensor
from vllmpy.loader.gguf_arch import GGUFArch
from vllmpy.loader.gguf_file import GGUFFile, open_gguf_file
from vllmpy.models.registry import gguf_architectures, gguf_module


class GGUFLoadError(ValueError):
    """A GGUF file (or part of it) that this loader refuses to load."""



# Tensor types we load. Matrices of the block types in quantization.gguf.QUANT_TYPES come
# as QuantizedTensor (the layer's method keeps them in blocks or dequantizes them); the
# rest (and every 1-D tensor) is dequantized here through gguf.quants.dequantize.
SUPPORTED_TYPES: frozenset[QType] = frozenset({
    QType.F32, QType.F16, QType.BF16,
    QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.IQ4_NL, QType.IQ4_XS,
})

# Names outside the transformer blocks.
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# blk.N.<gguf part> -> model.layers.N.<hf part>; the suffix (.weight / .bias) is kept.
_BLOCK_PARTS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE layers (Qwen2/3-MoE, OLMoE): the router, every expert's projection stacked as
    # one [E, out, in] tensor, and the shared expert with its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",  # the converter's --fuse-gate-up-exps
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}

# `rope_freqs.weight` holds llama.cpp's per-frequency divisors for Llama 3.1-style rope
# scaling. It is not a parameter: we read it into `rope_scaling` (type "llama3") in
# `_rope_scaling` and skip it when loading weights. It is the only tensor we skip.
_ROPE_FREQS = "rope_freqs.weight"

_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFCheckpoint:
    """An opened GGUF file: its architecture, a Hugging Face config, and the raw reader."""

    path: str  # the .gguf file
    architecture: str  # general.architecture, e.g. "llama", "qwen2", "qwen3"
    hf_config: dict  # config.json-shaped dict built from the metadata (see `_hf_config`)
    reader: GGUFFile  # memory-mapped file; other modules read metadata from it
    arch: GGUFArch  # the model family's mapping (its model file's GGUF_ARCH)

    def metadata(self, key: str, default: Any = None) -> Any:
        """The decoded value of KV field ``key`` (int, float, bool, str or list), or ``default``."""
        return self.reader.metadata.get(key, default)

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}


def open_gguf(path: str) -> GGUFCheckpoint:
    """Open ``path`` and build its Hugging Face config; refuses unknown architectures."""
    reader = open_gguf_file(str(path))
    architecture = reader.metadata.get("general.architecture")
    if architecture is None:
        raise GGUFLoadError(f"{path}: no general.architecture key; is this a model file?")
    module = gguf_module(str(architecture))
    if module is None or not hasattr(module, "GGUF_ARCH"):
        raise GGUFLoadError(
            f"GGUF architecture {architecture!r} is not supported; "
            f"supported: {sorted(gguf_architectures())}")
    ckpt = GGUFCheckpoint(str(path), architecture, {}, reader, module.GGUF_ARCH)
    ckpt.hf_config.update(_hf_config(ckpt))
    return ckpt


# End of generation, as llama.cpp decides it (llama-vocab.cpp, `special_eog_ids`): these token
# texts end generation whatever their type, ...
EOG_TEXTS: frozenset[str] = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# ... and so do the fill-in-the-middle pad, repository and file-separator tokens: the id the file
# names under tokenizer.ggml.<kind>_token_id, else a token spelled one of these ways.
EOG_FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}


def eog_token_ids(metadata: Mapping[str, Any], where: str = "GGUF file") -> set[int]:
    """The ids that end generation for a GGUF file's tokenizer metadata, by llama.cpp's rule.

    The union of: the FIM pad / repo / file-separator ids (`EOG_FIM_TEXTS`); every token whose
    text is in `EOG_TEXTS` (a text listed twice counts at its last id, as llama.cpp's
    text -> id map has it); and the `eos`, `eot` and `eom` ids the metadata names. Then, as
    llama.cpp does: `<|end|>` is dropped when `<|return|>` and `<|call|>` (or `<|calls|>` and
    `<|flush|>`) are in the set too (o200k_harmony, solar-open), and `</s>` is dropped when
    `<|tool_response>` or `<|plamo:eos|>` is (a plain `</s>` there). Where several tokens spell
    one FIM kind, llama.cpp takes whichever its hash map yields first; we take the lowest id.
    llama.cpp's fallback EOS id 11 for a byte-level file without tokenizer.ggml.eos_token_id is
    not followed: without the key there is no EOS. An id outside the vocabulary is refused.
    """
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    text_ids = {text: i for i, text in enumerate(tokens)}
    eog = {i for text, i in text_ids.items() if text in EOG_TEXTS}
    for kind, texts in EOG_FIM_TEXTS.items():
        named = _metadata_token_id(metadata, kind, len(tokens), where)
        spelled = sorted(text_ids[t] for t in texts if t in text_ids)
        if named is not None or spelled:
            eog.add(named if named is not None else spelled[0])
    for kind in ("eos", "eot", "eom"):
        if (named := _metadata_token_id(metadata, kind, len(tokens), where)) is not None:
            eog.add(named)
    by_text: dict[str, int] = {tokens[i]: i for i in sorted(eog) if i < len(tokens)}
    calls = "<|call|>" in by_text or "<|calls|>" in by_text
    if "<|end|>" in by_text and calls and ("<|return|>" in by_text or "<|flush|>" in by_text):
        eog.discard(by_text["<|end|>"])
    if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text):
        eog.discard(by_text["</s>"])
    return eog


def _metadata_token_id(metadata: Mapping[str, Any], kind: str, n_tokens: int,
                       where: str) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{kind}_token_id")
    if value is None:
        return None
    if n_tokens and not 0 <= int(value) < n_tokens:
        raise GGUFLoadError(f"{where}: tokenizer.ggml.{kind}_token_id={value} is outside the "
                            f"vocabulary of {n_tokens} tokens")
    return int(value)


def _require(ckpt: GGUFCheckpoint, key: str) -> Any:
    value = ckpt.metadata(key)
    if value is None:
        raise GGUFLoadError(f"{ckpt.path}: required metadata key {key!r} is missing")
    return value


def _as_float(value: Any) -> float:
    # Metadata floats are float32; Hugging Face reports them widened, e.g. 9.99999974e-06.
    return float(np.float32(value))


def _hf_config(ckpt: GGUFCheckpoint) -> dict:
    """The config keys every llama.cpp architecture spells alike, then the family's own
    (``GGUFArch.config``); the family's config converter checks the result as it checks a
    config.json."""
    arch = ckpt.architecture
    tensor_names = ckpt.tensor_names
    hidden = int(_require(ckpt, f"{arch}.embedding_length"))
    heads = int(_require(ckpt, f"{arch}.attention.head_count"))
    head_dim = int(ckpt.metadata(f"{arch}.attention.key_length", hidden // heads))
    config: dict[str, Any] = {
        "architectures": [gguf_architectures()[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(_require(ckpt, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(ckpt.metadata(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_require(ckpt, f"{arch}.context_length")),
        "vocab_size": _vocab_size(ckpt),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    if (ffn := ckpt.metadata(f"{arch}.feed_forward_length")) is not None:
        config["intermediate_size"] = int(ffn)
    if (eps := ckpt.metadata(f"{arch}.attention.layer_norm_rms_epsilon")) is not None:
        config["rms_norm_eps"] = _as_float(eps)
    if (eps := ckpt.metadata(f"{arch}.attention.layer_norm_epsilon")) is not None:
        config["layer_norm_eps"] = _as_float(eps)
    if (theta := ckpt.metadata(f"{arch}.rope.freq_base")) is not None:
        config["rope_theta"] = _as_float(theta)
    rope_dim = ckpt.metadata(f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        config["partial_rotary_factor"] = int(rope_dim) / head_dim
    if (window := ckpt.metadata(f"{arch}.attention.sliding_window")) is not None:
        config["sliding_window"] = int(window)
    for hf_key, gguf_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                             ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                             ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if (value := ckpt.metadata(gguf_key)) is not None:
            config[hf_key] = int(value)
    scaling = _rope_scaling(ckpt, head_dim, config.get("rope_theta", 10000.0))
    if scaling is not None:
        config["rope_scaling"] = scaling
    if ckpt.arch.config is not None:
        config.update(ckpt.arch.config(ckpt, config))
    return config


def _vocab_size(ckpt: GGUFCheckpoint) -> int:
    arch = ckpt.architecture
    if (value := ckpt.metadata(f"{arch}.vocab_size")) is not None:
        return int(value)
    tokens = ckpt.reader.metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    for t in ckpt.reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])  # GGUF dims are [in, out]: rows are the last one
    raise GGUFLoadError(f"{ckpt.path}: cannot tell vocab_size (no {arch}.vocab_size, "
                        "no tokenizer.ggml.tokens, no token_embd.weight)")


def _rope_scaling(ckpt: GGUFCheckpoint, head_dim: int, theta: float) -> dict | None:
    """rope_scaling declared by the file: rope.scaling.* keys, or a llama3 rope_freqs tensor."""
    arch = ckpt.architecture
    kind = ckpt.metadata(f"{arch}.rope.scaling.type")
    factor = ckpt.metadata(f"{arch}.rope.scaling.factor")
    if kind is None and ckpt.metadata(f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", ckpt.metadata(f"{arch}.rope.scale_linear")
    freqs = next((t for t in ckpt.reader.tensors if t.name == _ROPE_FREQS), None)
    if kind is not None and kind != "none":
        if freqs is not None:
            raise GGUFLoadError(f"{ckpt.path}: both {arch}.rope.scaling.type={kind!r} and "
                                f"tensor {_ROPE_FREQS!r}; only one rope scaling is supported")
        if kind not in ("linear", "yarn"):
            raise GGUFLoadError(f"{ckpt.path}: {arch}.rope.scaling.type={kind!r} is not "
                                "supported; supported: ['linear', 'yarn']")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": _as_float(factor or 1.0)}
        optional = (("original_max_position_embeddings", "original_context_length", int),
                    ("attention_factor", "attn_factor", _as_float),
                    ("attention_factor", "yarn_attn_factor", _as_float),
                    ("beta_fast", "yarn_beta_fast", _as_float),
                    ("beta_slow", "yarn_beta_slow", _as_float))
        for hf_key, suffix, cast in optional:
            value = ckpt.metadata(f"{arch}.rope.scaling.{suffix}")
            if value is not None and hf_key not in scaling:
                scaling[hf_key] = cast(value)
        return scaling
    return None if freqs is None else _llama3_scaling(ckpt, freqs, head_dim, theta)


def _llama3_scaling(ckpt: GGUFCheckpoint, tensor: Any, head_dim: int, theta: float) -> dict:
    """Recover Llama 3.1's rope_scaling from the divisors llama.cpp stored in rope_freqs.

    llama.cpp's converter evaluates the llama3 rule with the Hugging Face parameters and
    stores the result; we assume the published parameters (low 1, high 4, original 8192),
    take the factor from the largest divisor, and accept them only if they reproduce every
    stored divisor. Anything else is refused rather than silently run unscaled.
    """
    stored = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                        dtype=np.float64).reshape(-1)
    scaling = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if stored.shape != inv_freq.shape or not np.allclose(
            llama3_rope_divisors(inv_freq, scaling), stored, rtol=1e-4):
        raise GGUFLoadError(
            f"{ckpt.path}: tensor {_ROPE_FREQS!r} does not match llama3 rope scaling with "
            f"{scaling}; custom rope frequency factors are not supported")
    return scaling


def llama3_rope_divisors(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Per-frequency divisor of the llama3 rope rule (inv_freq_scaled = inv_freq / divisor)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    # smooth = 1 (short wavelengths) keeps the frequency; smooth = 0 divides it by factor.
    return 1.0 / ((1 - smooth) / factor + smooth)


def hf_weight_name(arch: GGUFArch, gguf_name: str) -> str | None:
    """The Hugging Face name of GGUF tensor ``gguf_name``; None if it is unknown."""
    if gguf_name in arch.global_names:
        return arch.global_names[gguf_name]
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, suffix = match.groups()
    hf_part = arch.block_parts.get(part) or _BLOCK_PARTS.get(part)
    return None if hf_part is None else f"{arch.layer_prefix}.{layer}.{hf_part}.{suffix}"


def _rotary_heads(ckpt: GGUFCheckpoint, gguf_name: str) -> int | None:
    """Head count to un-interleave ``gguf_name`` by, or None if it is stored as in HF
    (only llama.cpp's Llama converter permutes q/k rows: ``GGUFArch.permute_qk``)."""
    match = _BLOCK_RE.fullmatch(gguf_name)
    if not ckpt.arch.permute_qk or match is None:
        return None
    heads_key = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}.get(
        match.group(2))
    return None if heads_key is None else ckpt.hf_config[heads_key]


def _plan(ckpt: GGUFCheckpoint) -> list[tuple[Any, str, int | None]]:
    """(tensor, HF name, rotary heads) for every weight; refuses unknown names and types."""
    plan = []
    for tensor in ckpt.reader.tensors:
        if tensor.name == _ROPE_FREQS or tensor.name in ckpt.arch.skip:
            continue  # folded into hf_config (rope_scaling, ...) by open_gguf
        hf_name = hf_weight_name(ckpt.arch, tensor.name)
        if hf_name is None:
            raise GGUFLoadError(
                f"{ckpt.path}: unexpected tensor {tensor.name!r} for architecture "
                f"{ckpt.architecture!r}")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise GGUFLoadError(
                f"{ckpt.path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                f"which is not supported; supported: {sorted(t.name for t in SUPPORTED_TYPES)}")
        plan.append((tensor, hf_name, _rotary_heads(ckpt, tensor.name)))
    return plan


def iter_gguf_weights(
    ckpt: GGUFCheckpoint, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight, dequantized to ``dtype`` in HF layout.

    A 2-D block-quantized weight comes as a ``QuantizedTensor``: it behaves as the
    dequantized tensor, and a layer that can run it quantized reads its blocks instead.
    All names and types are checked before the first tensor is yielded. For ``llama``,
    llama.cpp's rotary row interleaving of attn_q / attn_k (weights and biases) is undone.
    Tied checkpoints (no ``output.weight``) yield no ``lm_head.weight``; the model ties it
    to the embedding.
    """
    plan = _plan(ckpt)
    stacked = sorted({t.tensor_type.name for t, _, _ in plan
                      if len(t.shape) == 3 and t.tensor_type.name in QUANT_TYPES})
    if stacked:
        log(f"GGUF: MoE expert tensors ({', '.join(stacked)}) dequantized to "
            f"{str(dtype).removeprefix('torch.')} at load (quantized experts are not kept "
            "in blocks yet)")
    for tensor, hf_name, rotary_heads in plan:
        if tensor.tensor_type.name in QUANT_TYPES and len(tensor.shape) == 2:
            weight = _quantized(tensor, dtype)
            if rotary_heads is not None:
                weight = weight.with_blocks(
                    unpermute_rotary_rows(weight.blocks, rotary_heads, tensor.name))
            yield hf_name, weight
            continue
        dense = _dequantize(tensor, dtype)
        if rotary_heads is not None:
            dense = unpermute_rotary_rows(dense, rotary_heads, tensor.name)
        if ckpt.arch.transform is not None:
            dense = ckpt.arch.transform(hf_name, dense)
        yield hf_name, dense


def _quantized(tensor: Any, dtype: torch.dtype) -> QuantizedTensor:
    """One reader tensor's blocks, copied out of the memory map, as a ``QuantizedTensor``
    that stands for its dequantized ``dtype`` weights of HF shape [out, in]."""
    hf_shape = (int(tensor.shape[1]), int(tensor.shape[0]))
    try:
        return QuantizedTensor(tensor.tensor_type.name, hf_shape,
                               torch.from_numpy(np.array(tensor.data)), dtype)
    except ValueError as e:
        raise GGUFLoadError(f"tensor {tensor.name!r}: {e}") from None


def _dequantize(tensor: Any, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize one reader tensor to a fresh ``dtype`` tensor of HF shape [out, in]."""
    # The reader lists dims innermost first ([in, out]); HF order is the reverse.
    hf_shape = tuple(int(d) for d in reversed(tensor.shape))
    array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    if array.size != math.prod(hf_shape):
        raise GGUFLoadError(f"tensor {tensor.name!r}: {array.size} values after dequantizing "
                            f"{tensor.tensor_type.name}, expected shape {hf_shape}")
    if not array.flags.writeable:
        array = array.copy()  # F32 comes back as a read-only view of the memory map
    return torch.from_numpy(array.reshape(hf_shape)).to(dtype)


def unpermute_rotary_rows(weight: torch.Tensor, n_head: int, name: str = "tensor") -> torch.Tensor:
    """Undo llama.cpp's conversion-time permutation of Llama q/k rows (weight or bias).

    Hugging Face Llama rotates the two halves of each head's dims ([x0..x{d/2-1}],
    [x{d/2}..]); llama.cpp rotates adjacent pairs, so its converter interleaves each head's
    rows as (0, d/2, 1, d/2+1, ...). We view each head as [d/2, 2] and swap back to [2, d/2].
    """
    rows = weight.shape[0]
    if rows % (2 * n_head) != 0:
        raise GGUFLoadError(f"tensor {name!r}: {rows} rows do not split into {n_head} heads "
                            "of even size")
    # [n_head, head_dim/2, 2, *rest] -> [n_head, 2, head_dim/2, *rest]
    split = weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape).contiguous()
