"""A tiny target with real (random) safetensors weights, and EAGLE / EAGLE-3 heads for it
in the layouts their trainers write, built so that they agree with the target part of the
time: the target ties its embeddings (at transformers' initialisation its greedy text
often repeats a token), and each head passes the embedding of the token it reads (EAGLE)
or the target's hidden state (EAGLE-3) through to the LM head almost unchanged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from server_utils import TINY_LLAMA, write_tiny_chat_model

TARGET = dict(TINY_LLAMA, num_hidden_layers=4, tie_word_embeddings=True)
HEAD = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "model_type": "llama", "torch_dtype": "float32"}
DRAFT_VOCAB = 8192
AUX_LAYERS = [1, 2, 3]


@pytest.fixture(scope="session")
def eagle_target(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = write_tiny_chat_model(tmp_path_factory.mktemp("eagle_target"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TARGET.items()
                                            if k != "architectures"}))
    model.save_pretrained(path, safe_serialization=True)
    return path


def _layer(prefix: str, gen: torch.Generator, qkv_in: int) -> dict[str, torch.Tensor]:
    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.02

    return {
        f"{prefix}.self_attn.q_proj.weight": rand(64, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": rand(32, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": rand(32, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": rand(64, 64),
        f"{prefix}.mlp.gate_proj.weight": rand(128, 64),
        f"{prefix}.mlp.up_proj.weight": rand(128, 64),
        f"{prefix}.mlp.down_proj.weight": rand(64, 128),
        f"{prefix}.post_attention_layernorm.weight": 1 + rand(64),
    }


@pytest.fixture(scope="session")
def eagle_heads(tmp_path_factory, eagle_target) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(f"{eagle_target}/model.safetensors", framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    gen = torch.Generator().manual_seed(1)
    heads = {}

    # EAGLE: fc reads [embedding of the next token, target hidden state]; it keeps the
    # first (scaled to the hidden state's size), and the layer adds a little.
    one = tmp_path_factory.mktemp("eagle_head")
    fc = torch.randn(64, 128, generator=gen) * 0.02
    fc[:, :64] += 40 * torch.eye(64)
    weights = {"fc.weight": fc, **_layer("layers.0", gen, 64),
               # EAGLE checkpoints carry a copy of the embeddings; the target's are used
               "embed_tokens.weight": torch.randn(49152, 64, generator=gen)}
    save_file(weights, f"{one}/model.safetensors")
    (one / "config.json").write_text(json.dumps(dict(HEAD, architectures=["LlamaForCausalLM"])))
    heads["eagle"] = str(one)

    # EAGLE-3: fc reads the states entering target layers 1, 2, 3 and keeps the last; the
    # LM head covers the DRAFT_VOCAB lowest ids (the common ones), shuffled: d2t maps back.
    three = tmp_path_factory.mktemp("eagle3_head")
    fc = torch.randn(64, 192, generator=gen) * 0.02
    fc[:, 128:] += 40 * torch.eye(64)
    chosen = torch.randperm(DRAFT_VOCAB, generator=gen)
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[chosen] = True
    weights = {"fc.weight": fc, **_layer("midlayer", gen, 128),
               "midlayer.input_layernorm.weight": torch.ones(64),
               "midlayer.hidden_norm.weight": torch.ones(64),
               "norm.weight": torch.ones(64),
               "lm_head.weight": embed[chosen].clone(),
               "d2t": chosen - torch.arange(DRAFT_VOCAB), "t2d": t2d}
    save_file(weights, f"{three}/model.safetensors")
    (three / "config.json").write_text(json.dumps(dict(
        HEAD, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=64,
        eagle_config={"eagle_aux_hidden_state_layer_ids": AUX_LAYERS})))
    heads["eagle3"] = str(three)
    return heads
