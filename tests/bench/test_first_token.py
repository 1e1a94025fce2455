"""``kvserve bench first-token`` on a tiny model: one record per setting, greedy, with the
first steps' top log-probs; a malformed setting is an error naming it."""

from __future__ import annotations

import argparse
import math

import pytest

from kvserve.bench.first_token import first_tokens, parse_setting
from tests.tiny_models import make_tiny_model


def test_each_setting_answers_greedy_with_its_top_logprobs(tmp_path) -> None:
    model = str(make_tiny_model(tmp_path, "llama"))
    settings = [parse_setting("none:float32"), parse_setting("auto:float32")]
    records = first_tokens(
        model, settings, "hi", 4, 3, num_kv_blocks=32, max_model_len=64, num_threads=1
    )
    assert [r["setting"] for r in records] == ["none:float32", "auto:float32"]
    for rec in records:
        assert 1 <= len(rec["token_ids"]) <= 4
        assert 1 <= len(rec["top_logprobs"]) <= 3
        for step in rec["top_logprobs"]:
            assert 1 <= len(step) <= 4  # top 3, plus the sampled token where it is not among them
            assert all(lp <= 0.0 and math.isfinite(lp) for lp in step.values())
    # An HF model holds no quantized blocks: both settings run the same weights.
    assert records[0]["token_ids"] == records[1]["token_ids"]


@pytest.mark.parametrize("bad", ["auto", ":float32", "none:"])
def test_a_malformed_setting_is_named(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="QUANTIZATION:DTYPE"):
        parse_setting(bad)
