"""The engine core's side of structured output: compile off the step loop, mask per step."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from vllmpy.structured_output.params import StructuredOutputsParams
from vllmpy.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from vllmpy.tokenizer.tokenizer import Tokenizer


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """Compiles grammars on worker threads and builds each step's token bitmask.

    Contract:
    - ``grammar_init(request_id, params)`` returns at once; the grammar compiles on a
      worker thread (the tokenizer and xgrammar load there, on first use) and is shared by
      every request with the same kind, spec and whitespace rule: the last
      ``CACHE_SIZE`` of them are kept.
    - ``grammar_bitmask(requests)`` -> int32 ``[len(requests), bitmask_words(vocab_size)]``:
      bit ``j`` of word ``w`` of row ``i`` is set when ``requests[i]`` may sample token
      ``32 * w + j`` next. Every request must be ready.
    - ``jump_forward_tokens(request, limit)`` -> up to ``limit`` tokens its grammar forces
      next, already accepted by its matcher (empty unless jump-forward is enabled).
    """

    CACHE_SIZE = 256

    def __init__(self, vocab_size: int, stop_token_ids: Iterable[int],
                 load_tokenizer: Callable[[], Tokenizer | None],
                 enable_jump_forward: bool = False, max_workers: int = 2) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.enable_jump_forward = enable_jump_forward
        self._load_tokenizer = load_tokenizer
        self._max_workers = max_workers
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards the lazily built compiler and tokenizer
        self._compiler: Any = None  # xgrammar.GrammarCompiler
        self.tokenizer: Tokenizer | None = None  # set once a grammar has compiled
        self._cache: OrderedDict[tuple[str, str, bool], Future[Any]] = OrderedDict()

    # ---- compilation ----------------------------------------------------------------

    def grammar_init(self, request_id: str,
                     params: StructuredOutputsParams) -> StructuredOutputRequest:
        key = params.key()
        future = self._cache.get(key)
        if future is None:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._max_workers,
                                                    thread_name_prefix="vllmpy-grammar")
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return StructuredOutputRequest(request_id, params, future)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        from vllmpy.structured_output.backend_xgrammar import compile_grammar

        return compile_grammar(self._get_compiler(), params)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                from vllmpy.structured_output.backend_xgrammar import tokenizer_info, xgr

                tokenizer = self._load_tokenizer()
                if tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer, and "
                                     "this model has none")
                info = tokenizer_info(tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = xgr().GrammarCompiler(info, max_threads=self._max_workers)
                self.tokenizer = tokenizer
            return self._compiler

    def wait_for_any(self, requests: Iterable[StructuredOutputRequest],
                     timeout: float) -> None:
        """Block up to ``timeout`` seconds until one of these requests' grammars is done
        (the step loop calls this when nothing else can run, instead of spinning)."""
        pending = [r.compilation for r in requests if not r.compilation.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    # ---- one step -------------------------------------------------------------------

    def grammar_bitmask(self, requests: Sequence[StructuredOutputRequest]) -> np.ndarray:
        import torch

        bitmask = np.full((len(requests), bitmask_words(self.vocab_size)), -1, dtype=np.int32)
        view = torch.from_numpy(bitmask)  # shares the memory; xgrammar fills through it
        for row, request in enumerate(requests):
            if request.matcher is None:
                raise RuntimeError(f"request {request.request_id!r}: its grammar is not "
                                   "ready, so it cannot be scheduled to sample")
            if not request.matcher.is_terminated():
                request.matcher.fill_next_token_bitmask(view, row)
        return bitmask

    def jump_forward_tokens(self, request: StructuredOutputRequest, limit: int) -> list[int]:
        """Tokens for the text the grammar allows as the only continuation, accepted by the
        matcher. Only whole tokens whose text is a prefix of that forced text are taken,
        and not its last token, which might merge with whatever follows it; so the tokens
        appended are ones the model could have produced itself."""
        matcher = request.matcher
        tokenizer = self.tokenizer
        if (not self.enable_jump_forward or limit <= 0 or matcher is None
                or tokenizer is None or matcher.is_terminated()):
            return []
        forced = matcher.find_jump_forward_string()
        if not forced:
            return []
        candidates = tokenizer.encode(forced, add_special_tokens=False)[:-1][:limit]
        taken: list[int] = []
        for token_id in candidates:
            text = tokenizer.decode(taken + [token_id], skip_special_tokens=False)
            if not forced.startswith(text) or not matcher.accept_token(token_id):
                break
            taken.append(token_id)
        return taken

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
