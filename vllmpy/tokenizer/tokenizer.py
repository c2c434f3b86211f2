"""The tokenizer the frontend uses: a `tokenizers.Tokenizer` plus what the checkpoint says about it.

Both loaders (`hf.py` for a tokenizer.json directory, `gguf_tokenizer.py` for a GGUF file) build
the backend completely -- normalizer, pre-tokenizer, model, decoder, added tokens and a
post-processor that adds BOS/EOS exactly when the checkpoint asks for it -- and hand it to
`Tokenizer`, which adds chat templating, id checks and a few derived facts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, processors

from vllmpy.tokenizer.chat_template import render_chat_template


@functools.cache
def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    given the code points 256, 257, ... in byte order, so every byte has a visible spelling.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def bos_eos_post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None,
                           add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
    """A post-processor that puts BOS before and/or EOS after a sequence when asked to.

    `bos` / `eos` are `(token text, id)`; asking for one the checkpoint does not define is refused.
    """
    if add_bos and bos is None:
        raise ValueError("the checkpoint asks to add a BOS token but defines no BOS token id")
    if add_eos and eos is None:
        raise ValueError("the checkpoint asks to add an EOS token but defines no EOS token id")
    head = f"{bos[0]}:0 " if add_bos and bos else ""
    tail = f" {eos[0]}:0" if add_eos and eos else ""
    pair_head = f" {bos[0]}:1" if add_bos and bos else ""
    pair_tail = f" {eos[0]}:1" if add_eos and eos else ""
    special = [tok for tok, wanted in ((bos, add_bos), (eos, add_eos)) if wanted and tok]
    return processors.TemplateProcessing(
        single=f"{head}$A:0{tail}",
        pair=f"{head}$A:0{tail}{pair_head} $B:1{pair_tail}",
        special_tokens=list(dict.fromkeys(special)),
    )


class Tokenizer:
    """Text <-> token ids for one checkpoint.

    Contract:
    - `encode(text, add_special_tokens=True)` adds BOS/EOS only where the checkpoint asks for
      them (the backend's post-processor says so); text spelling a special token such as
      `<|im_start|>` becomes that token.
    - `decode(ids)` refuses ids outside `[0, vocab_size)` with a ValueError naming the id.
    - `apply_chat_template` renders the checkpoint's Jinja chat template (see chat_template.py).
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, chat_template: str | None) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        for name, token_id in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"{name}={token_id} is outside the vocabulary of "
                                 f"{self.vocab_size} tokens")
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_id: int | None = eos_token_id
        self.chat_template: str | None = chat_template
        self.bos_token: str | None = self._token_text(bos_token_id)
        self.eos_token: str | None = self._token_text(eos_token_id)
        added = backend.get_added_tokens_decoder()
        # The ids decode(skip_special_tokens=True) drops, ascending.
        self.all_special_ids: list[int] = sorted(i for i, tok in added.items() if tok.special)

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying `tokenizers.Tokenizer` (for batch encoding and streaming decoders)."""
        return self._backend

    def _token_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        self._check_ids(ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary spelling of each id (byte-level vocabularies spell a space as 'Ġ')."""
        self._check_ids(ids)
        return [self._backend.id_to_token(i) or "" for i in ids]

    def _check_ids(self, ids: Iterable[int]) -> None:
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary of "
                                 f"{self.vocab_size} tokens")

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """Length in UTF-8 bytes of the longest token's text.

        A text of N bytes therefore needs at least ceil(N / max_token_bytes) tokens.
        """
        vocab = self._backend.get_vocab(with_added_tokens=True)
        if isinstance(self._backend.decoder, decoders.ByteLevel):
            # A token spelled in the byte alphabet stands for one byte per character; added
            # tokens spelled otherwise stand for their own UTF-8 text.
            alphabet = set(byte_level_alphabet().values())
            return max(len(tok) if set(tok) <= alphabet else len(tok.encode("utf-8"))
                       for tok in vocab)
        texts = self._backend.decode_batch([[i] for i in vocab.values()],
                                           skip_special_tokens=False)
        return max(len(text.encode("utf-8")) for text in texts)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render `messages` with the checkpoint's chat template; tokenize the result with
        `encode(text, add_special_tokens=False)` (the template writes its own special tokens)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass a prompt instead of messages "
                             "or supply a chat template")
        return render_chat_template(
            self.chat_template, messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools, bos_token=self.bos_token, eos_token=self.eos_token,
            chat_template_kwargs=chat_template_kwargs,
        )

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_id={self.eos_token_id}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")
