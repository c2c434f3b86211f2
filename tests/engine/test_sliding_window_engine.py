"""Sliding windows through the engine: prefix caching, chunked prefill, preemption and the
pool's accounting on tiny random-weight Mistral (a window of 8 on every layer) and Qwen2
(a window of 12 from its second layer on, the first layer full), against transformers'
greedy tokens and top-5 log-probs on the same weights. transformers' own sliding mask is
the oracle; the first test checks that it hides exactly the keys a window should."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_oracle import assert_outputs_match, hf_scored

from vllmpy import LLM, SamplingParams

VOCAB = 256
COMMON: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                              max_position_embeddings=512, rms_norm_eps=1e-6)
MODELS = {  # kind: (layers, window)
    "mistral": (2, 8),
    "qwen2": (3, 12),
}
NEW_TOKENS = 24
# top-5 log-probs too: a slip in the window that leaves the greedy tokens alone shows there
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def _make(kind: str, path) -> torch.nn.Module:
    import transformers as tf

    layers, window = MODELS[kind]
    torch.manual_seed(0)
    model: Any  # a transformers PreTrainedModel
    if kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(
            **COMMON, num_hidden_layers=layers, sliding_window=window,
            tie_word_embeddings=False))
    else:  # layer 0 full, layers 1.. windowed
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(
            **COMMON, num_hidden_layers=layers, sliding_window=window, use_sliding_window=True,
            max_window_layers=1, tie_word_embeddings=True))
        assert model.config.layer_types == ["full_attention"] + ["sliding_attention"] * 2
    # Larger-than-default weights make the logits decisive, so greedy paths are long.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (checkpoint path, transformers model), each built once."""
    built: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in built:
            path = tmp_path_factory.mktemp(kind)
            built[kind] = path, _make(kind, path)
        return built[kind]

    return get


def _llm(path, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, device="cpu", dtype="float32",
                enable_prefix_caching=True)
    return LLM(str(path), **{**args, **kwargs})


def _tokens(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _assert_pool_idle(llm: LLM, num_blocks: int) -> None:
    core = llm.engine.engine_core
    assert not llm.has_unfinished_requests() and not core.scheduler.requests
    assert core.kv_cache_manager.num_free_blocks == num_blocks


# ---- the oracle ------------------------------------------------------------------------


@torch.inference_mode()
def test_transformers_hides_exactly_the_keys_outside_the_window(tiny):
    """Two layers of window W: the logits at p depend on the tokens p - 2(W - 1) .. p and
    on no earlier one."""
    _, hf_model = tiny("mistral")
    assert hf_model.config.sliding_window == 8
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([_tokens(48, g)] * 3)
    p, reach = 40, 2 * (8 - 1)
    ids[1, p - reach - 1] = (ids[1, p - reach - 1] + 1) % VOCAB  # just outside
    ids[2, p - reach] = (ids[2, p - reach] + 1) % VOCAB  # the earliest token still seen
    logits = hf_model(input_ids=ids, use_cache=False).logits[:, p]
    assert torch.equal(logits[1], logits[0])
    assert (logits[2] - logits[0]).abs().max() > 1e-3


# ---- prefix caching ----------------------------------------------------------------------


@pytest.mark.parametrize("kind, block_size", [("mistral", 16), ("qwen2", 8)])
def test_shared_prefixes_hit_the_cache_and_match_transformers(tiny, kind, block_size):
    """Prompts of 24 to 70 tokens sharing a 48-token prefix (longer than the window and
    than three blocks): once the first has run, the others start from its cached blocks
    (counted in tokens by the engine's stats) and still give transformers' tokens."""
    path, hf_model = tiny(kind)
    g = torch.Generator().manual_seed(1)
    prefix = _tokens(48, g)
    first = prefix + _tokens(6, g)
    later = [prefix + _tokens(19, g), prefix[:21] + _tokens(3, g), prefix + _tokens(22, g),
             list(first)]
    # the blocks a prompt shares with ``first`` in full, up to the one holding its last token
    shared = [48, 21, 48, len(first)]
    expected_hits = [min(s // block_size, (len(p) - 1) // block_size) * block_size
                     for s, p in zip(shared, later)]
    assert all(h > 8 for h in expected_hits)  # each hit spans more than a window

    num_blocks = 64
    llm = _llm(path, block_size=block_size, num_blocks=num_blocks, max_model_len=128)
    core = llm.engine.engine_core
    before = core.get_stats()
    outs = llm.generate([first], GREEDY, use_tqdm=False)
    outs += llm.generate(later, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] + expected_hits
    stats = core.get_stats()
    prompts = [first] + later
    assert (stats.prefix_cache_queries_total - before.prefix_cache_queries_total
            == sum(map(len, prompts)))
    assert stats.prefix_cache_hits_total - before.prefix_cache_hits_total == sum(expected_hits)
    assert outs[-1].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_outputs_match(outs, hf_model, prompts, min_tokens=len(prompts) * NEW_TOKENS // 2,
                         label=f"{kind} bs={block_size}")
    _assert_pool_idle(llm, num_blocks)


# ---- chunked prefill and preemption ------------------------------------------------------


@pytest.mark.parametrize("kind, block_size", [("mistral", 8), ("qwen2", 16)])
def test_chunked_prefill_and_preemption_match_transformers(tiny, kind, block_size):
    """With prefix caching on: prefill chunks of 5 tokens (under the window) in a roomy
    pool, then chunks of 20 (over it) in a pool too small for the batch, so requests are
    preempted and recomputed. Both give transformers' tokens and end with every block
    free."""
    path, hf_model = tiny(kind)
    g = torch.Generator().manual_seed(2)
    prefix = _tokens(30, g)
    prompts = [prefix + _tokens(k, g) for k in (25, 4, 38)] + [_tokens(20, g)]
    max_model_len = 96
    for chunk, num_blocks in ((5, 64), (20, max_model_len // block_size + 2)):
        llm = _llm(path, block_size=block_size, num_blocks=num_blocks,
                   max_model_len=max_model_len, max_num_batched_tokens=chunk)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        label = f"{kind} bs={block_size} chunk={chunk} blocks={num_blocks}"
        assert_outputs_match(outs, hf_model, prompts,
                             min_tokens=len(prompts) * NEW_TOKENS // 2, label=label)
        preemptions = llm.engine.engine_core.scheduler.num_preemptions_total
        assert (preemptions > 0) == (num_blocks < 64), f"{label}: {preemptions} preemptions"
        _assert_pool_idle(llm, num_blocks)


# ---- a request far longer than the window ------------------------------------------------


def test_a_request_25_windows_long_matches_transformers(tiny):
    """A 200-token prompt under a window of 8, in prefill chunks of 64 and decoded beside a
    short request, gives transformers' tokens, and transformers without the window gives
    others (so an engine ignoring the window would fail). Each step the long request holds
    a block for every token given a slot, the ones out of the window included, and the
    pool counts the rest free."""
    import transformers as tf

    path, hf_model = tiny("mistral")
    g = torch.Generator().manual_seed(3)
    long, short = _tokens(200, g), _tokens(25, g)
    block_size, num_blocks = 16, 32
    llm = _llm(path, block_size=block_size, num_blocks=num_blocks, max_model_len=256,
               max_num_batched_tokens=64)
    core = llm.engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=5)
    long_id = llm.add_request(long, params)
    llm.add_request(short, params)
    outs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                outs[out.request_id] = out
        request = core.scheduler.requests.get(long_id)
        if request is not None:
            held = core.kv_cache_manager.get_block_ids(long_id)
            assert len(held) == -(-request.num_computed_tokens // block_size)
            others = sum(len(core.kv_cache_manager.get_block_ids(r))
                         for r in core.scheduler.requests if r != long_id)
            assert core.kv_cache_manager.num_free_blocks == num_blocks - len(held) - others
    assert core.scheduler.num_preemptions_total == 0
    _assert_pool_idle(llm, num_blocks)

    ordered = [outs[long_id]] + [o for rid, o in outs.items() if rid != long_id]
    assert_outputs_match(ordered, hf_model, [long, short], min_tokens=32, label="mistral long")
    ours = list(outs[long_id].outputs[0].token_ids)
    unwindowed = tf.MistralForCausalLM.from_pretrained(path, sliding_window=None).eval()
    assert hf_scored(unwindowed, long, ours).tokens != ours
