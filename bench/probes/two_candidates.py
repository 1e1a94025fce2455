"""Two quantized candidates per shape, timed as the kernel selection times them but with only
their own copies in rotation: ``q4_1_x16_amx_bf16`` (the Q4_1 blocks on AMX bf16) and
``int8_amx`` (the int8 copy), the embedded model's four layer shapes at 16 and 32 rows.

    PYTHONPATH=. .venv/bin/python bench/probes/two_candidates.py

Per shape: the best single call, candidates interleaved call by call on as many copies as
``kernel_select.copies_for`` gives (every candidate's bytes counted, as at start-up), and the
best mean call of a run over all copies back to back. The selection itself holds every
candidate's copies (up to ``HELD_BYTES``) in the same rotation, so its weights come from
memory; here only these two candidates' copies rotate.
"""

from __future__ import annotations

import copy
import time

import torch

from kvserve.models.quant import quantize_dense
from kvserve.models.quant_linear import kernel_layout, quantized_candidates
from kvserve.runtime.kernel_select import copies_for

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down
WANT = ("q4_1_x16_amx_bf16", "int8_amx")
CPU = torch.device("cpu")


def main() -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    for rows in (16, 32):
        total = {k: [0.0, 0.0] for k in WANT}
        for shape in SHAPES:
            w = kernel_layout(
                quantize_dense(torch.randn(*shape, generator=gen) * 0.02, "q4_1"), "x16"
            )
            first = quantized_candidates(w, act_dtype=torch.bfloat16, device=CPU)
            held = w.nbytes + sum(m.nbytes for m in first if not m.shares_source)
            n = copies_for(w.nbytes, held_per_copy=held)
            rot: dict[str, list] = {}
            for k in range(n):
                ms = (
                    first
                    if k == 0
                    else quantized_candidates(
                        copy.deepcopy(w), act_dtype=torch.bfloat16, device=CPU
                    )
                )
                for m in ms:
                    if m.name in WANT:
                        m.prepare()
                        rot.setdefault(m.name, []).append(m)
            x = torch.randn(rows, shape[1]).bfloat16()
            out = torch.empty(rows, shape[0], dtype=torch.bfloat16)
            for ms in rot.values():
                ms[0].apply(x, out)
            call = dict.fromkeys(rot, float("inf"))
            run = dict.fromkeys(rot, float("inf"))
            for r in range(60):  # interleaved call by call, as the selection does
                for k, ms in rot.items():
                    t = time.perf_counter()
                    ms[r % n].apply(x, out)
                    call[k] = min(call[k], time.perf_counter() - t)
            for _ in range(6):  # all copies back to back
                for k, ms in rot.items():
                    t = time.perf_counter()
                    for m in ms:
                        m.apply(x, out)
                    run[k] = min(run[k], (time.perf_counter() - t) / n)
            cells = "  ".join(
                f"{k}: call {call[k] * 1e6:.0f} us, run {run[k] * 1e6:.0f} us" for k in rot
            )
            print(f"M={rows} {shape} copies={n}  {cells}")
            for k in rot:
                total[k][0] += call[k]
                total[k][1] += run[k]
        sums = "  ".join(
            f"{k}: call {v[0] * 1e6:.0f} run {v[1] * 1e6:.0f}" for k, v in total.items()
        )
        print(f"M={rows} a layer's four: {sums}")


if __name__ == "__main__":
    main()
