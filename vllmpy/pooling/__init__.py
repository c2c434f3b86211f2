"""The pooling path: requests that run their prompt once and return vectors, not tokens.

``params`` holds a request's ``PoolingParams`` (its task: embed, classify, score or
encode); ``config`` reads what the checkpoint says about pooling (sentence-transformers'
module files) and vLLM's ``--pooler-config`` JSON; ``pooler`` turns a step's hidden states
into each request's output. A pooling engine (``--runner pooling``, or an encoder-only
architecture) serves pooling requests only, through the same scheduler and model runner as
generation: each request is scheduled whole, computed in one step and finished there.
"""

from __future__ import annotations

from typing import Any


def model_tasks(model_config: Any) -> tuple[str, ...]:
    """The tasks an engine serves: ("generate",), or a pooling model's: a model with a
    classification head classifies and scores text pairs; any other embeds, and scores
    pairs by the cosine of their embeddings; every pooling model encodes tokens."""
    if model_config.runner != "pooling":
        return ("generate",)
    from vllmpy.models.registry import resolve_model_class

    model_cls = resolve_model_class(model_config.text_config.architectures)
    if callable(getattr(model_cls, "classify", None)):
        return ("classify", "score", "encode")
    return ("embed", "score", "encode")
