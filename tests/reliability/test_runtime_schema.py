"""ddtree-serve fuzzed from its own OpenAPI schema (schemathesis): one real server on the tiny models,
as deployed (an API key), and for every route a bounded number of generated requests, valid ones and
ones that break the schema. Each must answer without a 5xx, with a status, media type and body the
schema documents, and a request the schema forbids must be refused (a 4xx).

The schema is the one the server serves at /openapi.json (public: server/openapi.py says why), so this
also checks that it describes the request bodies the server really accepts."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks
from schemathesis.config import SchemathesisConfig

from ddtree_devtools.server_process import ServerProcess

pytestmark = pytest.mark.slow

KEY = "sk-schema-test"
AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "tiny"
MAX_CONTEXT = 48  # bounds every generated request's work: prompt + completion tokens
# Generated requests per route, valid and not, the same ones every run (derandomized): about half a
# minute on 2 cores. (Schemathesis's coverage phase, hundreds of boundary cases more per route, would
# take minutes of generation on the CPU; hypothesis's own extremes found this server's one 5xx,
# top_p: 5e-324, within these.)
EXAMPLES = 50
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.negative_data_rejection]


@pytest.fixture(scope="module")
def server(tiny_models):
    args = ["--target", str(tiny_models / "target"), "--draft", str(tiny_models / "draft"),
            "--served-model-name", MODEL, "--max-context", str(MAX_CONTEXT), "--max-running", "2"]
    with ServerProcess(args, env={"DDTREE_API_KEY": KEY}) as srv:
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def served_schema(server):
    config = SchemathesisConfig.from_dict({"phases": {"coverage": {"enabled": False}}})
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)


def test_the_schema_is_public_and_describes_the_request_bodies(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()  # no key
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    body = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert "messages" in body["required"] and {"logprobs", "top_logprobs", "min_tokens"} <= set(body["properties"])
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["required"]
    assert "/_test/fault" not in doc["paths"]
    assert MODEL not in str(doc), "the schema says nothing about the deployment"
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401  # the API itself needs the key


schema = schemathesis.pytest.from_fixture("served_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_generated_request_gets_a_5xx(case):
    case.call_and_validate(headers=AUTH, checks=CHECKS, timeout=60)
