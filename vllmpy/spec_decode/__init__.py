"""Speculative decoding: proposers of draft tokens behind one interface, and the rejection
sampler that verifies them against the target model (``rejection_sampler``).

A proposer is asked, after a step, for the drafts each request should verify with its
next one. Each method is one module here with one line in ``config.METHODS``; its module
defines ``make(config, runner) -> Proposer`` and, when the proposer keeps KV of its own
in the target's blocks, ``kv_config(config, target_source_kind, target_text)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from vllmpy.spec_decode.config import SpeculativeConfig


class Proposer:
    """Proposes up to ``num_speculative_tokens`` drafts per request.

    ``propose`` sees the runner's persistent token table: row ``r`` of ``token_ids``
    holds the ``num_tokens[r]`` known tokens of the request in that row (prompt and
    output; no drafts). It returns one list per entry of ``rows``, at most
    ``max_drafts[i]`` long.
    """

    # KV slots the scheduler allocates past each step's tokens for this proposer's own
    # drafts (a draft model writes their KV there while it proposes).
    num_lookahead_tokens = 0
    # Whether ``propose`` runs after every step, also with no row to draft for (a proposer
    # that must see each step's tokens while the target's hidden states are at hand).
    every_step = False

    def observe(self, req_ids: Sequence[str], step: Any, hidden_states: Any) -> None:
        """The target's forward of a step just ran: its requests, its ``StepInputs`` and
        its last hidden states [num_tokens, hidden_size] (valid until the next step)."""

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: Sequence[int],
                max_drafts: Sequence[int]) -> list[list[int]]:
        raise NotImplementedError

    def forget(self, req_id: str) -> None:
        """The request left the runner's batch (finished, aborted or preempted)."""

    def initialize_kv_cache(self) -> None:
        """Allocate what the proposer keeps per token, once the target's pool is sized."""

    def capture_graphs(self) -> str | None:
        """CUDA: capture the proposer's own CUDA graphs, after the target's; returns the
        start-up line's words for them (None: it keeps none)."""
        return None


def draft_kv_config(config: SpeculativeConfig, target_source_kind: str,
                    target_text: Any) -> Any | None:
    """The KV geometry (a TextModelConfig) of the layers the method's proposer caches in
    the target's blocks, checked against the target; None when it caches nothing. Read
    before any weight is, so the pool's bytes per block count both."""
    from vllmpy.spec_decode.config import METHODS

    module = importlib.import_module(f"vllmpy.spec_decode.{METHODS[config.method]}")
    kv_config = getattr(module, "kv_config", None)
    return None if kv_config is None else kv_config(config, target_source_kind, target_text)


def make_proposer(config: SpeculativeConfig, runner: Any) -> Proposer:
    """The proposer of ``config.method`` for the model runner ``runner``."""
    from vllmpy.spec_decode.config import METHODS

    module = importlib.import_module(f"vllmpy.spec_decode.{METHODS[config.method]}")
    return module.make(config, runner)
