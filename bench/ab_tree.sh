# Shared by the A/B scripts under bench/results/ (sourced, not run): each side of an A/B runs
# its own tree's code, "old" from a git worktree of a commit, "new" from the checked-out tree.
set -euo pipefail
AB_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# ab_worktree BASE: the path of a git worktree of commit BASE (made once, in /tmp).
ab_worktree() {
  local dir="/tmp/kvserve-base-$1"
  [ -d "$dir" ] || git -C "$AB_ROOT" worktree add --detach "$dir" "$1" > /dev/null
  echo "$dir"
}

# in_tree TREE CMD...: CMD (run with the project's venv python as "$AB_PY") in TREE with its
# code first on the path.
# NOTE: from inside TREE: python -m and -c put the working directory ahead of PYTHONPATH, so
# run from the checked-out tree both sides ran its code (sessions 18-19's A/Bs, until session 20).
AB_PY="$AB_ROOT/.venv/bin/python"
in_tree() {
  local tree="$1"; shift
  (cd "$tree" && PYTHONPATH="$tree" "$@")
}

# ab_throughput TAG TREE WORKLOAD NUM_PROMPTS MAX_NUM_SEQS JSON: `kvserve bench throughput` on
# TREE's code (paths relative to the repository root), one line of output tok/s.
ab_throughput() {
  in_tree "$2" "$AB_PY" -m kvserve.cli bench throughput --workload-file "$AB_ROOT/$3" \
    --num-prompts "$4" --max-num-seqs "$5" --num-threads 2 --output-json "$AB_ROOT/$6" \
    > /dev/null 2>&1
  echo "$(date -u +%H:%M:%S) $1 $(basename "$3") B=$5: $("$AB_PY" -c "import json,sys; print(round(json.load(open(sys.argv[1]))['results']['output_tokens_per_s'], 1))" "$AB_ROOT/$6") tok/s"
}

# ab_rounds ROUNDS OLD_TREE SIDE_FN: SIDE_FN TAG TREE ROUND for each round, "old" (OLD_TREE)
# then "new" (the checked-out tree), each with its own KVSERVE_CACHE_DIR (so each side
# measures and keeps its own kernel selection), after a header line naming the side.
ab_rounds() {
  local rounds="$1" old="$2" fn="$3" i tag tree
  for tag in old new; do mkdir -p "/tmp/kvserve-ab-cache-$tag"; done
  for i in $(seq "$rounds"); do
    for tag in old new; do
      tree=$([ "$tag" = old ] && echo "$old" || echo "$AB_ROOT")
      export KVSERVE_CACHE_DIR="/tmp/kvserve-ab-cache-$tag"
      echo "== $tag round $i $(date -u +%H:%M:%S) ($tree)"
      "$fn" "$tag" "$tree" "$i"
    done
  done
}
