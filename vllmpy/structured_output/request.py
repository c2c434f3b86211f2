"""One request's grammar state: its compilation in flight, then its matcher."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from vllmpy.structured_output.params import StructuredOutputsParams


class GrammarCompileError(ValueError):
    """The request's grammar could not be compiled; the message says why."""


class StructuredOutputRequest:
    """Contract: ``ready()`` is False while the grammar compiles, then True for good (it
    builds the matcher on first success) or raises ``GrammarCompileError``. Once ready,
    ``matcher`` has accepted every output token of the request, in order."""

    def __init__(self, request_id: str, params: StructuredOutputsParams,
                 compiled: Future[Any]) -> None:
        self.request_id = request_id
        self.params = params
        self._compiled = compiled
        self.matcher: Any = None  # xgrammar.GrammarMatcher, once the grammar is compiled
        self._warned = False

    @property
    def compilation(self) -> Future[Any]:
        """The compilation in flight (shared with requests of the same grammar)."""
        return self._compiled

    def ready(self) -> bool:
        if self.matcher is not None:
            return True
        if not self._compiled.done():
            return False
        exc = self._compiled.exception()
        if exc is not None:
            raise GrammarCompileError(f"request {self.request_id!r}: {exc}") from exc
        from vllmpy.structured_output.backend_xgrammar import xgr

        self.matcher = xgr().GrammarMatcher(self._compiled.result())
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing more can follow."""
        return self.matcher is not None and self.matcher.is_terminated()

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance the matcher over sampled tokens. A token the grammar refuses (possible
        only when something else overrode the mask, such as min_tokens hiding the stop
        token the grammar asked for) is skipped, and the first one is reported on stderr."""
        if self.matcher is None or self.matcher.is_terminated():
            return False
        accepted = True
        for token_id in token_ids:
            if self.matcher.accept_token(token_id):
                continue
            accepted = False
            if not self._warned:
                self._warned = True
                print(f"vllmpy: request {self.request_id!r}: token {token_id} does not fit "
                      "its grammar; the output may not match it", file=sys.stderr, flush=True)
        return accepted
