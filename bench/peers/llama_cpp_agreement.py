"""llama.cpp's agreement with dense fp32, beside kvserve's, on the same file and text.

    python bench/peers/llama_cpp_agreement.py --bin BUILD/bin/llama-server [--tokens 2048]

The reference is kvserve's dense fp32 (the GGUF dequantised, ``quantization="none"``),
teacher-forced over the first ``--tokens`` tokens of ``kvserve bench accuracy``'s text, as that
benchmark does. Against it, every position's distribution from:

- kvserve with the GGUF as stored (``quantization="auto"``, fp32 activations): full-vocabulary
  KL divergence, top-1 agreement, and the top-K KL below;
- llama.cpp's server on the same GGUF file, fed the same token ids one position at a time
  (``/completion`` with ``n_probs`` K, ``n_predict`` 1, prompt cache on): its pre-sampling
  top-K probabilities (the full softmax's, ``post_sampling_probs`` off).

NOTE: the server returns K probabilities, not the vocabulary's, so its KL is taken over a
partition: the K tokens it names, plus one bucket for the rest of the vocabulary. KL over a
coarser partition is a lower bound of the full KL (data processing), so the script prints the
same top-K figure for kvserve too (over kvserve's own K tokens): compare like with like. Top-1
agreement is exact for both.

``--answer TEXT`` also asks both engines, at greedy with their default settings on the same file,
to answer TEXT as a chat user turn (the same prompt token ids: kvserve's chat template) for
``--answer-tokens`` tokens, and prints whether the token ids are the same.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request

import torch

from kvserve.bench.accuracy import CORPUS, teacher_forced
from kvserve.engine.llm import LLM
from kvserve.models.loader import default_model_path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("llama-server did not become ready")


def partition_kl(ref: torch.Tensor, ids: list[int], logprobs: list[float]) -> float:
    """KL(ref || q) over the partition {each of ``ids``} + {the rest}, where q gives
    ``exp(logprobs)`` to ``ids`` and the remaining mass to the rest; ``ref``: [vocab] logprobs."""
    p = ref[ids].exp().double()
    q = torch.tensor(logprobs, dtype=torch.float64).exp()
    p_rest = max(1.0 - float(p.sum()), 1e-12)
    q_rest = max(1.0 - float(q.sum()), 1e-12)
    kl = float((p * (p.clamp_min(1e-30).log() - q.log())).sum())
    return kl + p_rest * (math.log(p_rest) - math.log(q_rest))


def kvserve_logprobs(model: str, quantization: str, ids: list[int], chunk: int) -> torch.Tensor:
    """[positions, vocab] teacher-forced log-probabilities of kvserve on ``model``."""
    llm = LLM(
        model=model,
        quantization=quantization,
        dtype="float32",
        num_kv_blocks=512,
        max_model_len=4096,
    )
    forced = teacher_forced(llm.engine.runner, ids, chunk, keep_logprobs=True)
    return torch.cat(forced.logprobs or [])


def llama_cpp_top_k(url: str, ids: list[int], k: int) -> list[tuple[list[int], list[float]]]:
    """Per position i (predicting ``ids[i + 1]``): llama.cpp's top-k (ids, logprobs)."""
    out = []
    for i in range(len(ids) - 1):
        body = {
            "prompt": ids[: i + 1],
            "n_predict": 1,
            "n_probs": k,
            "temperature": 0.0,
            "cache_prompt": True,
            "post_sampling_probs": False,
        }
        top = _post(url + "/completion", body)["completion_probabilities"][0]["top_logprobs"]
        out.append(([t["id"] for t in top], [t["logprob"] for t in top]))
    return out


def greedy_answers(url: str, model: str, question: str, max_tokens: int) -> tuple[list, list]:
    """(kvserve's, llama.cpp's) greedy token ids answering ``question`` from the same ids."""
    from kvserve.sampling_params import SamplingParams

    llm = LLM(model=model, max_model_len=4096)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ours = list(llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    body = {
        "prompt": list(prompt),
        "n_predict": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
    }
    theirs = list(_post(url + "/completion", body)["tokens"])
    return ours, theirs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="llama-server binary")
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of text (positions + 1)")
    ap.add_argument("--top-k", type=int, default=100, help="n_probs asked of llama.cpp")
    ap.add_argument("--chunk-size", type=int, default=128, help="kvserve's teacher-forced chunk")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--answer", default=None, help="also compare greedy answers to this question")
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--json", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or default_model_path()

    probe = LLM(model=model, quantization="none", dtype="float32", num_kv_blocks=8)
    text = CORPUS.read_text(encoding="utf-8")
    ids = probe.tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
    del probe
    ref = kvserve_logprobs(model, "none", ids, args.chunk_size)
    auto = kvserve_logprobs(model, "auto", ids, args.chunk_size)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [args.bin, "-m", model, "-t", str(args.threads), "-c", str(args.tokens + 64)]
    cmd += ["-np", "1", "--port", str(port), "--host", "127.0.0.1"]
    ours: list[int] = []
    theirs: list[int] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, proc)
        t0 = time.perf_counter()
        peer = llama_cpp_top_k(url, ids, args.top_k)
        print(
            f"llama.cpp: {len(peer)} positions in {time.perf_counter() - t0:.0f}s", file=sys.stderr
        )
        if args.answer:
            ours, theirs = greedy_answers(url, model, args.answer, args.answer_tokens)
    finally:
        proc.terminate()
        proc.wait(30)

    n = len(ids) - 1
    full_kl = float((ref.exp() * (ref - auto)).sum(-1).mean())
    auto_top = auto.topk(args.top_k, dim=-1)
    figures = {
        "positions": n,
        "top_k": args.top_k,
        "kvserve_auto": {
            "kl_full": full_kl,
            "kl_top_k": sum(
                partition_kl(ref[i], auto_top.indices[i].tolist(), auto_top.values[i].tolist())
                for i in range(n)
            )
            / n,
            "top1_agreement": float((ref.argmax(-1) == auto.argmax(-1)).float().mean()),
        },
        "llama_cpp": {
            "kl_top_k": sum(partition_kl(ref[i], *peer[i]) for i in range(n)) / n,
            "top1_agreement": sum(int(ref[i].argmax()) == peer[i][0][0] for i in range(n)) / n,
        },
    }
    print(
        f"| engine (same GGUF, against dense fp32) | KL, top-{args.top_k} + rest | KL, full "
        "| same top-1 |"
    )
    print("|---|---|---|---|")
    a, p = figures["kvserve_auto"], figures["llama_cpp"]
    print(
        f"| kvserve, as stored | {a['kl_top_k']:.5f} | {a['kl_full']:.5f} "
        f"| {100 * a['top1_agreement']:.2f} % |"
    )
    print(f"| llama.cpp server | {p['kl_top_k']:.5f} | - | {100 * p['top1_agreement']:.2f} % |")
    if args.answer:
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        figures["answer"] = {"kvserve": ours, "llama_cpp": theirs, "first_difference": same}
        verdict = "the same token ids" if ours == theirs else f"differ from token {same}"
        print(f"greedy answers to {args.answer!r}, {len(ours)} tokens: {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), **figures}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
