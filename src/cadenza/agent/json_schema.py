"""A small JSON-schema validator for the subset tool definitions use.

Supported keywords: type (string, integer, number, boolean, object, array, null, or a list
of them), properties, required, additionalProperties (bool), enum, items, minimum, maximum,
minLength, maxLength. That is all the tool schemas in `tools.py` need; anything else in a
schema is ignored. Errors name the argument path, what was expected and what was found.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def _json_type(v: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _TYPES[name](v):
            return name
    return type(v).__name__


def _short(v: Any, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def validate(value: Any, schema: dict[str, Any], path: str = "arguments") -> list[str]:
    """All violations of `schema` by `value`, as messages; an empty list means valid."""
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else list(types)
        if not any(_TYPES.get(t, lambda v: False)(value) for t in allowed):
            errors.append(
                f"{path}: expected {' or '.join(allowed)}, found {_json_type(value)} {_short(value)}"
            )
            return errors
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: expected one of {schema['enum']}, found {_short(value)}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: expected at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(
                f"{path}: expected at most {schema['maxLength']} characters, found {len(value)}"
            )
    if _TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: expected >= {schema['minimum']}, found {value}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: expected <= {schema['maximum']}, found {value}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}: missing required property {name!r}")
        if schema.get("additionalProperties", True) is False:
            extra = sorted(k for k in value if k not in props)
            if extra:
                errors.append(
                    f"{path}: unexpected properties {extra}; allowed: {sorted(props) or 'none'}"
                )
        for name, sub in props.items():
            if name in value:
                errors.extend(validate(value[name], sub, f"{path}.{name}"))
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors.extend(validate(item, schema["items"], f"{path}[{i}]"))
    return errors
