"""OpenAI `response_format` (and vLLM's `structured_outputs` option) to the wire's
StructuredOutput constraint, checked before any work is routed.

Pure: no I/O. A schema the engine's backend would reject later is refused
here with a 400 naming the field.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from common.proto import engine_pb2 as pb


def check_schema(schema: Any, param: str) -> str:
    """The schema serialized for the wire; ValueError naming `param` when it is
    not a valid JSON Schema (checked against the 2020-12 meta-schema)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{param}: a JSON Schema must be an object")  # noqa: TRY004 (a 400)
    serialized = json.dumps(schema, separators=(",", ":"))
    problem = _meta_schema_problem(serialized)
    if problem is not None:
        raise ValueError(f"{param}: {problem}")
    return serialized


# The meta-schema check costs ~1.5 ms; agents send the same tools every turn.
@functools.lru_cache(maxsize=1024)
def _meta_schema_problem(serialized: str) -> str | None:
    try:
        Draft202012Validator.check_schema(json.loads(serialized))
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"invalid JSON Schema{f' at {where}' if where else ''}: {exc.message}"
    return None


def from_response_format(response_format: dict[str, Any]) -> pb.StructuredOutput | None:
    """`response_format` → constraint (None for plain text). ValueError names
    the offending field."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema: required for type 'json_schema'")
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ValueError("response_format.json_schema.name: required, a non-empty string")
        schema = spec.get("schema", {"type": "object"})
        return pb.StructuredOutput(
            json_schema=check_schema(schema, "response_format.json_schema.schema")
        )
    raise ValueError(
        f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'"
    )


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def from_structured_outputs(options: dict[str, Any]) -> pb.StructuredOutput:
    """vLLM's `structured_outputs` request option: exactly one of json (a
    schema), json_object, regex, choice or grammar."""
    given = [k for k in STRUCTURED_KINDS if options.get(k) is not None]
    unknown = sorted(set(options) - set(STRUCTURED_KINDS))
    if unknown:
        raise ValueError(
            f"structured_outputs: unsupported option(s) {unknown}; "
            f"give one of {list(STRUCTURED_KINDS)}"
        )
    if len(given) != 1:
        raise ValueError(f"structured_outputs: give exactly one of {list(STRUCTURED_KINDS)}")
    kind = given[0]
    value = options[kind]
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        return pb.StructuredOutput(json_schema=check_schema(schema, "structured_outputs.json"))
    if kind == "json_object":
        if value is not True:
            raise ValueError("structured_outputs.json_object: must be true")
        return pb.StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError("structured_outputs.choice: a non-empty list of strings")
        return pb.StructuredOutput(choice=pb.Choices(values=value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{kind}: a non-empty string")
    return pb.StructuredOutput(**{kind: value})
