"""The CPU attention's decode copies through the whole engine: requests that finish at
different times, join between steps and share the batch give the same greedy tokens with
the copies as with a fresh gather every step."""

from __future__ import annotations

import json

import pytest
import torch

from attention.cpu_paths import use_torch_ops

from vllmpy import LLM, SamplingParams
from vllmpy.attention import cpu_backend
from vllmpy.attention.cpu_backend import _DecodePlan

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
          "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """An engine whose decodes run through PyTorch's ops (the path that keeps the copies),
    not the C kernel."""
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.MonkeyPatch.context() as mp:
        use_torch_ops(mp)
        yield LLM(model=str(path), load_format="dummy", device="cpu", num_blocks=160,
                  block_size=8, max_model_len=512, max_num_seqs=8)


def run(llm: LLM) -> list[list[int]]:
    # 14 requests through 8 rows: some finish early and others take their rows
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 256 for j in range(5 + 3 * i)]}
               for i in range(14)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 5 * (i % 7), ignore_eos=True)
              for i in range(14)]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_tokens_with_the_copies_equal_those_of_a_gather_every_step(llm, monkeypatch):
    plans: list[_DecodePlan] = []
    init = _DecodePlan.__init__

    def kept(self, *args):
        init(self, *args)
        plans.append(self)

    monkeypatch.setattr(_DecodePlan, "__init__", kept)
    monkeypatch.setattr(cpu_backend, "MIRROR_MIN_KV_ELEMENTS", 1 << 62)  # always gather
    gathered = run(llm)
    assert plans == []
    monkeypatch.setattr(cpu_backend, "MIRROR_MIN_KV_ELEMENTS", 0)  # copies for every decode
    copied = run(llm)
    assert copied == gathered
    # the copies did serve: most rows took only their new token (a step after a prefill
    # gathers every row again)
    reused = sum(len(p.lens) - len(p.fresh) for p in plans)
    rows = sum(len(p.lens) for p in plans)
    assert reused > rows / 2
    # and a request finishing let another take its row, gathered afresh
    assert any(0 < len(p.fresh) < len(p.lens) for p in plans)


def test_the_copies_never_take_more_memory_than_the_cache(llm, monkeypatch):
    monkeypatch.setattr(cpu_backend, "MIRROR_MIN_KV_ELEMENTS", 0)
    run(llm)
    cache_bytes = 2 * 160 * 8 * 2 * 16 * 4  # keys and values, float32, per layer
    model = llm.engine.engine_core.model_runner.model
    mirrors = [m.backend._mirror for m in model.modules()
               if isinstance(getattr(m, "backend", None), cpu_backend.CpuAttentionBackend)]
    assert mirrors and all(m is not None for m in mirrors)
    for mirror in mirrors:
        assert mirror.kv.dtype == torch.float32
        assert mirror.kv.numel() * 4 <= cache_bytes
