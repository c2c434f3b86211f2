"""DeepSeek-V2-Lite, V2 and V3 (multi-head latent attention over a paged latent cache, MoE
routing of both generations) against transformers' DeepseekV2ForCausalLM and
DeepseekV3ForCausalLM on tiny random weights, fp32 on the CPU.

The model runs two ways: driven step by step here (built as the runner builds it, its
latent caches bound by hand, prompts fed in chunks beside other requests' decodes; with
the PyTorch backend and with the Triton one under the interpreter), and through
``vllmpy.LLM`` (batches, chunked prefill, preemption).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from hf_oracle import assert_greedy_match, assert_outputs_match, hf_scored

from vllmpy import LLM, SamplingParams
from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.config import ConfigError
from vllmpy.core.cache_spec import MLASpec
from vllmpy.layers.custom_op import bind_ops
from vllmpy.layers.mla import LatentAttention
from vllmpy.layers.moe import select_experts
from vllmpy.loader.materialize import materialize
from vllmpy.models.deepseek_v2 import DeepseekV2Config, DeepseekV3Config
from vllmpy.models.registry import resolve_model_class, text_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
BASE: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=256, max_position_embeddings=256, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
            num_experts_per_tok=2, first_k_dense_replace=1, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 1.0,
        "beta_fast": 32, "beta_slow": 1}
CONFIGS = {
    # V2-Lite's shape: one q_proj, greedy softmax routing, two shared experts
    "v2_lite": ("DeepseekV2", dict(q_lora_rank=None, n_shared_experts=2,
                                   topk_method="greedy")),
    # V2: q_lora_rank, group-limited routing, a scaling factor, attention biases
    "v2": ("DeepseekV2", dict(q_lora_rank=48, n_shared_experts=1,
                              topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              routed_scaling_factor=1.5, attention_bias=True)),
    # V3: sigmoid noaux_tc with its correction bias, renormalised, YaRN with mscale
    "v3": ("DeepseekV3", dict(q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2,
                              norm_topk_prob=True, routed_scaling_factor=2.5,
                              rope_parameters=YARN)),
    # V3 with rope in halves, raw sigmoid weights, no dense layer and tied embeddings
    "v3_halves": ("DeepseekV3", dict(q_lora_rank=48, n_shared_experts=2, n_group=2,
                                     topk_group=1, norm_topk_prob=False,
                                     rope_interleave=False, first_k_dense_replace=0,
                                     tie_word_embeddings=True)),
}


def _make(kind: str, path: Path) -> torch.nn.Module:
    import transformers as tf

    family, extra = CONFIGS[kind]
    torch.manual_seed(0)
    config = getattr(tf, f"{family}Config")(**{**BASE, **extra})
    model = getattr(tf, f"{family}ForCausalLM")(config)
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.15)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"deepseek-{request.param}")
    return request.param, path, _make(request.param, path)


def _prompts(n: int, lo: int = 5, hi: int = 45, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, BASE["vocab_size"], (k,), generator=g).tolist() for k in lens]


# ---- through the engine ----------------------------------------------------------------

def _llm(path: Path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", block_size=16,
                num_blocks=96)
    return LLM(str(path), **{**args, **kwargs})


def test_greedy_and_logprobs_match_transformers(tiny):
    """16 requests of 5..59 tokens in one batch, prompts in chunks of a 24-token step
    budget: greedy tokens and top-5 log-probs as transformers gives them."""
    kind, path, hf_model = tiny
    prompts = _prompts(16, 5, 60, seed=2)
    outs = _llm(path, max_num_batched_tokens=24).generate(prompts, GREEDY)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=16 * 16,
                         label=f"deepseek {kind}")


def test_preempted_requests_come_back_with_the_same_tokens(tiny):
    """A pool too small for every request at once: requests are preempted and recomputed,
    small prefill chunks beside decodes, and each one's tokens are those it gets alone."""
    kind, path, _ = tiny
    if kind != "v2":
        pytest.skip("one config covers the schedule")
    prompts = _prompts(5, 12, 30, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    base = _llm(path)
    alone = [base.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    small = _llm(path, block_size=4, num_blocks=16, max_model_len=48,
                 max_num_batched_tokens=7)
    together = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert small.engine.engine_core.scheduler.num_preemptions_total > 0
    assert together == alone


def test_fp8_latent_cache_through_the_engine(tiny):
    """--kv-cache-dtype fp8: the engine allocates e4m3 latent pages for every MLA layer
    and serves from them; the first tokens agree with transformers where its margin is
    wide."""
    kind, path, hf_model = tiny
    if kind != "v3":
        pytest.skip("one config covers the fp8 cache")
    llm = _llm(path, kv_cache_dtype="fp8")
    caches = llm.engine.engine_core.model_runner.kv_caches
    assert len(caches) == 3 and all(c.dtype == torch.float8_e4m3fn for c in caches)
    assert all(tuple(c.shape[1:]) == (16, 48) for c in caches)
    prompt = _prompts(1, 20, 21, seed=7)[0]
    ours = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4,
                                                 ignore_eos=True))[0].outputs[0].token_ids
    ref = hf_scored(hf_model, prompt, list(ours))
    assert ours[0] == ref.tokens[0] or ref.margins[0] < 0.5
    assert any(c.float().abs().sum() > 0 for c in caches)


# ---- the model driven step by step, caches bound by hand ------------------------------

BLOCK = 8


def build(path: Path, num_blocks: int, backend: str = "torch") -> torch.nn.Module:
    """The checkpoint in float32 on the CPU, as the runner builds it, one latent cache of
    ``num_blocks`` blocks bound to every layer that declares one; ``backend="triton"``
    swaps in the CUDA backend (under Triton's interpreter)."""
    text = text_config(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = resolve_model_class(text.architectures)(text)
    materialize(model, torch.device("cpu"), torch.float32)
    bind_ops(model, torch.device("cpu"))
    model.load_weights(st.load_file(str(path / "model.safetensors")).items())
    model.eval()
    caching: list[Any] = [m for m in model.modules() if hasattr(m, "cache_spec")]
    assert tuple(m.cache_spec() for m in caching) == text.layer_cache_specs()
    for module, spec in zip(caching, text.layer_cache_specs()):
        module.bind(torch.zeros(spec.cache_shape(num_blocks, BLOCK)))
        if backend == "triton":
            from vllmpy.attention.mla_triton_backend import TritonMLABackend

            module.backend = TritonMLABackend(module.dims, module.scale)
    return model


@torch.inference_mode()
def drive(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
          chunk: int = 6) -> list[list[int]]:
    """Greedy continuations of every prompt at once: each step feeds every request its
    next ``chunk`` prompt tokens (or its one new token), so chunks and decodes share steps;
    request r owns blocks r, r + R, r + 2R, ... (interleaved over the pool)."""
    n = len(prompts)
    tokens, done = [list(p) for p in prompts], [0] * n
    out: list[list[int]] = [[] for _ in prompts]
    width = -(-(max(map(len, prompts)) + max_tokens) // BLOCK)
    tables = torch.tensor([[r + b * n for b in range(width)] for r in range(n)],
                          dtype=torch.int32)
    while any(len(o) < max_tokens for o in out):
        reqs = [r for r in range(n) if len(out[r]) < max_tokens]
        counts = [min(chunk, len(tokens[r]) - done[r]) for r in reqs]
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for r, c in zip(reqs, counts):
            for p in range(done[r], done[r] + c):
                ids.append(tokens[r][p])
                pos.append(p)
                slots.append(int(tables[r, p // BLOCK]) * BLOCK + p % BLOCK)
            qsl.append(qsl[-1] + c)
            lens.append(done[r] + c)
        meta = AttentionMetadata(
            num_actual_tokens=qsl[-1], query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            query_start_loc_cpu=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
            seq_lens_cpu=lens, slot_mapping=torch.tensor(slots), block_tables=tables[reqs],
            block_size=BLOCK, max_query_len=max(counts), max_seq_len=max(lens))
        hidden = model(torch.tensor(ids), torch.tensor(pos), meta)
        last = torch.tensor(qsl[1:]) - 1
        picked = model.compute_logits(hidden[last]).argmax(-1).tolist()
        for r, c, tok in zip(reqs, counts, picked):
            done[r] += c
            if done[r] == len(tokens[r]):  # the prompt (or the last token) is in
                tokens[r].append(tok)
                out[r].append(tok)
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_model_stepped_by_hand_matches_transformers(tiny, backend):
    """Chunked prefills beside decodes, then batched decodes: the greedy tokens of
    transformers' forward over each request alone (PyTorch backend: 16 tokens of 4
    requests; the Triton one under the interpreter: 8 tokens of 3)."""
    kind, path, hf_model = tiny
    n, steps = (4, 16) if backend == "torch" else (3, 8)
    prompts = _prompts(n, seed=4)
    model = build(path, num_blocks=n * 10, backend=backend)
    compared = 0
    for prompt, ours in zip(prompts, drive(model, prompts, steps), strict=True):
        compared += assert_greedy_match(ours, hf_scored(hf_model, prompt, ours),
                                        f"{kind} {backend}")
    assert compared >= n * steps // 2


def test_fp8_latent_cache_holds_the_rows_rounded_to_e4m3(tiny, monkeypatch):
    """--kv-cache-dtype fp8 on MLA: the latent rows are stored as e4m3 with one scale per
    layer (1.0), and the logits are those of a float32 cache holding every row's e4m3
    round trip (prefill and decode); they differ from the float cache's."""
    from vllmpy.attention import mla_backend

    kind, path, _ = tiny
    if kind != "v3":
        pytest.skip("one config covers the fp8 cache")
    prompt = _prompts(1, 20, 21, seed=6)[0]
    write = mla_backend.write_latent_rows

    def round_tripped(c_kv, k_pe, *args):
        e4m3 = torch.float8_e4m3fn
        write(c_kv.to(e4m3).to(c_kv.dtype), k_pe.to(e4m3).to(k_pe.dtype), *args)

    def logits(dtype: torch.dtype) -> torch.Tensor:
        model = build(path, num_blocks=4)
        for m in model.modules():
            if isinstance(m, LatentAttention):
                m.bind(torch.zeros(m.cache_spec().cache_shape(4, BLOCK), dtype=dtype))
        out = []
        with torch.inference_mode():
            for start, end in ((0, 17), (17, 18), (18, 19)):
                meta = AttentionMetadata(
                    num_actual_tokens=end - start,
                    query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                    query_start_loc_cpu=[0, end - start],
                    seq_lens=torch.tensor([end], dtype=torch.int32), seq_lens_cpu=[end],
                    slot_mapping=torch.arange(start, end),
                    block_tables=torch.arange(4, dtype=torch.int32)[None], block_size=BLOCK)
                hidden = model(torch.tensor(prompt[start:end]), torch.arange(start, end),
                               meta)
                out.append(model.compute_logits(hidden))
        caches = [m.kv_cache for m in model.modules() if isinstance(m, LatentAttention)]
        assert all(c is not None and c.dtype == dtype for c in caches)
        return torch.cat(out)

    fp8, plain = logits(torch.float8_e4m3fn), logits(torch.float32)
    monkeypatch.setattr(mla_backend, "write_latent_rows", round_tripped)
    torch.testing.assert_close(fp8, logits(torch.float32), atol=1e-5, rtol=1e-5)
    assert (fp8 - plain).abs().max() > 1e-3


# ---- configs --------------------------------------------------------------------------

def _cfg(family: str, **kw):
    arch = f"{family}ForCausalLM"
    cls = DeepseekV3Config if family == "DeepseekV3" else DeepseekV2Config
    return cls.from_hf({**BASE, "architectures": [arch], **kw}, arch)


def test_config_reading():
    cfg = _cfg("DeepseekV2", q_lora_rank=None, topk_method="greedy")
    assert cfg.q_lora_rank is None and cfg.n_group is None and cfg.scoring == "softmax"
    assert cfg.sparse_layers == (False, True, True)
    # the engine's KV fields: one latent per token, kv_lora_rank + rope wide
    assert (cfg.num_key_value_heads, cfg.head_dim) == (1, 48)
    assert cfg.layer_cache_specs() == (MLASpec(32, 16),) * 3
    # an absent q_lora_rank is transformers' default; an explicit null means no LoRA
    assert _cfg("DeepseekV2").q_lora_rank == 1536
    v3 = _cfg("DeepseekV3", n_group=4, topk_group=2, rope_parameters=YARN)
    assert (v3.scoring, v3.norm_topk_prob, v3.routed_scaling_factor) == ("sigmoid", True, 2.5)
    assert (v3.n_group, v3.topk_group, v3.num_nextn_predict_layers) == (4, 2, 1)
    assert v3.rope_interleave and v3.rope_scaling["rope_type"] == "yarn"


@pytest.mark.parametrize("family, bad, match", [
    ("DeepseekV2", dict(topk_method="noaux_tc"), "topk_method"),
    ("DeepseekV2", dict(scoring_func="sigmoid"), "scoring_func"),
    ("DeepseekV2", dict(norm_topk_prob=True), "norm_topk_prob"),
    ("DeepseekV2", dict(topk_method="group_limited_greedy", n_group=None), "n_group"),
    ("DeepseekV2", dict(moe_layer_freq=2), "moe_layer_freq"),
    ("DeepseekV3", dict(topk_method="greedy"), "topk_method"),
    ("DeepseekV3", dict(n_group=3), "n_group"),
    ("DeepseekV3", dict(n_group=4, topk_group=1, num_experts_per_tok=3),
     "num_experts_per_tok"),
    ("DeepseekV3", dict(mlp_bias=True), "mlp_bias"),
    ("DeepseekV3", dict(num_key_value_heads=1), "num_key_value_heads"),
    ("DeepseekV3", dict(hidden_act="gelu"), "hidden_act"),
    ("DeepseekV3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}),
     "original_max_position_embeddings"),
])
def test_config_refusals_name_the_key(family, bad, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(family, **{"n_group": 4, "topk_group": 2, **bad})


# ---- routing against transformers' routers --------------------------------------------

@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_routing_matches_transformers_router(kind):
    """select_experts picks transformers' experts with its weights: V2's group-limited
    softmax (groups by their best expert) and V3's sigmoid noaux_tc."""
    import transformers as tf
    import transformers.models.deepseek_v2.modeling_deepseek_v2 as v2
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as v3

    family, extra = CONFIGS[kind]
    config = getattr(tf, f"{family}Config")(**{**BASE, **extra, "n_routed_experts": 16,
                                                "n_group": 4, "topk_group": 2,
                                                "num_experts_per_tok": 3})
    torch.manual_seed(3)
    router = (v2.DeepseekV2TopkRouter if kind == "v2" else v3.DeepseekV3TopkRouter)(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        if kind == "v3":
            router.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(64, BASE["hidden_size"])
    logits, ref_w, ref_ids = router(x)
    bias = router.e_score_correction_bias if kind == "v3" else None
    weights, ids = select_experts(logits, 3, kind == "v3",
                                  "sigmoid" if kind == "v3" else "softmax", bias, 4, 2,
                                  config.routed_scaling_factor)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_w.gather(1, ref_order))


# ---- loading ---------------------------------------------------------------------------

def test_mtp_layers_are_skipped_and_strays_refused(tiny, tmp_path):
    """V3 checkpoints carry their MTP layers as model.layers.{num_hidden_layers}.*: the
    model loads without them (and loads none of them); a stray tensor of a real layer is
    still refused by name."""
    kind, path, _ = tiny
    if kind != "v3":
        pytest.skip("one config covers the loader")
    tensors = st.load_file(str(path / "model.safetensors"))
    mtp = {f"model.layers.3.{k}": torch.zeros(4) for k in
           ("enorm.weight", "hnorm.weight", "eh_proj.weight", "self_attn.kv_b_proj.weight")}
    text = text_config(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = resolve_model_class(text.architectures)(text)
    materialize(model, torch.device("cpu"), torch.float32)
    loaded = model.load_weights({**tensors, **mtp}.items())
    assert loaded and not any(name.startswith("model.layers.3.") for name in loaded)
    with torch.device("meta"):
        model = resolve_model_class(text.architectures)(text)
    materialize(model, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.k_proj"):
        model.load_weights({**tensors, "model.layers.2.self_attn.k_proj.weight":
                            torch.zeros(4)}.items())


def test_missing_tensor_is_refused_by_name(tiny, tmp_path):
    kind, path, _ = tiny
    if kind != "v2_lite":
        pytest.skip("one config covers the loader")
    tensors = st.load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    st.save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(Exception, match=r"layers\.1\.self_attn\.kv_b_proj"):
        build(tmp_path, num_blocks=4)
