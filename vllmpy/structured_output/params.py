"""What a request asks its output to match: vLLM's ``StructuredOutputsParams``."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

# The kinds of constraint, in the order they are named in errors.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object`` is
    set; anything else raises ``ValueError`` naming the fields.

    The constraint is enforced token by token with xgrammar: the sampler only sees tokens
    that keep the output a prefix of some string the constraint accepts.
    """

    json: str | dict[str, Any] | bool | None = None  # a JSON Schema, as an object or JSON text
    regex: str | None = None  # a regular expression the whole output matches
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF (GBNF) grammar whose start rule is ``root``
    json_object: bool | None = None  # True: any JSON object or array (response_format json_object)
    # json: no whitespace outside strings (by default the schema's JSON may be spaced freely)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError("structured outputs need exactly one of json, regex, choice, "
                             f"grammar or json_object; got {got}")
        if self.json is not None and not isinstance(self.json, (str, dict, bool)):
            raise ValueError(f"structured outputs json must be a JSON Schema object or its "
                             f"JSON text, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured outputs choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object not in (None, False, True):
            raise ValueError(f"structured outputs json_object must be a boolean, "
                             f"got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured outputs disable_any_whitespace must be a boolean, "
                             f"got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of ``KINDS``."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    def spec(self) -> str:
        """The constraint as one string: a schema as JSON text (its key order kept, since
        it fixes the order properties are generated in), a choice list as a JSON array."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else _json.dumps(self.json)
        if kind == "choice":
            return _json.dumps(self.choice, ensure_ascii=False)
        if kind == "json_object":
            return ""
        value = getattr(self, kind)
        assert isinstance(value, str)
        return value

    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: kind, spec and the whitespace rule."""
        return self.kind, self.spec(), self.disable_any_whitespace
