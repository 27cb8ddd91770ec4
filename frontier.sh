#!/usr/bin/env bash
# The paper's question in one command: accuracy against wall-clock across μ, at equal updates (bash frontier.sh)
#   1. every point — a LOSS preset (with each NAV δ of NAV_DELTAS where the preset has NAV) at a μ of MUS — on every
#      build and seed is one run_stages.sh run of TOTAL_UPDATES updates of the preset's prompts per update:
#      TOTAL_UPDATES / μ stages, evaluated every EVAL_UPDATES updates (after every stage when μ is larger), in
#      resident mode up to μ = RESIDENT_MAX_MU (stages too short to pay a process start, a model load and an engine
#      start each, as the paper's GRPO baseline ran resident in verl), processes per phase above it
#   2. bench/frontier.py: the table (frontier.md), every number (frontier.json) and the figures (plots/) from the
#      runs' records: time split, staleness, the importance weights, speed-ups against BASELINE at equal updates,
#      at matched accuracy and re-costed for a per-stage switching cost of each of COSTS
# Rerunning resumes: finished runs are skipped and a killed one resumes where it stopped (run_stages.sh). Every
# variable below can be set from the environment; run_stages.sh's (LR, PROMPTS_PER_UPDATE, ...) pass through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# ------------------------------------------------------------------------------ hyperparameters
PRESET=${PRESET:-lab-fork}      # lab | lab-fork (the CPU lab tasks) | paper (a GPU box) | toy (the tests)
OUT=${OUT:-runs/frontier-$PRESET}  # build<b>/seed<s>/<label>-mu<μ>/ per run; frontier.md, frontier.json, plots/
case "$PRESET" in               # the points' μ ("drift": the drift rule), their equal updates, how often they are
                                # evaluated (updates), on which of the task's benchmarks (empty: run_stages.sh's
                                # preset) with how many samples per problem (EVAL_K; empty: the preset's). The lab
                                # tasks: their held-out sets (2,500 problems of the builder's, none trained or
                                # warm-started on), one sample each: avg@1's standard error ≤ 0.5/√2500 = 0.01 at any
                                # accuracy (with 200 test problems it was 0.015–0.019 after training, measured on
                                # lab-fork with 12 samples each: problems differ more than samples do)
  paper) : "${MUS:=4 16 64 256 1024}" "${TOTAL_UPDATES:=4096}" "${EVAL_UPDATES:=256}" "${BENCHMARKS:=}" "${EVAL_K:=}" ;;
  lab|lab-fork) : "${MUS:=4 16 64 256}" "${TOTAL_UPDATES:=256}" "${EVAL_UPDATES:=64}" "${BENCHMARKS:=heldout}" "${EVAL_K:=1}" ;;
  toy) : "${MUS:=2 4}" "${TOTAL_UPDATES:=8}" "${EVAL_UPDATES:=4}" "${BENCHMARKS:=}" "${EVAL_K:=}" ;;
  *) echo "PRESET must be lab, lab-fork, paper or toy, got '$PRESET'" >&2; exit 2 ;;
esac
LOSSES=${LOSSES:-grpo mu-grpo}  # LOSS presets (losses.sh)
NAV_DELTAS=${NAV_DELTAS:-1e-4 0.1}  # NAV δ of the presets with NAV (one point each; grpo has none)
SEEDS=${SEEDS:-0 1}             # run_stages.sh's SEED: prompt order, sampling, minibatch order
BUILDS=${BUILDS:-$([[ $PRESET == lab* ]] && echo "0 1" || echo 0)}   # lab tasks: the builder's --seed (the task and
                                # its warm-started policy; 0 is data/<task>/, b > 0 data/<task>_build<b>/); else 0
BASELINE=${BASELINE:-grpo:$(set -- $MUS; echo "$1")}  # label:μ the speed-ups are against (label: the LOSS, -d<δ> with NAV)
RESIDENT_MAX_MU=${RESIDENT_MAX_MU:-64}   # μ up to this run resident (RESIDENT=true)
DRIFT_FIRST=${DRIFT_FIRST:-64}  # "drift" in MUS: stages that end on drift (STAGE_END=drift), the first of this μ, the
                                # next planned from where each ended, up to TOTAL_UPDATES; evaluated after every stage
COSTS=${COSTS:-0,2,20,180}      # per-stage switching costs (seconds) the points are re-costed at
POINTS=${POINTS:-}              # only these points, label:μ, e.g. "grpo:4 mu-grpo-d1e-4:1024" (default: all)
ESTIMATE=${ESTIMATE:-$([[ $PRESET == paper ]] && echo true || echo false)}  # first run the preflight alone and print
                                # every point's estimated hours from its throughputs (the paper preset: days)
# ------------------------------------------------------------------------------

export MU_GRPO_VENV=${MU_GRPO_VENV:-.venv}
bash setup.sh >&2
PY=$MU_GRPO_VENV/bin/python
source losses.sh
for v in TOTAL_UPDATES EVAL_UPDATES RESIDENT_MAX_MU DRIFT_FIRST; do
  [[ "${!v}" =~ ^[0-9]+$ ]] && (( ${!v} >= 1 )) || { echo "$v must be a whole number >= 1, got '${!v}'" >&2; exit 2; }
done
for mu in $MUS; do
  [[ "$mu" == drift ]] || { [[ "$mu" =~ ^[0-9]+$ ]] && (( mu >= 1 && TOTAL_UPDATES % mu == 0 )); } \
    || { echo "MUS: each μ must divide TOTAL_UPDATES=$TOTAL_UPDATES (or be 'drift'), got '$mu'" >&2; exit 2; }
done
for x in $SEEDS $BUILDS; do
  [[ "$x" =~ ^[0-9]+$ ]] || { echo "SEEDS and BUILDS must be whole numbers, got '$x'" >&2; exit 2; }
done
[[ $PRESET == lab* || "$BUILDS" == 0 ]] || { echo "BUILDS: only the lab tasks have builds; use BUILDS=0" >&2; exit 2; }

# the points: label:μ, label = the LOSS preset, with -d<δ> for a preset whose flags use NAV δ
ALL=()
for loss in $LOSSES; do
  NAV_DELTA=1e-4 loss_args "$loss" || exit 2
  if [[ "$LOSS_ARGS" == *"--nav_delta=1e-4"* ]]; then labels=(); for d in $NAV_DELTAS; do labels+=("$loss-d$d"); done
  else labels=("$loss"); fi
  for label in "${labels[@]}"; do for mu in $MUS; do ALL+=("$label:$mu"); done; done
done
for p in $POINTS $BASELINE; do
  [[ " ${ALL[*]} " == *" $p "* ]] || { echo "'$p' is not one of the points: ${ALL[*]}" >&2; exit 2; }
done
SELECTED=(${POINTS:-${ALL[@]}})
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock -n 9 || { echo "another frontier.sh is running on $OUT (it holds $OUT/.lock)" >&2; exit 1; }
T0=$(date +%s)
echo "frontier $OUT on $PRESET: ${#SELECTED[@]} point(s) [${SELECTED[*]}] × builds [$BUILDS] × seeds [$SEEDS]," \
     "$TOTAL_UPDATES updates each, evaluated every $EVAL_UPDATES; resident up to μ = $RESIDENT_MAX_MU; baseline $BASELINE"

if [[ "$ESTIMATE" == true ]]; then     # the preflight at the first point's settings, then the estimate table
  first=${SELECTED[0]}; label=${first%:*}; mu=${first##*:}; [[ "$mu" == drift ]] && mu=$DRIFT_FIRST
  env PRESET="$PRESET" LOSS="${label%-d*}" RUN="$OUT/preflight" STAGES=1 UPDATES="$mu" PREFLIGHT=1 PREFLIGHT_ONLY=true \
      bash run_stages.sh > "$OUT/preflight.log" 2>&1 9>&- \
    || { echo "the preflight failed; see $OUT/preflight.log:" >&2; tail -20 "$OUT/preflight.log" >&2; exit 1; }
  $PY bench/frontier.py --estimate_from="$OUT/preflight/preflight.json" --estimate_points="${SELECTED[*]}" \
      --total_updates="$TOTAL_UPDATES" --preflight_updates="$mu" --costs="$COSTS" 9>&- | tee "$OUT/estimate.md"
fi

n=0
for build in $BUILDS; do
  BUILD_ENV=()
  if [[ $PRESET == lab* ]]; then       # the task of this build: built once, by its builder with --seed=<build>
    LAB_DIR=data/${PRESET/-/_}$( (( build == 0 )) || echo "_build$build")
    [[ -f "$LAB_DIR/model/config.json" && -f "$LAB_DIR/heldout.jsonl" ]] \
      || $PY "data/${PRESET/-/_}.py" --out_dir="$LAB_DIR" --seed="$build" >&2    # (the same task again if only
                                                                              # heldout.jsonl is missing: older builds)
    BUILD_ENV=(MODEL="$LAB_DIR/model" TRAIN_DATA="$LAB_DIR/train.jsonl" EVAL_DATA_DIR="$LAB_DIR")
  fi
  for seed in $SEEDS; do
    for point in "${SELECTED[@]}"; do
      label=${point%:*} mu=${point##*:} loss=${point%:*}; loss=${loss%-d*}
      delta=$([[ "$label" == *-d* ]] && echo "${label##*-d}" || echo 1e-4)
      run=$OUT/build$build/seed$seed/$label-mu$mu
      mkdir -p "$(dirname "$run")"
      n=$((n + 1))
      echo "[$n/$(( ${#SELECTED[@]} * $(wc -w <<< "$BUILDS") * $(wc -w <<< "$SEEDS") ))] $run ($(( ($(date +%s) - T0) / 60 )) min)"
      if [[ "$mu" == drift ]]; then
        STAGE_ENV=(STAGE_END=drift UPDATES="$DRIFT_FIRST" TOTAL_UPDATES="$TOTAL_UPDATES" DRIFT_MAX_UPDATES="$TOTAL_UPDATES"
                   EVAL_EVERY=1 RESIDENT=$( (( DRIFT_FIRST <= RESIDENT_MAX_MU )) && echo true || echo false))
      else
        STAGE_ENV=(STAGE_END=fixed STAGES=$((TOTAL_UPDATES / mu)) UPDATES="$mu"
                   EVAL_EVERY=$(( EVAL_UPDATES > mu ? EVAL_UPDATES / mu : 1 ))
                   RESIDENT=$( (( mu <= RESIDENT_MAX_MU )) && echo true || echo false))
      fi
      env "${BUILD_ENV[@]}" "${STAGE_ENV[@]}" ${EVAL_K:+EVAL_K="$EVAL_K"} ${BENCHMARKS:+BENCHMARKS="$BENCHMARKS"} \
          PRESET="$PRESET" LOSS="$loss" NAV_DELTA="$delta" SEED="$seed" RUN="$run" \
          bash run_stages.sh > "$run.log" 2>&1 9>&- \
        || { echo "$run failed; see $run.log (rerun frontier.sh to resume):" >&2; tail -5 "$run.log" >&2; exit 1; }
    done
  done
done

$PY bench/frontier.py --runs_dir="$OUT" --baseline="$BASELINE" --costs="$COSTS" 9>&- | tee "$OUT/frontier.log"
echo "frontier done in $(( ($(date +%s) - T0) / 60 )) min: $OUT/frontier.md, $OUT/plots/"
