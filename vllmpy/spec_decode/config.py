"""``--speculative-config``: vLLM's SpeculativeConfig JSON, parsed, checked and resolved.

The method is named by ``method`` or, as vLLM does, inferred from ``model`` (a name
holding "eagle3" / "eagle" is an EAGLE head, any other checkpoint a draft model). Keys
vLLM does not know, keys this engine does not build and methods it does not run are
refused by name before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllmpy.config import ConfigError
from vllmpy.startup_flags import _fields, json_object_flag

FLAG = "--speculative-config"
EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'

# method -> the module of vllmpy.spec_decode that proposes its drafts
METHODS: dict[str, str] = {
    "ngram": "ngram",
    "draft_model": "draft_model",
    "eagle": "eagle",
    "eagle3": "eagle",
    "mtp": "mtp",
    "deepseek_mtp": "mtp",
}
# Methods vLLM knows that this engine does not run yet, with what is missing.
NOT_BUILT: dict[str, str] = {
    "medusa": "no Medusa heads are built",
    "mlp_speculator": "no MLP speculator is built",
    "suffix": "no suffix-tree proposer is built",
}

_SPEC: dict[str, tuple[Any, ...]] = {
    "method": ("str", None),
    "model": ("str", None),
    "num_speculative_tokens": ("int", None, 1),
    "prompt_lookup_min": ("int", None, 1),
    "prompt_lookup_max": ("int", None, 1),
    "draft_sample_method": ("str", "greedy"),
    "disable_by_batch_size": ("int", None, 2),
    "draft_tensor_parallel_size": ("int", 1, 1),
    "quantization": ("str", None),
    "revision": ("str", None),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """A resolved speculative-decoding configuration."""

    method: str  # one of METHODS
    num_speculative_tokens: int  # k: drafts proposed (and verified) per request and step
    # draft_model: the draft checkpoint (directory, .gguf, repo id); eagle/eagle3: the head;
    # mtp/deepseek_mtp: None or the target itself (its own MTP layers are read)
    model: str | None = None
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched
    # No drafts while this many requests or more run (None: always draft)
    disable_by_batch_size: int | None = None
    quantization: str | None = None  # draft_model: the draft's --quantization
    revision: str | None = None  # draft_model: hub revision of the draft

    def describe(self) -> str:
        """The start-up line's words for it."""
        what = {"ngram": f"ngram (prompt lookup {self.prompt_lookup_min}.."
                         f"{self.prompt_lookup_max})",
                "draft_model": f"draft model {self.model}",
                "eagle": f"EAGLE head {self.model}",
                "eagle3": f"EAGLE-3 head {self.model}",
                "mtp": "the target's MTP layer",
                "deepseek_mtp": "the target's MTP layer"}[self.method]
        return f"speculative decoding: {what}, {self.num_speculative_tokens} tokens per step"

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        data = _fields(FLAG, json_object_flag(FLAG, value, EXAMPLE), _SPEC)
        method = data["method"] or _infer_method(data["model"])
        if method in NOT_BUILT:
            raise ConfigError(f"{FLAG}: method {method!r} is not supported yet: "
                              f"{NOT_BUILT[method]}; the methods built are "
                              f"{', '.join(METHODS)}")
        if method not in METHODS:
            raise ConfigError(f"{FLAG}: unknown method {method!r}; choose one of "
                              f"{', '.join(METHODS)}")
        if data["draft_sample_method"] != "greedy":
            raise ConfigError(f"{FLAG}: draft_sample_method {data['draft_sample_method']!r} "
                              f"is not supported: drafts are proposed greedily, so only "
                              f"'greedy' is accepted")
        if data["draft_tensor_parallel_size"] != 1:
            raise ConfigError(f"{FLAG}: draft_tensor_parallel_size "
                              f"{data['draft_tensor_parallel_size']} is not supported: the "
                              f"engine runs on one device; use 1")
        k = data["num_speculative_tokens"]
        if k is None:
            raise ConfigError(f"{FLAG}: num_speculative_tokens is required for method "
                              f"{method!r}, e.g. '{EXAMPLE}'")
        lookup_min, lookup_max = data["prompt_lookup_min"], data["prompt_lookup_max"]
        if method == "ngram":
            if data["model"] is not None:
                raise ConfigError(f"{FLAG}: method 'ngram' takes no model, got "
                                  f"{data['model']!r}")
            # vLLM's defaults: both 5 when neither is given, else the one given for both.
            if lookup_min is None and lookup_max is None:
                lookup_min = lookup_max = 5
            elif lookup_min is None:
                lookup_min = lookup_max
            elif lookup_max is None:
                lookup_max = lookup_min
            if lookup_min > lookup_max:
                raise ConfigError(f"{FLAG}: prompt_lookup_min={lookup_min} must be <= "
                                  f"prompt_lookup_max={lookup_max}")
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if data[key] is not None:
                    raise ConfigError(f"{FLAG}: {key} applies to method 'ngram' only, "
                                      f"not {method!r}")
            if data["model"] is None and method not in ("mtp", "deepseek_mtp"):
                what = ("draft checkpoint (a directory, a .gguf file or a repo id)"
                        if method == "draft_model"
                        else "EAGLE head (a directory or a repo id)")
                raise ConfigError(f"{FLAG}: method {method!r} needs a model: the {what}")
        return cls(method=method, num_speculative_tokens=k, model=data["model"],
                   prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max,
                   disable_by_batch_size=data["disable_by_batch_size"],
                   quantization=data["quantization"], revision=data["revision"])


def _infer_method(model: str | None) -> str:
    """vLLM's inference of the method from the draft's name."""
    if model is None:
        raise ConfigError(f"{FLAG}: name a method (one of {', '.join(METHODS)}) or a draft "
                          f"model, e.g. '{EXAMPLE}'")
    name = model.lower()
    if "eagle3" in name:
        return "eagle3"
    if "eagle" in name:
        return "eagle"
    return "draft_model"
