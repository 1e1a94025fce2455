"""Request traces: deterministic generators from a seed, and JSONL save / load.

One request per JSONL line::

    {"request_id": "req-0", "prompt_len": 120, "output_len": 64, "arrival_time": 0.25,
     "prompt_token_ids": [...], "prefix_group": "g3", "output_token_ids": [...]}

``prompt_len``, ``output_len`` and ``arrival_time`` (seconds from the start of the trace) are
required; the rest are optional. ``prompt_token_ids`` is given when the token values matter
(shared prefixes, multi-turn history); otherwise :func:`resolve_prompt_token_ids` makes
deterministic, request-unique ids at replay time. ``output_token_ids`` is a scripted reply:
the simulator emits exactly these tokens, so that a later turn re-sending the history hits
the prefix cache on the reply too.

Kinds (``generate_workload(kind, num_requests, seed, **kw)``):

- ``random``: prompt and output lengths uniform in ``[min_prompt_len, max_prompt_len]`` and
  ``[min_output_len, max_output_len]``.
- ``sharegpt``: long-tailed lengths, ``round(LogNormal(ln(prompt_median), prompt_sigma))``
  clipped to ``[min_prompt_len, max_prompt_len]``, likewise the output. The defaults
  (median 110 / 220 tokens, sigma 0.9, means ~165 / ~330) follow the ShareGPT length means
  reported in the vLLM paper (161 input, 338 output tokens).
- ``shared-prefix``: ``num_groups`` prefixes of ``prefix_len`` tokens; request ``i`` takes
  group ``i % num_groups`` and a unique suffix of ``suffix_len`` tokens (uniform in
  ``[suffix_len // 2, suffix_len]``).
- ``multi-turn``: conversations of ``num_turns`` turns sharing one ``system_prompt_len`` system
  prompt. Turn t's prompt is the whole history (system, user 1, reply 1, ..., user t); replies
  are scripted. Conversations start as a Poisson process; turn t+1 arrives ``think_time``
  seconds (exponentially distributed) after turn t.

Arrivals: a Poisson process at ``request_rate`` requests/s (``float('inf')``, the default:
all at t=0).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

T = TypeVar("T")

FIRST_TOKEN_ID = 10  # NOTE: keep clear of the low ids that real vocabularies use as specials
DEFAULT_VOCAB_SIZE = 32000
KINDS = ("random", "sharegpt", "shared-prefix", "multi-turn")


@dataclass
class WorkloadRequest:
    """One request of a trace."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival_time: float
    prompt_token_ids: list[int] | None = None
    prefix_group: str | None = None
    output_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        _check_int(self.prompt_len, "prompt_len", 1)
        _check_int(self.output_len, "output_len", 1)
        # NOTE: an infinite arrival made the simulated duration inf and a replay sleep forever.
        if not isinstance(self.arrival_time, (int, float)) or not (
            0 <= self.arrival_time < math.inf
        ):
            raise ValueError(
                f"arrival_time must be a finite number >= 0, got {self.arrival_time!r}"
            )
        _check_token_ids(self.prompt_token_ids, "prompt_token_ids")
        _check_token_ids(self.output_token_ids, "output_token_ids")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(
                f"request {self.request_id}: prompt_len {self.prompt_len} != "
                f"len(prompt_token_ids) {len(self.prompt_token_ids)}"
            )
        if self.output_token_ids is not None and len(self.output_token_ids) != self.output_len:
            raise ValueError(
                f"request {self.request_id}: output_len {self.output_len} != "
                f"len(output_token_ids) {len(self.output_token_ids)}"
            )

    def to_dict(self) -> dict:
        """JSON-ready dict; optional fields that are None are left out."""
        d: dict = {
            "request_id": self.request_id,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "arrival_time": self.arrival_time,
        }
        for k in ("prompt_token_ids", "prefix_group", "output_token_ids"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d


def _check_token_ids(ids: object, name: str) -> None:
    """None, or a list of token ids (ints >= 0); ValueError naming the field otherwise."""
    if ids is None:
        return
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    ):
        raise ValueError(f"{name} must be a list of token ids (ints >= 0)")


def _check_int(v: object, name: str, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def resolve_prompt_token_ids(
    req: WorkloadRequest, vocab_size: int = DEFAULT_VOCAB_SIZE, salt: int = 0
) -> list[int]:
    """The request's prompt ids, or deterministic pseudo-random ids unique to its request_id."""
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    rng = random.Random(f"{salt}:{req.request_id}")
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(req.prompt_len)]


# --- generators --------------------------------------------------------------------------


def _arrivals(rng: np.random.Generator, n: int, request_rate: float) -> list[float]:
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (inf = all at once), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / request_rate, size=n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, vocab_size, size=n).tolist()


def _lognormal_lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int
) -> list[int]:
    if median <= 0 or sigma < 0 or lo < 1 or hi < lo:
        raise ValueError(f"bad length distribution: median={median} sigma={sigma} [{lo}, {hi}]")
    x = rng.lognormal(math.log(median), sigma, size=n)
    return np.clip(np.rint(x), lo, hi).astype(int).tolist()


def _gen_random(rng: np.random.Generator, n: int, kw: dict) -> list[WorkloadRequest]:
    lo_p, hi_p = kw.pop("min_prompt_len", 16), kw.pop("max_prompt_len", 512)
    lo_o, hi_o = kw.pop("min_output_len", 16), kw.pop("max_output_len", 256)
    if not (1 <= lo_p <= hi_p and 1 <= lo_o <= hi_o):
        raise ValueError("random workload: need 1 <= min_*_len <= max_*_len")
    prompts = rng.integers(lo_p, hi_p + 1, size=n).tolist()
    outputs = rng.integers(lo_o, hi_o + 1, size=n).tolist()
    arrivals = _arrivals(rng, n, kw.pop("request_rate", math.inf))
    return [WorkloadRequest(f"req-{i}", prompts[i], outputs[i], arrivals[i]) for i in range(n)]


def _gen_sharegpt(rng: np.random.Generator, n: int, kw: dict) -> list[WorkloadRequest]:
    prompts = _lognormal_lengths(
        rng,
        n,
        kw.pop("prompt_median", 110.0),
        kw.pop("prompt_sigma", 0.9),
        kw.pop("min_prompt_len", 4),
        kw.pop("max_prompt_len", 4096),
    )
    outputs = _lognormal_lengths(
        rng,
        n,
        kw.pop("output_median", 220.0),
        kw.pop("output_sigma", 0.9),
        kw.pop("min_output_len", 1),
        kw.pop("max_output_len", 2048),
    )
    arrivals = _arrivals(rng, n, kw.pop("request_rate", math.inf))
    return [WorkloadRequest(f"req-{i}", prompts[i], outputs[i], arrivals[i]) for i in range(n)]


def _gen_shared_prefix(
    rng: np.random.Generator, n: int, kw: dict, vocab_size: int
) -> list[WorkloadRequest]:
    num_groups = kw.pop("num_groups", 8)
    prefix_len = kw.pop("prefix_len", 512)
    suffix_len = kw.pop("suffix_len", 64)
    output_len = kw.pop("output_len", 64)
    _check_int(num_groups, "num_groups", 1)
    _check_int(prefix_len, "prefix_len", 1)
    _check_int(suffix_len, "suffix_len", 1)
    _check_int(output_len, "output_len", 1)
    prefixes = [_tokens(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    arrivals = _arrivals(rng, n, kw.pop("request_rate", math.inf))
    reqs = []
    for i in range(n):
        g = i % num_groups
        suffix = _tokens(
            rng, int(rng.integers(max(suffix_len // 2, 1), suffix_len + 1)), vocab_size
        )
        ids = prefixes[g] + suffix
        reqs.append(
            WorkloadRequest(
                f"req-{i}", len(ids), output_len, arrivals[i], ids, prefix_group=f"g{g}"
            )
        )
    return reqs


def _gen_multi_turn(
    rng: np.random.Generator, n: int, kw: dict, vocab_size: int
) -> list[WorkloadRequest]:
    num_turns = kw.pop("num_turns", 4)
    system_len = kw.pop("system_prompt_len", 256)
    user_median, user_sigma = kw.pop("user_median", 64.0), kw.pop("user_sigma", 0.6)
    reply_median, reply_sigma = kw.pop("reply_median", 128.0), kw.pop("reply_sigma", 0.6)
    max_turn_len = kw.pop("max_turn_len", 1024)
    think_time = kw.pop("think_time", 10.0)
    _check_int(num_turns, "num_turns", 1)
    _check_int(system_len, "system_prompt_len", 1)
    if think_time < 0:
        raise ValueError(f"think_time must be >= 0, got {think_time}")
    num_convs = -(-n // num_turns)
    system = _tokens(rng, system_len, vocab_size)
    starts = _arrivals(rng, num_convs, kw.pop("request_rate", math.inf))
    reqs: list[WorkloadRequest] = []
    for c in range(num_convs):
        history = list(system)
        t_arrive = starts[c]
        for t in range(num_turns):
            u = _lognormal_lengths(rng, 1, user_median, user_sigma, 1, max_turn_len)[0]
            r = _lognormal_lengths(rng, 1, reply_median, reply_sigma, 1, max_turn_len)[0]
            history = history + _tokens(rng, u, vocab_size)
            reply = _tokens(rng, r, vocab_size)
            reqs.append(
                WorkloadRequest(
                    f"conv{c}-turn{t}",
                    len(history),
                    r,
                    t_arrive,
                    list(history),
                    prefix_group=f"conv{c}",
                    output_token_ids=reply,
                )
            )
            history = history + reply
            t_arrive += float(rng.exponential(think_time)) if think_time > 0 else 0.0
    reqs = reqs[:n]
    reqs.sort(key=lambda q: q.arrival_time)
    return reqs


def generate_workload(
    kind: str, num_requests: int, seed: int = 0, **kw: object
) -> list[WorkloadRequest]:
    """A deterministic trace of ``num_requests`` requests of ``kind`` (see the module doc).

    Common keywords: ``request_rate`` (req/s, default inf) and ``vocab_size`` (token ids are
    drawn from ``[10, vocab_size)``). Unknown keywords raise ValueError. Sorted by arrival.
    """
    _check_int(num_requests, "num_requests", 1)
    rng = np.random.default_rng(seed)
    opts = dict(kw)
    vocab_size = opts.pop("vocab_size", DEFAULT_VOCAB_SIZE)
    _check_int(vocab_size, "vocab_size", FIRST_TOKEN_ID + 1)
    if kind == "random":
        reqs = _gen_random(rng, num_requests, opts)
    elif kind == "sharegpt":
        reqs = _gen_sharegpt(rng, num_requests, opts)
    elif kind == "shared-prefix":
        reqs = _gen_shared_prefix(rng, num_requests, opts, vocab_size)
    elif kind == "multi-turn":
        reqs = _gen_multi_turn(rng, num_requests, opts, vocab_size)
    else:
        raise ValueError(f"unknown workload kind {kind!r}; expected one of {', '.join(KINDS)}")
    if opts:
        raise ValueError(f"unknown options for workload {kind!r}: {', '.join(sorted(opts))}")
    return reqs


# --- JSONL -------------------------------------------------------------------------------


def save_jsonl(path: str | Path, requests: Iterable[WorkloadRequest]) -> None:
    """Write one JSON object per request."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_dict(), separators=(",", ":")) + "\n")


def read_jsonl(path: str | Path, parse: Callable[[dict, int], T], what: str) -> list[T]:
    """``parse(obj, index)`` for every JSON object line of ``path`` (blank lines skipped).

    Raises ValueError naming the file, the line and ``what`` was being read.
    """
    items: list[T] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError("expected a JSON object")
                items.append(parse(d, len(items)))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: bad {what}: {e}") from None
    return items


_WORKLOAD_FIELDS = {
    "request_id",
    "prompt_len",
    "output_len",
    "arrival_time",
    "prompt_token_ids",
    "prefix_group",
    "output_token_ids",
}


def _parse_workload_line(d: dict, index: int) -> WorkloadRequest:
    missing = [k for k in ("prompt_len", "output_len", "arrival_time") if k not in d]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    unknown = set(d) - _WORKLOAD_FIELDS
    if unknown:
        raise ValueError(f"unknown fields {', '.join(sorted(unknown))}")
    group = d.get("prefix_group")
    return WorkloadRequest(
        request_id=str(d.get("request_id", f"req-{index}")),
        prompt_len=d["prompt_len"],
        output_len=d["output_len"],
        arrival_time=float(d["arrival_time"]),
        prompt_token_ids=d.get("prompt_token_ids"),
        prefix_group=None if group is None else str(group),
        output_token_ids=d.get("output_token_ids"),
    )


def load_jsonl(path: str | Path) -> list[WorkloadRequest]:
    """Read a trace; a missing ``request_id`` becomes ``req-<line index>``.

    Raises ValueError naming the line and the field that is wrong, or the file if it holds
    no request.
    """
    requests = read_jsonl(path, _parse_workload_line, "workload line")
    if not requests:
        raise ValueError(f"{path}: no requests (the trace is empty)")
    return requests
