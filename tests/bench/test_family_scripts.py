"""The pure helpers of the per-family speed harness (bench/peers/family_*.py); no engine runs."""

import datetime
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.test_records import KINDS, TOP_KEYS

LSCPU = """Architecture:          x86_64
CPU(s):                2
Model name:            AMD EPYC 7B13
CPU family:            25
Model:                 1
L3 cache:              32 MiB
Flags:                 fpu sse avx avx2 fma f16c
"""


PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"


def _load(name: str):  # noqa: ANN202
    """A bench/peers script as a module (registered: its dataclasses need sys.modules)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(PEERS))
    try:
        path = PEERS / f"{name}.py"
        if not path.is_file():
            path = PEERS.parent / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PEERS))


def _bpe_json() -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4}
    tok = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "c")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return json.loads(tok.to_str())


def test_fit_vocab_covers_every_id_and_keeps_the_encoding() -> None:
    from tokenizers import Tokenizer

    fc = _load("family_checkpoints")
    base = _bpe_json()
    wide = fc.fit_vocab(base, 40)
    before, after = Tokenizer.from_str(json.dumps(base)), Tokenizer.from_str(json.dumps(wide))
    assert after.get_vocab_size() == 40 and before.get_vocab_size() == 5
    assert after.encode("abcab").ids == before.encode("abcab").ids == [4, 3]
    assert after.decode([4, 39]) == "abc<x39>"
    assert base["model"]["vocab"] == {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4}  # not mutated
    narrow = Tokenizer.from_str(json.dumps(fc.fit_vocab(base, 4)))
    assert narrow.get_vocab_size() == 4
    assert narrow.encode("abc").ids == [3, 2]  # "abc" (id 4) and the merge making it are cut
    with_special = {**base, "added_tokens": [{"id": 4, "content": "<s>", "special": True}]}
    with pytest.raises(ValueError, match="added token id 4 does not fit vocab_size 4"):
        fc.fit_vocab(with_special, 4)
    with pytest.raises(ValueError, match="BPE"):
        fc.fit_vocab({"model": {"type": "WordLevel", "vocab": {}}}, 10)


def test_every_family_config_builds_and_holds_the_workload_ids() -> None:
    """Each family is a real transformers config whose vocabulary holds the trace's ids."""
    import transformers

    fc, fs = _load("family_checkpoints"), _load("family_speed")
    keys = [f.key for f in fc.FAMILIES]
    assert len(set(keys)) == len(keys) == 10
    for fam in fc.FAMILIES:
        config = getattr(transformers, fam.config_class)(**fam.config)
        assert config.vocab_size >= fs.WORKLOAD_VOCAB, fam.key
        assert config.num_hidden_layers == fam.config["num_hidden_layers"]
    assert min(f.config["vocab_size"] for f in fc.FAMILIES) == fs.WORKLOAD_VOCAB
    with pytest.raises(ValueError, match="unknown family 'gpt2'.*qwen3-0.6b"):
        fc.family("gpt2")
    with pytest.raises(ValueError, match="--gguf-types: 'q4_k'"):
        fc.convert_gguf(Path("x"), Path("y"), "q4_k")


def _write_run(tmp_path: Path, system: str, b: int, elapsed_s: float) -> None:
    rec_mod = _load("peer_record")
    rec = rec_mod.throughput_record(system, "x", b, b * 128, b * 64, elapsed_s, b)
    rec_mod.write(rec, str(tmp_path), _load("family_speed").run_name(system, b))


def test_family_figures_and_table_rows(tmp_path) -> None:
    fs = _load("family_speed")
    _write_run(tmp_path, "kvserve_before", 1, 2.0)  # 32 tok/s
    _write_run(tmp_path, "kvserve_after", 1, 1.0)  # 64 tok/s
    _write_run(tmp_path, "vllm-fp32", 1, 4.0)  # 16 tok/s
    assert (tmp_path / "offline_vllm_fp32_b1.json").is_file()  # as vllm_offline.py names it
    _write_run(tmp_path, "kvserve_before", 8, 8.0)  # 64 tok/s, its "after" run failed
    figures = fs.family_figures(tmp_path, [1, 8], ["vllm-fp32", "llama.cpp-q8_0"])
    assert figures == {
        "B=1": {"kvserve": [32.0, 64.0], "vllm-fp32": 16.0},
        "B=8": {"kvserve": [64.0, None]},
    }
    families = {"q": {"family": "Qwen3", "shape": "Qwen3-0.6B", "figures": figures}}
    rows = fs.table_rows(families, [1, 8], ["kvserve", "vllm-fp32", "llama.cpp-q8_0"])
    assert rows[0] == (
        "| family | checkpoint | B=1 kvserve | B=1 vllm-fp32 | B=1 llama.cpp-q8_0 "
        "| B=8 kvserve | B=8 vllm-fp32 | B=8 llama.cpp-q8_0 |"
    )
    assert rows[1] == "|" + "---|" * 8
    assert rows[2] == "| Qwen3 | Qwen3-0.6B | 32-64 | 16 | - | 64 | - | - |"


def test_the_sitting_record_has_the_records_schema() -> None:
    fs = _load("family_speed")
    started = datetime.datetime(2026, 12, 7, 19, 30, tzinfo=datetime.timezone.utc)
    families = {"q": {"family": "Qwen3", "shape": "s", "figures": {"B=1": {"kvserve": [1, 2]}}}}
    peers = {"kvserve": "abcdef1", "vllm": "0.32.0"}
    record = fs.build_record(LSCPU, started, "abcdef1234", "3.1 3.0 2.9", peers, ["c"], families)
    assert record["cpu_kind"] == "epyc-avx2" and record["commit"] == "abcdef1"
    assert record["lscpu"]["flags"] == ["avx", "avx2", "fma", "f16c"]
    assert record["figures"] == {"families": families}
    for key, kind in TOP_KEYS.items():
        assert isinstance(record[key], kind), key
    assert KINDS.fullmatch(record["cpu_kind"])
    assert fs.record_path(record) == Path("epyc-avx2") / "2026-12-07_abcdef1_families.json"
    assert json.loads(_load("make_record").dumps(record)) == record
