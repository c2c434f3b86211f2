"""Recurrent-state seats on a hybrid model (Mamba2 layers beside attention): one seat per
running sequence, sized with the KV blocks from one pool. A byte budget that holds fewer
seats than --max-num-seqs lowers the ceiling, says so on stderr, and still serves every
request; a budget that holds no sequence is refused with its arithmetic."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import assert_outputs_match

from vllmpy import LLM, SamplingParams
from vllmpy.config import ConfigError, EngineArgs
from vllmpy.core.cache_spec import CacheLayout, RecurrentStateSpec
from vllmpy.engine.configure import build_engine_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
           layer_types=["mamba", "attention", "mamba"], num_attention_heads=4,
           num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
           mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
           num_local_experts=0, shared_intermediate_size=96, max_position_embeddings=256,
           position_embedding_type="rope", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.GraniteMoeHybridForCausalLM(tf.GraniteMoeHybridConfig(**CFG)).float().eval()
    with torch.no_grad():  # larger-than-default weights make the logits decisive
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif not name.endswith(("A_log", "dt_bias", ".D")):
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp("granite-hybrid")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(4, 40, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


def _config(path, **kwargs):
    args = EngineArgs(model=str(path), skip_tokenizer_init=True, device="cpu",
                      **{"dtype": "float32", "block_size": 16, **kwargs})
    return build_engine_config(args)


def test_the_pool_holds_one_seat_per_sequence(hybrid, capfd):
    path, _ = hybrid
    config = _config(path, num_blocks=64, max_num_seqs=8)
    layout = config.cache.layout
    assert isinstance(layout, CacheLayout) and layout.is_hybrid
    kinds = [type(s) for s in layout.specs]
    assert kinds.count(RecurrentStateSpec) == 2 and len(layout.paged) == 1
    # a seat: each Mamba2 layer's conv window and SSM state, in float32
    conv_dim = 2 * 64 + 2 * 2 * 16  # x, then B and C of each group
    per_layer = (conv_dim * 3 + 8 * 16 * 16) * 4
    assert config.cache.bytes_per_seat == 2 * per_layer
    assert config.cache.num_seats == 8 and config.scheduler.max_num_seqs == 8
    assert config.cache.bytes_per_block == 2 * 16 * 2 * 16 * 4  # the one attention layer
    assert not config.cache.enable_prefix_caching
    err = capfd.readouterr().err
    assert "prefix caching: off for GraniteMoeHybridForCausalLM" in err
    assert f"recurrent state: 8 seats x {2 * per_layer} bytes" in err


def test_fewer_seats_than_max_num_seqs_serve_every_request(hybrid, capfd):
    path, hf_model = hybrid
    per_seat = _config(path, num_blocks=64).cache.bytes_per_seat
    per_block = 2 * 16 * 2 * 16 * 4
    budget = 3 * per_seat + 16 * per_block  # 3 seats beside one 256-token sequence's blocks
    capfd.readouterr()
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              block_size=16, kv_cache_memory=budget, max_num_seqs=16,
              max_num_batched_tokens=24)
    err = capfd.readouterr().err
    assert "recurrent-state budget: reduced max_num_seqs from 16 to 3" in err
    core = llm.engine.engine_core
    assert core.scheduler.max_num_seqs == 3
    prompts = _prompts(16)
    outs = llm.generate(prompts, GREEDY)
    assert len(outs) == 16 and all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert_outputs_match(outs, hf_model, prompts, min_tokens=16 * 6, label="3 seats")
    runner = core.model_runner  # 16 requests went through the same 3 seats
    assert sorted([*runner._seat_of.values(), *runner._free_seats]) == [0, 1, 2]


def test_preempted_requests_recompute_their_state(hybrid):
    path, hf_model = hybrid
    prompts = _prompts(6)
    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
              block_size=4, num_blocks=20, max_model_len=64, max_num_batched_tokens=9)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.engine_core.scheduler.num_preemptions_total > 0
    assert_outputs_match(outs, hf_model, prompts, min_tokens=6 * 6, label="preempted")


def test_a_budget_without_room_for_one_sequence_is_refused(hybrid):
    path, _ = hybrid
    per_seat = _config(path, num_blocks=64).cache.bytes_per_seat
    with pytest.raises(ConfigError, match=rf"recurrent state takes {per_seat} bytes and its "
                                          r"16 KV blocks"):
        _config(path, kv_cache_memory=per_seat, max_model_len=256)
    with pytest.raises(ConfigError, match="speculative decoding is not supported"):
        _config(path, num_blocks=64,
                speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_ssm_state_dtype_flag(hybrid):
    path, _ = hybrid
    config = _config(path, num_blocks=64, dtype="bfloat16", mamba_ssm_cache_dtype="float32")
    assert config.cache.ssm_cache_dtype == torch.float32
    auto = _config(path, num_blocks=64, dtype="bfloat16")
    assert auto.cache.ssm_cache_dtype == torch.bfloat16
    assert config.cache.bytes_per_seat > auto.cache.bytes_per_seat  # the SSM half doubles
    with pytest.raises(ConfigError, match="--mamba-ssm-cache-dtype 'float16'"):
        _config(path, num_blocks=64, mamba_ssm_cache_dtype="float16")
