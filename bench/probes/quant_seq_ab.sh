#!/usr/bin/env bash
# The quantized int8-dot kernel of another checkout against this one's, over the model's
# projection sequence (bench/probes/quant_seq.py), alternating, ROUNDS rounds.
#
#   bench/probes/quant_seq_ab.sh OLD_TREE [ROUNDS] [quant_seq.py args...]
#
# OLD_TREE: e.g. `git worktree add /tmp/old HEAD~1` (it needs no venv: this checkout's
# .venv runs both). Each tree builds its own kernels (the build cache is keyed by source).
# Default args: --huge-pages --only vnni --rows 1 8 16 32 128 512.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OLD="$1"
ROUNDS="${2:-3}"
shift $(( $# >= 2 ? 2 : 1 ))
ARGS=("$@")
[ ${#ARGS[@]} -gt 0 ] || ARGS=(--huge-pages --only vnni --rows 1 8 16 32 128 512)
for r in $(seq 1 "$ROUNDS"); do
  for tree in "$OLD" "$ROOT"; do
    echo "== $([ "$tree" = "$ROOT" ] && echo new || echo old) round $r ($tree)"
    PYTHONPATH="$tree" "$ROOT/.venv/bin/python" "$ROOT/bench/probes/quant_seq.py" "${ARGS[@]}" | tail -n +2
  done
done
