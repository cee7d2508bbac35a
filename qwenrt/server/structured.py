"""`response_format` (chat and completions) -> the engine's output constraint keywords, checked field by field so
that a bad one is a 400 naming it; and the engine's constraint fields as the API's params."""

from __future__ import annotations

from typing import Any

from qwenrt.server.errors import APIError

# the engine keyword a refusal names -> the request field that carried it
ENGINE_FIELDS = {"json_schema": "response_format", "json_object": "response_format", "regex": "response_format",
                 "grammar": "response_format"}


def constraint_options(response_format: dict[str, Any] | None) -> dict:
    """{"type": "text"} or None -> {}; {"type": "json_object"} -> json_object; {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}} -> json_schema (strict or not, the schema is
    enforced, as vLLM does)."""
    if response_format is None:
        return {}
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                            f"{kind!r:.60}", "response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema must be an object with the schema",
                       "response_format.json_schema")
    schema = spec.get("schema", {})  # OpenAI: a missing schema allows any JSON object
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON Schema object",
                       "response_format.json_schema.schema")
    return {"json_schema": schema} if schema else {"json_object": True}
