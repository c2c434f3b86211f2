"""EAGLE and EAGLE-3 heads against an independent reference: every draft the engine
proposed equals what a plain-PyTorch head (written here from the published layouts)
drafts from transformers' hidden states of the same target on the same tokens; greedy
outputs equal the plain engine's; refusals name what is wrong."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError

ENGINE = dict(device="cpu", dtype="float32", max_model_len=512, num_blocks=128)
PROMPTS = [f"{'one two three four ' * (i % 3 + 1)}item {i}: def f{i}(x): return x + {i}"
           for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NEAR_TIE = 1e-4


def _config(head_dir):
    with open(f"{head_dir}/config.json") as f:
        return json.load(f)


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, theta=10000.0):
    """Hugging Face's rotate-half rotary embedding over positions 0..T-1; x [T, heads, d]."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float()
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def _layer(w, prefix, x, residual):
    """One Llama decoder layer over a whole sequence (causal), given the attention's input
    ``x`` and the residual it adds to."""
    t = x.shape[0]
    q = (x @ w[f"{prefix}.self_attn.q_proj.weight"].T).view(t, 4, 16)
    k = (x @ w[f"{prefix}.self_attn.k_proj.weight"].T).view(t, 2, 16)
    v = (x @ w[f"{prefix}.self_attn.v_proj.weight"].T).view(t, 2, 16)
    q, k = _rope(q), _rope(k)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(16)
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, 64)
    h = residual + attn @ w[f"{prefix}.self_attn.o_proj.weight"].T
    n = _rms(h, w[f"{prefix}.post_attention_layernorm.weight"])
    gate = torch.nn.functional.silu(n @ w[f"{prefix}.mlp.gate_proj.weight"].T)
    return h + (gate * (n @ w[f"{prefix}.mlp.up_proj.weight"].T)) @ w[
        f"{prefix}.mlp.down_proj.weight"].T


class ReferenceHead:
    """The head's greedy drafts after a known sequence, recomputed from scratch."""

    def __init__(self, method, head_dir, target):
        from safetensors.torch import load_file

        self.method, self.target = method, target
        self.aux = _config(head_dir).get("eagle_config", {}).get(
            "eagle_aux_hidden_state_layer_ids")
        self.w = load_file(f"{head_dir}/model.safetensors")
        self.embed = target.model.embed_tokens.weight.detach()

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int
               ) -> tuple[list[int], list[float], list[torch.Tensor]]:
        """k drafts after ``tokens``; per draft, the margin of its logit over the runner-up
        (a near tie may flip either way) and the state the LM head read."""
        out = self.target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        if self.method == "eagle":
            states = out.hidden_states[-1][0]  # after the target's final norm
        else:
            states = torch.cat([out.hidden_states[i][0] for i in self.aux], -1)
            states = states @ self.w["fc.weight"].T
        ids = list(tokens[1:])
        drafts, margins, read = [], [], []
        for _ in range(k):
            e = self.embed[torch.tensor(ids)]
            if self.method == "eagle":
                x = torch.cat([e, states], -1) @ self.w["fc.weight"].T
                o = _layer(self.w, "layers.0", x, x)  # no input norm on EAGLE's layer 0
                read.append(o[-1])
                logits = o[-1] @ self.embed.T  # the target's (tied) LM head
            else:
                w = self.w
                x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"]),
                               _rms(states, w["midlayer.hidden_norm.weight"])], -1)
                o = _layer(w, "midlayer", x, states)
                read.append(_rms(o[-1], w["norm.weight"]))
                logits = read[-1] @ w["lm_head.weight"].T
            top = torch.topk(logits, 2)
            best = int(top.indices[0])
            if self.method == "eagle3":
                best += int(self.w["d2t"][best])
            drafts.append(best)
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(best)
            states = torch.cat([states, o[-1:]], 0)  # the output before the final norm
        return drafts, margins, read


def _runner(llm):
    return llm.engine.engine_core.model_runner


@pytest.fixture(scope="module")
def plain(eagle_target):
    llm = LLM(eagle_target, **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_every_draft_is_the_reference_heads_and_outputs_are_lossless(
        method, eagle_target, eagle_heads, plain):
    from transformers import AutoModelForCausalLM

    llm = LLM(eagle_target, speculative_config={
        "method": method, "model": eagle_heads[method], "num_speculative_tokens": 3},
        **ENGINE)
    proposer = _runner(llm).proposer
    head = proposer.model
    # per proposal: the known tokens, the drafts, and the states the head's LM head read
    seen: list[tuple[list[int], list[int], list[torch.Tensor]]] = []
    propose, draft_ids = proposer.propose, head.draft_ids
    calls: list[torch.Tensor] = []

    def read(states):
        calls.append(states.clone())
        return draft_ids(states)

    def spy(token_ids, num_tokens, rows, max_drafts):
        calls.clear()
        out = propose(token_ids, num_tokens, rows, max_drafts)
        # call j holds, in order, the rows that draft more than j tokens
        for r, (row, drafts) in enumerate(zip(rows, out)):
            states = [calls[j][sum(len(d) > j for d in out[:r])] for j in range(len(drafts))]
            seen.append((token_ids[row, :num_tokens[row]].tolist(), drafts, states))
        return out

    proposer.propose, head.draft_ids = spy, read
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == plain
    spec = llm.engine.engine_core.get_stats().spec_decoding
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert llm.engine.engine_core.get_stats().kv_cache_usage == 0.0

    target = AutoModelForCausalLM.from_pretrained(eagle_target, torch_dtype=torch.float32)
    reference = ReferenceHead(method, eagle_heads[method], target.eval())
    checked = 0
    for tokens, drafts, states in seen[::3]:  # every third: prompts and decode steps
        want, margins, want_states = reference.drafts(tokens, len(drafts))
        for i, (a, b) in enumerate(zip(drafts, want)):
            torch.testing.assert_close(states[i], want_states[i], rtol=1e-4, atol=1e-4)
            if a != b:
                assert margins[i] < NEAR_TIE, (tokens, drafts, want, margins)
                break
            checked += 1
    assert checked > 30


def test_eagle3_reads_the_named_target_layers(eagle_target, eagle_heads):
    llm = LLM(eagle_target, speculative_config={
        "method": "eagle3", "model": eagle_heads["eagle3"], "num_speculative_tokens": 2},
        **ENGINE)
    head = _runner(llm).proposer.model
    named = _config(eagle_heads["eagle3"])["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert head.config.aux_layer_ids == tuple(named) == (1, 2, 3)
    assert head.config.draft_vocab_size < head.config.vocab_size
    assert head.embed_tokens is None and head.lm_head is not None
    assert int(head.d2t.abs().sum()) > 0  # the checkpoint's map, not zeros


def _head(tmp_path, name, config, weights_from=None):
    import shutil

    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if weights_from is not None:
        shutil.copy(f"{weights_from}/model.safetensors", path)
    return str(path)


@pytest.mark.parametrize("change, method, needle", [
    ({"architectures": ["LlamaForCausalLMEagle3"]}, "eagle",
     "is an eagle3 head (LlamaForCausalLMEagle3) but the method is 'eagle'"),
    ({"architectures": ["MistralForCausalLM"]}, "eagle",
     "architecture 'MistralForCausalLM', not an EAGLE head"),
    ({"vocab_size": 1000}, "eagle", "vocabulary of 1000 tokens, the target 49152"),
    ({"target_hidden_size": 128}, "eagle", "hidden states of width 128, the target's are 64"),
    ({"architectures": ["LlamaForCausalLMEagle3"],
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, "eagle3",
     "target layers [1, 2, 4]; the target has 4 layers"),
    ({"architectures": ["LlamaForCausalLMEagle3"],
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, "eagle3",
     "names 2 layers; an EAGLE-3 head reads 3"),
    ({"speculators_model_type": "eagle3"}, "eagle3", "speculators format"),
])
def test_heads_that_do_not_fit_are_refused_by_name(tmp_path, eagle_target, eagle_heads,
                                                   change, method, needle):
    config = dict(_config(eagle_heads["eagle"]), **change)
    head = _head(tmp_path, "head", config, eagle_heads["eagle"])
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        LLM(eagle_target, speculative_config={"method": method, "model": head,
                                              "num_speculative_tokens": 2}, **ENGINE)
    assert needle in str(e.value)


def test_the_pool_counts_the_heads_layer(eagle_target, eagle_heads):
    from vllmpy.config import EngineArgs
    from vllmpy.engine.configure import build_engine_config

    common = dict(model=eagle_target, device="cpu", dtype="float32", num_blocks=64)
    plain = build_engine_config(EngineArgs(**common))
    spec = build_engine_config(EngineArgs(**common, speculative_config={
        "method": "eagle", "model": eagle_heads["eagle"], "num_speculative_tokens": 2}))
    # 4 target layers and the head's 1, of the same KV geometry
    assert spec.cache.bytes_per_block * 4 == plain.cache.bytes_per_block * 5
