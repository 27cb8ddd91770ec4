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
#   bash tools/bakeoff.sh confirm  §4: the rule's ten learning builds of candidates 40–99 (probes
#                                  at lr 1e-4), then build by build every arm at its tuned lr in
#                                  the declared order (tools/bakeoff.py --step=order), two at a
#                                  time; refused until the tuning is complete (tune.json)
#   bash tools/bakeoff.sh dose     §7: μ-GRPO, GRPO clip (stages of μ = 256) and GRPO μ = 4 at
#                                  their tuned lrs, 1,024 updates, on the first six confirmation
#                                  builds, build by build
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
export JOBS=2 OPTIMIZER_BOUNDARY=carry  # two runs at a time; AdamW's state carried (§2)
export MUS="4 64"
export EVAL_CACHE=$OUT/eval_cache   # a build's initial policy evaluated once for every arm and lr
PYTHON=${MU_GRPO_VENV:-.venv}/bin/python
losses() { local p; for p in "$@"; do p=${p%:*}; echo "${p%-d1e-4}"; done | sort -u | tr '\n' ' '; }
# the builds a frontier directory holds (its rule's, once it has kept them), in order
kept_builds() { (ls -d "$1"/build* 2>/dev/null || :) | sed 's/.*build//' | sort -n | tr '\n' ' '; }
# the builds a frontier's rule kept (its regimes/selection.json), in order
rule_builds() { "$PYTHON" -c 'import json, sys; print(*json.load(open(sys.argv[1]))["kept"])' \
                  "$1/regimes/selection.json"; }
# frontier.sh on each build of <builds> in turn, at the points tools/bakeoff.py --step=order gives:
# its runs without a final yet, in the declared order. A run the trainer stops ends that frontier
# with its failure and has its final (amendment 1): the build goes on without it. Any other failure,
# or a stop by a signal, ends this script with frontier.sh's code (rerun to resume)
run_in_order() {  # <experiment> <builds>, frontier settings in the environment
  local b line stopped points before code
  for b in $2; do
    before= code=0
    while :; do
      line=$("$PYTHON" tools/bakeoff.py --step=order --experiment="$1" --out="$OUT" --builds="$b")
      read -r _ stopped points <<< "$line"
      [[ -n "$points" ]] || break                      # every run of the build has its final
      if [[ -n "$before" ]] && (( code == 0 || code >= 128 || stopped == before )); then
        echo "build $b: frontier.sh ended (exit $code) with runs still to finish: $points" >&2
        exit $(( code ? code : 1 ))
      fi
      before=$stopped code=0
      BUILDS="$b" POINTS="$points" KEY_POINTS= OUT="$OUT/$1" bash frontier.sh || code=$?
    done
  done
}
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
  confirm|dose)
    "$PYTHON" tools/bakeoff.py --step=order --out="$OUT"      # refused until the tuning is complete
    # the rule's builds (probes already made are kept: a rerun finishes the rule, then goes on)
    BUILDS= REGIMES=learns:10 MIN_BUILDS=10 CANDIDATES="$(echo $(seq 40 99))" LR=1e-4 \
      POINTS=probes LOSSES="$(losses $ARMS)" OUT="$OUT/confirm" bash frontier.sh
    BUILDS=$(rule_builds "$OUT/confirm")
    [[ -n "$BUILDS" ]] || { echo "the rule kept no build of candidates 40-99" >&2; exit 1; }
    if [[ $STEP == confirm ]]; then
      LOSSES="$(losses $ARMS)" BASELINE=mu-grpo-d1e-4:64 run_in_order confirm "$BUILDS"
    else
      MUS="4 256" TOTAL_UPDATES=1024 EVAL_UPDATES=256 LOSSES="mu-grpo grpo" BASELINE=grpo:4 \
        run_in_order dose "$(echo $BUILDS | cut -d' ' -f1-6)"
    fi ;;
  *) echo "usage: bash tools/bakeoff.sh tune | confirm | dose | chaos (docs/bakeoff.md)" >&2
     exit 2 ;;
esac
