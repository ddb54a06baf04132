"""schemathesis against the live server's own OpenAPI schema: generated requests (valid
and not) get no 5xx and no response the schema does not describe (status, content type,
body), on every operation. (Hypothesis drives schemathesis' strategies directly: its
pytest plugin does not load under this pytest.)"""

from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


def test_the_schema_documents_each_apis_errors(served_schema_raw):
    paths = served_schema_raw["paths"]
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(chat) and "422" not in chat
    assert "text/event-stream" in chat["200"]["content"]
    error = paths["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert error["properties"]["type"] == {"const": "error"}


def test_no_server_errors_and_conforming_responses(served_schema, schema_server):
    operations = [result.ok() for result in served_schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "POST /v1/messages/count_tokens",
        "GET /v1/models", "GET /health", "GET /metrics"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            case.call_and_validate(base_url=schema_server.url, timeout=60, checks=CHECKS)

        check()
