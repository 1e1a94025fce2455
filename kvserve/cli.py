"""``kvserve`` command line: generate, chat, serve, bench, simulate."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import sys
import time
from argparse import SUPPRESS
from collections.abc import Callable
from typing import Any

import kvserve
from kvserve.cli_sampling import add_sampling_args, sampling_params_from_args
from kvserve.engine.config import EngineConfig


def _build_llm(args: argparse.Namespace):  # noqa: ANN202 - LLM
    from kvserve.engine.llm import LLM

    # NOTE: the engine logs its one start-up line (INFO) and the memory report (DEBUG).
    config = EngineConfig.from_cli_args(args)
    return LLM(**{k: v for k, v in vars(config).items()})


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a completion for one or more prompts and print it with its speed."""
    llm = _build_llm(args)
    params = sampling_params_from_args(args, llm.engine.generation_defaults.values, n=args.n)
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
    params = sampling_params_from_args(args, llm.engine.generation_defaults.values)
    history: list[dict[str, str]] = []
    turn = 0
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
        reply = stream_chat_reply(llm, history, _turn_params(params, turn), sys.stdout)
        history.append({"role": "assistant", "content": reply})
        turn += 1
    return 0


def _turn_params(params, turn: int):  # noqa: ANN001, ANN202 - SamplingParams
    """``params`` for the chat's turn number ``turn`` (0 first). NOTE: a seeded request draws
    its random numbers by output position, so each turn takes the printed seed plus its
    number: the same seed every turn would draw the same numbers each time."""
    if params.seed is None or turn == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + turn)


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
    p.add_argument(
        "--quiet",
        action="store_true",
        help="do not print the start-up line (as --log-level warning)",
    )
    return p


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# Loggers whose INFO records are start-up detail (kernel selection, loading, planning): shown
# with --log-level debug only. NOTE: set by level, so records still reach a handler a caller
# adds at DEBUG.
DETAIL_LOGGERS = (
    "kvserve.runtime",  # runtime/ (kernel selection, linear, native, huge pages, ...)
    "kvserve.models",  # models/ (loading, quantized kernel choice)
    "kvserve.tokenizer",
    "kvserve.huge_pages",
)
# Modules that log detail on the bare "kvserve" logger (which also carries the start-up
# line): filtered by source file at INFO.
_DETAIL_SOURCES = ("/runtime/", "/models/")


def add_log_level_arg(p: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    """``--log-level`` on ``p`` (sub-commands: SUPPRESS, so the top-level value stands)."""
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=default,
        help="how much kvserve logs (default info: one start-up line; debug: the kernel "
        "selection, memory plan and loading detail)",
    )


_HANDLERS: list[logging.Handler] = []  # the handler configure_logging added


class _DetailFilter(logging.Filter):
    """Drops INFO records of the start-up detail modules that log on the "kvserve" logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        path = record.pathname.replace("\\", "/")
        return not any(part in path for part in _DETAIL_SOURCES)


def configure_logging(level: str) -> None:
    """Log kvserve's records to stderr at ``level`` ("info": the start-up line, warnings and
    errors; "debug": every planner and kernel-selection line too)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    numeric = getattr(logging, level.upper())
    root = logging.getLogger()
    if _HANDLERS:  # configured before (bench's pass-through commands do it again)
        root.removeHandler(_HANDLERS.pop())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    if numeric > logging.DEBUG:
        handler.addFilter(_DetailFilter())
    root.addHandler(handler)
    _HANDLERS.append(handler)
    # NOTE: other libraries' loggers (httpx, asyncio, ...) stay at WARNING.
    root.setLevel(max(numeric, logging.WARNING))
    logging.getLogger("kvserve").setLevel(numeric)
    detail = logging.NOTSET if numeric <= logging.DEBUG else max(numeric, logging.WARNING)
    for name in DETAIL_LOGGERS:
        logging.getLogger(name).setLevel(detail)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser (sub-commands register themselves here); with ``command``, only
    that sub-command's optional module is imported."""
    parser = KvserveArgumentParser(
        prog="kvserve", description="kvserve command line: generate, chat, serve, bench, simulate."
    )
    add_log_level_arg(parser, default="info")
    # NOTE: -v (once: "log at INFO", now the default) stays as a hidden --log-level debug.
    parser.add_argument(
        "-v", "--verbose", dest="log_level", action="store_const", const="debug", help=SUPPRESS
    )
    parser.add_argument("--version", action="version", version=f"kvserve {kvserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _engine_parser(sub, "generate", "generate a completion on the embedded (or given) model")
    p.add_argument("prompt", nargs="+", help="prompt text (one or more)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("-n", "--n", type=int, default=1, help="samples per prompt (default 1)")
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = _engine_parser(sub, "chat", "interactive chat")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p, max_tokens=256)
    p.set_defaults(func=cmd_chat)

    for register in _optional_commands(command):
        register(sub, _engine_parser)
    return parser


class KvserveArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that takes ``--log-level`` (every sub-command, at any depth: the
    sub-parsers are of the parser's class), unless it defines a flag of that name itself.

    NOTE: parsers with other prefix characters (bench's pass-through commands) take theirs
    in their own argv (``kvserve.bench.cli``)."""

    def _ensure_log_level(self) -> None:
        if "-" in self.prefix_chars and "--log-level" not in self._option_string_actions:
            add_log_level_arg(self)

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's
        self._ensure_log_level()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._ensure_log_level()
        return super().format_help()

    def subcommand(self, name: str | None) -> KvserveArgumentParser | None:
        """The parser of sub-command ``name`` (None when there is none of that name)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                child = action.choices.get(name)
                return child if isinstance(child, KvserveArgumentParser) else None
        return None

    def takes_config(self) -> bool:
        return "--config" in self._option_string_actions

    def flags_from_config(self, path: str) -> list[str]:
        """The command-line flags a ``--config`` YAML file stands for (vLLM's convention:
        a mapping of flag names, dashes or underscores, to values). Exits with a message
        naming the file and the key on a key that is not a flag or a value of the wrong
        kind."""
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            self.error(f"--config: {e.strerror}: {path}")
        except yaml.YAMLError as e:
            self.error(f"--config: {path} is not valid YAML: {e}")
        if data is None:
            return []
        if not isinstance(data, dict):
            self.error(f"--config: {path} must map flag names to values, got {type(data).__name__}")
        out: list[str] = []
        for key, value in data.items():
            flag = "--" + str(key).replace("_", "-")
            action = self._option_string_actions.get(flag)
            if action is None or flag in ("--config", "--help"):
                near = _close(flag, self._option_string_actions)
                self.error(f"--config: {path}: {key!r} is not a flag of {self.prog}{near}")
            if value is None:
                continue
            if action.nargs == 0:  # a switch: true or false
                if not isinstance(value, bool):
                    self.error(f"--config: {path}: {key!r} takes true or false, got {value!r}")
                if value:
                    out.append(flag)
                elif isinstance(action, argparse.BooleanOptionalAction):
                    out.append(_negated(flag, action.option_strings))
                continue
            if isinstance(value, dict):
                self.error(f"--config: {path}: {key!r} takes a value or a list, got a mapping")
            values = [str(v) for v in value] if isinstance(value, list) else [str(value)]
            if isinstance(value, list) and action.nargs not in ("+", "*"):
                for v in values:  # an appending flag (--stop a --stop b)
                    out += [flag, v]
            else:
                out += [flag, *values]
        return out


def _close(flag: str, known: Any) -> str:
    near = difflib.get_close_matches(flag, list(known), n=1)
    return f" (did you mean {near[0][2:]!r}?)" if near else ""


def _negated(flag: str, option_strings: list[str]) -> str:
    """The other spelling of a BooleanOptionalAction's ``flag`` (--x <-> --no-x)."""
    other = [s for s in option_strings if s != flag]
    return other[0] if other else flag


def expand_config_file(parser: KvserveArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with the flags of its sub-command's ``--config FILE`` inserted right after the
    sub-command's name, so the command line's own flags (parsed later) override the file's."""
    at = next((i for i, t in enumerate(argv) if t == "--config" or t.startswith("--config=")), None)
    command = command_of(argv)
    child = parser.subcommand(command)
    if at is None or child is None or not child.takes_config():
        return argv
    token = argv[at]
    path = (
        token.split("=", 1)[1] if "=" in token else (argv[at + 1] if at + 1 < len(argv) else None)
    )
    if path is None:
        return argv  # argparse says "expected one argument"
    start = argv.index(command) + 1
    return [*argv[:start], *child.flags_from_config(path), *argv[start:]]


# Sub-commands that live in their own packages: name -> module. NOTE: only the module of the
# command run is imported (fastapi, matplotlib and the bench modules cost seconds).
OPTIONAL_COMMANDS = {
    "serve": "kvserve.server.cli",
    "bench": "kvserve.bench.cli",
    "simulate": "kvserve.sim.cli",
    "router": "kvserve.router.cli",
}


def command_of(argv: list[str]) -> str | None:
    """The sub-command named in ``argv`` (None when there is none, as for ``--help``)."""
    it = iter(argv)
    for token in it:
        if token == "--log-level":
            next(it, None)
        elif not token.startswith("-"):
            return token
    return None


def _optional_commands(command: str | None = None) -> list[Callable[..., None]]:
    """The registrars of the optional sub-commands: ``command``'s alone when it names one
    of the built-in or optional commands, else all of them (for the help and its errors)."""
    if command in ("generate", "chat"):
        return []
    names = [command] if command in OPTIONAL_COMMANDS else list(OPTIONAL_COMMANDS)
    out: list[Callable[..., None]] = []
    for mod_name in (OPTIONAL_COMMANDS[n] for n in names):
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
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_of(argv))
    args = parser.parse_args(expand_config_file(parser, argv))
    level = args.log_level
    if getattr(args, "quiet", False) and level == "info":
        level = "warning"
    configure_logging(level)
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
