"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis).

Every generated request (valid and invalid bodies for every route) goes to a real
``kvserve serve`` on a tiny model: no answer may be a 5xx, none may hang (a timeout per
call), and the server must be healthy after every case. Examples per route: 15 here
(``KVSERVE_FUZZ_EXAMPLES``); ``make fuzz`` runs 300. A second server runs with ``--api-key``:
the same holds with the key, and without it every protected route answers 401.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from kvserve.server.app import build_app
from tests.server.fake_engine import FakeEngine
from tests.server.server_proc import running_server
from tests.tiny_models import make_tiny_model

NUM_EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "15"))
CALL_TIMEOUT_S = 60.0
API_KEY = "fuzz-key"
# The routes --api-key guards (docs/server.md).
PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/debug/")

# NOTE: the schema is the app's own (routes and pydantic models do not depend on the engine),
# taken in process; the calls go to the real server.
schema = schemathesis.openapi.from_dict(build_app(FakeEngine()).openapi())


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir: Path = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    with running_server("--model", str(model_dir), "--max-model-len", "96") as url:
        yield url


@schema.parametrize()
@settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_never_answers_5xx_and_stays_healthy(case: schemathesis.Case, server_url: str) -> None:
    response = case.call(base_url=server_url, timeout=CALL_TIMEOUT_S)
    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
    if response.status_code >= 400:
        assert "error" in response.json(), response.text[:500]
    assert httpx.get(server_url + "/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def keyed_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir: Path = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    args = ("--model", str(model_dir), "--max-model-len", "96", "--api-key", API_KEY)
    with running_server(*args) as url:
        yield url


@schema.parametrize()
@settings(
    max_examples=max(1, NUM_EXAMPLES // 5),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_key_server_never_answers_5xx_and_refuses_calls_without_the_key(
    case: schemathesis.Case, keyed_server_url: str
) -> None:
    keyed = case.call(
        base_url=keyed_server_url,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=CALL_TIMEOUT_S,
    )
    assert keyed.status_code < 500, (case.as_curl_command(), keyed.text[:500])
    assert keyed.status_code != 401, (case.as_curl_command(), keyed.text[:500])
    if case.path.startswith(PROTECTED):
        bare = case.call(base_url=keyed_server_url, timeout=CALL_TIMEOUT_S)
        assert bare.status_code == 401, (case.as_curl_command(), bare.text[:500])
        assert "error" in bare.json(), bare.text[:500]
    assert httpx.get(keyed_server_url + "/health", timeout=10).status_code == 200
