"""The shape of an engine as the async layer and the server see it (``EngineLike``):
LLMEngine has it, and the tests' fakes copy it; the server reaches an engine through
nothing else."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.structured.spec import StructuredOutputsParams

if TYPE_CHECKING:
    from kvserve.models.generation_config import GenerationDefaults


class TokenizerLike(Protocol):
    """The tokenizer operations the server uses (kvserve.tokenizer.Tokenizer has them)."""

    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]: ...


class ArchLike(Protocol):
    """The model shape the server reads."""

    @property
    def vocab_size(self) -> int: ...


class KVPoolLike(Protocol):
    """The KV-cache manager as the server sees it: its capacity and its integrity check."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def check_integrity(self) -> None: ...


class SchedulingConfigLike(Protocol):
    """The engine configuration the server reads: whether priorities are honoured."""

    @property
    def scheduling_policy(self) -> str: ...


class ConstraintValidator(Protocol):
    """Compiles a structured-output constraint; ValueError naming the problem if invalid."""

    def validate(self, spec: StructuredOutputsParams) -> None: ...


class EngineLike(Protocol):
    """Everything of LLMEngine that the async layer and the server use (tests pass a fake
    with the same shape); the server reaches the engine through nothing else.

    ``structured`` is None for an engine without structured output (a test's fake).
    """

    model_path: str
    max_model_len: int
    generation_defaults: GenerationDefaults  # the model's sampling defaults

    @property
    def arch(self) -> ArchLike: ...

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def kv_cache_manager(self) -> KVPoolLike: ...

    @property
    def structured(self) -> ConstraintValidator | None: ...

    @property
    def config(self) -> SchedulingConfigLike: ...

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> dict[str, Any]: ...
