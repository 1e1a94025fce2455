"""Workload flags shared by the bench commands, on top of :mod:`kvserve.sim.workloads`.

Every benchmark replays the same deterministic trace: generated from ``--seed`` or read from a
JSONL file, with the prompt token ids resolved so any engine (kvserve, HF transformers, vLLM,
llama.cpp) gets exactly the same prompts.
"""

from __future__ import annotations

import argparse

from kvserve.sim.workloads import (
    DEFAULT_VOCAB_SIZE,
    KINDS,
    WorkloadRequest,
    generate_workload,
    load_jsonl,
    resolve_prompt_token_ids,
    save_jsonl,
)


def add_workload_args(p: argparse.ArgumentParser, *, num_prompts: int = 32) -> None:
    """Add ``--workload``, ``--workload-file``, ``--num-prompts``, lengths and ``--seed``."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=KINDS, default="random", help="generated trace kind")
    g.add_argument(
        "--workload-file", default=None, help="replay this JSONL trace instead of generating"
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests in the trace (default {num_prompts}); with --workload-file: the first N",
    )
    p.set_defaults(default_num_prompts=num_prompts)
    g.add_argument(
        "--input-len", type=int, default=None, help="random: every prompt has exactly this length"
    )
    g.add_argument(
        "--output-len", type=int, default=None, help="random/shared-prefix: output tokens each"
    )
    g.add_argument(
        "--max-output-len",
        type=int,
        default=None,
        help="sharegpt: clip the long-tailed output lengths to at most this many tokens",
    )
    g.add_argument("--num-groups", type=int, default=None, help="shared-prefix: prefix groups")
    g.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: prefix tokens")
    g.add_argument("--suffix-len", type=int, default=None, help="shared-prefix: question tokens")
    g.add_argument("--num-turns", type=int, default=None, help="multi-turn: turns per chat")
    g.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="prompt token ids are drawn from [10, vocab-size)",
    )
    g.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the generated trace (and arrivals)"
    )
    g.add_argument("--save-workload", default=None, help="write the resolved trace as JSONL")


def workload_options(args: argparse.Namespace) -> dict[str, object]:
    """Generator keywords for ``args.workload`` from the flags that were given."""
    kind = args.workload
    kw: dict[str, object] = {"vocab_size": args.vocab_size}
    if kind == "random":
        if args.input_len is not None:
            kw.update(min_prompt_len=args.input_len, max_prompt_len=args.input_len)
        if args.output_len is not None:
            kw.update(min_output_len=args.output_len, max_output_len=args.output_len)
    elif kind == "shared-prefix":
        for name in ("num_groups", "prefix_len", "suffix_len", "output_len"):
            if getattr(args, name) is not None:
                kw[name] = getattr(args, name)
    elif kind == "multi-turn":
        if args.num_turns is not None:
            kw["num_turns"] = args.num_turns
        # NOTE: offline replay sends every turn at once; think time only matters for arrivals.
        kw["think_time"] = 0.0
    elif kind == "sharegpt":
        if args.output_len is not None:
            kw.update(min_output_len=args.output_len, max_output_len=args.output_len)
        elif args.max_output_len is not None:
            kw["max_output_len"] = args.max_output_len
    return kw


# The length flags each generated kind reads (a --workload-file trace reads none).
KIND_FLAGS: dict[str, tuple[str, ...]] = {
    "random": ("input_len", "output_len"),
    "sharegpt": ("output_len", "max_output_len"),
    "shared-prefix": ("num_groups", "prefix_len", "suffix_len", "output_len"),
    "multi-turn": ("num_turns",),
}


def check_flags_apply(args: argparse.Namespace) -> None:
    """Raise ValueError naming a length flag that the trace would ignore.

    NOTE: a flag of another kind (``--input-len`` with sharegpt) or any length flag with
    ``--workload-file`` used to be dropped silently, so the run was not the one asked for.
    """
    used = () if args.workload_file else KIND_FLAGS[args.workload]
    for name in sorted({n for names in KIND_FLAGS.values() for n in names}):
        if getattr(args, name) is None or name in used:
            continue
        kinds = " / ".join(k for k, names in KIND_FLAGS.items() if name in names)
        what = "a --workload-file trace" if args.workload_file else repr(args.workload)
        raise ValueError(f"--{name.replace('_', '-')} applies to --workload {kinds}, not {what}")


def build_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    """The trace the flags describe, every request with its ``prompt_token_ids`` set.

    Saved to ``--save-workload`` when given. Raises ValueError on bad flags.
    """
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    check_flags_apply(args)
    if args.workload_file:
        reqs = load_jsonl(args.workload_file)[: args.num_prompts]
    else:
        reqs = generate_workload(
            args.workload,
            args.num_prompts or args.default_num_prompts,
            args.workload_seed,
            **workload_options(args),
        )
    return finalize(reqs, args.vocab_size, args.save_workload, salt=args.workload_seed)


def finalize(
    reqs: list[WorkloadRequest], vocab_size: int, save_path: str | None = None, salt: int = 0
) -> list[WorkloadRequest]:
    """Resolve every request's prompt ids and optionally save the trace as JSONL.

    Requests without ids get pseudo-random ones, deterministic in (``salt``, request id).
    """
    if not reqs:
        raise ValueError("the workload has no requests")
    out = []
    for r in reqs:
        ids = resolve_prompt_token_ids(r, vocab_size, salt)
        out.append(
            WorkloadRequest(
                r.request_id,
                r.prompt_len,
                r.output_len,
                r.arrival_time,
                ids,
                r.prefix_group,
                r.output_token_ids,
            )
        )
    if save_path:
        save_jsonl(save_path, out)
    return out


def check_vocab(reqs: list[WorkloadRequest], vocab_size: int) -> None:
    """Raise ValueError if a prompt id does not fit a model with ``vocab_size`` tokens."""
    for r in reqs:
        top = max(r.prompt_token_ids or [0])
        if top >= vocab_size:
            raise ValueError(
                f"request {r.request_id}: prompt token id {top} >= the model's vocab size "
                f"{vocab_size}; regenerate the workload with --vocab-size {vocab_size}"
            )


def workload_meta(args: argparse.Namespace) -> dict[str, object]:
    """The workload flags, stored with a result so the run can be repeated."""
    keys = (
        "workload",
        "workload_file",
        "num_prompts",
        "input_len",
        "output_len",
        "num_groups",
        "prefix_len",
        "suffix_len",
        "num_turns",
        "vocab_size",
        "workload_seed",
    )
    return {k: getattr(args, k) for k in keys}
