"""Tokenizer wrapper: encode/decode, chat template, and the incremental detokenizer.

Wraps a Hugging Face ``transformers`` tokenizer loaded from an HF directory or from the
metadata of a GGUF file. Parsing a GGUF vocabulary takes seconds, so the converted
tokenizer is cached in the process and on disk (``$KVSERVE_CACHE_DIR/tokenizers``, default
``~/.cache/kvserve``), which brings a later load down to a fraction of a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any

from kvserve.cache_dir import cache_root
from kvserve.detokenizer import IncrementalDetokenizer

__all__ = ["CHAT_ROLES", "IncrementalDetokenizer", "Tokenizer", "tokenizer_cache_dir"]

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")
# apply_chat_template's own parameters and the variables the request sets: never taken from
# a request's chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages", "conversation", "tools", "documents", "add_generation_prompt",
        "continue_final_message", "chat_template", "tokenize", "padding", "truncation",
        "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)  # fmt: skip

# (absolute path, gguf file name or "", mtime_ns) -> loaded HF tokenizer
_PROCESS_CACHE: dict[tuple[str, str, int], Any] = {}
_PROCESS_CACHE_LOCK = threading.Lock()


def tokenizer_cache_dir() -> str:
    """Folder holding tokenizers converted from GGUF files (``$KVSERVE_CACHE_DIR/tokenizers``)."""
    return str(cache_root() / "tokenizers")


class Tokenizer:
    """A loaded tokenizer with the few operations the engine needs.

    Attributes:
        eos_token_id: end-of-sequence id (``<|im_end|>`` for SmolLM2-Instruct) or None.
        bos_token_id: beginning-of-sequence id or None.
        vocab_size: ``len(tokenizer)``: base vocabulary plus added tokens.
        all_special_ids: ids of special tokens (skipped by ``skip_special_tokens``).
        load_time_s: seconds spent loading (0 when it came from the process cache).
        loaded_from_cache: "process", "disk" or None (loaded from the source).
    """

    def __init__(self, hf_tokenizer: Any, *, load_time_s: float = 0.0) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: list[int] = list(hf_tokenizer.all_special_ids)
        self.load_time_s = load_time_s
        self.loaded_from_cache: str | None = None
        # NOTE: the fast (Rust) backend decodes a few ids without the Python overhead of
        # PreTrainedTokenizer.decode; the detokenizer calls it once per step per request.
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)

    # ----------------------------------------------------------------------------- loading
    @classmethod
    def from_loaded(cls, tokenizer_dir: str, gguf_file: str | None) -> Tokenizer:
        """Load the tokenizer of a model: from ``tokenizer_dir`` (HF files) or from the
        metadata of ``gguf_file`` (a file name inside ``tokenizer_dir``, or a path).

        Raises ValueError when the folder or file does not exist.
        """
        start = time.perf_counter()
        if gguf_file is not None:
            path = os.path.abspath(os.path.join(tokenizer_dir, gguf_file))
            if not os.path.isfile(path):
                raise ValueError(f"tokenizer: GGUF file not found: {path}")
        else:
            path = os.path.abspath(tokenizer_dir)
            if not os.path.isdir(path):
                raise ValueError(f"tokenizer: tokenizer_dir is not a folder: {path}")
        key = (path, "gguf" if gguf_file is not None else "", os.stat(path).st_mtime_ns)
        with _PROCESS_CACHE_LOCK:
            hf = _PROCESS_CACHE.get(key)
            source: str | None = "process" if hf is not None else None
            if hf is None:
                if gguf_file is not None:
                    hf, from_disk = _load_gguf_tokenizer(path)
                    source = "disk" if from_disk else None
                else:
                    _check_has_tokenizer(path, is_gguf=False)
                    hf = _auto_tokenizer().from_pretrained(path)
                _PROCESS_CACHE[key] = hf
        tok = cls(hf, load_time_s=time.perf_counter() - start)
        tok.loaded_from_cache = source
        logger.info("tokenizer loaded in %.2f s (cache: %s)", tok.load_time_s, source)
        return tok

    # ------------------------------------------------------------------------- encode/decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (special-token markup in the text is recognised)."""
        if not isinstance(text, str):
            raise ValueError(f"tokenizer.encode: text must be a str, got {type(text).__name__}")
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``. Bytes of an incomplete UTF-8 character decode to U+FFFD.

        No ``clean_up_tokenization_spaces``: the text is exactly what the tokens spell, so
        incremental and whole decoding agree."""
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf_tokenizer.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Vocabulary strings of ``ids`` (byte-level tokens look like ``'Ġworld'``)."""
        return list(self.hf_tokenizer.convert_ids_to_tokens(list(ids)))

    # ---------------------------------------------------------------------------- chat
    @property
    def chat_template(self) -> str | None:
        """The model's Jinja chat template (from GGUF metadata or tokenizer_config.json)."""
        return getattr(self.hf_tokenizer, "chat_template", None)

    def render_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat prompt as text. ``chat_template`` replaces the model's template;
        ``tools`` (OpenAI tool dicts) reach templates that render them;
        ``continue_final_message`` leaves the last message open (no end-of-turn after it), for
        the model to continue; ``template_kwargs`` are more variables for the template (e.g.
        ``enable_thinking``), none of ``apply_chat_template``'s own parameters. Raises
        ValueError for malformed messages, a template that fails, a reserved template kwarg,
        or when there is no template."""
        validate_messages(messages)
        if not (chat_template or self.chat_template):
            raise ValueError("tokenizer: this model has no chat template; send a plain prompt")
        extra: dict[str, Any] = {}
        if chat_template is not None:
            extra["chat_template"] = chat_template
        if tools:
            extra["tools"] = tools
        if continue_final_message:
            extra["continue_final_message"] = True
        if template_kwargs:
            check_template_kwargs(template_kwargs)
            extra.update(template_kwargs)
        try:
            text = self.hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )
        except Exception as e:  # noqa: BLE001 - jinja errors come in many types
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"tokenizer: the chat template failed: {e}") from e
        if not isinstance(text, str):
            raise ValueError("tokenizer: the chat template did not render to a string")
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt (the template already holds any BOS it needs)."""
        text = self.render_chat_template(
            messages,
            add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        # NOTE: add_special_tokens=False: the template writes BOS/markers itself; adding them
        # again would duplicate BOS on models whose tokenizer prepends one.
        return self.encode(text, add_special_tokens=False)


class ChatOptionError(ValueError):
    """A chat option that conflicts with the request; ``field`` names the option at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def generation_flags(
    add_generation_prompt: bool | None, continue_final_message: bool, last_role: object
) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) as vLLM takes them; ``None``: not set.

    ``continue_final_message`` (assistant prefill: the model continues the last message, which
    must be the assistant's, ``last_role``) turns ``add_generation_prompt`` off unless it is
    set; both true is a ChatOptionError, as vLLM refuses it.
    """
    if not continue_final_message:
        return add_generation_prompt is not False, False
    if add_generation_prompt:
        raise ChatOptionError(
            "continue_final_message and add_generation_prompt cannot both be true (continue "
            "the last message, or start a new assistant turn)",
            "continue_final_message",
        )
    if last_role != "assistant":
        raise ChatOptionError(
            "continue_final_message continues the last message, which must be the assistant's "
            f"(the text to continue); it is {last_role!r}",
            "messages",
        )
    return False, True


def check_template_kwargs(template_kwargs: dict[str, Any]) -> None:
    """ChatOptionError naming any of ``RESERVED_TEMPLATE_KWARGS`` among ``template_kwargs``."""
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & template_kwargs.keys())
    if reserved:
        verb = "is" if len(reserved) == 1 else "are"
        raise ChatOptionError(
            f"chat_template_kwargs: {', '.join(map(repr, reserved))} {verb} set by the request "
            "itself, not as a template variable",
            "chat_template_kwargs",
        )


def validate_messages(messages: object) -> None:
    """Raise ValueError naming the problem unless ``messages`` is a non-empty list of dicts
    with ``role`` in system/user/assistant/tool and string ``content``."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {CHAT_ROLES}, got {role!r}")
        if not isinstance(msg.get("content"), str):
            got = type(msg.get("content")).__name__
            raise ValueError(f"messages[{i}].content must be a string, got {got}")


# Files a Llama-family tokenizer loads from: fast (tokenizers), SentencePiece, byte-level BPE.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _check_has_tokenizer(path: str, *, is_gguf: bool) -> None:
    """Raise ValueError naming ``path`` when the GGUF file or HF folder holds no tokenizer.

    NOTE: transformers fails on these with a KeyError ('tokens', GGUF) or a note about
    installing sentencepiece (folder), neither naming the model.
    """
    if is_gguf:
        from kvserve.models.gguf_reader import read_gguf  # NOTE: lazy: pulls in numpy / gguf

        if "tokenizer.ggml.tokens" not in read_gguf(path).metadata:
            raise ValueError(
                f"{path}: no tokenizer in its metadata (tokenizer.ggml.tokens); use a GGUF "
                "converted with its tokenizer"
            )
    elif not any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES):
        raise ValueError(
            f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy the model's "
            "tokenizer files into the folder"
        )


def _auto_tokenizer() -> Any:
    # NOTE: imported lazily: transformers takes ~2 s to import, and core/ tests never need it.
    from transformers import AutoTokenizer

    return AutoTokenizer


def _load_gguf_tokenizer(path: str) -> tuple[Any, bool]:
    """Load the tokenizer of a GGUF file, through the on-disk cache. Returns (tokenizer,
    came_from_disk_cache)."""
    import transformers

    stat = os.stat(path)
    digest = hashlib.sha256(
        f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()
    ).hexdigest()[:24]
    cache_dir = os.path.join(tokenizer_cache_dir(), digest)
    auto = _auto_tokenizer()
    if os.path.isfile(os.path.join(cache_dir, "tokenizer.json")):
        try:
            return auto.from_pretrained(cache_dir), True
        except Exception as exc:  # a damaged cache entry: rebuild it
            logger.warning("tokenizer cache %s unreadable (%s); rebuilding", cache_dir, exc)
            shutil.rmtree(cache_dir, ignore_errors=True)
    # NOTE: checked only on a disk-cache miss: it parses the GGUF header (~70 ms).
    _check_has_tokenizer(path, is_gguf=True)
    hf = auto.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _save_to_cache(hf, cache_dir)
    return hf, False


def _save_to_cache(hf: Any, cache_dir: str) -> None:
    """Write the converted tokenizer atomically (temp folder + rename); failures only warn."""
    try:
        parent = os.path.dirname(cache_dir)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
        hf.save_pretrained(tmp)
        try:
            os.rename(tmp, cache_dir)
        except OSError:  # another process won the race; keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.warning("could not cache the tokenizer in %s: %s", cache_dir, exc)
