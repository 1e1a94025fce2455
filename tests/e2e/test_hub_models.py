"""Models named as users name them: a Hugging Face Hub id (``org/name``, ``org/name:QUANT``)
resolves through huggingface_hub's real ``snapshot_download`` over a Hugging Face cache laid
out on disk as the Hub client writes it (``models--org--name/{blobs,refs/main,snapshots/
<rev>}``), offline; nothing is mocked and nothing is downloaded. A Hub id that is not cached
while offline is an error saying how to get it, at once."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvserve.engine.llm import LLM
from kvserve.models.errors import ModelFileNotFoundError, ModelLoadError
from kvserve.models.hub import hub_id_of_path, parse_hub_id
from kvserve.models.loader import resolve_model
from kvserve.models.quant_model import model_id
from kvserve.server.app import build_app
from tests.tiny_gguf import make_tiny_gguf
from tests.tiny_models import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]
REVISION = "0123456789abcdef0123456789abcdef01234567"
HF_REPO = "kvserve-test/tiny-llama"
GGUF_REPO = "kvserve-test/tiny-llama-GGUF"
# The model's sampling defaults, as a model author writes them (Qwen2.5-Instruct's values,
# max_new_tokens lowered).
GENERATION_CONFIG = (
    '{"bos_token_id": 1, "eos_token_id": 2, "do_sample": true, "temperature": 0.7, '
    '"top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 6}'
)


def _add_to_cache(hub_cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """Lay ``files`` (name in the repository -> local file) out as the Hub client caches a
    snapshot: content-addressed blobs, the snapshot's symlinks to them, ``refs/main``."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    for name, source in files.items():
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME whose hub cache holds an HF-format repository (with a generation config)
    and a GGUF repository of two quantizations."""
    work = tmp_path_factory.mktemp("hub")
    model_dir = Path(make_tiny_model(work / "src", "llama"))
    (model_dir / "generation_config.json").write_text(GENERATION_CONFIG)
    hub_cache = work / "hf_home" / "hub"
    _add_to_cache(hub_cache, HF_REPO, {p.name: p for p in model_dir.iterdir() if p.is_file()})
    ggufs = {}
    for tag in ("Q8_0", "Q4_0"):
        path = Path(make_tiny_gguf(work / tag, "llama", tensor_type=tag))
        ggufs[f"tiny-llama-{tag}.gguf"] = path
    _add_to_cache(hub_cache, GGUF_REPO, ggufs)
    return work / "hf_home"


@pytest.fixture
def offline_cache(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """huggingface_hub, already imported in this process, pointed at the test cache and
    offline: its settings are read from the environment once, at import (the subprocess tests
    below set HF_HOME and HF_HUB_OFFLINE themselves)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hf_home


def _run(code: str, hf_home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HOME": str(hf_home)}
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    # NOTE: the timeout only bounds a failure: the offline error comes at once.
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_hub_ids_are_told_from_paths() -> None:
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert parse_hub_id("org/name-GGUF:Q4_K_M") == ("org/name-GGUF", "Q4_K_M")
    for not_an_id in ("model.gguf", "a/b/c", "./a/b", "/a/b", "a/../b", "a--b/c", "org/"):
        assert parse_hub_id(not_an_id) is None, not_an_id
    snapshot = f"/x/hub/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/{REVISION}"
    assert hub_id_of_path(snapshot) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert model_id(snapshot, {"mode": "none", "weight_bytes_by_format": {"dense": 1}}) == (
        "Qwen/Qwen2.5-0.5B-Instruct"
    )
    assert hub_id_of_path("/x/models/tiny-llama") is None


def test_a_local_path_wins_over_a_hub_id(tmp_path: Path, monkeypatch, offline_cache) -> None:
    local = Path(make_tiny_model(tmp_path / HF_REPO.split("/")[0], "llama", name="tiny-llama"))
    monkeypatch.chdir(tmp_path)
    assert resolve_model(HF_REPO) == str(local)


def test_hub_ids_resolve_offline_honouring_hf_home(hf_home: Path) -> None:
    """HF_HOME and HF_HUB_OFFLINE as a user sets them, in a fresh process: the cached ids
    resolve; one not cached is refused at once, saying how to get it."""
    code = (
        "import sys\n"
        "from kvserve.cli import main\n"
        "from kvserve.models.loader import resolve_model\n"
        "from kvserve.models.quant_model import model_id\n"
        f"path = resolve_model({HF_REPO!r})\n"
        "print(path)\nprint(model_id(path))\n"
        f"print(resolve_model({GGUF_REPO + ':q4_0'!r}))\n"
        "sys.exit(main(['generate', '--model', 'nobody/none', 'hi']))\n"
    )
    proc = _run(code, hf_home)
    hf_path, name, gguf_path = proc.stdout.splitlines()
    repo = hf_home / "hub" / "models--kvserve-test--tiny-llama"
    assert Path(hf_path) == repo / "snapshots" / REVISION
    assert name == HF_REPO
    assert Path(gguf_path).name == "tiny-llama-Q4_0.gguf"
    assert proc.returncode == 2  # the CLI's exit status for a bad argument
    err = proc.stderr
    assert err.startswith("kvserve: error: ") and "Traceback" not in err, err
    assert "nobody/none" in err and f"not in the Hugging Face cache ({hf_home / 'hub'})" in err
    assert "HF_HUB_OFFLINE=0" in err and "hf download nobody/none" in err, err


def test_gguf_repository_needs_its_quantization(offline_cache) -> None:
    with pytest.raises(ModelLoadError, match=r"2 \.gguf files.*kvserve-test/tiny-llama-GGUF:QUANT"):
        resolve_model(GGUF_REPO)
    assert resolve_model(GGUF_REPO + ":Q8_0").endswith("tiny-llama-Q8_0.gguf")
    with pytest.raises(ModelFileNotFoundError, match=r"no GGUF file of quantization Q4_K_M.*holds"):
        resolve_model(GGUF_REPO + ":Q4_K_M")


@pytest.fixture(scope="module")
def hub_llm(hf_home: Path) -> LLM:
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        return LLM(
            model=HF_REPO, num_kv_blocks=32, max_model_len=64, num_threads=1, dtype="float32"
        )


def test_llm_runs_a_hub_model_with_its_generation_config(hub_llm: LLM) -> None:
    engine = hub_llm.engine
    assert hub_id_of_path(engine.model_path) == HF_REPO
    assert model_id(engine.model_path, engine.quantization) == HF_REPO
    assert dict(engine.generation_defaults.values) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 6,
    }
    params = hub_llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 20, 6)
    out = hub_llm.generate("hello", use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 6  # max_new_tokens: the default max_tokens


def test_generation_config_vllm_ignores_the_model_defaults(hf_home: Path, offline_cache) -> None:
    from kvserve.models.generation_config import load_generation_defaults

    snapshot = resolve_model(HF_REPO)
    assert load_generation_defaults("vllm", snapshot).values == {}
    folder = shutil.copytree(snapshot, hf_home.parent / "gen", symlinks=False)
    Path(folder, "generation_config.json").write_text('{"temperature": 0.3}')
    assert dict(load_generation_defaults(str(folder), snapshot).values) == {"temperature": 0.3}


def test_serve_names_the_hub_model_and_applies_its_defaults(hub_llm: LLM) -> None:
    """What ``kvserve serve --model kvserve-test/tiny-llama`` serves: the Hub id as the model
    id, and the model's max_new_tokens (6) capping OpenAI's default 16."""

    async def main() -> None:
        app = build_app(hub_llm.engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            models = (await c.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == [HF_REPO]
            body = {"model": HF_REPO, "prompt": "hello", "ignore_eos": True}
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == HF_REPO
            assert r.json()["usage"]["completion_tokens"] == 6
        await app.state.async_engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=120))
