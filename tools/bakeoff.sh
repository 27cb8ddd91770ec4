#!/usr/bin/env bash
# docs/bakeoff.md's runs (issue 78), every run a frontier.sh run on the second lab task in the
# paper's shape (resumable: finished runs are skipped, a killed one resumes; rerun to continue):
#   bash tools/bakeoff.sh tune     §3: every arm × lr of LRS on the rule's first three learning
#                                  builds of candidates 0–11 (lr 1e-4's frontier probes and keeps
#                                  them, its probes at lr 1e-4; the others run on those). One point
#                                  beyond an end, for that arm only (docs/bakeoff.md, amendment 1):
#                                  ARMS="topr:64" LRS=3e-6 bash tools/bakeoff.sh tune
#   bash tools/bakeoff.sh chaos    §8: μ-GRPO and GRPO clip at μ = 64, lr 1e-4 and 3e-5, on the
#                                  first two tuning builds, each three times (chaos/lr<lr>/<copy>/):
#                                  the original, a repeat, and the micro-batch split halved
#                                  (MICRO_BATCH_TOKENS=2048: only the float order of sums)
# The later steps (confirm, dose) are added here with the tuning's results, before they run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEP=${1:-}
OUT=${OUT:-runs/bakeoff}
LRS=${LRS:-1e-4 3e-5 1e-5}      # the grid (docs/bakeoff.md §3; an arm best at an end: LRS="3e-4"
                                # or "3e-6" after)
ARMS=${ARMS:-mu-grpo-d1e-4:64 relaxed-no-nav:64 grpo:64 m2po:64 topr:64 cispo:64 cispo-nav-d1e-4:64
oapl:64 dppo-tv:64 vespo:64 gspo:64 grpo:4}
ARMS=$(echo $ARMS)              # (one line)
export PRESET=lab-fork SEEDS=0 EVAL_UPDATES=64 EVAL_K=1 BENCHMARKS=test,heldout NAV_DELTAS=1e-4
export MUS="4 64"
export EVAL_CACHE=$OUT/eval_cache   # a build's initial policy evaluated once for every arm and lr
losses() { local p; for p in "$@"; do p=${p%:*}; echo "${p%-d1e-4}"; done | sort -u | tr '\n' ' '; }
# the builds a frontier directory holds (its rule's, once it has kept them), in order
kept_builds() { (ls -d "$1"/build* 2>/dev/null || :) | sed 's/.*build//' | sort -n | tr '\n' ' '; }
first_tuned() {
  [[ -d "$OUT/tune/lr1e-4" ]] && return
  echo "tune LRS=1e-4 first: its frontier finds the builds" >&2; exit 2
}

case "$STEP" in
  tune)
    BUILDS=
    [[ "$LRS" == 1e-4* ]] || first_tuned
    for lr in $LRS; do
      # the rule's builds, kept by lr 1e-4's frontier
      [[ -n "$BUILDS" || ! -d "$OUT/tune/lr1e-4" ]] || BUILDS=$(kept_builds "$OUT/tune/lr1e-4")
      rule=(REGIMES=learns:3 MIN_BUILDS=3 CANDIDATES="0 1 2 3 4 5 6 7 8 9 10 11")
      [[ -z "$BUILDS" ]] || rule=(BUILDS="$BUILDS")
      env "${rule[@]}" LR="$lr" LOSSES="$(losses $ARMS)" POINTS="$ARMS" KEY_POINTS="$ARMS" \
          BASELINE="${ARMS%% *}" OUT="$OUT/tune/lr$lr" bash frontier.sh
      [[ -n "$BUILDS" ]] || BUILDS=$(kept_builds "$OUT/tune/lr$lr")
    done ;;
  chaos)
    first_tuned
    BUILDS=$(echo $(kept_builds "$OUT/tune/lr1e-4") | cut -d' ' -f1-2)
    for lr in 1e-4 3e-5; do
      for copy in original repeat split; do
        split=(); [[ $copy != split ]] || split=(MICRO_BATCH_TOKENS=2048)
        env "${split[@]}" BUILDS="$BUILDS" LR="$lr" LOSSES="mu-grpo grpo" \
            POINTS="mu-grpo-d1e-4:64 grpo:64" KEY_POINTS="mu-grpo-d1e-4:64 grpo:64" \
            BASELINE=mu-grpo-d1e-4:64 OUT="$OUT/chaos/lr$lr/$copy" bash frontier.sh
      done
    done ;;
  *) echo "usage: bash tools/bakeoff.sh tune | chaos (docs/bakeoff.md)" >&2; exit 2 ;;
esac
