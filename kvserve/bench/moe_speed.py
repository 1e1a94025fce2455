"""The MoE MLP on CPU: grouped by expert against a per-token loop and a dense MLP.

    python -m kvserve.bench.moe_speed [--hidden 1024 --experts 32 --top-k 4 --inter 512]

Three ways to compute one layer's MLP over ``T`` tokens, timed at several ``T``:

- ``grouped``: ``SparseMoeBlock.forward`` (``kvserve/models/moe.py``): the tokens sorted by
  expert, one gate/up and one down GEMM per active expert, scattered back with the routing
  weights;
- ``per_token``: each token alone, each of its ``k`` experts alone (two GEMVs each), the
  way a naive loop runs it;
- ``dense``: one SwiGLU MLP of width ``k x inter``, the same active parameters per token as
  the MoE (the floor: every token reads the same weights).

Each is the median of ``--reps`` rounds (each round runs the three in turn) after two
warm-up rounds, on ``--threads`` threads,
fp32, the same ``Linear``s the engine builds (``torch.mm`` on the transposed weights).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.config import ModelArchConfig
from kvserve.models.moe import SparseMoeBlock, stacked_linear_param
from kvserve.runtime.autotune.candidates import build_linear
from kvserve.runtime.layer_ops import TORCH_OPS, LayerOps, layer_ops
from kvserve.runtime.linear import Linear
from kvserve.runtime.native import available as native_available

CPU = torch.device("cpu")


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    return build_linear(weight, bias, act_dtype=torch.float32, device=CPU)


def make_block(arch: ModelArchConfig, seed: int = 0) -> SparseMoeBlock:
    """A ``SparseMoeBlock`` with random weights, its Linears built."""
    gen = torch.Generator().manual_seed(seed)
    block = SparseMoeBlock(arch, dtype=torch.float32, device=CPU)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    block.build_linears(_linear, {})
    return block


def per_token(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Each token alone through each of its experts (the loop the grouped path replaces)."""
    weights, experts, _ = block.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        row = x[t : t + 1]
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = block.gate_up_projs[e](row).chunk(2, dim=-1)
            out[t] += block.down_projs[e](F.silu(gate) * up)[0] * weights[t, j]
    return out


def make_dense(hidden: int, inter: int) -> Callable[[torch.Tensor, LayerOps], torch.Tensor]:
    """A dense SwiGLU MLP of width ``inter`` (fused gate/up, as the decoder layer runs it)."""
    gen = torch.Generator().manual_seed(1)
    gate_up = stacked_linear_param(1, 2 * inter, hidden, dtype=torch.float32, device=CPU)[0]
    down = stacked_linear_param(1, hidden, inter, dtype=torch.float32, device=CPU)[0]
    with torch.no_grad():
        gate_up.copy_(torch.randn(gate_up.shape, generator=gen) * 0.05)
        down.copy_(torch.randn(down.shape, generator=gen) * 0.05)
    gate_up_proj, down_proj = _linear(gate_up), _linear(down)

    def run(x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        gu = gate_up_proj(x)
        act = x.new_empty((x.shape[0], inter))
        return down_proj(ops.silu_mul(gu[:, :inter], gu[:, inter:], gu, act))

    return run


def median_ms(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median wall time in ms of each of ``fns`` over ``reps`` rounds after two warm-up
    rounds; each round runs every function once, in turn.

    NOTE: interleaved so that a change in the machine's load (the 2-vCPU box is shared)
    reaches every method alike instead of whichever ran then.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(reps + 2):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if r >= 2:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    """Print one table row per token count: ms of grouped, per-token and dense."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--inter", type=int, default=512, help="each expert's MLP width")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--per-token-max", type=int, default=64, help="skip the loop above this T")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    arch = ModelArchConfig(
        "qwen3moe",
        1000,
        args.hidden,
        args.inter,
        1,
        8,
        8,
        args.hidden // 8,
        4096,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.inter,
    )
    ops = layer_ops(native_kernels=native_available(), device=CPU)
    block, dense = make_block(arch), make_dense(args.hidden, args.top_k * args.inter)
    print(
        f"hidden {args.hidden}, {args.experts} experts of width {args.inter}, top {args.top_k}; "
        f"dense width {args.top_k * args.inter}; {args.threads} thread(s), fp32, "
        f"layer ops {ops.name if ops is not TORCH_OPS else 'torch'}"
    )
    print("| tokens | grouped ms | per-token loop ms | dense (same active params) ms |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for num_tokens in args.tokens:
            x = torch.randn(num_tokens, args.hidden, generator=torch.Generator().manual_seed(2))
            fns: dict[str, Callable[[], object]] = {
                "grouped": lambda x=x: block.forward(x, ops),
                "dense": lambda x=x: dense(x, ops),
            }
            if num_tokens <= args.per_token_max:
                fns["loop"] = lambda x=x: per_token(block, x)
            ms = median_ms(fns, args.reps)
            loop = f"{ms['loop']:.2f}" if "loop" in ms else "-"
            print(f"| {num_tokens} | {ms['grouped']:.2f} | {loop} | {ms['dense']:.2f} |")


if __name__ == "__main__":
    main()
