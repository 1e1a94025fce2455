"""Checks that need the model (prompt length, vocabulary, context) and the request's
SamplingParams; each error names the offending field. Everything else is checked by
protocol.py and SamplingParams."""

from __future__ import annotations

from kvserve.engine.async_engine import RequestStream
from kvserve.sampling_params import SamplingParams
from kvserve.server import protocol as p
from kvserve.server.context import ServingContext, off_engine
from kvserve.server.errors import APIError, engine_error, from_value_error
from kvserve.server.tokenizer_pool import LARGE
from kvserve.structured.spec import StructuredOutputsParams

# NOTE: a 64-bit integer, as vLLM's protocol takes it (negative ones too): the sampler maps
# any int seed (plus the sample index) onto its generator (runtime/sampler.seeded_uniform).
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_CHOICES = 256  # prompts x n in one request


def check_prompt_ids(ctx: ServingContext, token_ids: list[int], param: str) -> None:
    """400 (naming ``param``) for an empty prompt, an id outside the vocabulary, or a prompt
    that leaves no room in the context for one generated token."""
    if not token_ids:
        raise APIError(f"{param} is empty", param=param)
    for t in token_ids:
        if not 0 <= t < ctx.vocab_size:
            raise APIError(
                f"{param} token id {t} is outside the vocabulary [0, {ctx.vocab_size})",
                param=param,
            )
    if len(token_ids) >= ctx.max_model_len:
        raise APIError(
            f"{param} has {len(token_ids)} tokens, but this model's context length is "
            f"{ctx.max_model_len} (and at least one token must be generated)",
            param=param,
            code="context_length_exceeded",
        )


def resolve_max_tokens(
    ctx: ServingContext, num_prompt_tokens: int, max_tokens: int | None, param: str
) -> int:
    """``max_tokens`` checked against the context (None: as many as the context and the KV
    pool leave, at most the model's ``max_new_tokens`` default, as vLLM caps it)."""
    if max_tokens is None:
        room = max(1, ctx.max_total_tokens - num_prompt_tokens)
        default = ctx.sampling_defaults.get("max_tokens")
        return room if default is None else min(room, default)
    if num_prompt_tokens + max_tokens > ctx.max_model_len:
        raise APIError(
            f"{param}={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds this "
            f"model's context length {ctx.max_model_len}; lower {param}",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def check_request(ctx: ServingContext, req: p.SamplingRequest) -> None:
    """The checks of a chat or completion request that need no tokens: ``stream_options``
    only with ``stream`` and ``priority`` only under the priority policy (400s, as vLLM)."""
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be set when stream is true", param="stream_options")
    if req.priority != 0 and ctx.scheduling_policy != "priority":
        # NOTE: vLLM answers the same 400: under fcfs a priority would silently reorder the
        # queue ahead of other clients' requests.
        raise APIError(
            f"priority={req.priority} needs priority scheduling: this server schedules "
            f"{ctx.scheduling_policy!r} (start it with --scheduling-policy priority)",
            param="priority",
        )


def _canonical_token_id(key: str) -> bool:
    """``key`` spells a token id the one way: ASCII digits, no sign, no leading zero, no
    spaces or underscores (which ``int()`` would accept)."""
    return key.isascii() and key.isdigit() and (key == "0" or key[0] != "0")


def _logit_bias(ctx: ServingContext, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> bias) with every id checked."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not _canonical_token_id(key):
            message = f"logit_bias key {key!r} is not a token id (a decimal integer such as '42')"
            raise APIError(message, param="logit_bias")
        # NOTE: a key longer than the vocabulary's largest id is outside it; not parsed.
        token_id = int(key) if len(key) <= len(str(ctx.vocab_size)) else ctx.vocab_size
        if not 0 <= token_id < ctx.vocab_size:
            raise APIError(
                f"logit_bias token id {key} is outside the vocabulary [0, {ctx.vocab_size})",
                param="logit_bias",
            )
        out[token_id] = value
    return out


async def check_constraint(
    ctx: ServingContext, constraint: StructuredOutputsParams | None, param: str | None
) -> None:
    """Compile the constraint now (cached), so a bad schema/regex/grammar is a 400 naming
    the problem before anything is queued."""
    if constraint is None or ctx.validate_constraint is None:
        return
    check = ctx.validate_constraint
    try:
        await off_engine(ctx, lambda: check(constraint), LARGE)
    except ValueError as e:
        raise APIError(str(e), param=param) from e


def sampling_params(
    ctx: ServingContext,
    req: p.SamplingRequest,
    max_tokens: int,
    logprobs: int | None,
    constraint: StructuredOutputsParams | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for an OpenAI request (400 naming the field if invalid)."""
    lo, hi = SEED_RANGE
    if req.seed is not None and not lo <= req.seed <= hi:
        raise APIError(f"seed must be a 64-bit integer, in [{lo}, {hi}]", param="seed")
    # NOTE: no upper bound on top_k: as vLLM, one above the vocabulary size means no
    # restriction (the sampler clips it to the vocabulary).
    logit_bias = _logit_bias(ctx, req.logit_bias)
    for t in req.stop_token_ids or ():
        if not 0 <= t < ctx.vocab_size:
            raise APIError(
                f"stop_token_ids: token id {t} is outside the vocabulary [0, {ctx.vocab_size})",
                param="stop_token_ids",
            )
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop is not None and any(not s for s in stop):
        raise APIError("stop strings must be non-empty", param="stop")

    defaulted = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    given = req.model_dump(include=req.model_fields_set & defaulted)

    def pick(name: str, openai_default: float) -> float:
        """The request's value, else the model's default, else OpenAI's (vLLM's order)."""
        value = given.get(name)
        return value if value is not None else ctx.sampling_defaults.get(name, openai_default)

    try:
        return SamplingParams(
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=int(pick("top_k", -1)),
            min_p=pick("min_p", 0.0),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop or None,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=logit_bias,
            structured_outputs=constraint,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as e:
        raise from_value_error(e) from e


async def add_engine_requests(
    ctx: ServingContext,
    base_id: str,
    prompts: list[list[int]],
    params_list: list[SamplingParams],
    req: p.SamplingRequest,
) -> list[RequestStream]:
    """Queue one engine request per prompt; on any failure abort the ones already queued and
    raise the failure as its API error (``errors.ENGINE_ERRORS``)."""
    streams: list[RequestStream] = []
    try:
        for i, (ids, params) in enumerate(zip(prompts, params_list, strict=True)):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(
                await ctx.engine.add_request(
                    ids, params, request_id=rid, priority=req.priority, cache_salt=req.cache_salt
                )
            )
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, Exception):
            raise engine_error(e) from e
        raise
    return streams
