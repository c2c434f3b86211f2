"""DeepSeek-V3's MTP layer as the proposer (``"method": "mtp"``): a tiny random V3 from
transformers whose checkpoint we give an MTP layer (transformers builds none) that
mostly drafts "the last token again"; greedy outputs with speculation equal those
without, which equal transformers'; drafts are accepted part of the time; refusals name
what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_oracle import assert_outputs_match
from safetensors.torch import load_file, save_file

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError

CONFIG = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              vocab_size=256, max_position_embeddings=256, kv_lora_rank=32,
              qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
              num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=48,
              n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
              rms_norm_eps=1e-6, num_nextn_predict_layers=1, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
ENGINE = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
              num_blocks=128, max_num_batched_tokens=24)
SPEC = {"method": "mtp", "num_speculative_tokens": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lens = [7, 40, 12, 5, 19, 30]  # 40 > the 24-token prefill chunk
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in lens]


def _mtp_layer(tensors: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Layer ``n`` (MoE, as n >= first_k_dense_replace): a copy of layer n - 1's shapes
    with small random weights, and eh_proj passing the normed embedding through, so with
    the target's tied LM head it drafts the token it reads, most of the time."""
    g = torch.Generator().manual_seed(7)
    layer = {}
    for name, t in tensors.items():
        if name.startswith(f"model.layers.{n - 1}."):
            fresh = (1 + 0.1 * torch.randn(t.shape, generator=g) if "norm" in name
                     else 0.02 * torch.randn(t.shape, generator=g))
            layer[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = fresh
    eh = 0.02 * torch.randn(64, 128, generator=g)
    eh[:, :64] += 4 * torch.eye(64)
    p = f"model.layers.{n}."
    layer.update({f"{p}enorm.weight": torch.ones(64), f"{p}hnorm.weight": torch.ones(64),
                  f"{p}eh_proj.weight": eh, f"{p}shared_head.norm.weight": torch.ones(64),
                  # DeepSeek ships a copy of the LM head; no embed_tokens here: shared
                  f"{p}shared_head.head.weight": tensors["model.embed_tokens.weight"].clone()})
    return layer


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(checkpoint with its MTP layer, one without, transformers' model)."""
    import transformers as tf

    bare = tmp_path_factory.mktemp("v3_bare")
    torch.manual_seed(0)
    config = tf.DeepseekV3Config(**CONFIG)
    model = tf.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    model = model.float().eval()
    model.save_pretrained(bare, safe_serialization=True)
    full = tmp_path_factory.mktemp("v3_mtp")
    for f in bare.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, full / f.name)
    tensors = load_file(str(bare / "model.safetensors"))
    n = CONFIG["num_hidden_layers"]
    save_file({**tensors, **_mtp_layer(tensors, n)}, str(full / "model.safetensors"),
              metadata={"format": "pt"})
    return full, bare, model


def test_outputs_are_lossless_and_match_transformers(target):
    path, _, hf_model = target
    prompts = _prompts()
    plain = LLM(str(path), **ENGINE).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5))
    assert_outputs_match(plain, hf_model, prompts, min_tokens=6 * 12, label="v3 plain")
    llm = LLM(str(path), speculative_config=SPEC, **ENGINE)
    head = llm.engine.engine_core.model_runner.proposer.model
    assert head.config.sparse_layers == (True,) and head.config.mtp_layer == 2
    assert head.embed_tokens is None and head.shared_head.head is not None
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [o.outputs[0].token_ids for o in plain]
    spec = llm.engine.engine_core.get_stats().spec_decoding
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_the_pool_counts_the_mtp_layer(target):
    from vllmpy.config import EngineArgs
    from vllmpy.engine.configure import build_engine_config

    common = dict(model=str(target[0]), device="cpu", dtype="float32", num_blocks=64)
    plain = build_engine_config(EngineArgs(**common))
    spec = build_engine_config(EngineArgs(**common, speculative_config=SPEC))
    # 2 target layers and the MTP layer, one latent cache each
    assert spec.cache.bytes_per_block * 2 == plain.cache.bytes_per_block * 3


def _variant(tmp_path: Path, source: Path, **change) -> str:
    shutil.copytree(source, tmp_path / "v")
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    (tmp_path / "v" / "config.json").write_text(json.dumps({**cfg, **change}))
    return str(tmp_path / "v")


def test_refusals_name_what_is_wrong(target, tmp_path, eagle_target):
    full, bare, _ = target
    cases = [
        (_variant(tmp_path, full, num_nextn_predict_layers=0), SPEC,
         "has no MTP layers (num_nextn_predict_layers 0)"),
        (str(bare), SPEC, "has no model.layers.2.eh_proj"),
        (eagle_target, {**SPEC, "method": "deepseek_mtp"},
         "the target is LlamaForCausalLM, which has none this engine builds (supported: "
         "DeepseekV3ForCausalLM)"),
        (str(full), {**SPEC, "model": eagle_target}, "its model names another"),
    ]
    for model, spec, needle in cases:
        with pytest.raises(ConfigError, match="--speculative-config") as e:
            LLM(model, speculative_config=spec, **ENGINE)
        assert needle in str(e.value), (spec, str(e.value))
