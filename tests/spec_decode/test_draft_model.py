"""The draft model's own bookkeeping: after a verify it computes only the tokens whose KV
it does not hold, not again the drafts it fed itself that the target accepted."""

from __future__ import annotations

from server_utils import write_tiny_chat_model

from vllmpy import LLM, SamplingParams
from vllmpy.spec_decode import draft_model

K = 3
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROMPT = "one two three four one two three four item 7: def f(x): return x"


def _run(monkeypatch, target: str, draft: str) -> tuple[list[int], LLM]:
    """(tokens of each catch-up forward of the draft after the prompt's, the speculative
    engine), its outputs checked against the plain engine's."""
    sizes: list[int] = []
    original = draft_model.DraftModelProposer._catch_up

    def counting(self, req_ids, ends, drafts):
        before = dict(self.computed)
        original(self, req_ids, ends, drafts)
        sizes.extend(int(end) - before.get(r, 0) for r, end in zip(req_ids, ends)
                     if before.get(r) is not None)

    monkeypatch.setattr(draft_model.DraftModelProposer, "_catch_up", counting)
    engine = dict(load_format="dummy", device="cpu", dtype="float32", max_model_len=512,
                  num_blocks=64)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": K}
    llm = LLM(target, speculative_config=spec, **engine)
    outs = [o.outputs[0].token_ids for o in llm.generate([PROMPT], GREEDY)]
    plain = LLM(target, **engine)
    assert outs == [o.outputs[0].token_ids for o in plain.generate([PROMPT], GREEDY)]
    assert llm.engine.engine_core.get_stats().kv_cache_usage == 0.0
    return sizes, llm


def test_accepted_drafts_are_not_computed_again(tmp_path, monkeypatch):
    """A draft with the target's own (dummy) weights: every draft is accepted, so each
    catch-up after a verify of K drafts is the one draft the draft never fed itself plus
    the target's bonus token (2 tokens), where recomputing the accepted drafts would take
    K + 1."""
    path = write_tiny_chat_model(tmp_path / "target")
    sizes, llm = _run(monkeypatch, path, path)
    stats = llm.engine.engine_core.get_stats().spec_decoding
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # all accepted
    # (the last verify may carry fewer drafts, cut to the tokens max_tokens leaves)
    assert sizes and all(n == 2 for n in sizes[:-1]) and sizes[-1] in (1, 2), str(sizes)


def test_a_rejected_draft_is_computed_again(tmp_path, monkeypatch):
    """A draft that agrees with the target part of the time (the target's first layer):
    a catch-up never skips past the first rejected draft, and the outputs stay the
    plain engine's."""
    import json
    import shutil

    target = write_tiny_chat_model(tmp_path / "target")
    draft = tmp_path / "draft"
    draft.mkdir()
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "target" / name, draft)
    sizes, llm = _run(monkeypatch, target, str(draft))
    stats = llm.engine.engine_core.get_stats().spec_decoding
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # each catch-up: 1 token (its first draft rejected) up to 2 (every draft accepted)
    assert sizes and all(1 <= n <= 2 for n in sizes), sizes
