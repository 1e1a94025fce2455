"""``kvserve`` command line: generate, chat, serve, bench, simulate."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

import kvserve
from kvserve.engine.config import EngineConfig


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        help=f"tokens to generate (default {max_tokens})",
    )
    g.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (the default here, unlike the API's 1.0) is greedy: the same text every run",
    )
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely (-1: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top one")
    g.add_argument(
        "--presence-penalty", type=float, default=0.0, help="-2..2, on tokens already generated"
    )
    g.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="-2..2, by how often they were"
    )
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help=">1 discourages repeats (default 1)"
    )
    g.add_argument(
        "--sampling-seed",
        dest="sample_seed",
        type=int,
        default=None,
        help="per-request sampling seed",
    )
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-text")


def _sampling_params(args: argparse.Namespace, **overrides: object):  # noqa: ANN202 - SamplingParams
    from kvserve.sampling_params import SamplingParams

    values: dict[str, object] = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    values.update(overrides)
    return SamplingParams(**values)


def _build_llm(args: argparse.Namespace):  # noqa: ANN202 - LLM
    from kvserve.engine.llm import LLM
    from kvserve.models.quant_model import summary_line

    config = EngineConfig.from_cli_args(args)
    llm = LLM(**{k: v for k, v in vars(config).items()})
    if not args.quiet:
        for line in llm.memory_report():
            print(f"[kvserve] {line}", file=sys.stderr)
        print(f"[kvserve] {summary_line(llm.engine.quantization)}", file=sys.stderr)
    return llm


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a completion for one or more prompts and print it with its speed."""
    llm = _build_llm(args)
    params = _sampling_params(args, n=args.n)
    prompts = args.prompt
    t0 = time.perf_counter()
    if args.raw:
        outs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    num_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    texts = [c.text for o in outs for c in o.outputs]
    for i, text in enumerate(texts):
        if len(texts) > 1:  # several prompts or samples: say which is which
            print(f"--- {i // params.n}.{i % params.n}" if params.n > 1 else f"--- {i}")
        print(text)
    print(
        f"[kvserve] {num_tokens} tokens in {dt:.2f} s = {num_tokens / dt:.1f} tokens/s "
        f"(prompt {sum(len(o.prompt_token_ids) for o in outs)} tokens, incl. prefill)",
        file=sys.stderr,
    )
    return 0


CHAT_EXIT_COMMANDS = ("/exit", "/quit")


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat on stdin/stdout, streamed token by token; the prefix
    cache reuses the history. ``/exit``, ``/quit``, an empty line or Ctrl-D quit."""
    llm = _build_llm(args)
    params = _sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("kvserve chat: /exit, /quit, an empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip() or line.strip() in CHAT_EXIT_COMMANDS:
            break
        history.append({"role": "user", "content": line})
        try:
            dropped = fit_history(llm, history, params.max_tokens)
        except ValueError as e:
            history.pop()
            print(f"[{e}]", file=sys.stderr)
            continue
        if dropped:
            print(f"[{dropped} oldest messages dropped to fit --max-model-len]", file=sys.stderr)
        reply = stream_chat_reply(llm, history, params, sys.stdout)
        history.append({"role": "assistant", "content": reply})
    return 0


def fit_history(llm, history: list[dict[str, str]], max_tokens: int | None) -> int:  # noqa: ANN001 - LLM
    """Drop the oldest turns of ``history`` (never the system prompt or the last message)
    until its prompt and ``max_tokens`` fit the context; returns how many were dropped.
    ValueError if the last message does not fit even alone."""
    limit = llm.engine.max_model_len - (max_tokens or 1)
    first = 1 if history and history[0]["role"] == "system" else 0
    dropped = 0
    while len(llm.tokenizer.apply_chat_template(history)) > limit:
        if len(history) - first <= 1:
            raise ValueError(
                f"the message does not fit: with --max-tokens {max_tokens} the prompt may have "
                f"at most {limit} tokens (--max-model-len {llm.engine.max_model_len})"
            )
        del history[first]
        dropped += 1
    return dropped


def stream_chat_reply(llm, history, params, out) -> str:  # noqa: ANN001 - LLM, SamplingParams, TextIO
    """Generate the assistant's reply to ``history``, writing its text to ``out`` as it comes
    (one write per step). A reply cut by max_tokens ends with a marker line; Ctrl-C stops the
    reply (the request is aborted) and keeps what was written. Returns the reply text."""
    engine = llm.engine
    request_id = engine.add_request(llm.tokenizer.apply_chat_template(history), params)
    text, finish, error = "", None, None
    try:
        while finish is None and error is None:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                completion = output.outputs[0]
                if completion.delta_text:
                    out.write(completion.delta_text)
                    out.flush()
                text = completion.text
                error = output.error
                if output.finished:
                    finish = completion.finish_reason or "stop"
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        finish = "interrupted"
    out.write("\n")
    if error is not None:
        out.write(f"[error: {error}]\n")
    elif finish == "length":
        out.write(f"[reply cut at --max-tokens {params.max_tokens}]\n")
    elif finish == "interrupted":
        out.write("[reply interrupted]\n")
    out.flush()
    return text


def _engine_parser(
    sub: argparse._SubParsersAction, name: str, help_: str
) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, description=help_)
    EngineConfig.add_cli_args(p)
    p.add_argument("--quiet", action="store_true", help="do not print the memory report")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (sub-commands register themselves here)."""
    parser = argparse.ArgumentParser(
        prog="kvserve", description="kvserve command line: generate, chat, serve, bench, simulate."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"kvserve {kvserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _engine_parser(sub, "generate", "generate a completion on the embedded (or given) model")
    p.add_argument("prompt", nargs="+", help="prompt text (one or more)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("-n", "--n", type=int, default=1, help="samples per prompt (default 1)")
    _sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = _engine_parser(sub, "chat", "interactive chat")
    p.add_argument("--system", default=None, help="system prompt")
    _sampling_args(p, max_tokens=256)
    p.set_defaults(func=cmd_chat)

    for register in _optional_commands():
        register(sub, _engine_parser)
    return parser


def _optional_commands() -> list[Callable[..., None]]:
    """Sub-commands that live in their own packages (serve, bench, simulate)."""
    out: list[Callable[..., None]] = []
    for mod_name in (
        "kvserve.server.cli",
        "kvserve.bench.cli",
        "kvserve.sim.cli",
        "kvserve.router.cli",
    ):
        try:
            mod = __import__(mod_name, fromlist=["register"])
        except ModuleNotFoundError as e:
            if e.name != mod_name:
                raise
            continue
        if hasattr(mod, "register"):
            out.append(mod.register)
        else:  # a self-contained command: add_parser(sub) + run(args)
            out.append(_plain_command(mod))
    return out


def _plain_command(mod: object) -> Callable[..., None]:
    def register(sub: argparse._SubParsersAction, _engine_parser: object) -> None:
        p = mod.add_parser(sub)  # type: ignore[attr-defined]
        p.set_defaults(func=mod.run)  # type: ignore[attr-defined]

    return register


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="[%(name)s] %(message)s"
    )
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:
            raise
        print(f"kvserve: error: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
