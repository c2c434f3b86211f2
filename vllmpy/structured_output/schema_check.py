"""Refuse JSON Schema keywords the grammar backend would silently not enforce.

xgrammar turns a schema into a grammar, and a few keywords it cannot express it skips
without a word: the output would then look right and still fail validation. A schema
that uses one is refused here, naming the keyword and where it sits (a JSON pointer).
"""

from __future__ import annotations

from typing import Any

# Keywords never enforced, with what to say.
_UNSUPPORTED: dict[str, str] = {
    "not": "'not' is not supported",
    "if": "'if'/'then'/'else' are not supported",
    "then": "'if'/'then'/'else' are not supported",
    "else": "'if'/'then'/'else' are not supported",
    "dependentRequired": "'dependentRequired' is not supported",
    "dependentSchemas": "'dependentSchemas' is not supported",
    "dependencies": "'dependencies' is not supported",
    "contains": "'contains' is not supported",
    "minContains": "'minContains' is not supported",
    "maxContains": "'maxContains' is not supported",
    "additionalItems": "'additionalItems' is not supported; use prefixItems and items",
    "$dynamicRef": "'$dynamicRef' is not supported",
    "$dynamicAnchor": "'$dynamicAnchor' is not supported",
    "$recursiveRef": "'$recursiveRef' is not supported",
    "$recursiveAnchor": "'$recursiveAnchor' is not supported",
}
# Keywords enforced only at a harmless value.
_ONLY_WHEN: dict[str, tuple[Any, str]] = {
    "uniqueItems": (False, "'uniqueItems': true is not supported"),
    "unevaluatedProperties": (True, "'unevaluatedProperties' other than true is not supported"),
    "unevaluatedItems": (True, "'unevaluatedItems' other than true is not supported"),
}
# Keywords skipped unless the schema names its type.
_NEED_TYPE = ("minLength", "maxLength", "pattern", "format", "minimum", "maximum",
              "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "maxItems")
# Keywords that constrain a value, skipped when they sit beside a $ref.
_VALIDATION = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
    "uniqueItems", "maxProperties", "minProperties", "required", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems",
    "allOf", "anyOf", "oneOf"})
# Where subschemas sit: a map of them, a list of them, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems", "allOf", "anyOf", "oneOf")
_SCHEMA_ONE = ("additionalProperties", "items", "propertyNames")


def check_json_schema(schema: Any) -> None:
    """Raise ValueError naming the first keyword of ``schema`` (a decoded JSON Schema) that
    structured output cannot enforce; return quietly when there is none."""
    _check(schema, "#", schema)


def _check(schema: Any, where: str, root: Any) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema at {where} must be an object or a boolean, "
                         f"got {type(schema).__name__}")
    for key, reason in _UNSUPPORTED.items():
        if key in schema:
            _refuse(reason, where)
    for key, (allowed, reason) in _ONLY_WHEN.items():
        if key in schema and schema[key] != allowed:
            _refuse(reason, where)
    _check_keywords(schema, where)
    one_of = schema.get("oneOf")
    if isinstance(one_of, list) and not _pairwise_disjoint(one_of, root):
        _refuse("'oneOf' whose alternatives may overlap is not supported (it would be "
                "enforced as anyOf); make them disjoint by type or by a const property, "
                "or use anyOf", where)
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                _check(sub, f"{where}/{key}/{_escape(name)}", root)
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                _check(sub, f"{where}/{key}/{i}", root)
    for key in _SCHEMA_ONE:
        if key in schema:
            _check(schema[key], f"{where}/{key}", root)


def _check_keywords(schema: dict[str, Any], where: str) -> None:
    ref = schema.get("$ref")
    if ref is not None:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            _refuse(f"'$ref': {ref!r} is not supported: only references inside the schema "
                    "('#' or '#/...') are", where)
        beside = sorted(k for k in schema if k in _VALIDATION)
        if beside:
            _refuse(f"keywords beside '$ref' ({', '.join(beside)}) are not supported: "
                    "move them into the referenced schema", where)
    if "type" not in schema:
        typed = [k for k in _NEED_TYPE if k in schema]
        if typed:
            _refuse(f"'{typed[0]}' without 'type' is not supported: name the type", where)
    multiple = schema.get("multipleOf")
    if multiple is not None and (schema.get("type") != "integer" or isinstance(multiple, bool)
                                 or not isinstance(multiple, int)):
        _refuse("'multipleOf' is supported only with an integer value on 'type': 'integer'",
                where)
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        _refuse("'allOf' with more than one schema is not supported", where)
    if isinstance(schema.get("items"), list):
        _refuse("'items' as a list is not supported; use prefixItems", where)


# ---- oneOf: enforced as anyOf, so only alternatives that cannot both match are safe -------


def _pairwise_disjoint(alternatives: list[Any], root: Any) -> bool:
    resolved = [_resolve(alt, root) for alt in alternatives]
    return all(_disjoint(a, b) for i, a in enumerate(resolved) for b in resolved[i + 1:])


def _resolve(schema: Any, root: Any) -> Any:
    """Follow a local '$ref' (a few hops at most); anything else is returned as is."""
    for _ in range(8):
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            return schema
        target = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return schema
            target = target[part]
        schema = target
    return schema


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _literals(schema: dict[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return list(enum) if isinstance(enum, list) else None


def _types(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types a schema admits (integer counted as number), None if it does not say."""
    literals = _literals(schema)
    if literals is not None:
        return {_json_type(v) for v in literals}
    declared = schema.get("type")
    if declared is None:
        return None
    names = [declared] if isinstance(declared, str) else list(declared)
    return {"number" if n == "integer" else n for n in names}


def _disjoint(a: Any, b: Any) -> bool:
    """True only when no value can match both schemas (a sufficient, simple test)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    lit_a, lit_b = _literals(a), _literals(b)
    if lit_a is not None and lit_b is not None:
        return not any(x == y and _json_type(x) == _json_type(y) for x in lit_a for y in lit_b)
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not types_a & types_b:
        return True
    if types_a == types_b == {"object"}:  # a discriminating property both require
        props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
        for name in set(a.get("required") or ()) & set(b.get("required") or ()):
            if (isinstance(props_a.get(name), dict) and isinstance(props_b.get(name), dict)
                    and _literals(props_a[name]) is not None
                    and _literals(props_b[name]) is not None
                    and _disjoint(props_a[name], props_b[name])):
                return True
    return False


def _escape(name: str) -> str:
    """A property name as a JSON-pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")


def _refuse(reason: str, where: str) -> None:
    raise ValueError(f"the JSON schema cannot be enforced: {reason} (at {where})")
