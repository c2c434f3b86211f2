"""``PoolingParams``: what a pooling request asks for (vLLM's class of the same name)."""

from __future__ import annotations

from dataclasses import dataclass

# task -> what it returns per request
TASKS = {
    "embed": "one vector per prompt (the pooled hidden states, through the checkpoint's "
             "Dense layers, normalized by default)",
    "classify": "class probabilities (the classification head's logits after softmax, or "
                "sigmoid for one label)",
    "score": "one relevance score per text pair (a cross-encoder's, or the cosine of two "
             "embeddings)",
    "encode": "the hidden states of every token (the ALL pooling) or of the step tokens",
}


@dataclass
class PoolingParams:
    """``task`` is one of ``TASKS``; ``dimensions`` (embed) keeps the first dimensions of a
    matryoshka model's vector (before normalizing); ``normalize`` (embed) overrides the
    checkpoint's default; ``use_activation`` (classify/score) applies softmax / sigmoid
    (default True); ``truncate_prompt_tokens`` keeps the last k prompt tokens (-1: as many
    as the model takes) instead of refusing a longer prompt."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"pooling task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1, "
                             f"got {t!r}")
