#!/usr/bin/env bash
# The paper's question in one command: accuracy against wall-clock across μ, at equal updates (bash frontier.sh)
#   0. the lab tasks: candidate builds, each built and probed in order, until the rule has enough builds of each regime
#      (bench/regimes.py; "the builds" below)
#   1. every point — a LOSS preset (with each NAV δ of NAV_DELTAS where the preset has NAV) at a μ of MUS — on every
#      build and seed is one run_stages.sh run of TOTAL_UPDATES updates of the preset's prompts per update:
#      TOTAL_UPDATES / μ stages, evaluated every EVAL_UPDATES updates (after every stage when μ is larger), in
#      resident mode up to μ = RESIDENT_MAX_MU (stages too short to pay a process start, a model load and an engine
#      start each, as the paper's GRPO baseline ran resident in verl), processes per phase above it
#   2. bench/frontier.py: the table (frontier.md), every number (frontier.json) and the figures (plots/) from the
#      runs' records: time split, staleness, the importance weights, speed-ups against BASELINE at equal updates,
#      at matched accuracy and re-costed for a per-stage switching cost of each of COSTS; the paper's comparisons as
#      paired differences with 95 % intervals, per regime; where the ratio leaves GRPO's clip
# Rerunning resumes: finished runs are skipped and a killed one resumes where it stopped (run_stages.sh). Every
# variable below can be set from the environment; run_stages.sh's (LR, PROMPTS_PER_UPDATE, ...) pass through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# ------------------------------------------------------------------------------ hyperparameters
# ---- the task and where everything goes
PRESET=${PRESET:-lab-fork}      # lab | lab-fork (the CPU lab tasks) | paper (a GPU box) | toy (the tests)
OUT=${OUT:-runs/frontier-$PRESET}  # build<b>/seed<s>/<label>-mu<μ>/ per run; frontier.md, frontier.json, plots/
# ---- set per preset, unless given in the environment: MUS, TOTAL_UPDATES, EVAL_UPDATES, BENCHMARKS, EVAL_K
case "$PRESET" in               # the points' μ ("drift": the drift rule), their equal updates, how often they are
                                # evaluated (updates), on which of the task's benchmarks (empty: run_stages.sh's
                                # preset) with how many samples per problem (EVAL_K; empty: the preset's). The lab
                                # tasks: their held-out sets (2,500 problems of the builder's, none trained or
                                # warm-started on), one sample each: avg@1's standard error ≤ 0.5/√2500 = 0.01 at any
                                # accuracy (with 200 test problems it was 0.015–0.019 after training, measured on
                                # lab-fork with 12 samples each: problems differ more than samples do)
  paper) : "${MUS:=4 16 64 256 1024}" "${TOTAL_UPDATES:=4096}" "${EVAL_UPDATES:=256}" "${BENCHMARKS:=}" "${EVAL_K:=}" ;;
  lab|lab-fork) : "${MUS:=4 16 64 256}" "${TOTAL_UPDATES:=256}" "${EVAL_UPDATES:=128}" "${BENCHMARKS:=heldout}" "${EVAL_K:=1}" ;;
  toy) : "${MUS:=2 4}" "${TOTAL_UPDATES:=8}" "${EVAL_UPDATES:=4}" "${BENCHMARKS:=}" "${EVAL_K:=}" ;;
  *) echo "PRESET must be lab, lab-fork, paper or toy, got '$PRESET'" >&2; exit 2 ;;
esac
# ---- the points (label:μ): LOSS presets × NAV δ × MUS, over seeds and builds; the baseline
LOSSES=${LOSSES:-grpo mu-grpo}  # LOSS presets (losses.sh)
NAV_DELTAS=${NAV_DELTAS:-1e-4 0.1}  # NAV δ of the presets with NAV (one point each; grpo has none)
SEEDS=${SEEDS:-0 1}             # run_stages.sh's SEED: prompt order, sampling, minibatch order
KEY_POINTS=${KEY_POINTS-$([[ $PRESET == lab* ]] && echo "grpo:4 grpo:64 grpo:256 mu-grpo-d1e-4:64 mu-grpo-d1e-4:256 mu-grpo-d0.1:256 mu-grpo-d1e-4:4" || :)}
                                # the points the paper's claims rest on: run on every build and seed; the others (the
                                # rest of the μ sweep) only on SWEEP_BUILDS × SWEEP_SEEDS. Empty: every point everywhere.
                                # The lab's: μ = 64 is the paper's shape (4 stages, μ/4 = 16), μ = 256 one stage on the
                                # initial policy's rollouts (another experiment: docs/multistage.md)
SWEEP_BUILDS=${SWEEP_BUILDS:-first}  # "first": the first build of each regime the rule keeps (else of BUILDS)
SWEEP_SEEDS=${SWEEP_SEEDS:-0}
# ---- the builds (lab tasks: the builder's --seed, i.e. the task and its warm-started policy; 0 is data/<task>/, b > 0
# data/<task>_build<b>/). Each candidate is built, then probed: GRPO at the smallest μ for PROBE_UPDATES updates (seed
# PROBE_SEED, none of SEEDS), whose records give the build's regime (bench/regimes.py regime_name: saturated, learns,
# stalls; $OUT/regimes/build<b>.json). The rule: candidates in CANDIDATES' order until it has each regime's quota of
# REGIMES (with too few in a regime, the next candidates of REGIMES, in order, up to MIN_BUILDS); the frontier runs on
# those (how many it looked at and kept: frontier.md)
BUILDS=${BUILDS:-}              # given: exactly these builds, no probe and no rule (the toy and paper presets: 0)
CANDIDATES=${CANDIDATES:-0 1 2 3 4 5 6 7}
REGIMES=${REGIMES:-learns:3 stalls:1}  # <regime>:<quota>, the first quota candidates of each: the paper's setting (a
                                # model that solves some problems at the start and that GRPO at small μ improves) on
                                # three builds, so each claim has 6 pairs there; the lab's first builds' (GRPO barely
                                # moves them) on one, as the contrast: such builds are rare (1 of 8 candidates)
MIN_BUILDS=${MIN_BUILDS:-4}
PROBE_UPDATES=${PROBE_UPDATES:-64}
PROBE_SEED=${PROBE_SEED:-100}
BASELINE=${BASELINE:-grpo:$(set -- $MUS; echo "$1")}  # label:μ the speed-ups are against (label: the LOSS, -d<δ> with NAV)
# ---- how a point runs and is costed
RESIDENT_MAX_MU=${RESIDENT_MAX_MU:-64}   # μ up to this run resident (RESIDENT=true)
DRIFT_FIRST=${DRIFT_FIRST:-64}  # "drift" in MUS: stages that end on drift (STAGE_END=drift), the first of this μ, the
                                # next planned from where each ended, up to TOTAL_UPDATES; evaluated after every stage
COSTS=${COSTS:-0,2,20,180}      # per-stage switching costs (seconds) the points are re-costed at
EVAL_CACHE=${EVAL_CACHE-$OUT/eval_cache}  # the runs' kept evaluations (run_stages.sh EVAL_CACHE): a build's initial
                                # policy is evaluated by its first run (the probe) and reused by the others, the same
                                # rows (every request samples from its own seed); empty: every run evaluates it
# ---- which points run, and what runs before them (the estimate, the preflight)
POINTS=${POINTS:-}              # only these points, label:μ, e.g. "grpo:4 mu-grpo-d1e-4:1024" (default: all)
ESTIMATE=${ESTIMATE:-$([[ $PRESET == paper ]] && echo true || echo false)}  # print every point's estimated hours
                                # from the (first LOSS's) preflight's throughputs before the runs (the paper preset: days)
PREFLIGHT=${PREFLIGHT:-auto}    # run_stages.sh's preflight (auto: the paper preset | 1 | 0 | force), run here once per
                                # box shape and LOSS before any run (ESTIMATE runs it too), on one run's share of the
                                # GPUs at the settings of the LOSS's first resident point (else its first): every path
                                # it checks is the box's and the loss's, not the point's. The runs do not run it again
# ---- the box
GPUS=${GPUS:-}                  # the box's GPUs (default: all torch sees); JOBS > 1 splits them evenly between the runs
                                # at once (each its CUDA_VISIBLE_DEVICES) or is refused when it cannot
JOBS=${JOBS:-$([[ $PRESET == lab* ]] && awk -v c="$(nproc)" '/MemAvailable/ { m = int($2 / 3145728); print (m < c ? (m > 1 ? m : 1) : c) }' /proc/meminfo || echo 1)}
                                # runs at once, each pinned to its own JOBS-th of the cores (taskset; torch's and
                                # vLLM's OpenMP threads as many). The lab: a core per run (a run's processes keep
                                # about one busy; a run takes 1.15-1.19x its time alone on 2 cores, measured) and at
                                # most one per 3 GiB available (a run peaks at about 2.5 GiB); every run has the
                                # same share, so their times compare. Elsewhere 1: a run has the whole machine. On
                                # a GPU box each run also gets GPUS / JOBS of the GPUs (gpu_slices in bench/frontier.py)
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
for x in $SEEDS $BUILDS $JOBS $CANDIDATES $MIN_BUILDS $PROBE_UPDATES $PROBE_SEED $SWEEP_SEEDS \
         $([[ "$SWEEP_BUILDS" == first ]] || echo "$SWEEP_BUILDS"); do
  [[ "$x" =~ ^[0-9]+$ ]] || { echo "SEEDS, BUILDS, JOBS, CANDIDATES, MIN_BUILDS, PROBE_UPDATES, PROBE_SEED and SWEEP_*" \
                                   "must be whole numbers (SWEEP_BUILDS or 'first'), got '$x'" >&2; exit 2; }
done
for r in $REGIMES; do
  [[ "$r" =~ ^(saturated|learns|stalls):[1-9][0-9]*$ ]] \
    || { echo "REGIMES: each is <regime>:<quota>, a regime of saturated, learns or stalls, got '$r'" >&2; exit 2; }
done
[[ $PRESET == lab* || -n "$BUILDS" ]] || BUILDS=0
(( JOBS >= 1 )) || { echo "JOBS must be at least 1, got $JOBS" >&2; exit 2; }
[[ "$PREFLIGHT" =~ ^(auto|0|1|force)$ ]] || { echo "PREFLIGHT must be auto, 0, 1 or force, got '$PREFLIGHT'" >&2; exit 2; }
[[ "$PREFLIGHT" == auto ]] && PREFLIGHT=$([[ $PRESET == paper ]] && echo 1 || echo 0)
: "${GPUS:=$($PY -c "import common; print(common.gpu_count())")}"
[[ "$GPUS" =~ ^[0-9]+$ ]] || { echo "GPUS must be a whole number, got '$GPUS'" >&2; exit 2; }
SLICES=() GPU_ENV=()            # JOBS runs at once on a GPU box: each on its own GPUS / JOBS of them. They share no
# port: torchrun --standalone rendezvouses on a free one (torch/distributed/run.py:990, rdzv_endpoint "localhost:0")
# and vLLM's engines take free ones (vllm/utils/network_utils.py:192, get_open_port, unless VLLM_PORT is set)
if (( JOBS > 1 && GPUS > 0 )); then
  split=$($PY bench/frontier.py --jobs="$JOBS" --gpus="$GPUS") || exit 2
  SLICES=($split)
  GPU_ENV=(CUDA_VISIBLE_DEVICES="${SLICES[0]}" GPUS=$(( GPUS / JOBS )))   # the preflight's: one run's share
fi
[[ $PRESET == lab* || "$BUILDS" == 0 ]] || { echo "BUILDS: only the lab tasks have builds; use BUILDS=0" >&2; exit 2; }

# the points: label:μ, label = the LOSS preset, with -d<δ> for a preset whose flags use NAV δ
ALL=()
for loss in $LOSSES; do
  NAV_DELTA=1e-4 loss_args "$loss" || exit 2
  if [[ "$LOSS_ARGS" == *"--nav_delta=1e-4"* ]]; then labels=(); for d in $NAV_DELTAS; do labels+=("$loss-d$d"); done
  else labels=("$loss"); fi
  for label in "${labels[@]}"; do for mu in $MUS; do ALL+=("$label:$mu"); done; done
done
for p in $POINTS $BASELINE $KEY_POINTS; do
  [[ " ${ALL[*]} " == *" $p "* ]] || { echo "'$p' (POINTS, BASELINE or KEY_POINTS) is not one of the points:" \
                                            "${ALL[*]}" >&2; exit 2; }
done
SELECTED=(${POINTS:-${ALL[@]}})
mkdir -p "$OUT"
# REPORT_TO (run_stages.sh's trackers) passes through to every run; they form one group, this frontier
export TRACKER_GROUP=${TRACKER_GROUP:-$(basename "$OUT")}
exec 9>"$OUT/.lock"
flock -n 9 || { echo "another frontier.sh is running on $OUT (it holds $OUT/.lock)" >&2; exit 1; }
T0=$(date +%s)

resident_point() {              # resident_point <label:μ>: whether the point runs resident (RESIDENT_MAX_MU)
  local mu=${1##*:}; [[ "$mu" == drift ]] && mu=$DRIFT_FIRST
  (( mu <= RESIDENT_MAX_MU ))
}
point_env() {                   # point_env <label:μ>: POINT_ENV, the run_stages.sh settings of the point's runs
  local label=${1%:*} mu=${1##*:}
  POINT_ENV=(LOSS="${label%-d*}" NAV_DELTA="$([[ "$label" == *-d* ]] && echo "${label##*-d}" || echo 1e-4)"
             RESIDENT=$(resident_point "$1" && echo true || echo false))
  if [[ "$mu" == drift ]]; then
    POINT_ENV+=(STAGE_END=drift UPDATES_PER_STAGE="$DRIFT_FIRST" TOTAL_UPDATES="$TOTAL_UPDATES" DRIFT_MAX_UPDATES="$TOTAL_UPDATES"
                EVAL_EVERY=1)
  else
    POINT_ENV+=(STAGE_END=fixed STAGES=$((TOTAL_UPDATES / mu)) UPDATES_PER_STAGE="$mu"
                EVAL_EVERY=$(( EVAL_UPDATES > mu ? EVAL_UPDATES / mu : 1 )))
  fi
}

if [[ "$PREFLIGHT" != 0 || "$ESTIMATE" == true ]]; then   # one preflight per box shape and LOSS, before any run
  declare -A CHECKED=()
  for point in "${SELECTED[@]}"; do       # per LOSS: its first resident point (the hand-off checked too), else its first
    label=${point%:*}; loss=${label%-d*}
    [[ -z "${CHECKED[$loss]:-}" ]] || continue
    for p in "${SELECTED[@]}"; do
      l=${p%:*}; [[ "${l%-d*}" == "$loss" ]] && resident_point "$p" && { point=$p; break; }
    done
    CHECKED[$loss]=$point
    run=$OUT/preflight$( (( ${#CHECKED[@]} == 1 )) || echo "-$loss")
    point_env "$point"
    echo "preflight for $loss on $([[ ${#GPU_ENV[@]} -gt 0 ]] && echo "GPUs ${SLICES[0]}" || echo "this box") at $point's settings: $run"
    env "${GPU_ENV[@]}" "${POINT_ENV[@]}" PRESET="$PRESET" RUN="$run" PREFLIGHT_ONLY=true \
        PREFLIGHT=$([[ "$PREFLIGHT" == force ]] && echo force || echo 1) bash run_stages.sh > "$run.log" 2>&1 9>&- \
      || { echo "the preflight failed; see $run.log:" >&2; tail -20 "$run.log" >&2; exit 1; }
    if [[ "$ESTIMATE" == true ]] && (( ${#CHECKED[@]} == 1 )); then
      mu=${point##*:}; [[ "$mu" == drift ]] && mu=$DRIFT_FIRST
      $PY bench/frontier.py --estimate_from="$run/preflight.json" --estimate_points="${SELECTED[*]}" \
          --total_updates="$TOTAL_UPDATES" --preflight_updates="$mu" --costs="$COSTS" 9>&- | tee "$OUT/estimate.md"
    fi
  done
fi

CORES=($($PY -c "import os; print(*sorted(os.sched_getaffinity(0)))" 9>&-))   # the cores this may run on
per=$(( ${#CORES[@]} / JOBS ))
worker_cores() {                # worker_cores <k>: worker k's cores, its JOBS-th of them ("" with JOBS=1: unpinned)
  (( JOBS > 1 )) || return 0
  (( per > 0 )) && { local IFS=,; echo "${CORES[*]:$1*per:per}"; } || echo "${CORES[$1 % ${#CORES[@]}]}"
}
launch() {                      # launch <run dir> <build> <seed> <cores, "" for none> <GPUs, "" for all>: run_stages.sh
  local run=$1 build=$2 cores=$4 BUILD_ENV=() PIN=() GPU=()    # at POINT_ENV's settings on the build's task
  mkdir -p "$(dirname "$run")"
  [[ -z "${LAB_DIR[$build]:-}" ]] \
    || BUILD_ENV=(MODEL="${LAB_DIR[$build]}/model" TRAIN_DATA="${LAB_DIR[$build]}/train.jsonl" EVAL_DATA_DIR="${LAB_DIR[$build]}")
  [[ -z "$cores" ]] || PIN=(taskset -c "$cores" env OMP_NUM_THREADS=$(( $(tr -cd , <<< "$cores" | wc -c) + 1 ))
                            VLLM_CPU_OMP_THREADS_BIND="$cores")   # (tests/conftest.py pins its workers the same way)
  [[ -z "$5" ]] || GPU=(CUDA_VISIBLE_DEVICES="$5" GPUS=$(( GPUS / JOBS )))
  "${PIN[@]}" env "${BUILD_ENV[@]}" "${POINT_ENV[@]}" "${GPU[@]}" ${EVAL_K:+EVAL_K="$EVAL_K"} \
      ${BENCHMARKS:+BENCHMARKS="$BENCHMARKS"} PRESET="$PRESET" SEED="$3" RUN="$run" PREFLIGHT=0 EVAL_CACHE="$EVAL_CACHE" \
      bash run_stages.sh > "$run.log" 2>&1 9>&- \
    || { echo "$run failed; see $run.log (rerun frontier.sh to resume):" >&2; tail -5 "$run.log" >&2; return 1; }
}

declare -A LAB_DIR=()           # each build's task: built once, by its builder with --seed=<build>, before any run
build_task() {                  # (on every core: a build's thread count is part of what it is)
  LAB_DIR[$1]=data/${PRESET/-/_}$( (( $1 == 0 )) || echo "_build$1")
  [[ -f "${LAB_DIR[$1]}/model/config.json" && -f "${LAB_DIR[$1]}/heldout.jsonl" ]] \
    || $PY "data/${PRESET/-/_}.py" --out_dir="${LAB_DIR[$1]}" --seed="$1" >&2 9>&-  # (the same task again if only
}                                                                                 # heldout.jsonl is missing: older builds)
FIRSTS=""                       # the first kept build of each regime (SWEEP_BUILDS=first)
if [[ $PRESET == lab* && -z "$BUILDS" ]]; then   # the rule: build and probe candidates until it has enough builds
  LOOKED=() SMALL=$(set -- $MUS; echo "$1")
  [[ "$SMALL" =~ ^[0-9]+$ ]] && (( PROBE_UPDATES % SMALL == 0 )) \
    || { echo "PROBE_UPDATES=$PROBE_UPDATES must be a multiple of the smallest μ ($SMALL)" >&2; exit 2; }
  for b in $CANDIDATES; do
    build_task "$b"
    probe=$OUT/regimes/build$b
    if [[ ! -f "$probe.json" ]]; then
      echo "probe of build $b: GRPO μ = $SMALL, $PROBE_UPDATES updates, seed $PROBE_SEED ($(( ($(date +%s) - T0) / 60 )) min)"
      TOTAL_UPDATES=$PROBE_UPDATES EVAL_UPDATES=$PROBE_UPDATES point_env "grpo:$SMALL"
      launch "$probe" "$b" "$PROBE_SEED" "$(worker_cores 0)" "${SLICES[0]:-}" || exit 1
      $PY bench/regimes.py --regime_of="$probe" 9>&-
    fi
    LOOKED+=("$b")
    chosen=$($PY bench/regimes.py --select="$OUT/regimes" --candidates="${LOOKED[*]}" --regimes="$REGIMES" \
                 --at_least="$MIN_BUILDS" 2> "$OUT/regimes/selection.log" 9>&-) \
      || { cat "$OUT/regimes/selection.log" >&2; exit 1; }
    BUILDS=$(sed -n 1p <<< "$chosen") FIRSTS=$(sed -n 2p <<< "$chosen")
    [[ $(sed -n 3p <<< "$chosen") != complete ]] || break
  done
  cat "$OUT/regimes/selection.log" >&2     # the rule's table and how many builds it looked at and kept
  [[ -n "$BUILDS" ]] || { echo "the rule kept no build of [$CANDIDATES] (regimes $REGIMES): see $OUT/regimes/" >&2; exit 1; }
else
  for build in $BUILDS; do [[ $PRESET != lab* ]] || build_task "$build"; done
fi
[[ "$SWEEP_BUILDS" != first ]] || SWEEP_BUILDS=${FIRSTS:-${BUILDS%% *}}
echo "frontier $OUT on $PRESET: ${#SELECTED[@]} point(s) [${SELECTED[*]}] × builds [$BUILDS] × seeds [$SEEDS]" \
     "${KEY_POINTS:+(the points other than [$KEY_POINTS] only on builds [$SWEEP_BUILDS] × seeds [$SWEEP_SEEDS])}," \
     "$TOTAL_UPDATES updates each, evaluated every $EVAL_UPDATES; resident up to μ = $RESIDENT_MAX_MU; baseline $BASELINE"
RUNS=()                         # "build seed label:μ", in the order they are taken: per seed, the key points on every
for seed in $SEEDS; do          # build, then the rest of the sweep on its builds (stopped early, the claims' runs are done)
  for point in "${SELECTED[@]}"; do
    if [[ -z "$KEY_POINTS" || " $KEY_POINTS " == *" $point "* ]]; then
      for build in $BUILDS; do RUNS+=("$build $seed $point"); done
    fi
  done
  for point in "${SELECTED[@]}"; do
    if [[ -n "$KEY_POINTS" && " $KEY_POINTS " != *" $point "* && " $SWEEP_SEEDS " == *" $seed "* ]]; then
      for build in $SWEEP_BUILDS; do [[ " $BUILDS " != *" $build "* ]] || RUNS+=("$build $seed $point"); done
    fi
  done
done

run_point() {                   # run_point <index in RUNS> <cores to pin it to, "" for none> <its GPUs, "" for all>
  local build seed point; read -r build seed point <<< "${RUNS[$1]}"
  local run=$OUT/build$build/seed$seed/${point%:*}-mu${point##*:}
  echo "[$(( $1 + 1 ))/${#RUNS[@]}] $run ($(( ($(date +%s) - T0) / 60 )) min${2:+, cores $2}${3:+, GPUs $3})"
  point_env "$point"
  launch "$run" "$build" "$seed" "$2" "$3"
}

if (( JOBS == 1 )); then
  for i in "${!RUNS[@]}"; do run_point "$i" "" "" || exit 1; done
else                            # JOBS workers, each on its own cores, each taking the next run no worker has taken
  echo 0 > "$OUT/.next"
  worker() {
    local i
    while i=$(flock "$OUT/.next" bash -c 'i=$(<"$1"); echo $((i + 1)) > "$1"; echo "$i"' _ "$OUT/.next") \
          && (( i < ${#RUNS[@]} )); do
      run_point "$i" "$1" "$2" || return 1
    done
  }
  WORKERS=()
  for (( k = 0; k < JOBS; k++ )); do   # a worker's cores: its JOBS-th of them (with more JOBS than cores, one shared)
    worker "$(worker_cores "$k")" "${SLICES[k]:-}" 9>&- &
    WORKERS+=($!)
  done
  # a background job here ignores Ctrl-C (bash, without job control): stopping frontier.sh stops every worker's runs
  stop_workers() { for w in "${WORKERS[@]}"; do $PY -c "import processes, sys; processes.stop_tree(int(sys.argv[1]))" "$w" 9>&-; done; }
  trap 'stop_workers; exit 130' INT TERM
  failed=0
  for _ in "${WORKERS[@]}"; do      # a failed run stops the other workers' runs (a rerun resumes them all)
    wait -n || { failed=1; stop_workers; wait; break; }
  done
  trap - INT TERM
  rm -f "$OUT/.next"
  (( failed == 0 )) || exit 1
fi

$PY bench/frontier.py --runs_dir="$OUT" --baseline="$BASELINE" --costs="$COSTS" 9>&- | tee "$OUT/frontier.log"
echo "frontier done in $(( ($(date +%s) - T0) / 60 )) min: $OUT/frontier.md, $OUT/plots/"
