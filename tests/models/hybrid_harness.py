"""A hybrid (attention + recurrent-state) model driven step by step without the engine:
built as the runner builds it, its paged caches and state seats bound by hand, and greedy
continuations of a batch computed through chunked prefills and decodes. Used to test the
model files against transformers on their own."""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch as st
import torch
from hf_oracle import assert_greedy_match, hf_scored

from vllmpy.attention.metadata import AttentionMetadata
from vllmpy.core.cache_spec import RecurrentStateSpec
from vllmpy.layers.attention import Attention
from vllmpy.layers.custom_op import bind_ops
from vllmpy.loader.materialize import materialize
from vllmpy.models.registry import resolve_model_class, text_config

BLOCK = 16
# the transformers release the model tests compare against (pyproject's test extra)
ORACLE_TRANSFORMERS = "5.23.0"


def build(path: Path, num_seats: int, max_len: int = 256) -> torch.nn.Module:
    """The checkpoint at ``path`` in float32 on the CPU, every cache bound: one paged cache
    of ``num_seats * max_len`` tokens per attention layer, ``num_seats`` state seats per
    recurrent layer. The caching modules must be what the config declares, in order."""
    text = text_config(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = resolve_model_class(text.architectures)(text)
    materialize(model, torch.device("cpu"), torch.float32)
    bind_ops(model, torch.device("cpu"))
    model.load_weights(st.load_file(str(path / "model.safetensors")).items())
    model.eval()
    caching = [m for m in model.modules() if isinstance(m, Attention) or hasattr(m, "bind_state")]
    specs = text.layer_cache_specs()
    assert len(caching) == len(specs), (caching, specs)
    blocks = num_seats * -(-max_len // BLOCK)
    for module, spec in zip(caching, specs):
        if isinstance(spec, RecurrentStateSpec):
            assert module.cache_spec() == spec
            module.bind_state(spec.allocate(num_seats, torch.float32, torch.float32, "cpu"))
        else:
            assert isinstance(module, Attention)
            assert (module.num_kv_heads, module.head_dim, module.sliding_window) == (
                spec.num_kv_heads, spec.head_dim, spec.sliding_window)
            module.bind(torch.zeros(spec.cache_shape(blocks, BLOCK)))
    model.max_len = max_len  # type: ignore[assignment]
    return model


def _metadata(reqs: list[int], done: list[int], counts: list[int], max_len: int
              ) -> AttentionMetadata:
    per_seat = -(-max_len // BLOCK)
    qsl, seq_lens, slots = [0], [], []
    for r, n in zip(reqs, counts):
        qsl.append(qsl[-1] + n)
        seq_lens.append(done[r] + n)
        slots += [r * per_seat * BLOCK + p for p in range(done[r], done[r] + n)]
    tables = torch.tensor([[r * per_seat + b for b in range(per_seat)] for r in reqs],
                          dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=qsl[-1], query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        query_start_loc_cpu=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=seq_lens, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables, block_size=BLOCK, max_query_len=max(counts),
        max_seq_len=max(seq_lens), state_indices=torch.tensor(reqs, dtype=torch.int32),
        state_indices_cpu=list(reqs))


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
           chunk: int = 7) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Every prompt at once (request r in seat r), prompts fed ``chunk`` tokens a step
    beside the others' decodes. Returns each request's tokens and log-probs [steps, vocab]."""
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(o) < max_tokens for o in out):
        reqs = [r for r in range(len(prompts)) if len(out[r]) < max_tokens]
        counts = [min(chunk, len(tokens[r]) - done[r]) for r in reqs]
        meta = _metadata(reqs, done, counts, model.max_len)
        ids = torch.tensor([t for r, n in zip(reqs, counts)
                            for t in tokens[r][done[r]:done[r] + n]])
        positions = torch.tensor([p for r, n in zip(reqs, counts)
                                  for p in range(done[r], done[r] + n)])
        hidden = model(ids, positions, meta)
        for i, (r, n) in enumerate(zip(reqs, counts)):
            done[r] += n
            if done[r] == len(tokens[r]):  # the prompt is in: sample
                row = hidden[meta.query_start_loc_cpu[i + 1] - 1]
                lp = torch.log_softmax(model.compute_logits(row[None]).float(), -1)[0]
                tok = int(lp.argmax())
                out[r].append(tok)
                tokens[r].append(tok)
                logprobs[r].append(lp)
    return out, [torch.stack(lp) for lp in logprobs]


def assert_matches_transformers(model: torch.nn.Module, hf_model: torch.nn.Module,
                                prompts: list[list[int]], max_tokens: int, min_tokens: int,
                                chunk: int = 7, atol: float = 1e-3) -> None:
    """Our greedy tokens are transformers' (the near-tie rule of ``assert_greedy_match``)
    and our log-probs of every token, at each compared step, transformers' within atol."""
    outs, logprobs = greedy(model, prompts, max_tokens, chunk)
    compared = 0
    for prompt, ours, lp in zip(prompts, outs, logprobs, strict=True):
        ref = hf_scored(hf_model, prompt, ours)
        steps = assert_greedy_match(ours, ref, f"prompt {prompt[:4]}")
        torch.testing.assert_close(lp[:steps], ref.logprobs[:steps], atol=atol, rtol=0)
        compared += steps
    assert compared >= min_tokens, f"only {compared} tokens compared (floor {min_tokens})"


@torch.no_grad()
def assert_gated_norms_grouped(hf_model: torch.nn.Module) -> int:
    """transformers' Mamba2 mixers of more than one group normalize each group of
    intermediate_size / n_groups channels on its own, as the original Mamba2
    (mamba_ssm's RMSNormGated with group_size = d_ssm // ngroups) and ``Mamba2Mixer`` do:
    scaling every group but the first leaves the first group's output as it was. Some
    releases (transformers 5.17's Mamba2 and GraniteMoeHybrid) normalize over the whole
    width; against those the engine is off for reasons of the oracle's own. Returns the
    number of grouped norms checked."""
    import transformers

    checked = 0
    for name, mixer in hf_model.named_modules():
        norm, groups = getattr(mixer, "norm", None), getattr(mixer, "n_groups", 1)
        if norm is None or not hasattr(mixer, "A_log") or groups < 2:
            continue
        width = norm.weight.shape[0]
        first = width // groups
        g = torch.Generator().manual_seed(0)
        x, gate = (torch.randn(1, 2, width, generator=g).to(norm.weight) for _ in range(2))
        scaled = x.clone()
        scaled[..., first:] *= 10.0  # [1, 2, width]: every group but the first
        before, after = norm(x, gate)[..., :first], norm(scaled, gate)[..., :first]
        assert torch.allclose(before, after, rtol=1e-3, atol=1e-5), (
            f"transformers {transformers.__version__}: {type(norm).__name__} of {name} "
            f"normalizes over all {width} channels, not per group of {first} "
            f"(n_groups={groups}) as Mamba2 does; the model tests' oracle is "
            f"transformers=={ORACLE_TRANSFORMERS}")
        checked += 1
    return checked
