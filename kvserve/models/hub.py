"""Models named by a Hugging Face Hub id (``org/name``): resolved to a local snapshot.

``--model Qwen/Qwen2.5-0.5B-Instruct`` (or ``LLM(model=...)``) goes through
``huggingface_hub.snapshot_download``, as vLLM's ``--model`` does: the files come from the
Hugging Face cache (``$HF_HOME/hub``, or ``$HF_HUB_CACHE``) or are downloaded into it;
``HF_HUB_OFFLINE=1`` allows the cache only. ``org/name:QUANT`` (llama.cpp's ``-hf``
spelling) names one GGUF file of a GGUF repository by its quantization tag
(``bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M``).

A local path always wins: a hub id is only tried for a name that is no existing path.
"""

from __future__ import annotations

import os
import re

from kvserve.models.errors import ModelFileNotFoundError, ModelLoadError

# ``org/name`` with the Hub's characters, optionally ``:QUANT`` (a GGUF quantization tag).
_HUB_ID = re.compile(
    r"(?P<repo>[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*)(?::(?P<quant>[A-Za-z0-9][\w\-]*))?"
)
# The files of an HF-format model folder (kvserve reads config.json, the safetensors, the
# tokenizer files and generation_config.json); other weight formats (.bin, .pth, onnx) are
# not fetched.
HF_FOLDER_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja")
_INSTALL_HINT = "pip install huggingface_hub"


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, quant_tag)`` when ``text`` is spelled as a Hub id (``org/name`` or
    ``org/name:QUANT``), else None. Says nothing of whether the repository exists."""
    match = _HUB_ID.fullmatch(text)
    if match is None or ".." in text or "--" in match["repo"]:
        return None
    return match["repo"], match["quant"]


def hub_id_of_path(path: str) -> str | None:
    """The Hub id (``org/name``) of a snapshot folder in the Hugging Face cache layout
    (``.../models--org--name/snapshots/<revision>``), else None."""
    parts = os.path.normpath(path).split(os.sep)
    if len(parts) < 3 or parts[-2] != "snapshots" or not parts[-3].startswith("models--"):
        return None
    names = parts[-3][len("models--") :].split("--")
    return "/".join(names) if len(names) == 2 and all(names) else None


def resolve_hub_model(text: str) -> str:
    """The local path of the model ``text`` names on the Hub (a snapshot folder, or the one
    GGUF file of ``org/name:QUANT``), downloading it into the Hugging Face cache unless
    ``HF_HUB_OFFLINE`` is set.

    Raises ModelFileNotFoundError saying how to get the model when it is neither cached nor
    downloadable (offline, no network, no such repository), never waits on the network
    longer than huggingface_hub's own timeouts.
    """
    parsed = parse_hub_id(text)
    if parsed is None:
        raise ModelLoadError(f"{text!r} is not a Hugging Face Hub id (org/name)")
    repo_id, quant = parsed
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError as e:
        raise ModelFileNotFoundError(
            f"{text}: no such local file or directory; as a Hugging Face Hub id it needs "
            f"huggingface_hub (`{_INSTALL_HINT}`)"
        ) from e
    patterns = _gguf_patterns(quant) if quant else list(HF_FOLDER_PATTERNS)
    offline = constants.is_offline_mode()
    try:
        folder = huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns)
    except errors.LocalEntryNotFoundError as e:
        # NOTE: offline and not cached, or the Hub unreachable and not cached.
        where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
        if offline:
            raise ModelFileNotFoundError(
                f"{text}: no such local file or directory, and the Hub model {repo_id} is not "
                f"in {where}; HF_HUB_OFFLINE=1 forbids downloading it. Download it first "
                f"(`hf download {repo_id}` with network access) or set HF_HUB_OFFLINE=0"
            ) from e
        raise ModelFileNotFoundError(
            f"{text}: no such local file or directory, and the Hub model {repo_id} is not in "
            f"{where} and could not be downloaded ({_first_line(e)}); check the network, "
            f"or download it elsewhere (`hf download {repo_id}`) into that cache"
        ) from e
    except errors.RepositoryNotFoundError as e:  # GatedRepoError included
        raise ModelFileNotFoundError(
            f"{text}: no such local file or directory, nor a model the Hub serves to this "
            f"user ({_first_line(e)}); for a private or gated model log in first "
            "(`hf auth login` or HF_TOKEN)"
        ) from e
    except errors.HfHubHTTPError as e:
        raise ModelFileNotFoundError(
            f"{text}: the Hub refused the download: {_first_line(e)}"
        ) from e
    return _gguf_in(folder, text, quant) if quant else folder


def _gguf_patterns(quant: str) -> list[str]:
    """Download patterns of the one GGUF file tagged ``quant`` (``x-Q4_K_M.gguf``,
    ``x.q4_k_m.gguf``): the tag as written, upper and lower case."""
    return sorted({f"*[-._]{tag}.gguf" for tag in (quant, quant.upper(), quant.lower())})


def _gguf_in(folder: str, text: str, quant: str) -> str:
    """The one ``.gguf`` file of ``folder`` whose name ends in the tag ``quant``."""
    tag = re.compile(rf"[-._]{re.escape(quant)}\.gguf$", re.IGNORECASE)
    found: list[str] = []
    every: list[str] = []
    for root, _dirs, files in os.walk(folder):
        for name in files:
            if name.lower().endswith(".gguf"):
                rel = os.path.relpath(os.path.join(root, name), folder)
                every.append(rel)
                if tag.search(name):
                    found.append(rel)
    if len(found) == 1:
        return os.path.join(folder, found[0])
    if not found:
        held = f" (it holds {', '.join(sorted(every))})" if every else ""
        raise ModelFileNotFoundError(
            f"{text}: no GGUF file of quantization {quant} in {folder}{held}"
        )
    raise ModelLoadError(
        f"{text}: {len(found)} GGUF files of quantization {quant} ({', '.join(sorted(found))}); "
        "split GGUF files are not supported: pass one file's path"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
