"""A request's output constraint, from OpenAI's `response_format` or vLLM's
`structured_outputs` extra body, as the engine's StructuredOutputsParams.

    response_format    {"type": "text"} | {"type": "json_object"} |
                       {"type": "json_schema", "json_schema": {name, schema, strict, ...}}
    structured_outputs {"json": schema} | {"regex": str} | {"choice": [str]} |
                       {"grammar": EBNF/Lark} | {"json_object": true}

A malformed field is a 400 naming it here; an invalid schema, regex or grammar is found
when the engine compiles it (in a worker, engine.make_group) and named there as
`structured_outputs.<kind>`; `sent_as` renames that to the field the client sent.
"""

from __future__ import annotations

from typing import Any

from ksana_jax.sampling_params import STRUCTURED_KINDS, StructuredOutputsParams
from server.errors import APIError


def constraint(
    response_format: dict[str, Any] | None, extra: dict[str, Any] | None
) -> tuple[StructuredOutputsParams | None, dict[str, str]]:
    """The request's constraint (None: free text) and the client's names of its fields
    (engine name -> client's, for admission.renamed)."""
    if response_format is not None and extra is not None:
        raise APIError(
            400, "set response_format or structured_outputs, not both", param="response_format"
        )
    if extra is not None:
        return _from_extra(extra), {}
    if response_format is None:
        return None, {}
    kind = response_format.get("type")
    if kind == "text":
        return None, {}
    if kind == "json_object":
        _only(response_format, {"type"}, "response_format")
        return StructuredOutputsParams(json_object=True), {
            "structured_outputs.json_object": "response_format"
        }
    if kind == "json_schema":
        _only(response_format, {"type", "json_schema"}, "response_format")
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(
                400,
                "response_format.json_schema must be an object {name, schema, strict}",
                param="response_format.json_schema",
            )
        _only(spec, {"name", "schema", "strict", "description"}, "response_format.json_schema")
        schema = spec.get("schema", {})  # OpenAI: absent = any JSON object's schema
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return StructuredOutputsParams(json=schema or {"type": "object"}), {
            "structured_outputs.json": "response_format.json_schema.schema"
        }
    raise APIError(
        400,
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param="response_format.type",
    )


def _from_extra(extra: dict[str, Any]) -> StructuredOutputsParams:
    _only(extra, set(STRUCTURED_KINDS), "structured_outputs")
    try:
        return StructuredOutputsParams(**extra)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param="structured_outputs") from None


def _only(body: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(
            400,
            f"{where} has unknown field(s) {unknown}; allowed: {sorted(allowed)}",
            param=f"{where}.{unknown[0]}",
        )
