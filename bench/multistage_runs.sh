#!/usr/bin/env bash
# docs/multistage.md's runs (2026-12-02): the paper's shape at the lab's 256 updates on the rule's first six learning
# builds of the second lab task, seed 0, every point a frontier.sh run (resumable: rerun to continue):
#   fair/lr<lr>   GRPO μ = 4 (resident), GRPO μ = 64 and μ-GRPO μ = 64 (4 stages each) at each lr of LRS
#   arms/<arm>    μ-GRPO μ = 64 × 4 stages at lr 1e-4 with one change each (the mechanism's arms)
# Every run is evaluated on the task's test split (the lr is chosen there) and its held-out set (what is reported),
# after every stage at μ = 64 and every 64 updates at μ = 4; μ-GRPO and GRPO at μ = 64, lr 1e-4, also save their
# policy every 16 updates within a stage (where a stage's fall happens). Then: python bench/multistage.py
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-runs/multistage}
LRS=${LRS:-1e-4 3e-5 1e-5}
ARMS=${ARMS:-reset relaxed-high relaxed-low beta2-0.95 stage-warmup-16}
export PRESET=lab-fork SEEDS=0 EVAL_UPDATES=64 EVAL_K=1 BENCHMARKS=test,heldout EVAL_CACHE=$OUT/eval_cache
export NAV_DELTAS=1e-4 MUS="4 64"
# the rule, extended past its first three: the first six learning builds of the candidates, in order (held-out probes)
BUILDS=
for lr in $LRS; do
  P="grpo:4 grpo:64 mu-grpo-d1e-4:64"
  extra=(); [[ $lr != 1e-4 ]] || extra=(SAVE_POLICY_EVERY=16)
  env "${extra[@]}" LR=$lr LOSSES="grpo mu-grpo" POINTS="$P" KEY_POINTS="$P" BASELINE=grpo:4 BUILDS="$BUILDS" \
      REGIMES=learns:6 MIN_BUILDS=6 CANDIDATES="0 1 2 3 4 5 6 7 8 9 10 11" OUT=$OUT/fair/lr$lr bash frontier.sh
  # the builds the rule kept, for every later frontier (no probes again)
  BUILDS=$(ls -d "$OUT"/fair/lr1e-4/build* | sed 's/.*build//' | sort -n | tr '\n' ' ')
done
for arm in $ARMS; do
  case $arm in
    reset)           set -- LOSSES=mu-grpo OPTIMIZER_BOUNDARY=reset ;;
    relaxed-high)    set -- LOSSES=relaxed-high ;;
    relaxed-low)     set -- LOSSES=relaxed-low ;;
    beta2-0.95)      set -- LOSSES=mu-grpo ADAM_BETAS=0.9,0.95 ;;
    stage-warmup-16) set -- LOSSES=mu-grpo STAGE_WARMUP=16 ;;
    *) echo "unknown arm $arm" >&2; exit 2 ;;
  esac
  loss=${1#LOSSES=}
  env "$@" LR=1e-4 POINTS="$loss-d1e-4:64" KEY_POINTS="$loss-d1e-4:64" BASELINE="$loss-d1e-4:64" BUILDS="$BUILDS" \
      OUT=$OUT/arms/$arm bash frontier.sh
done
