#!/usr/bin/env bash
# The decode attention alone on cold K/V for one recorded ShareGPT step (B=31, lengths as the
# engine orders them: ascending), against the same count of equal lengths, for the tree as
# checked out ("new") and commit BASE ("old", from a git worktree), alternated ROUNDS times.
# LENS_SETS (sets of lengths separated by ";") replaces the two cases; LAYERS sets the probe's
# --layers (48: the pool must outgrow the L3, so small batches want more).
#   [LENS_SETS="2000 100 100 100;575 575 575 575" LAYERS=200] \
#     bench/results/session18/attn_cold_ab.sh [BASE=8b3f4a5] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:-8b3f4a5}; ROUNDS=${2:-3}
OLD=/tmp/kvserve-base-$BASE
[ -d "$OLD" ] || git worktree add --detach "$OLD" "$BASE" > /dev/null
STEP="58 75 125 126 165 270 272 272 302 304 305 330 336 338 373 436 449 451 455 461 479 482 509 515 540 544 544 591 651 751 846"
IFS=';' read -r -a SETS <<< "${LENS_SETS:-$STEP;$(printf '399 %.0s' $(seq 31))}"
for i in $(seq "$ROUNDS"); do
  for tag in old new; do
    tree=$([ $tag = old ] && echo "$OLD" || echo "$PWD")
    for lens in "${SETS[@]}"; do
      echo "$(date -u +%H:%M:%S) $tag $(echo $lens | cut -c1-12)...: $(PYTHONPATH="$tree" .venv/bin/python \
        bench/probes/attn_cold.py --threads 2 --huge-pages --layers "${LAYERS:-48}" --lens $lens | grep -v '==' | paste -sd ' ')"
    done
  done
done
