"""llama.cpp's n-gram speculation beside kvserve's, on ``kvserve bench spec``'s prompts.

    python bench/peers/llama_cpp_spec.py --bin BUILD/bin/llama-server [--repeats 2]

The same one-stream workloads as ``kvserve bench spec`` (``kvserve/bench/spec.py``): ``copy``
(answers end at EOS, ``--copy-max-tokens`` at most) and ``fresh`` (``--output-len`` tokens, EOS
ignored), the same prompt token ids (kvserve's chat template on the same GGUF), greedy. Each
repeat starts llama-server plain, then with ``--spec-type`` (default ``ngram-simple``) and
runs the prompts one at a time (``/completion``, prompt cache off); tokens/s is the generated
tokens over the wall time of the prompts, prefill included, as kvserve's bench counts it. The
median repeat is printed with the server's own draft counts (``timings.draft_n`` /
``draft_n_accepted``) and whether both servers gave the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from llama_cpp_agreement import _free_port, _post, _wait_ready  # noqa: E402 (bench/peers)

from kvserve.bench.spec import COPY_PROMPTS, FRESH_PROMPTS
from kvserve.engine.llm import LLM
from kvserve.models.loader import default_model_path


def run_server(
    args: argparse.Namespace, spec: list[str], prompts: dict[str, tuple[list, dict]]
) -> dict[str, tuple[float, list, int, int]]:
    """Start llama-server with ``spec`` flags and run each workload's prompts one at a time;
    name -> (tokens/s, token ids per prompt, drafted, accepted)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [args.bin, "-m", args.model, "-t", str(args.threads), "-c", "4096", "-np", "1"]
    cmd += ["--port", str(port), "--host", "127.0.0.1", *spec]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {}
    try:
        _wait_ready(url, proc)
        _post(url + "/completion", {"prompt": [1, 2, 3], "n_predict": 4})  # warm-up
        for name, (ids, params) in prompts.items():
            tokens, drafted, accepted = [], 0, 0
            t0 = time.perf_counter()
            for prompt in ids:
                body = {"prompt": list(prompt), "temperature": 0.0, "cache_prompt": False}
                r = _post(url + "/completion", {**body, **params, "return_tokens": True})
                tokens.append(list(r["tokens"]))
                drafted += int(r.get("timings", {}).get("draft_n", 0))
                accepted += int(r.get("timings", {}).get("draft_n_accepted", 0))
            seconds = time.perf_counter() - t0
            out[name] = (sum(len(t) for t in tokens) / seconds, tokens, drafted, accepted)
    finally:
        proc.terminate()
        proc.wait(30)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="llama-server binary")
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded model)")
    ap.add_argument("--spec", default="--spec-type ngram-simple", help="llama-server's flags")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--copy-max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    args.model = args.model or default_model_path()
    tok = LLM(model=args.model, num_kv_blocks=8, kernel_selection="off").tokenizer
    chat = [tok.apply_chat_template([{"role": "user", "content": m}]) for m in COPY_PROMPTS]
    fresh = [tok.apply_chat_template([{"role": "user", "content": m}]) for m in FRESH_PROMPTS]
    prompts = {
        "copy": (chat, {"n_predict": args.copy_max_tokens}),
        "fresh": (fresh, {"n_predict": args.output_len, "ignore_eos": True}),
    }
    runs: dict[str, list] = {"plain": [], "spec": []}
    for _ in range(args.repeats):
        runs["plain"].append(run_server(args, [], prompts))
        runs["spec"].append(run_server(args, args.spec.split(), prompts))
    for name in prompts:
        plain = statistics.median(r[name][0] for r in runs["plain"])
        spec = statistics.median(r[name][0] for r in runs["spec"])
        last = runs["spec"][-1][name]
        same = last[1] == runs["plain"][-1][name][1]
        print(
            f"{name:6s} llama.cpp plain {plain:7.1f} tok/s  {args.spec!r} {spec:7.1f} tok/s  "
            f"x{spec / plain:.2f}  drafted {last[2]} accepted {last[3]}  same output: {same}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
