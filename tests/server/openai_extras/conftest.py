"""One real ``kvserve serve`` on the embedded model for every test of this package (package
scope: the structured-output, tool-calling and request-surface tests share it), and the
official openai client and an httpx client on it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.openai_extras.common import MAX_MODEL_LEN
from tests.server.server_proc import running_server


@pytest.fixture(scope="package")
def base_url() -> Iterator[str]:
    with running_server("--max-model-len", str(MAX_MODEL_LEN), "--debug-endpoints") as url:
        yield url


@pytest.fixture(scope="package")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="package")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="package")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
