"""Structured output: constrain a request's tokens to a JSON schema, regex, choice list or
grammar, with xgrammar.

- ``params``: ``StructuredOutputsParams``, what a request asks for (vLLM's names).
- ``schema_check``: refuses JSON Schema keywords the grammar would silently not enforce.
- ``backend_xgrammar``: constraint -> grammar, our tokenizer -> xgrammar's view, compile.
- ``manager``: the engine core's compiler pool and cache, per-step bitmask, jump-forward.
- ``request``: one request's compilation in flight, then its matcher.
- ``bitmask``: ``apply_grammar_bitmask``, the runner's masking of the logits.

Importing this package is cheap: xgrammar loads on first use.
"""

from __future__ import annotations

from vllmpy.structured_output.params import StructuredOutputsParams


def validate_structured_outputs(params: StructuredOutputsParams | None,
                                has_tokenizer: bool = True) -> None:
    """Raise ValueError naming the problem when the constraint cannot be compiled (a bad
    JSON schema, regex or grammar, a schema keyword that cannot be enforced, or no
    tokenizer to compile against). None passes. Runs in the frontend, so a bad request is
    refused before it reaches the engine."""
    if params is None:
        return
    if not has_tokenizer:
        raise ValueError("structured output needs the model's tokenizer, and none is loaded "
                         "(--skip-tokenizer-init, or a model without one)")
    from vllmpy.structured_output.backend_xgrammar import validate

    validate(params)


__all__ = ["StructuredOutputsParams", "validate_structured_outputs"]
