"""``--limit-mm-per-prompt`` and ``--language-model-only``, and the refusal of multimodal
content parts.

The flags parse and validate as vLLM's ``MultiModalConfig`` does. ``--limit-mm-per-prompt``
takes a JSON object from modality to a count, or to an object of options such as
``{"count": 1, "num_frames": 32}``. For image, video and audio the options are those of
vLLM's dummy-input dataclasses (an unknown one is refused); for any other modality name
only ``count`` is read and the rest dropped, as upstream's fallback options class does. The
options size dummy inputs for memory profiling upstream; this engine profiles no
multimodal inputs, so they are validated and then ignored. A modality not named has a limit
of 999; ``--language-model-only`` makes every limit 0.

This server takes text only, so every multimodal content part is refused, whatever the
limit: with a limit of 0 with the usage doc's text ("At most 0 image(s) may be provided in
one prompt. ..."), otherwise naming the part type. Request validation reads the server's
limits from ``request_limits`` (a context set around the chat route's parsing); without
one the default limits apply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from vllmpy.startup_flags import json_object_flag

FLAG = "--limit-mm-per-prompt"
DEFAULT_LIMIT = 999  # a modality the flag does not name (vLLM's default)
# The options each predefined modality takes besides "count" (vLLM's *DummyOptions).
MODALITY_OPTIONS: dict[str, tuple[str, ...]] = {
    "image": ("width", "height"),
    "video": ("num_frames", "width", "height"),
    "audio": ("length",),
}
# Chat content part types that carry a modality's input (vLLM's part parsers).
PART_MODALITIES: dict[str, str] = {
    "image_url": "image", "input_image": "image", "image_pil": "image",
    "image_embeds": "image", "input_audio": "audio", "audio_url": "audio",
    "audio_embeds": "audio", "video_url": "video", "video_embeds": "video",
}


@dataclass(frozen=True)
class MultimodalLimits:
    """The most items of each modality one prompt may carry."""

    counts: Mapping[str, int] = field(default_factory=dict)  # the modalities the flag names
    language_model_only: bool = False  # every limit is 0
    dropped: tuple[str, ...] = ()  # "modality.option" read and dropped (not predefined)

    def limit(self, modality: str) -> int:
        if self.language_model_only:
            return 0
        return self.counts.get(modality, DEFAULT_LIMIT)


def parse_limits(limit_mm_per_prompt: str | dict[str, Any] | None,
                 language_model_only: bool = False) -> MultimodalLimits:
    """The two flags' limits; malformed JSON, a negative or non-integer count, an entry
    that is neither a count nor an object, or an unknown or bad option of image, video or
    audio raises ValueError naming the flag."""
    if limit_mm_per_prompt is None:
        return MultimodalLimits(language_model_only=language_model_only)
    data = json_object_flag(FLAG, limit_mm_per_prompt, '{"image": 2, "video": 0}')
    counts, dropped = {}, []
    for modality, entry in data.items():
        if isinstance(entry, dict):
            counts[modality] = _count(modality, entry.get("count", DEFAULT_LIMIT))
            dropped += _check_options(modality, entry)
        else:
            counts[modality] = _count(modality, entry)
    return MultimodalLimits(counts, language_model_only, tuple(dropped))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(modality: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"{FLAG}: the {modality!r} entry must be a count (an integer >= 0) "
                         f"or an object of options such as {{\"count\": 1}}, got {value!r}")
    if value < 0:
        raise ValueError(f"{FLAG}: the {modality!r} limit must be a count >= 0, got {value}")
    return value


def _check_options(modality: str, entry: dict[str, Any]) -> list[str]:
    """Validate a predefined modality's options (unknown ones refused); return the options
    of any other modality, which are dropped."""
    extra = [key for key in entry if key != "count"]
    if modality not in MODALITY_OPTIONS:
        return [f"{modality}.{key}" for key in extra]
    allowed = MODALITY_OPTIONS[modality]
    for key in extra:
        if key not in allowed:
            raise ValueError(f"{FLAG}: unknown option {key!r} for {modality}; its options are "
                             f"{', '.join(('count', *allowed))}")
        value = entry[key]
        if value is not None and not (_is_int(value) and value > 0):
            raise ValueError(f"{FLAG}: {modality}.{key} must be a positive integer or null, "
                             f"got {value!r}")
    return []


def content_refusal(limits: MultimodalLimits, content: Any) -> str | None:
    """The 400 message for a message's ``content`` (a string, null or a list of parts),
    or None when it holds only text parts. Parts are checked for shape elsewhere; one
    that is not a dict with a string type is left to that check."""
    if not isinstance(content, list):
        return None
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind == "text":
            continue
        modality = PART_MODALITIES.get(kind)
        if modality is None:
            return (f"content part type {kind!r} is not supported: this server takes text "
                    f"parts only")
        if limits.limit(modality) == 0:
            return (f"At most 0 {modality}(s) may be provided in one prompt. Set "
                    f"`--limit-mm-per-prompt` to increase this limit.")
        return (f"content part type {kind!r} is not supported: this server takes text only "
                f"({modality} input needs a multimodal model)")
    return None


def multimodal_refusal(limits: MultimodalLimits,
                       messages: Iterable[Mapping[str, Any]]) -> str | None:
    """The 400 message for a request's chat ``messages`` (as sent), or None when every
    message holds only text."""
    for message in messages:
        refusal = content_refusal(limits, message.get("content"))
        if refusal is not None:
            return refusal
    return None


_REQUEST_LIMITS: ContextVar[MultimodalLimits | None] = ContextVar("multimodal_limits",
                                                                  default=None)


@contextlib.contextmanager
def request_limits(limits: MultimodalLimits) -> Iterator[None]:
    """Validate the requests parsed inside this block against ``limits``."""
    token = _REQUEST_LIMITS.set(limits)
    try:
        yield
    finally:
        _REQUEST_LIMITS.reset(token)


def active_limits() -> MultimodalLimits:
    """The limits of the ``request_limits`` block in force, else the default ones."""
    return _REQUEST_LIMITS.get() or MultimodalLimits()
