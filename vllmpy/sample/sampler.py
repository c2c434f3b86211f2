"""Sampler: one token id per logits row, following vLLM v1's order of operations.

1. float32; logit_bias added; stop/EOS ids of requests under min_tokens set to -inf.
2. Penalties: repetition (CTRL rule over prompt + output tokens), frequency and presence
   (over output tokens).
3. Greedy rows take the argmax here.
4. Temperature; then min-p; then top-k and top-p.
5. Random rows: ``argmax(probs / q)`` with ``q ~ Exponential(1)`` (the exponential-race
   form of the Gumbel-max trick), ``q`` drawn from the request's own generator when it has
   one, so a seeded request repeats exactly whatever else is in the batch.

Every step is row-wise and stays on the logits' device. Nothing reads back to the host,
except that on the CPU (where it costs nothing) top-p checks one flag to skip a full sort.
"""

from __future__ import annotations

import torch

from vllmpy.sample.metadata import SamplingMetadata

_TINY = torch.finfo(torch.float32).tiny


class Sampler(torch.nn.Module):
    """``forward(logits [num_reqs, vocab_size], metadata) -> [num_reqs] int64`` token ids.

    The input logits are left unchanged; any float dtype is accepted and the work is done
    in float32. The result is on the logits' device. ``sample`` also returns the logits
    of the distribution each row was drawn from (what processed logprobs report).
    """

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return self.sample(logits, metadata)[0]

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([num_reqs] int64 token ids, [num_reqs, vocab_size] processed logits): the
        logits after every step above (tokens masked away are -inf); on the fast path,
        where nothing changes them, the input logits themselves. With ``out`` (an int64
        [num_reqs] on the logits' device) the ids are written there, and it is returned."""
        sampled, processed = self._sample(logits, metadata, out)
        if out is not None and sampled is not out:
            out.copy_(sampled)
            return out, processed
        return sampled, processed

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata,
                out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        md = metadata
        if logits.dim() != 2 or tuple(logits.shape) != (md.num_reqs, md.vocab_size):
            raise ValueError(f"logits of shape {tuple(logits.shape)} do not match the "
                             f"metadata ({md.num_reqs} requests, vocab {md.vocab_size})")
        if plain_argmax(md):
            # Converting to float32 is exact and monotonic, so it cannot change the argmax;
            # on the CPU the float32 argmax is several times faster than the bfloat16 one
            # (docs/perf-log/cpu-decode.md, "the 16-stream spread").
            scores = logits.float() if logits.device.type == "cpu" else logits
            return greedy_ids(scores, out), logits
        logits = apply_logits_processors(logits.float(), md)
        greedy = None if md.all_random else greedy_ids(logits)
        if md.all_greedy:
            assert greedy is not None
            return greedy, logits
        logits = apply_sampling_filters(logits, md)
        sampled = random_sample(logits.softmax(dim=-1), md.generators)
        if greedy is None:
            return sampled, logits
        assert md.greedy_mask is not None
        return torch.where(md.greedy_mask, greedy, sampled), logits


def plain_argmax(md: SamplingMetadata) -> bool:
    """Whether every row's id is the argmax of its logits as they come: all greedy, and no
    bias, penalty or min_tokens mask changes a logit."""
    return md.all_greedy and md.no_penalties and md.no_logit_bias and md.no_min_tokens


def greedy_ids(scores: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax (the first position of its largest score), into ``out`` when given.
    On a GPU the rows are split over many programs (``vllmpy.ops.argmax``): a single
    150k-wide row is one block's work for ``torch.argmax``."""
    if scores.is_cuda:
        from vllmpy.ops.argmax import argmax_rows  # Triton, imported only on a GPU

        return argmax_rows(scores if scores.stride(-1) == 1 else scores.contiguous(), out)
    if out is not None:
        return torch.argmax(scores, dim=-1, out=out)
    return scores.argmax(dim=-1)


def apply_sampling_filters(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Temperature, then min-p, then top-k and top-p: the logits of the distribution a
    random row draws from. [num_reqs, vocab] fp32, out of place."""
    assert md.temperature is not None
    logits = logits / md.temperature.unsqueeze(1)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        logits = apply_top_k_top_p(logits, md.top_k, md.max_top_k, md.top_p)
    return logits


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logit_bias, min_tokens masking and penalties, out of place. [num_reqs, vocab] fp32."""
    if md.logit_bias_index is not None:
        assert md.logit_bias_values is not None
        logits = logits.index_put(md.logit_bias_index, md.logit_bias_values, accumulate=True)
    if md.min_tokens_index is not None:
        logits = logits.index_put(md.min_tokens_index, logits.new_full((), float("-inf")))
    if not md.no_penalties:
        logits = apply_penalties(logits, md)
    return logits


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_reqs, vocab_size] float32 occurrence counts of ids padded with vocab_size."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]  # drop the padding column


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM's penalties. Repetition: a token seen in the prompt or the output has its
    logit divided by the penalty when positive, multiplied when not. Then frequency
    (times the token's count in the output) and presence (once if in the output) are
    subtracted."""
    assert md.output_token_ids is not None
    output_counts = _token_counts(md.output_token_ids, md.vocab_size)
    output_mask = output_counts > 0
    if md.repetition_penalties is not None:
        assert md.prompt_token_ids is not None
        seen = output_mask | (_token_counts(md.prompt_token_ids, md.vocab_size) > 0)
        penalty = torch.where(seen, md.repetition_penalties.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if md.frequency_penalties is not None:
        logits = logits - md.frequency_penalties.unsqueeze(1) * output_counts
    if md.presence_penalties is not None:
        logits = logits - md.presence_penalties.unsqueeze(1) * output_mask
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability
    (computed after temperature, as vLLM does). The top token always survives."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k then top-p (over the top-k survivors), as in vLLM.

    Top-k keeps every token whose logit is at least the k-th largest (ties at the k-th
    value all stay, as in vLLM and Hugging Face). Top-p keeps the smallest set of most
    likely tokens whose probability reaches p: a token stays when the mass ranked above it
    is below p, so the top token always stays; among equal probabilities the lower token
    id ranks first. Rows with k == vocab_size or p == 1 keep everything.
    """
    if top_k is not None:
        logits = _apply_top_k_only(logits, top_k, max_top_k)
    if top_p is None:
        return logits
    if logits.device.type == "cpu":
        # On the CPU reading a flag back costs nothing, and a full-vocabulary sort is slow.
        kept = _apply_top_p_candidates(logits, top_p)
        if kept is not None:
            return kept
    return _apply_top_p_sorted(logits, top_p)


def _apply_top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p over a full sort of each row."""
    # Stable descending sort: ties keep token-id order.  [num_reqs, vocab]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1)
    mass_above = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
    # p == 1 keeps everything even where float32 rounding lets the sum reach 1 early.
    drop = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


_TOP_P_CANDIDATES = 1024


def _apply_top_p_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Top-p over the few most likely tokens of each row, or None when some row's nucleus
    may reach past them (the caller then sorts everything). Same result as the full sort.
    """
    num_candidates = min(_TOP_P_CANDIDATES, logits.shape[1])
    probs = logits.softmax(dim=-1)
    values, ids = probs.topk(num_candidates, dim=-1)  # [num_reqs, num_candidates]
    # Order the candidates by probability, then by token id (topk leaves ties unordered).
    ids, by_id = ids.sort(dim=-1)
    values, by_prob = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, by_prob)
    cumulative = values.cumsum(dim=-1)
    mass_above = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
    # Every token strictly more likely than the last candidate is a candidate. If those
    # alone reach p, the first token after them is dropped and so is everything below,
    # whichever tied tokens topk happened to pick last.
    first_not_above = (values > values[:, -1:]).sum(dim=-1, keepdim=True)
    settled = (mass_above.gather(1, first_not_above).squeeze(1) >= top_p) | (top_p >= 1.0)
    if num_candidates < logits.shape[1] and not bool(settled.all()):
        return None
    kept_logits = logits.gather(1, ids).masked_fill(mass_above >= top_p.unsqueeze(1),
                                                    float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter_(1, ids, kept_logits)
    return torch.where((top_p >= 1.0).unsqueeze(1), logits, filtered)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor,
                      max_top_k: int) -> torch.Tensor:
    """Top-k without a full sort: the k-th largest of each row from one topk(max_top_k)."""
    top_values = logits.topk(max_top_k, dim=-1).values  # [num_reqs, max_top_k], descending
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    # Rows with top-k off (k == vocab_size) keep everything.
    kth = kth.masked_fill((top_k >= logits.shape[1]).unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / q), q ~ Exponential(1): a draw from ``probs``. [num_reqs] int64.

    Rows in ``generators`` draw q from their own generator (one vocab-sized draw per
    step), the rest from the global RNG.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # q == 0 would turn a masked token's 0/0 into NaN, which argmax would pick.
    q.clamp_(min=_TINY)
    return probs.div_(q).argmax(dim=-1)
