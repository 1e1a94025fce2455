"""A real ``kvserve serve`` process on the embedded model, driven by the openai client and httpx.

One server for the module (--max-model-len 512, an API key); max_tokens stays small.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.server_proc import FRESH_A, FRESH_B, running_server

API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_server("--max-model-len", str(MAX_MODEL_LEN), api_key=API_KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_completion_streaming_equals_non_streaming(client: openai.OpenAI, model: str) -> None:
    prompt = "The three primary colors are"
    full = client.completions.create(
        model=model, prompt=prompt, max_tokens=10, temperature=0, extra_body=FRESH_A
    )
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("length", "stop")
    assert full.usage.completion_tokens == 10 or choice.finish_reason == "stop"
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=FRESH_B,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_streaming_equals_non_streaming(client: openai.OpenAI, model: str) -> None:
    messages: list[Any] = [{"role": "user", "content": "Name a fruit."}]
    full = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body=FRESH_A
    )
    text = full.choices[0].message.content
    assert text and full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body=FRESH_B,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_and_seed_reproducible(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3, seed=1234
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert 3 <= first.usage.completion_tokens <= 24
    assert first.usage.completion_tokens == again.usage.completion_tokens


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt="1, 2, 3,", max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token_lp <= 0 and len(top) <= 3
        # temperature 0: the chosen token is the most likely one
        assert token_lp == pytest.approx(max(top.values()), abs=1e-4)
        assert token in top


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    prompt = "Here is a list of animals: cat, dog,"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_prefix_cache_reported_in_usage(client: openai.OpenAI, model: str) -> None:
    prompt = "The history of the printing press begins " + "in a small workshop " * 12
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens >= 48
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached < second.usage.prompt_tokens


def test_user_accepted_and_priority_only_under_the_priority_policy(
    http: httpx.Client, model: str
) -> None:
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "priority": 0, "user": "u1"}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    r = http.post("/v1/completions", json={**body, "priority": 1})  # the default policy: fcfs
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


LONG = "hello " * (MAX_MODEL_LEN + 10)
CHAT = [{"role": "user", "content": "Hi"}]
BAD: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0.0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 1.01}, 400, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "n": 129}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "model": "no-such-model"}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_request_then_good(
    http: httpx.Client, model: str, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    r = http.post(path, json={"model": model, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    ok = http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_malformed_json_and_auth(base_url: str, http: httpx.Client, model: str) -> None:
    r = http.post(
        "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["message"]
    body = {"model": model, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(base_url + "/v1/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(base_url + "/v1/completions", json=body, headers=wrong).status_code == 401
    assert httpx.get(base_url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url + "/v1", api_key="nope", max_retries=0).models.list()
    assert http.post("/v1/completions", json=body).status_code == 200
