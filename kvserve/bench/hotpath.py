"""Allocations on the decode hot path: how many tensors (and bytes) one steady-state step makes.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python -m kvserve.bench.hotpath [--batch-sizes 1 32]
        [--steps 8] [--warmup 3] [--prompt-len 32] [--threads 2] [--model PATH]

For each batch size: B random prompts are prefilled, a few decode steps warm up the runner,
then ``steps`` decode steps of ``ModelRunner.execute`` are observed three ways (each in its
own pass, so the instruments do not count each other):

- ``new_storages``: a ``TorchDispatchMode`` counts op outputs whose storage is not one of the
  op's inputs (every fresh tensor an aten op returns; ``out=`` and in-place ops count zero).
  NOTE: it sees ops as dispatched (``rms_norm`` counts once, not its internal temporaries),
  and tensors built by ``torch.tensor(list)`` bypass it: the profiler count covers both;
- ``profiler``: ``torch.profiler`` with ``profile_memory=True``: ops whose own (self) memory
  usage is positive, and the bytes they allocate (includes kernel-internal scratch);
- ``tracemalloc``: Python-side blocks still alive after the step (net; includes the step's
  returned ``ModelRunnerOutput``, so a leak shows as growth beyond it) and the peak of traced
  Python memory during the step;

plus the wall time of the same steps without instruments (best of ``--repeats``).
On CUDA the caching allocator's ``allocation.all.allocated`` counter is reported too.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvserve.core.outputs import ScheduledRequest, SchedulerOutput
from kvserve.runtime.model_runner import ModelRunner
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class StorageCounter(TorchDispatchMode):
    """Counts aten op outputs backed by a storage none of the op's inputs uses."""

    def __init__(self) -> None:
        super().__init__()
        self.num_new_storages = 0
        self.new_storage_bytes = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen: set[int] = set()
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                seen.add(t.untyped_storage().data_ptr())
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    self.num_new_storages += 1
                    self.new_storage_bytes += storage.nbytes()
                    name = str(func.overloadpacket.__name__)
                    self.by_op[name] = self.by_op.get(name, 0) + 1
        return out


@dataclass(slots=True)
class StepAllocations:
    """Per-step averages over the observed decode steps."""

    batch_size: int
    num_steps: int
    new_storages: float  # fresh tensors returned by aten ops (dispatch mode)
    new_storage_bytes: float
    profiler_allocs: float  # ops with positive self memory (profile_memory=True)
    profiler_bytes: float
    py_net_blocks: float  # tracemalloc: Python blocks alive after the step minus before
    py_peak_bytes: float  # tracemalloc: peak traced Python memory above the step's start
    step_ms: float  # wall time per step without instruments (best of the repeats)
    cuda_allocs: float | None = None  # caching allocator allocations (CUDA only)
    top_ops: list[tuple[str, float]] | None = None  # dispatch counts per op, largest first


def _req(rid: str, tokens: list[int], start: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=rid,
        token_ids=tokens[start:],
        start_pos=start,
        block_ids=blocks,
        sample=True,
        sampling_params=GREEDY,
        prompt_token_ids=tokens,
        output_token_ids=[],
    )


class _DecodeDriver:
    """B sequences on fixed block tables; ``step()`` decodes one token for each."""

    def __init__(self, runner: ModelRunner, batch_size: int, prompt_len: int, max_len: int) -> None:
        rng = random.Random(batch_size)
        bs = runner.block_size
        blocks_per_seq = -(-max_len // bs)
        if batch_size * blocks_per_seq > runner.num_blocks:
            raise ValueError(
                f"{batch_size} sequences of {max_len} tokens need {batch_size * blocks_per_seq} "
                f"blocks; the runner has {runner.num_blocks}"
            )
        free = list(range(runner.num_blocks))
        rng.shuffle(free)
        vocab = runner.arch.vocab_size
        self.runner = runner
        self.max_len = max_len
        self.seqs = {
            f"r{i}": [rng.randrange(vocab) for _ in range(prompt_len)] for i in range(batch_size)
        }
        self.tables = {rid: [free.pop() for _ in range(blocks_per_seq)] for rid in self.seqs}
        sched = [_req(rid, t, 0, self.tables[rid]) for rid, t in self.seqs.items()]
        self.apply(runner.execute(SchedulerOutput(scheduled=sched)))

    def apply(self, out) -> None:  # noqa: ANN001
        """Append the step's sampled tokens to their sequences."""
        for rid, tok in out.sampled_token_ids.items():
            self.seqs[rid].append(tok)

    def schedule(self) -> SchedulerOutput:
        """The next decode step (one new token per sequence)."""
        if any(len(t) >= self.max_len for t in self.seqs.values()):
            raise ValueError(f"sequences reached max_len {self.max_len}")
        return SchedulerOutput(
            scheduled=[_req(rid, t, len(t) - 1, self.tables[rid]) for rid, t in self.seqs.items()]
        )

    def step(self, observe: Callable[[SchedulerOutput], object] | None = None) -> None:
        """Run one decode step, through ``observe`` when given (it must call execute)."""
        sched = self.schedule()
        out = observe(sched) if observe is not None else self.runner.execute(sched)
        self.apply(out)


def count_step_allocations(
    runner: ModelRunner,
    batch_size: int,
    *,
    num_steps: int = 8,
    num_warmup: int = 3,
    prompt_len: int = 32,
    repeats: int = 3,
) -> StepAllocations:
    """Prefill ``batch_size`` prompts, warm up, then count allocations of decode steps.

    The runner needs ``batch_size * ceil((prompt_len + num_warmup + (3 + repeats) * num_steps
    + 1) / block_size)`` blocks.
    """
    if num_steps < 1 or num_warmup < 0 or repeats < 1:
        raise ValueError("num_steps and repeats must be >= 1, num_warmup >= 0")
    max_len = prompt_len + num_warmup + (3 + repeats) * num_steps + 1
    drv = _DecodeDriver(runner, batch_size, prompt_len, max_len)
    for _ in range(num_warmup):
        drv.step()

    counter = StorageCounter()

    def dispatch_observe(sched: SchedulerOutput) -> object:
        with counter:
            return runner.execute(sched)

    for _ in range(num_steps):
        drv.step(dispatch_observe)

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True) as prof:
        for _ in range(num_steps):
            drv.step()
    prof_allocs = 0
    prof_bytes = 0
    for e in prof.events():
        nbytes = max(e.self_cpu_memory_usage, 0) + max(getattr(e, "self_device_memory_usage", 0), 0)
        if nbytes > 0:
            prof_allocs += 1
            prof_bytes += nbytes

    net_blocks = 0
    peak = 0
    tracemalloc.start()
    try:
        for _ in range(num_steps):
            before = tracemalloc.take_snapshot()
            tracemalloc.reset_peak()
            start_bytes = tracemalloc.get_traced_memory()[0]
            sched = drv.schedule()
            out = runner.execute(sched)
            peak += tracemalloc.get_traced_memory()[1] - start_bytes
            after = tracemalloc.take_snapshot()
            net_blocks += sum(s.count_diff for s in after.compare_to(before, "filename"))
            drv.apply(out)
    finally:
        tracemalloc.stop()

    cuda_allocs: float | None = None
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        key = "allocation.all.allocated"
        a0 = torch.cuda.memory_stats(runner.device).get(key, 0)
        for _ in range(num_steps):
            drv.step()
        cuda_allocs = (torch.cuda.memory_stats(runner.device).get(key, 0) - a0) / num_steps

    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(num_steps):
            drv.step()
        best = min(best, (time.perf_counter() - t0) / num_steps)
    top = sorted(counter.by_op.items(), key=lambda kv: -kv[1])[:8]
    return StepAllocations(
        batch_size=batch_size,
        num_steps=num_steps,
        new_storages=counter.num_new_storages / num_steps,
        new_storage_bytes=counter.new_storage_bytes / num_steps,
        profiler_allocs=prof_allocs / num_steps,
        profiler_bytes=prof_bytes / num_steps,
        py_net_blocks=net_blocks / num_steps,
        py_peak_bytes=peak / num_steps,
        step_ms=1000 * best,
        cuda_allocs=cuda_allocs,
        top_ops=[(name, n / num_steps) for name, n in top],
    )


def format_result(r: StepAllocations) -> str:
    """One report line (plus the top allocating ops)."""
    line = (
        f"B={r.batch_size:3d}  new storages/step {r.new_storages:7.1f} "
        f"({r.new_storage_bytes / 1024:8.1f} KiB)  profiler allocs/step {r.profiler_allocs:7.1f} "
        f"({r.profiler_bytes / 1024:8.1f} KiB)  py net blocks/step {r.py_net_blocks:6.1f}  "
        f"py peak/step {r.py_peak_bytes / 1024:6.1f} KiB  step {r.step_ms:6.1f} ms"
    )
    if r.cuda_allocs is not None:
        line += f"  cuda allocs/step {r.cuda_allocs:.1f}"
    if r.top_ops:
        line += "\n       top ops: " + ", ".join(f"{n} {c:.1f}" for n, c in r.top_ops)
    return line


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``kvserve bench hotpath``); prints one line per batch size."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: embedded)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    from kvserve.models.llama import LlamaForCausalLM
    from kvserve.models.loader import load_model

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    loaded = load_model(args.model, torch.float32)
    model = LlamaForCausalLM(loaded.arch, device=args.device)
    model.load_weights(loaded.state_dict)
    del loaded
    max_len = args.prompt_len + args.warmup + (3 + args.repeats) * args.steps + 1
    blocks_per_seq = -(-max_len // args.block_size)
    num_blocks = sum(args.batch_sizes) * blocks_per_seq
    runner = ModelRunner(
        model, model.arch, num_blocks=num_blocks, block_size=args.block_size, device=args.device
    )
    print(f"loaded in {time.perf_counter() - t0:.1f}s; threads={torch.get_num_threads()}")
    for b in args.batch_sizes:
        r = count_step_allocations(
            runner,
            b,
            num_steps=args.steps,
            num_warmup=args.warmup,
            prompt_len=args.prompt_len,
            repeats=args.repeats,
        )
        print(format_result(r), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
