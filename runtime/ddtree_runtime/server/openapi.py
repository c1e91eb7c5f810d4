"""The OpenAPI document at /openapi.json: FastAPI's, plus what FastAPI cannot see.

The completion routes read and validate their bodies themselves (off the event loop, with a size limit
and strict types), so FastAPI knows nothing of them: their request bodies are added here from the same
pydantic models that validate them, and every route's responses from what it really answers (the
OpenAI error object for each error status). Clients, code generators and the schemathesis fuzzing
test (tests/reliability/test_runtime_schema.py) read it.

Public, even with an API key set: it is the same for every deployment (no model name, path, count or
version of the running service), describes only the OpenAI API any client already knows, and tools
fetch it before they hold a key; vLLM serves its own the same way.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ddtree_runtime.server.schemas import ChatCompletionRequest, CompletionRequest

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{model}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}
_ERROR_MEANING = {
    400: "The request is invalid (param names the field).",
    401: "The API key is missing or wrong (when the service has one).",
    404: "The model named is not the one this server serves.",
    413: "The body is larger than --max-body.",
    429: "The queue is full; Retry-After says when to try again.",
    503: "The engine is not ready, or the server is shutting down.",
}
_COMPLETION_ERRORS = (400, 401, 404, 413, 429, 503)
_OBJECT = {"type": "object"}
# a stream: server-sent events, each a JSON chunk (or the final "[DONE]") in its data field
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}

# Each route's success responses: media type -> schema.
_SUCCESS: dict[tuple[str, str], dict[str, dict]] = {
    ("get", "/health"): {"application/json": _OBJECT},
    ("get", "/metrics"): {"text/plain": {"type": "string"}},
    ("get", "/v1/models"): {"application/json": _OBJECT},
    ("post", "/v1/chat/completions"): {"application/json": _OBJECT, "text/event-stream": _EVENT},
    ("post", "/v1/completions"): {"application/json": _OBJECT, "text/event-stream": _EVENT},
}
_ERRORS = {
    ("get", "/health"): (),
    ("get", "/metrics"): (401,),
    ("get", "/v1/models"): (401,),
    ("post", "/v1/chat/completions"): _COMPLETION_ERRORS,
    ("post", "/v1/completions"): _COMPLETION_ERRORS,
}
_BODIES = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The document for `app`, built once."""
    if app.openapi_schema is None:
        app.openapi_schema = _build(app)
    return app.openapi_schema


def _build(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version="1", routes=app.routes,
                      description="OpenAI-compatible DDTree speculative decoding server.")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["Error"] = _ERROR
    for path, model in _BODIES.items():
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}},
        }
    error = {"application/json": {"$ref": "#/components/schemas/Error"}}
    for (method, path), success in _SUCCESS.items():
        responses = {"200": _response("OK", success)}
        if path == "/health":
            responses["503"] = _response("Starting, failed or draining.", {"application/json": _OBJECT})
        for status in _ERRORS[(method, path)]:
            responses[str(status)] = _response(_ERROR_MEANING[status], error)
        doc["paths"][path][method]["responses"] = responses
    return doc


def _response(description: str, content: dict[str, dict]) -> dict:
    return {"description": description, "content": {media: {"schema": schema} for media, schema in content.items()}}
