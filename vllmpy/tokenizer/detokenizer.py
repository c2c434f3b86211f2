"""Turning a stream of generated token ids into a stream of text deltas.

Decoding one token at a time goes wrong twice: a byte-level token can hold part of a UTF-8
character (an emoji is often four byte tokens), and some decoders change a token's text
depending on what precedes it (SentencePiece drops the leading space of the first token). So we
decode a short window of ids and keep two offsets into it:

    ids:   ... | prefix_offset ........... | read_offset ........... | end
                 already emitted (context)   not yet emitted

    new text = decode(ids[prefix:])[len(decode(ids[prefix:read])):]

When the new text ends in U+FFFD, the last tokens hold an incomplete UTF-8 sequence: only the
text up to the last token boundary that ends on a whole character is emitted, and the rest waits
for its missing bytes. Each emission slides the window forward (prefix <- read, read <- the
emitted boundary), so each token costs O(window), not O(output length). The first window starts with a few prompt tokens as context.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllmpy.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the first output tokens, as context for the decoder.
_PROMPT_CONTEXT = 5
# An incomplete UTF-8 character has at most 3 of its bytes, so sits in the last 3 tokens at most.
_MAX_CHAR_TOKENS = 3
# Text that still ends in U+FFFD with more pending tokens than this holds bytes that are
# invalid, not incomplete, and is emitted as it decodes.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    """Text deltas for one request's output tokens.

    Contract: the deltas `add_tokens` returns, followed by what `flush()` returns, concatenate to
    `tokenizer.decode(output_ids, skip_special_tokens=...)` for byte-level tokenizers. No delta
    ends in a character cut in half; `flush()` emits any bytes still incomplete at the very end
    as U+FFFD. (For a decoder that strips a leading space, the first delta keeps the space the
    prompt context gives it, as streaming servers do.)
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # The window: self._ids[:self._read] is context (already emitted, or prompt), the rest is
        # pending. Everything before the context has been dropped, so prefix_offset is always 0.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._read = len(self._ids)
        self._parts: list[str] = []
        self._text_cache: str | None = ""
        self.num_output_tokens = 0

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._parts)
        return self._text_cache

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append generated ids; return only the new complete text (possibly "")."""
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self.num_output_tokens += len(new_ids)
        prefix_text, text = self._window_texts()
        end = len(self._ids)
        if not text.endswith(_REPLACEMENT):
            return self._emit(text[len(prefix_text):], end)
        # The last few tokens may hold a character cut short: emit up to the last token boundary
        # that ends on a whole character and keep the rest pending.
        for cut in range(end - 1, max(self._read, end - 1 - _MAX_CHAR_TOKENS), -1):
            head = self._decode(self._ids[:cut])
            if not head.endswith(_REPLACEMENT):
                return self._emit(head[len(prefix_text):], cut)
        if end - self._read > _MAX_PENDING:
            return self._emit(text[len(prefix_text):], end)  # invalid bytes, not incomplete ones
        return ""

    def flush(self) -> str:
        """Emit whatever is still held back (an incomplete sequence decodes as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text, text = self._window_texts()
        return self._emit(text[len(prefix_text):], len(self._ids))

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _window_texts(self) -> tuple[str, str]:
        """(text of the context, text of context + pending ids)."""
        return self._decode(self._ids[:self._read]), self._decode(self._ids)

    def _emit(self, delta: str, end: int) -> str:
        # Slide the window: ids [read, end) become the context, older ids are dropped, and ids
        # from `end` on stay pending.
        del self._ids[:self._read]
        self._read = end - self._read
        if delta:
            self._parts.append(delta)
            self._text_cache = None
        return delta
