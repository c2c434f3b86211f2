"""FP8 MoE experts through ``quant_method: fp8``: the config gives each MoE layer its
experts' method (and keeps routers dense); the layer takes a checkpoint's per-expert,
stacked and fused fp8 tensors with per-tensor or 128 x 128 block scales; the CPU path
(dequantized at load) and the grouped-GEMM kernels (under Triton's interpreter) agree with
a reference on the dequantized weights; and a tiny Qwen3-MoE laid out as Qwen3-30B-A3B-FP8
is laid out matches transformers running its dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.layers.moe import ExpertLayout, FusedMoE, SparseMoeBlock, moe_reference
from vllmpy.layers.quantization import QuantizationError, quantization_config, quantize_model
from vllmpy.layers.quantization.dense import DenseMethod
from vllmpy.layers.quantization.fp8 import Fp8Config
from vllmpy.layers.quantization.fp8_moe import Fp8MoEMethod

FP8 = torch.float8_e4m3fn
BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}


def _quantize(w: torch.Tensor, block: tuple[int, int] | None):
    """The test's own fp8 quantizer of one matrix [N, K]: codes and a scale [1] (per
    tensor) or [ceil(N / bn), ceil(K / bk)] (per block, amax / 448 of each block)."""
    if block is None:
        scale = w.abs().max() / 448
        return (w / scale).to(FP8), scale.reshape(1)
    bn, bk = block
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk))
    codes = torch.empty(n, k, dtype=FP8)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            tile = w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk]
            scale[r, c] = tile.abs().max() / 448
            codes[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = (tile / scale[r, c]).to(FP8)
    return codes, scale


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    if block is None:
        return codes.float() * scale.float()
    bn, bk = block
    rows = torch.arange(codes.shape[0]) // bn
    cols = torch.arange(codes.shape[1]) // bk
    return codes.float() * scale[rows][:, cols]


E, H, INTER = 4, 160, 96  # neither H nor I a multiple of the 128-wide blocks


def _experts(block, seed: int = 0):
    """Per expert and projection: (codes, scale) of random weights, and the dequantized
    w13 [E, 2I, H] / w2 [E, H, I] they stand for."""
    g = torch.Generator().manual_seed(seed)
    dense = {"gate_proj": torch.randn(E, INTER, H, generator=g) * 0.2,
             "up_proj": torch.randn(E, INTER, H, generator=g) * 0.05,  # its own scales
             "down_proj": torch.randn(E, H, INTER, generator=g) * 0.2}
    q = {name: [_quantize(w[e], block) for e in range(E)] for name, w in dense.items()}
    deq = {name: torch.stack([_dequantize(c, s, block) for c, s in q[name]]) for name in q}
    return q, torch.cat((deq["gate_proj"], deq["up_proj"]), dim=1), deq["down_proj"]


def _layer(block, device: str = "cpu", **kwargs) -> FusedMoE:
    moe = FusedMoE(E, H, INTER, **kwargs)
    moe.set_method(Fp8MoEMethod(block, model_dtype=torch.float32))
    moe.bind_device(torch.device(device))
    return moe


def _load(moe: FusedMoE, q, block, spelling: str) -> None:
    scale = "weight_scale_inv" if block else "weight_scale"
    if spelling == "per_expert":  # Qwen3-30B-A3B-FP8's names
        for name, parts in q.items():
            for e, (codes, s) in enumerate(parts):
                moe.load_expert_tensor(f"{e}.{name}.weight", codes, f"x.{e}.{name}.weight")
                moe.load_expert_tensor(f"{e}.{name}.{scale}", s, f"x.{e}.{name}.{scale}")
        return
    stacked = {name: (torch.stack([c for c, _ in p]), torch.stack([s for _, s in p]))
               for name, p in q.items()}
    if spelling == "stacked":
        for name, (codes, s) in stacked.items():
            moe.load_expert_tensor(f"{name}.weight", codes, f"x.{name}.weight")
            moe.load_expert_tensor(f"{name}.{scale}", s, f"x.{name}.{scale}")
        return
    (gc, gs), (uc, us), (dc, ds) = stacked.values()  # fused, transformers' names
    moe.load_expert_tensor("gate_up_proj", torch.cat((gc, uc), 1), "x.gate_up_proj")
    moe.load_expert_tensor("gate_up_proj_scale_inv", torch.cat((gs, us), 1),
                           "x.gate_up_proj_scale_inv")
    moe.load_expert_tensor("down_proj", dc, "x.down_proj")
    moe.load_expert_tensor("down_proj_scale_inv", ds, "x.down_proj_scale_inv")


def _routing(tokens: int, seed: int = 5):
    """Expert 3 takes every token, 0 one, 1 the rest, 2 none."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.tensor([[0, 3]] + [[3, 1] if t % 2 else [1, 3] for t in range(1, tokens)])
    return x, torch.rand(tokens, 2, generator=g), ids


CASES = [(None, "per_expert"), (None, "stacked"), ((128, 128), "per_expert"),
         ((128, 128), "stacked"), ((128, 128), "fused")]


@pytest.mark.parametrize("block,spelling", CASES)
def test_cpu_experts_load_and_match_the_dequantized_reference(block, spelling) -> None:
    q, w13, w2 = _experts(block)
    moe = _layer(block)
    _load(moe, q, block, spelling)
    assert moe.missing() == [] and moe.w13.dtype == torch.float32  # dequantized at load
    torch.testing.assert_close(moe.w13.data, w13, rtol=0, atol=0)
    torch.testing.assert_close(moe.w2.data, w2, rtol=0, atol=0)
    x, weights, ids = _routing(7)
    torch.testing.assert_close(moe(x, weights, ids), moe_reference(x, w13, w2, weights, ids))
    assert moe.describe_experts() == (f"{moe.method.name} MoE expert layer(s) dequantized "
                                      "to float32 on the CPU")


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_the_kernel_path_matches_the_cpu_path(block) -> None:
    q, w13, w2 = _experts(block, seed=1)
    kernel = _layer(block, device="cuda")  # a CUDA binding: the grouped GEMMs
    _load(kernel, q, block, "per_expert")
    assert kernel.w13.dtype == FP8 and "Triton" in (kernel.describe_experts() or "")
    x, weights, ids = _routing(6, seed=7)
    ref = moe_reference(x, w13, w2, weights, ids)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # else under the interpreter
    out = kernel.to(dev)(x.to(dev), weights.to(dev), ids.to(dev)).cpu()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_codes_without_a_checkpoint_load_run_dequantized_per_call() -> None:
    """Random weights written straight into the parameters (no ``finish``) still run."""
    block = (128, 128)
    q, w13, w2 = _experts(block, seed=2)
    moe = _layer(block)
    stacked = {n: (torch.stack([c for c, _ in p]), torch.stack([s for _, s in p]))
               for n, p in q.items()}
    moe.w13.data.copy_(torch.cat((stacked["gate_proj"][0], stacked["up_proj"][0]), 1))
    moe.w13_scale.data.copy_(torch.cat((stacked["gate_proj"][1], stacked["up_proj"][1]), 1))
    moe.w2.data.copy_(stacked["down_proj"][0])
    moe.w2_scale.data.copy_(stacked["down_proj"][1])
    x, weights, ids = _routing(5)
    torch.testing.assert_close(moe(x, weights, ids), moe_reference(x, w13, w2, weights, ids))


def test_dense_weights_quantize_into_the_method() -> None:
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.1
    w2 = torch.randn(E, H, INTER, generator=g)
    for block in (None, (128, 128)):
        moe = _layer(block)
        moe.load_dense(w13, w2)
        assert moe.missing() == []
        torch.testing.assert_close(moe.w13.data, w13, rtol=0.07, atol=1e-3)
        torch.testing.assert_close(moe.w2.data, w2, rtol=0.07, atol=1e-2)


def test_online_quantization_of_float_experts() -> None:
    cfg = Fp8Config.online()
    cfg.bind_target(torch.device("cpu"), torch.float32)
    with torch.device("meta"):
        block = SparseMoeBlock(H, E, INTER, 2, True)
        quantize_model(block, cfg)
    moe = block.experts
    moe.to_empty(device="cpu")
    moe.bind_device(torch.device("cpu"))
    assert moe.method.checkpoint_suffixes(moe) == ("weight",)
    g = torch.Generator().manual_seed(4)
    w13 = torch.randn(E, 2 * INTER, H, generator=g)
    w2 = torch.randn(E, H, INTER, generator=g)
    moe.load_expert_tensor("gate_up_proj", w13, "x.gate_up_proj")  # gate and up apart
    for e in range(E):
        moe.load_expert_tensor(f"{e}.down_proj.weight", w2[e], f"x.{e}.down_proj.weight")
    assert moe.missing() == []
    torch.testing.assert_close(moe.w13.data, w13, rtol=0.07, atol=0.02)
    assert "(quantized at load)" in (moe.describe_experts() or "")


def test_the_config_gives_experts_and_routers_their_methods() -> None:
    cfg = Fp8Config.from_checkpoint(BLOCK_CONFIG, "config.json")
    with torch.device("meta"):
        block = SparseMoeBlock(H, E, INTER, 2, True)
        quantize_model(block, cfg)
    assert isinstance(block.gate.method, DenseMethod)  # routers stay in the model dtype
    method = block.experts.method
    assert isinstance(method, Fp8MoEMethod) and method.block == (128, 128)
    assert block.experts.w13.dtype == FP8
    # [E, 2 * ceil(I / 128), ceil(H / 128)] and [E, ceil(H / 128), ceil(I / 128)]
    assert tuple(block.experts.w13_scale.shape) == (E, 2 * 1, 2)
    assert tuple(block.experts.w2_scale.shape) == (E, 2, 1)
    for section, match in (({**BLOCK_CONFIG, "weight_block_size": [128, 8]}, "multiple of 16"),
                           ({"quant_method": "fp8", "activation_scheme": "static"},
                            "activation_scheme 'static'")):
        with torch.device("meta"):
            block = SparseMoeBlock(H, E, INTER, 2, True)
        with pytest.raises(QuantizationError, match=match):
            quantize_model(block, Fp8Config.from_checkpoint(section, "config.json"))
    ignoring = Fp8Config.from_checkpoint({**BLOCK_CONFIG, "ignored_layers": ["re:.*experts"]},
                                         "config.json")
    with torch.device("meta"):
        block = SparseMoeBlock(H, E, INTER, 2, True)
        quantize_model(block, ignoring)
    assert block.experts.method is None and block.experts.w13.dtype == torch.float32


def test_formats_without_an_expert_method_refuse_fp8_experts_by_name(tmp_path) -> None:
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    cfg = quantization_config("hf_dir", {}, str(tmp_path))
    assert cfg is not None and cfg.moe_method("mlp.experts", FusedMoE(E, H, INTER)) is None
    moe = FusedMoE(E, H, INTER)
    quantize_model(moe, cfg)
    with pytest.raises(ValueError, match=r"x\.0\.gate_proj\.weight.*quantized MoE experts"):
        moe.load_expert_tensor("0.gate_proj.weight", torch.zeros(INTER, H, dtype=FP8),
                               "x.0.gate_proj.weight")


def test_load_refusals_name_the_tensor() -> None:
    q, _, _ = _experts((128, 128))
    codes, scale = q["gate_proj"][0]
    moe = _layer((128, 128))
    with pytest.raises(QuantizationError, match=r"x\.0\.gate_proj\.weight.*float8_e4m3fn"):
        moe.load_expert_tensor("0.gate_proj.weight", codes.float(), "x.0.gate_proj.weight")
    with pytest.raises(ValueError, match=r"weight_scale'.*take \['weight', 'weight_scale_inv'\]"):
        moe.load_expert_tensor("0.gate_proj.weight_scale", scale, "x.0.gate_proj.weight_scale")
    with pytest.raises(ValueError, match="shape"):
        moe.load_expert_tensor("0.gate_proj.weight_scale_inv", scale[:, :1], "x.s")
    with pytest.raises(ValueError, match="names expert 4"):
        moe.load_expert_tensor("4.gate_proj.weight", codes, "x.4.gate_proj.weight")
    moe.load_expert_tensor("0.gate_proj.weight", codes, "x.0.gate_proj.weight")
    assert "0.gate_proj.weight_scale_inv" in moe.missing()
    assert "0.gate_proj.weight" not in moe.missing()
    transposed = _layer((128, 128), layout=ExpertLayout(transposed=True))
    with pytest.raises(ValueError, match="transposed or interleaved"):
        transposed.load_expert_tensor(
            "gate_up_proj", torch.zeros(E, H, 2 * INTER, dtype=FP8), "x.gate_up_proj")


# ---- a tiny Qwen3-MoE laid out as Qwen3-30B-A3B-FP8 --------------------------------

QWEN = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=96,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[1], bos_token_id=1, eos_token_id=2, pad_token_id=0,
            tie_word_embeddings=False)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def qwen3_moe_fp8(tmp_path_factory):
    """Every projection of attention, the dense MLP and the experts fp8 with 128 x 128
    block scales (``weight_scale_inv``); routers, embeddings, norms and the head float.
    Returns the checkpoint and transformers' model on its dequantized weights."""
    import safetensors.torch as st
    import transformers as tf

    path = tmp_path_factory.mktemp("qwen3moe-fp8")
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**QWEN))
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.12)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    tensors = st.load_file(str(path / "model.safetensors"))
    out, dequantized = {}, {}
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in QUANTIZED:
            codes, scale = _quantize(w.float(), (128, 128))
            out[name], out[name[:-len("weight")] + "weight_scale_inv"] = codes, scale
            dequantized[name] = _dequantize(codes, scale, (128, 128))
        else:
            out[name] = w
    st.save_file(out, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = BLOCK_CONFIG
    (path / "config.json").write_text(json.dumps(config))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in dequantized.items():
            if ".experts." not in name:
                params[name].copy_(w)
                continue
            prefix, expert, proj = name.rsplit(".", 3)[:3]
            e, i = int(expert), QWEN["moe_intermediate_size"]
            if proj == "down_proj":
                params[f"{prefix}.down_proj"][e].copy_(w)
            else:
                rows = slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)
                params[f"{prefix}.gate_up_proj"][e, rows].copy_(w)
    return path, model


def test_qwen3_moe_fp8_block_checkpoint_matches_transformers(qwen3_moe_fp8):
    path, hf_model = qwen3_moe_fp8
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              block_size=16, num_blocks=64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, QWEN["vocab_size"], (int(n),), generator=g).tolist()
               for n in torch.randint(12, 30, (3,), generator=g)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, greedy)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=3 * 16, label="qwen3moe fp8")
    model = llm.engine.engine_core.model_runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and all(isinstance(m.method, Fp8MoEMethod) for m in experts)
    assert {m.describe_experts() for m in experts} == {
        "fp8 block 128x128 MoE expert layer(s) dequantized to float32 on the CPU"}
    routers = [m.gate for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert all(isinstance(r.method, DenseMethod) for r in routers)


def test_dummy_weights_quantize_fp8_experts(tmp_path, capfd) -> None:
    """``--load-format dummy`` with an FP8 MoE config: the experts are drawn dense and
    quantized by their method (positive scales, codes that stand for the draws), and the
    start-up line names them."""
    import json

    from vllmpy import LLM, SamplingParams

    cfg = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
               hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
               vocab_size=256, max_position_embeddings=256, num_experts=4,
               num_experts_per_tok=2, norm_topk_prob=True,
               quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, device="cpu",
              dtype="float32", block_size=16, num_blocks=16)
    assert "fp8 block 128x128 MoE expert layer(s)" in capfd.readouterr().err
    experts = llm.engine.engine_core.model_runner.model.model.layers[0].mlp.experts
    w13 = experts.w13.detach()  # dequantized at load on the CPU
    assert w13.abs().max() > 0 and 0.01 < w13.std().item() < 0.03  # the 0.02 draws
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 2
