"""Hot (L1/L2) decode attention timing: us per call, one thread, B=8 x len."""
import math, sys, time, torch
from kvserve.runtime import native
assert native.available(), native.reason()
ops = native.ops()
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
B, L, bs = 8, int(sys.argv[1]) if len(sys.argv) > 1 else 128, 16
nb = B * L // bs
cache = torch.randn(2, nb, bs, 3, 64).bfloat16()
q = torch.randn(B, 9, 64).bfloat16()
tables = torch.randperm(nb, dtype=torch.int32).view(B, -1).contiguous()
lens = torch.full((B,), L, dtype=torch.int32)
out = torch.empty_like(q)
for _ in range(50): ops.paged_decode_attention(out, q, cache, tables, lens, 0.125, 0, 0)
best = 1e9
for _ in range(7):
    t = time.perf_counter()
    for _ in range(200): ops.paged_decode_attention(out, q, cache, tables, lens, 0.125, 0, 0)
    best = min(best, (time.perf_counter() - t) / 200)
print(f"{best*1e6:.1f} us/call, {best*1e9/(B*L):.1f} ns/token")
