"""The rest of the request surface against a real ``kvserve serve`` on the embedded model (the
package's server): unknown fields, logit_bias, echo and prompt logprobs, tokenize, continued
messages, seeds, chat template kwargs, response_format on completions."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.server.openai_extras.common import ASK, MAX_MODEL_LEN, error_of

# ---- the rest of the surface ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": ASK, "foo": 1}, "foo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "bar": 2}]},
            "messages",
        ),
        ("/v1/chat/completions", {"messages": ASK, "modalities": ["audio"]}, "modalities"),
        ("/v1/completions", {"prompt": "x", "foo": 1}, "foo"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"x": 1}}, "stream_options"),
        ("/tokenize", {"prompt": "x", "foo": 1}, "foo"),
    ],
)
def test_unknown_fields_are_400_naming_them(
    http: httpx.Client, endpoint: str, body: dict[str, Any], param: str
) -> None:
    message = error_of(http.post(endpoint, json=body), param)
    unknown = [k for k in ("foo", "bar", "modalities", "x") if k in json.dumps(body)][-1]
    assert unknown in message


def test_logit_bias(http: httpx.Client) -> None:
    for bias, needle in [({"49152": 1}, "49152"), ({"-1": 1}, "-1"), ({"abc": 1}, "abc")]:
        resp = http.post("/v1/completions", json={"prompt": "x", "logit_bias": bias})
        assert needle in error_of(resp, "logit_bias")
    resp = http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": 101}})
    error_of(resp, "logit_bias")
    target = http.post("/tokenize", json={"prompt": " banana", "add_special_tokens": False})
    tid = target.json()["tokens"][0]
    resp = http.post(
        "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0,
              "logit_bias": {str(tid): 100}},
    )  # fmt: skip
    assert resp.json()["choices"][0]["text"] == " banana banana"


def test_echo_and_prompt_logprobs(http: httpx.Client) -> None:
    prompt = "Hello world, this is"
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1,
            "prompt_logprobs": 2}  # fmt: skip
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["text"].startswith(prompt)
    lp = choice["logprobs"]
    assert lp["tokens"][: len(ids)] == [
        http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids
    ]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 3
    prompt_lps = choice["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for pos in range(1, len(ids)):
        entry = prompt_lps[pos]
        assert abs(entry[str(ids[pos])]["logprob"] - lp["token_logprobs"][pos]) < 1e-6
    streamed = "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in http.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
        if line.startswith("data: {") and json.loads(line[6:])["choices"]
    )
    assert streamed == choice["text"]


def test_tokenize_detokenize(http: httpx.Client) -> None:
    resp = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert resp["count"] == len(resp["tokens"]) and resp["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": resp["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    chat = http.post("/tokenize", json={"messages": ASK}).json()
    assert chat["count"] > resp["count"]
    # special tokens come back as sent (vLLM): /detokenize inverts /tokenize
    text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>") and "<|im_end|>" in text
    assert http.post("/tokenize", json={"prompt": text}).json()["tokens"] == chat["tokens"]
    error_of(http.post("/detokenize", json={"tokens": [10**6]}), "tokens")
    assert http.get("/debug/integrity").json() == {"ok": True}


def test_continue_final_message(http: httpx.Client) -> None:
    prefill = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]  # fmt: skip
    for flags in ({}, {"add_generation_prompt": False}):
        body = {"messages": prefill, "continue_final_message": True, **flags}
        text = "".join(
            http.post("/tokenize", json={**body, "return_token_strs": True}).json()["token_strs"]
        )
        assert text.endswith("<|im_start|>assistant\nThe capital of France is"), text
        resp = http.post(
            "/v1/chat/completions", json={**body, "max_tokens": 4, "temperature": 0}
        ).json()
        assert "Paris" in resp["choices"][0]["message"]["content"], resp
    closed = http.post("/tokenize", json={"messages": prefill, "return_token_strs": True})
    assert "".join(closed.json()["token_strs"]).endswith("<|im_start|>assistant\n")
    both = {"messages": prefill, "continue_final_message": True, "add_generation_prompt": True}
    assert "both" in error_of(
        http.post("/v1/chat/completions", json=both), "continue_final_message"
    )
    user_last = {"messages": prefill[:1], "continue_final_message": True}
    assert "'user'" in error_of(http.post("/v1/chat/completions", json=user_last), "messages")


def test_chat_echo_prepends_the_last_message_of_the_reply_role(http: httpx.Client) -> None:
    prefill = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is"}]  # fmt: skip
    body = {"messages": prefill, "continue_final_message": True, "max_tokens": 4,
            "temperature": 0, "n": 2}  # fmt: skip
    plain = http.post("/v1/chat/completions", json=body).json()["choices"]
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"]
    for p, e in zip(plain, echoed, strict=True):
        assert e["message"]["content"] == "The capital of France is" + p["message"]["content"]
    stream = {**body, "echo": True, "stream": True}
    lines = [ln[6:] for ln in http.post("/v1/chat/completions", json=stream).text.splitlines()
             if ln.startswith("data: ") and ln != "data: [DONE]"]  # fmt: skip
    texts = ["", ""]
    for ev in map(json.loads, lines):
        for c in ev["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
    assert texts == [e["message"]["content"] for e in echoed]
    # a new assistant turn after a user message: nothing of the reply's role to echo
    ask = {"messages": prefill[:1], "max_tokens": 4, "temperature": 0}
    assert (
        http.post("/v1/chat/completions", json={**ask, "echo": True}).json()["choices"][0]
        == http.post("/v1/chat/completions", json=ask).json()["choices"][0]
    )


def test_any_64_bit_seed_is_a_seed(http: httpx.Client) -> None:
    """Negative seeds too (vLLM takes any int64; the sampler maps every int onto its draws)."""
    for seed in (-1, -(2**63), 2**63 - 1):
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0,
                "seed": seed, "n": 2}  # fmt: skip
        first, again = (http.post("/v1/completions", json=body) for _ in range(2))
        assert first.status_code == 200, first.text
        assert first.json()["choices"] == again.json()["choices"]


def test_echo_with_max_tokens_0_scores_the_prompt(http: httpx.Client) -> None:
    prompt = "The capital of France is Paris."
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    full = http.post("/v1/completions", json=body).json()
    (choice,) = full["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert full["usage"]["completion_tokens"] == 0
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] == len(ids)
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    lines = [ln[6:] for ln in http.post("/v1/completions", json=stream).text.splitlines()
             if ln.startswith("data: ")]  # fmt: skip
    events = [json.loads(ln) for ln in lines[:-1]]
    assert "".join(ev["choices"][0]["text"] for ev in events if ev["choices"]) == prompt
    streamed = [t for ev in events if ev["choices"] for t in ev["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"] and events[-1]["usage"] == full["usage"]
    no_echo = {"prompt": prompt, "max_tokens": 0}
    assert "echo" in error_of(http.post("/v1/completions", json=no_echo), "max_tokens")


def test_chat_template_kwargs(http: httpx.Client) -> None:
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    plain = http.post("/tokenize", json={"messages": ASK}).json()["tokens"]
    assert http.post("/tokenize", json=body).json()["tokens"] == plain  # a variable it ignores
    resp = http.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    bad = {"messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert "'add_generation_prompt'" in error_of(
        http.post("/v1/chat/completions", json=bad), "chat_template_kwargs"
    )


def test_response_format_on_completions(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    body = {"prompt": "A JSON object with a number n:", "max_tokens": 20, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": schema}}}  # fmt: skip
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(text), schema)
    both = {**body, "structured_outputs": {"regex": "[0-9]+"}}
    assert "only one" in error_of(http.post("/v1/completions", json=both), "structured_outputs")


SPECIAL_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_echo_returns_the_prompt_as_sent(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": SPECIAL_PROMPT}).json()["tokens"]
    for prompt in (SPECIAL_PROMPT, ids):
        for stream in (False, True):
            body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True,
                    "logprobs": 1, "stream": stream}  # fmt: skip
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            if stream:
                lines = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
                choices = [json.loads(ln)["choices"][0] for ln in lines[:-1]]
            else:
                choices = [resp.json()["choices"][0]]
            text = "".join(ch["text"] for ch in choices)
            tokens = [t for ch in choices for t in ch["logprobs"]["tokens"]]
            offsets = [o for ch in choices for o in ch["logprobs"]["text_offset"]]
            assert text.startswith(SPECIAL_PROMPT), (prompt, stream, text)
            assert len(tokens) == len(ids) + 3
            # each token's text starts at its offset (ASCII here: token texts spell the text)
            assert "".join(tokens) == text
            assert all(text[o:].startswith(t) for o, t in zip(offsets, tokens, strict=True))
