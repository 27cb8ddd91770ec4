#!/usr/bin/env bash
# One stale stage replayed under any list of LOSS presets, in one command: the paper's ablations (Fig. 2 and 3) on the
# CPU lab task (bash ablate.sh), every objective family (VARIANTS=all), or the paper's own stage on the box (LAB=paper
# GPUS=4 TRAIN_RANKS=4 JOBS=1; docs/paper-run.md)
#   1. stage 0: one batch of rollouts from the warm-started lab policy (generate.py); LAB=paper: run_stages.sh's paper
#      preset makes it (its MODEL, TRAIN_DATA, template, lengths and checks; it also trains it once, under mu-grpo)
#   2. replays: every LOSS variant × seed runs UPDATES_PER_STAGE stale updates on those same rollouts
#      (optimize.py), saving the policy every SAVE_EVERY updates
#   3. the small-μ on-policy reference: run_stages.sh in resident mode, ONPOLICY_UPDATES updates per stage
#   4. every saved policy on the lab's test set, by one engine (evaluate.py --policy=a,b,...)
#   5. figures and table (tools/plot.py --ablation_dir): $OUT/plots/fig2_clip.png, fig3_nav_scope.png, table.md
# Rerunning skips the finished parts. Every variable below can also be set from the environment.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# ------------------------------------------------------------------------------ hyperparameters
# ---- the task and where everything goes
LAB=${LAB:-lab}                 # the task: lab (data/lab.py: arithmetic chains that slip) | lab-fork (data/lab_fork.py:
                                # a low-probability fork before a long doomed detour) | paper (run_stages.sh's paper
                                # preset; MODEL, TRAIN_DATA, BENCHMARKS, ... from the environment as there)
STAGE_PRESET=${STAGE_PRESET:-paper}  # LAB=paper: run_stages.sh's PRESET that makes the stage (toy: the same flow on a
                                # CPU, at the box's shape with ENGINES=2 TRAIN_RANKS=2)
BUILD=${BUILD:-0}               # the builder's --seed: which task and warm-started policy (a finding holds only if it
                                # holds on every build tried; frontier.sh's BUILDS name the same builds)
SUFFIX=$( [[ "$BUILD" == 0 ]] || echo "_build$BUILD")
OUT=${OUT:-runs/$LAB-ablation${SUFFIX/_/-}}  # everything goes here
LAB_DIR=${LAB_DIR:-data/${LAB/-/_}$SUFFIX}   # the task's data and policy (built by its builder if missing, with
LAB_ARGS=${LAB_ARGS:-}          # --seed=BUILD and LAB_ARGS)
# ---- the replays: every LOSS preset × seed on the same stale rollouts
VARIANTS=${VARIANTS:-grpo relaxed-no-nav nav-T mu-grpo nav-S nav-seq m2po}   # LOSS presets (loss.py PRESETS; all:
                                # every one of them)
SEEDS=${SEEDS:-0 1 2}           # one replay per seed: the order in which the stage's groups become minibatches
# ---- the stale stage and the updates on it
UPDATES_PER_STAGE=${UPDATES_PER_STAGE:-256}  # μ of the replays: the last update trains on data μ − 1 updates stale
PROMPTS_PER_UPDATE=${PROMPTS_PER_UPDATE:-4}   # prompts per minibatch (× GROUP_SIZE responses)
GROUP_SIZE=${GROUP_SIZE:-8}     # G
LR=${LR:-$([[ $LAB == paper ]] && echo 1e-6 || echo 1e-4)}   # AdamW's (constant); lab: the ratios drift (min ratio → 0)
                                # within 64 updates; paper: optimize.py's
NAV_DELTA=${NAV_DELTA:-}        # NAV's trigger threshold δ for every variant with NAV and reference (empty: 1e-4)
SAVE_EVERY=${SAVE_EVERY:-32}    # updates between saved policies: the points of each accuracy curve
# ---- the on-policy references (run_stages.sh, resident)
ONPOLICY_LOSSES=${ONPOLICY_LOSSES:-grpo}  # the references: each LOSS with a small μ, fresh rollouts per stage
ONPOLICY_UPDATES=${ONPOLICY_UPDATES:-32}  # their μ (0: no reference); UPDATES_PER_STAGE / ONPOLICY_UPDATES stages each
ONPOLICY_SEEDS=${ONPOLICY_SEEDS:-0 1 2}   # their seeds (resident mode: one engine and one trainer process per run)
# ---- evaluation and sampling
EVAL_K=${EVAL_K:-1}             # samples per test problem (temperature 1)
MAX_RESPONSE=${MAX_RESPONSE:-$([[ $LAB == lab-fork ]] && echo 160 || echo 128)}   # tokens (lab: 32–77; lab-fork: up to 82 as built by default, longer with fork=end)
# ---- the box
JOBS=${JOBS:-2}                 # replays run side by side, each on its JOBS-th of the cores (pinned, as many threads)
GPUS=${GPUS:-0}                 # GPUs for the engines (generation, evaluation) and the replays; 0: the CPU
TRAIN_RANKS=${TRAIN_RANKS:-1}   # each replay's ranks (torchrun: one per GPU, gloo ranks on the CPU); the box: JOBS=1 and
                                # TRAIN_RANKS=GPUS
# ------------------------------------------------------------------------------

bash setup.sh >&2
PY=${MU_GRPO_VENV:-.venv}/bin/python     # the run's environment (setup.sh)
[[ "$VARIANTS" != all ]] || VARIANTS=$($PY -m mu_grpo.launch --command=presets)
for v in BUILD UPDATES_PER_STAGE PROMPTS_PER_UPDATE GROUP_SIZE SAVE_EVERY ONPOLICY_UPDATES EVAL_K MAX_RESPONSE JOBS GPUS \
         TRAIN_RANKS; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "$v must be a whole number, got '${!v}'" >&2; exit 2; }
done
for v in UPDATES_PER_STAGE PROMPTS_PER_UPDATE SAVE_EVERY EVAL_K JOBS TRAIN_RANKS; do
  (( ${!v} >= 1 )) || { echo "$v must be at least 1, got '${!v}'" >&2; exit 2; }
done
case "$LAB" in lab) BUILDER=data/lab.py ;; lab-fork) BUILDER=data/lab_fork.py ;; paper) BUILDER= ;;
  *) echo "LAB must be lab, lab-fork or paper, got '$LAB'" >&2; exit 2 ;; esac
for variant in $VARIANTS $ONPOLICY_LOSSES; do LOSS=$variant $PY -m mu_grpo.launch --command=loss_flags > /dev/null || exit 2; done
for seed in $SEEDS $ONPOLICY_SEEDS; do
  [[ "$seed" =~ ^[0-9]+$ ]] || { echo "SEEDS and ONPOLICY_SEEDS must be whole numbers, got '$seed'" >&2; exit 2; }
done
if (( ONPOLICY_UPDATES > 0 && UPDATES_PER_STAGE % ONPOLICY_UPDATES != 0 )); then
  echo "UPDATES_PER_STAGE ($UPDATES_PER_STAGE) must be a multiple of ONPOLICY_UPDATES ($ONPOLICY_UPDATES)" >&2; exit 2
fi
REPORT_TO=${REPORT_TO:-none}    # run_stages.sh's trackers: the replays and the references, one group (this ablation)
[[ "$REPORT_TO" == none ]] || $PY -m mu_grpo.tracking --command=check --report_to="$REPORT_TO" || exit 2
export TRACKER_GROUP=${TRACKER_GROUP:-$(basename "$OUT")}
mkdir -p "$OUT/.done" "$OUT/logs"
exec 9>"$OUT/.lock"
flock -n 9 || { echo "another ablate.sh is running on $OUT (it holds $OUT/.lock)" >&2; exit 1; }
T0=$(date +%s)
echo "ablation $OUT on $LAB$([[ $LAB == paper ]] || echo " (build $BUILD)"): variants [$VARIANTS] × seeds [$SEEDS], μ = $UPDATES_PER_STAGE updates of $PROMPTS_PER_UPDATE prompts" \
     "× G=$GROUP_SIZE at lr $LR, NAV δ = ${NAV_DELTA:-1e-4}, a policy every $SAVE_EVERY updates; on-policy references" \
     "[$ONPOLICY_LOSSES] μ = $ONPOLICY_UPDATES (seeds [$ONPOLICY_SEEDS]); $JOBS replays at a time, each of" \
     "$TRAIN_RANKS rank(s); $GPUS GPU(s)"

# step NAME CMD...: skipped when done; output to $OUT/logs/NAME.log; marked done only when it succeeded
step() {
  local name=$1; shift
  if [[ -f "$OUT/.done/$name" ]]; then return; fi
  echo "[$name] $(( $(date +%s) - T0 )) s"
  "$@" > "$OUT/logs/$name.log" 2>&1 9>&- || { echo "[$name] failed; see $OUT/logs/$name.log:" >&2;
                                               tail -20 "$OUT/logs/$name.log" >&2; return 1; }
  touch "$OUT/.done/$name"
}

# 1. the shared stale rollouts: UPDATES_PER_STAGE minibatches' worth, from the initial policy
if [[ $LAB == paper ]]; then      # the paper run's first stage, no evaluation; then its settings are the replays'
  step rollouts env PRESET="$STAGE_PRESET" RUN="$OUT/source" STAGES=1 UPDATES_PER_STAGE="$UPDATES_PER_STAGE" \
      PROMPTS_PER_UPDATE="$PROMPTS_PER_UPDATE" GROUP_SIZE="$GROUP_SIZE" LOSS=mu-grpo LR="$LR" EVAL_EVERY=0 \
      GPUS="$GPUS" TRAIN_RANKS="$TRAIN_RANKS" bash run_stages.sh
  eval "$(RUN="$OUT/source" $PY -m mu_grpo.launch --command=recorded)"    # MODEL, TRAIN_DATA, ..., TEMPLATE_FLAG
  STAGE_DIR=$OUT/source/stage_0 REPLAY_FLAGS=
  SAMPLING=(--max_prompt_tokens="$MAX_PROMPT" --max_response_tokens="$MAX_RESPONSE" $TEMPLATE_FLAG)
else
  [[ -f "$LAB_DIR/model/config.json" ]] || step lab $PY "$BUILDER" --out_dir="$LAB_DIR" --seed="$BUILD" $LAB_ARGS
  MODEL=$LAB_DIR/model TRAIN_DATA=$LAB_DIR/train.jsonl EVAL_DATA_DIR=$LAB_DIR BENCHMARKS=test
  STAGE_DIR=$OUT/stage_0 REPLAY_FLAGS=--micro_batch_tokens=4096
  SAMPLING=(--max_prompt_tokens=64 --max_response_tokens="$MAX_RESPONSE" --prompt_template="{problem}")
  step rollouts $PY generate.py --policy="$MODEL" --data="$TRAIN_DATA" --run_dir="$OUT" --stage=0 \
      --prompts_per_stage=$((UPDATES_PER_STAGE * PROMPTS_PER_UPDATE)) --group_size="$GROUP_SIZE" --temperature=1.0 \
      --shard_prompts=1024 --gpus="$GPUS" "${SAMPLING[@]}"
fi

# 2. the replays, JOBS at a time, each on its JOBS-th of the cores; a failed one stops the others (mu_grpo/pool.py)
replay() {     # (a preset's KL penalty, offpolicy-grpo's, takes the replayed policy, MODEL, for π_ref)
  local variant=$1 seed=$2 TRAIN=($PY)
  (( TRAIN_RANKS == 1 )) || TRAIN=($PY -m torch.distributed.run --standalone --nproc_per_node="$TRAIN_RANKS")
  "${TRAIN[@]}" optimize.py --stage_dir="$STAGE_DIR" --policy="$MODEL" $REPLAY_FLAGS \
      --out="$OUT/$variant/seed$seed/policy" --seed="$seed" --updates_per_stage="$UPDATES_PER_STAGE" \
      --prompts_per_update="$PROMPTS_PER_UPDATE" --lr="$LR" --save_policy_every="$SAVE_EVERY" \
      --save_train_state=false $(LOSS=$variant $PY -m mu_grpo.launch --command=loss_flags)
  [[ "$REPORT_TO" == none ]] || $PY -m mu_grpo.tracking --command=follow --run_dir="$OUT/$variant/seed$seed" \
      --report_to="$REPORT_TO" --group="$TRACKER_GROUP" --settings="LOSS=$variant"$'\n'"SEED=$seed"
}
export -f replay
export PY OUT MODEL UPDATES_PER_STAGE PROMPTS_PER_UPDATE LR SAVE_EVERY REPORT_TO NAV_DELTA TRAIN_RANKS STAGE_DIR REPLAY_FLAGS
for variant in $VARIANTS; do
  for seed in $SEEDS; do echo "replay_${variant}_seed$seed replay $variant $seed"; done
done | $PY -m mu_grpo.pool --jobs="$JOBS" --logs="$OUT/logs" --done="$OUT/.done" 9>&-

# the policies step 4 evaluates: the initial one, the replays', then (step 3) the reference's stage policies
POLICIES=$MODEL
for variant in $VARIANTS; do
  for seed in $SEEDS; do
    for p in "$OUT/$variant/seed$seed"/policy_u* "$OUT/$variant/seed$seed/policy"; do POLICIES+=",$p"; done
  done
done

# 3. the on-policy reference: fresh rollouts every ONPOLICY_UPDATES updates, the same total updates
if (( ONPOLICY_UPDATES > 0 )); then
  for loss in $ONPOLICY_LOSSES; do
    for seed in $ONPOLICY_SEEDS; do
      step "onpolicy_${loss}_seed$seed" env PRESET="$LAB" MODEL="$MODEL" TRAIN_DATA="$TRAIN_DATA" \
          EVAL_DATA_DIR="$EVAL_DATA_DIR" BENCHMARKS="$BENCHMARKS" LOSS="$loss" RUN="$OUT/onpolicy-$loss/seed$seed" SEED="$seed" LR="$LR" \
          STAGES=$((UPDATES_PER_STAGE / ONPOLICY_UPDATES)) UPDATES_PER_STAGE="$ONPOLICY_UPDATES" PROMPTS_PER_UPDATE="$PROMPTS_PER_UPDATE" \
          GROUP_SIZE="$GROUP_SIZE" MAX_RESPONSE="$MAX_RESPONSE" EVAL_EVERY=0 RESIDENT=true SAVE_EVERY=1 GPUS="$GPUS" \
          TRAIN_RANKS="$TRAIN_RANKS" \
          bash run_stages.sh
      for ((s = 0; s < UPDATES_PER_STAGE / ONPOLICY_UPDATES; s++)); do POLICIES+=",$OUT/onpolicy-$loss/seed$seed/stage_$s/policy"; done
    done
  done
fi

# 4. every policy on the test set, one engine
step evaluate $PY evaluate.py --policy="$POLICIES" --benchmarks="$BENCHMARKS" --data_dir="$EVAL_DATA_DIR" --k="$EVAL_K" \
    --temperature=1.0 --top_p=1.0 --results="$OUT/results.jsonl" --gpus="$GPUS" "${SAMPLING[@]}"

# 5. figures and the table
$PY tools/plot.py --ablation_dir="$OUT" --out_dir="$OUT/plots" 9>&- | tee "$OUT/logs/plot.log"
echo "ablation done in $(( ($(date +%s) - T0) / 60 )) min: $OUT/plots/"
