#!/usr/bin/env bash
# μ-GRPO: a few large stages of generate.py → optimize.py → evaluate.py, each its own process.
# Rerunning continues from the first unfinished phase; a finished run does nothing.
# Every variable below can also be set from the environment: STAGES=2 LOSS=grpo bash run_stages.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
set -a     # every knob below is exported: mu_grpo/launch.py checks them all against one table before any phase runs

# ------------------------------------------------------------------------------ hyperparameters
# ---- the run
PRESET=${PRESET:-auto}          # auto (paper on a GPU box, toy otherwise) | paper | toy | lab | lab-fork (ablate.sh's tasks)
LOSS=${LOSS:-mu-grpo}           # mu-grpo | grpo | dapo | m2po | relaxed-no-nav | relaxed-low | relaxed-high | nav-none
                                # | nav-T | nav-S | nav-seq | offpolicy-grpo (clip [0.8, 1.2] + β·KL to the initial
                                # policy): losses.sh
RUN=${RUN:-}                    # run directory (default runs/<preset>-<loss>)
SEED=${SEED:-0}                 # seeds the prompt order, the sampling and the minibatch order
KL_COEF=${KL_COEF:-}            # β of the KL penalty to the initial policy (default: 0; offpolicy-grpo 0.04)
REPORT_TO=${REPORT_TO:-none}    # none | tensorboard | wandb | a comma list: live metrics (mu_grpo/tracking.py; WANDB_MODE)
TRACKER_GROUP=${TRACKER_GROUP:-}  # the tracker group of this run (frontier.sh and ablate.sh set one per frontier)
# ---- where a stage ends, and the optimizer across stages (its knobs empty: optimize.py's block, their home, decides)
STAGE_END=${STAGE_END:-fixed}   # fixed: STAGES stages of UPDATES_PER_STAGE updates | drift: a stage ends once the policy
                                # has drifted from its rollouts (optimize.py's warning on E[ρ | A<0]), the next one's μ
                                # planned from where it ended (records.StagePlan), until TOTAL_UPDATES
TOTAL_UPDATES=${TOTAL_UPDATES:-}  # drift: the run's updates (default STAGES × UPDATES_PER_STAGE)
DRIFT_GROWTH=${DRIFT_GROWTH:-1.25}  # drift: after a warning at update u the next stage plans ceil(growth · u) updates
DRIFT_MAX_UPDATES=${DRIFT_MAX_UPDATES:-}  # drift: the largest μ a stage is planned with (default 4 × UPDATES_PER_STAGE)
DRIFT_ARGS=${DRIFT_ARGS:-}      # drift: optimize.py's warning, e.g. "--drift_window=16 --drift_min_updates=16"
OPTIMIZER_BOUNDARY=${OPTIMIZER_BOUNDARY:-}  # carry | reset: AdamW's moments at each stage's start (optimizer_boundary)
ADAM_BETAS=${ADAM_BETAS:-}      # AdamW's β1,β2, e.g. 0.9,0.95 (adam_betas)
STAGE_WARMUP=${STAGE_WARMUP:-}  # lr warmup over each stage's first N updates (stage_warmup_updates)
# ---- evaluation and what is kept
EVAL_EVERY=${EVAL_EVERY:-1}     # evaluate after every N-th stage (and always after the last); 0: never
EVAL_CACHE=${EVAL_CACHE:-}      # a directory of kept evaluations: the initial policy's is taken from it when it holds
                                # that policy under this protocol, else made and kept there (runs from one MODEL, as
                                # frontier.sh's, evaluate it once; evaluate.py --cache)
SAVE_EVERY=${SAVE_EVERY:-}      # resident: policy, train state saved every N stages and at the end (default EVAL_EVERY)
KEEP_TRAIN_STATES=${KEEP_TRAIN_STATES:-false}  # true: keep every stage's train_state/ (else only the last)
SAVE_POLICY_EVERY=${SAVE_POLICY_EVERY:-}  # a policy every N updates within a stage too (stage_<s>/policy_u<N>)
# ---- the box
RESIDENT=${RESIDENT:-false}     # true: two long-lived processes (the engines, the trainer) run every stage (mu_grpo/handoff.py):
                                # no process start, model load and engine start per stage, for small μ
HANDOFF=${HANDOFF:-transfer}    # resident: transfer (vLLM's weight-transfer API: CUDA IPC on GPUs, shared memory on a CPU;
                                # mu_grpo/transfer.py) | files (each policy written and read back as files, for a box without IPC)
RESIDENT_GPU_MEMORY=${RESIDENT_GPU_MEMORY:-auto}  # resident, GPU: each engine's share; auto: all the trainer leaves,
                                # less 0.05 (0.78 for 7B on 4×H200, an estimate: mu_grpo/handoff.py check_engine_share)
PER_REQUEST_SEED=${PER_REQUEST_SEED:-true}  # true: each prompt samples from its own seed (the same response whichever
                                # engine, shard or resumed attempt makes it); false: the engines' seed alone
PREFLIGHT=${PREFLIGHT:-auto}    # mu_grpo/preflight.py first, at the run's settings (cached once passed): auto (the paper
                                # preset only) | 1 (any preset) | 0 (never) | force (and start after a FAIL)
PREFLIGHT_ARGS=${PREFLIGHT_ARGS:-}  # more mu_grpo/preflight.py flags, e.g. its miniature's size: "--prompts=8 --updates=2"
PREFLIGHT_ONLY=${PREFLIGHT_ONLY:-false}  # true: stop after the preflight (its throughputs: frontier.sh's estimate) and,
                                # with EVAL_CACHE, the initial policy's evaluation kept there (table1.sh's per model)
# ---- several nodes (README, Several nodes): the same command on each, RUN, MODEL and data on a shared filesystem
NNODES=${NNODES:-1}             # nodes running this script together; node 0 keeps the run-level files (mu_grpo/nodes.py)
NODE_RANK=${NODE_RANK:-0}       # this node: 0..NNODES-1
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}  # node 0's address as the other nodes reach it
MASTER_PORT=${MASTER_PORT:-29500}  # node 0's ports: this one for the nodes' store, the next for torchrun's rendezvous
JOIN_TIMEOUT=${JOIN_TIMEOUT:-600}  # seconds the nodes wait for each other to start
DEAD_AFTER=${DEAD_AFTER:-10}    # seconds without a node's heartbeat before the others stop (naming it)
COLLECTIVE_TIMEOUT=${COLLECTIVE_TIMEOUT:-60}  # seconds the trainers' ranks have to reach each other after the join
HSDP=${HSDP:-false}             # true: shard the trainer within each node, replicate across nodes (16 bytes/parameter)
# ---- set per preset (presets.sh), unless given in the environment
#   MODEL, TRAIN_DATA, BENCHMARKS  initial policy (HF name or directory), training problems (JSONL), evaluated sets
#   STAGES, UPDATES_PER_STAGE  generate → optimize stages, μ (optimizer updates per stage)
#   PROMPTS_PER_UPDATE, GROUP_SIZE, LR, WARMUP  prompts per minibatch × G responses; AdamW's lr, warmup over the run
#   MAX_PROMPT, MAX_RESPONSE, TEMPERATURE; EVAL_K, EVAL_TEMPERATURE, EVAL_TOP_P  lengths, sampling; the avg@k protocol
#   GPUS; ENGINES, TRAIN_RANKS  GPUs of every phase (0: CPU); vLLM engines, torchrun ranks (one per GPU, 1 on a CPU;
#                       ENGINES=2 TRAIN_RANKS=2 on a CPU runs the 4×H200 box's control flow, as the tests do)
#   NAV_DELTA           NAV's trigger threshold δ of the LOSS presets with NAV (losses.sh)
# ------------------------------------------------------------------------------

# torchrun's variables are for optimize.py's ranks, which torchrun sets itself: the engines must not see them (vLLM
# reads LOCAL_RANK, mu_grpo/engine.py TORCHRUN_VARIABLES); torchrun reads its flags from PET_<FLAG> too (a cluster's would win)
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE
for v in "${!PET_@}"; do unset "$v"; done
bash setup.sh >&2
PY=${MU_GRPO_VENV:-.venv}/bin/python     # the run's environment (setup.sh); tests point MU_GRPO_VENV at theirs
out=$($PY -m mu_grpo.launch --command=preset) || exit 2; eval "$out"     # PRESET=auto: paper with GPUs, else toy
source presets.sh                # the preset's defaults for the knobs above that it sets
source losses.sh                 # the paper's method and the baselines it is compared with, as optimize.py flags
loss_args "$LOSS" || exit 2
# every knob checked before any phase runs (a typo fails here, not after the first evaluation), defaults resolved
out=$($PY -m mu_grpo.launch --command=settings) || exit 2; eval "$out"
set +a
export -n MASTER_ADDR MASTER_PORT    # this script's own: torchrun sets its ranks' from its flags
TEMPLATE_ARG=($TEMPLATE_FLAG)    # the prompt's text: the problem alone for TEMPLATE plain and chat-system (mu_grpo/model_cards.py)
[[ -e "$RUN" ]] && NEW_RUN=false || NEW_RUN=true     # a new run refused before its first phase leaves nothing
mkdir -p "$LOGS" "$RUN/.done"
exec 9>"$LOCK"; $PY -m mu_grpo.launch --command=lock || exit 1  # one run_stages.sh per RUN (and node), held on fd 9 till it ends
# several nodes: each node's watch (node 0's serves the store) beats every second and stops this script within seconds
# once another node fails or stops answering (mu_grpo/nodes.py); a successful end tells it so (SIGUSR1)
NODE_ARGS=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --coordinator="$MASTER_ADDR:$MASTER_PORT")
WATCH= TRACKING=
if (( NNODES > 1 )); then
  $PY -m mu_grpo.nodes --command=watch "${NODE_ARGS[@]}" --pid=$$ --join_timeout_s="$JOIN_TIMEOUT" --dead_after_s="$DEAD_AFTER" \
      --errors="$LOGS/stderr.log" 9>&- &
  WATCH=$!
  # this script's stderr copied: its last line is what the other nodes are told when this one fails
  : > "$LOGS/stderr.log"
  exec 2> >(exec tee -i -a "$LOGS/stderr.log" >&2 9>&-)
fi
on_exit() {    # the trackers' last pass over the records; several nodes: a successful end tells this node's watch
  local st=$?
  if [[ -n "$TRACKING" ]]; then touch "$LOGS/tracking.stop.$$"; wait "$TRACKING" \
    || echo "[tracking] ended with an error: see $LOGS/tracking.log (the records are complete; a rerun logs them)" >&2
    rm -f "$LOGS/tracking.stop.$$"; fi
  if (( st == 0 )) && [[ -n "$WATCH" ]]; then kill -USR1 "$WATCH"; wait "$WATCH" || st=$?; fi
  $PY -m mu_grpo.launch --command=end --status="$st" --new_run="$NEW_RUN" 9>&- || true   # however it ends (mu_grpo/launch.py end)
  exit $st
}
trap on_exit EXIT
trap 'exit 130' INT              # a Ctrl-C: on_exit's line, not bash's death by the signal
# share KEY VALUE: node 0's VALUE on every node (its decision from files another node's NFS cache may not show yet)
share() {
  if (( NNODES == 1 )); then echo "$2"; return; fi
  kill -0 "$WATCH" 2>/dev/null || { echo "[node $NODE_RANK] this node's watch process has ended: stopping" >&2; exit 1; }
  $PY -m mu_grpo.nodes --command=share "${NODE_ARGS[@]}" --key="$1" --value="$2" 9>&-
}
echo "run $RUN: $PRESET preset, loss $LOSS; $( [[ $STAGE_END == drift ]] \
  && echo "stages that end on drift, the first of $UPDATES_PER_STAGE updates, until $TOTAL_UPDATES updates" \
  || echo "$STAGES stages × $UPDATES_PER_STAGE updates") of $PROMPTS_PER_UPDATE prompts × G=$GROUP_SIZE; model $MODEL; GPUs $GPUS"

# before any compute (mu_grpo/launch.py start): node 0 builds the toy and lab tasks, fetches data, the others wait for it; MODEL
# a local directory; several nodes: all here with the same settings, model and data, then the trainers' network; START
{ out=$($PY -m mu_grpo.launch --command=start --logs="$LOGS" --coordinator="$MASTER_ADDR:$MASTER_PORT" 3>&1 >&4 9>&-) \
  || exit $?; } 4>&1; eval "$out"       # (its assignments on descriptor 3, its output on this script's stdout)
# the trackers' follower: node 0 alone (its records are the run's), in a session of its own, so that a kill of this
# script's process group leaves it its last pass and the trackers' close (mu_grpo/tracking.py)
if [[ "$REPORT_TO" != none ]] && (( NODE_RANK == 0 )); then
  setsid $PY -m mu_grpo.tracking --command=follow --run_dir="$RUN" --report_to="$REPORT_TO" --pid=$$ --group="$TRACKER_GROUP" \
      --stop_file="$LOGS/tracking.stop.$$" --settings="$SETTINGS" >> "$LOGS/tracking.log" 2>&1 9>&- &
  TRACKING=$!
  echo "[tracking] $REPORT_TO: every update, stage and evaluation as it is recorded ($LOGS/tracking.log)"
fi

# phase NAME STAGE CMD...: skipped when done; its whole output in $LOGS/NAME.log, on the terminal without the libraries'
# chatter; timed into timeline.jsonl; marked done only once it succeeded. Several nodes: node 0 decides and records
phase() {
  local name=$1 stage=$2; shift 2
  local done t0 t1
  done=$(share "done/$name" "$([[ -f "$RUN/.done/$name" ]] && echo 1 || echo 0)")
  if [[ "$done" == 1 ]]; then echo "[$name] done already"; return; fi
  echo "[$name] $*"
  t0=$(date +%s.%N)
  if ! { "$@" 2>&1 | tee "$LOGS/$name.log" | $PY -u -m mu_grpo.launch --command=view; } 9>&-; then
    echo "[$name] failed; its whole output is in $LOGS/$name.log" >&2   # the lock stays with this script, not its children
    exit 1
  fi
  t1=$(date +%s.%N)
  (( NODE_RANK == 0 )) || return 0
  $PY -m mu_grpo.launch --command=row --name="$name" --stage="$stage" --start="$t0" --end="$t1"
  touch "$RUN/.done/$name"
}
if [[ $(share done/all "$([[ -f "$RUN/.done/all" ]] && echo 1 || echo 0)") == 1 ]]; then
  echo "run $RUN is complete; nothing to do (delete $RUN/.done/all to re-summarize, or the run directory to start over)"
  exit 0
fi

KL_ARGS=(--kl_coef="$KL_COEF")   # π_ref: the run's initial policy
[[ $(awk "BEGIN {print ($KL_COEF > 0)}") == 1 ]] && KL_ARGS+=(--ref_policy="$MODEL")
# minutes of checks before days of run, at the run's settings, before anything else; several nodes: node 0's
[[ "$PREFLIGHT" == 0 ]] || (( NODE_RANK > 0 )) || KL="${KL_ARGS[*]}" $PY -m mu_grpo.launch --command=preflight 9>&-

[[ "$RESIDENT" != true ]] || HANDOFF=$($PY -m mu_grpo.launch --command=handoff)   # files if the preflight found IPC failing
# this attempt's start, a zero-length row: the time from the last record before it is not the run's (records.pauses)
(( NODE_RANK > 0 )) || $PY -m mu_grpo.launch --command=attempt
EVAL_ARGS=(--benchmarks="$BENCHMARKS" --data_dir="$EVAL_DATA_DIR" --k="$EVAL_K" --temperature="$EVAL_TEMPERATURE"
           --top_p="$EVAL_TOP_P" --max_prompt_tokens="$MAX_PROMPT" --max_response_tokens="$MAX_RESPONSE"
           --results="$RUN/results.jsonl" --run_start="$START" --gpus="$GPUS" --engines="$ENGINES" "${TEMPLATE_ARG[@]}"
           "${NODE_ARGS[@]}")
GENERATE_ARGS=(--data="$TRAIN_DATA" --run_dir="$RUN" --group_size=$GROUP_SIZE --temperature=$TEMPERATURE
               --max_prompt_tokens=$MAX_PROMPT --max_response_tokens=$MAX_RESPONSE --shard_prompts=$SHARD_PROMPTS
               --gpus="$GPUS" --engines="$ENGINES" --seed="$SEED" --per_request_seed="$PER_REQUEST_SEED"
               "${TEMPLATE_ARG[@]}" "${NODE_ARGS[@]}"     # and the evaluations due before the stage, by its engines:
               --eval_every="$EVAL_EVERY" --eval_benchmarks="$BENCHMARKS" --eval_data_dir="$EVAL_DATA_DIR"
               --eval_k="$EVAL_K" --eval_temperature="$EVAL_TEMPERATURE" --eval_top_p="$EVAL_TOP_P"
               --results="$RUN/results.jsonl" --run_start="$START")
OPTIMIZE_ARGS=(--prompts_per_update=$PROMPTS_PER_UPDATE --lr=$LR   # and each stage its μ, --updates_per_stage
               --micro_batch_tokens=$MICRO_BATCH_TOKENS --gradient_checkpointing=$GRAD_CKPT --warmup_updates=$WARMUP
               --seed="$SEED" --checkpoint_every=$(( UPDATES_PER_STAGE >= 64 ? 64 : 0 )) $LOSS_ARGS "${KL_ARGS[@]}"
               --release_init_state=$([[ "$KEEP_TRAIN_STATES" == true ]] && echo false || echo true)
               --stage_end="$STAGE_END" --hsdp="$HSDP" $DRIFT_ARGS)
for flag in optimizer_boundary="$OPTIMIZER_BOUNDARY" adam_betas="$ADAM_BETAS" save_policy_every="$SAVE_POLICY_EVERY" \
            stage_warmup_updates="$STAGE_WARMUP"; do [[ -z "${flag#*=}" ]] || OPTIMIZE_ARGS+=(--"$flag"); done
if (( NNODES > 1 )); then     # every node's ranks in one torchrun world: rank 0 on node 0 (static rendezvous)
  TRAIN=($PY -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$TRAIN_RANKS"
         --master_addr="$MASTER_ADDR" --master_port=$((MASTER_PORT + 1)) --rdzv_conf=timeout="$JOIN_TIMEOUT")
elif (( TRAIN_RANKS > 1 )); then TRAIN=($PY -m torch.distributed.run --standalone --nproc_per_node="$TRAIN_RANKS")
else TRAIN=($PY); fi

# the engines evaluate each policy before the stage it generates, the initial one too, unless a kept evaluation may
# spare it (evaluate.py --cache)
[[ -z "$EVAL_CACHE" ]] || (( EVAL_EVERY == 0 )) || phase eval_init -1 $PY evaluate.py --policy="$MODEL" --stage=-1 \
    "${EVAL_ARGS[@]}" --cache="$EVAL_CACHE"
if [[ "$PREFLIGHT_ONLY" == true ]]; then (( NODE_RANK > 0 )) || echo "the preflight and the initial evaluation only"; exit 0; fi
if [[ "$RESIDENT" == true ]]; then   # two processes for every stage (a failed one stops the other); a rerun resumes:
                                     # the engine at the first stage without rollouts, the trainer at its last state
  $PY -m mu_grpo.launch --command=resident --logs="$RUN/logs" \
      $PY generate.py --resident=true --stage=0 --policy="$MODEL" "${GENERATE_ARGS[@]}" \
      --prompts_per_stage="$PROMPTS_PER_STAGE" --gpu_memory_utilization="$RESIDENT_GPU_MEMORY" \
      --policy_handoff="$HANDOFF" :: "${TRAIN[@]}" optimize.py --resident=true --run_dir="$RUN" \
      --stages="$STAGES" --policy_handoff="$HANDOFF" --engines="$ENGINES" \
      --policy="$MODEL" "${OPTIMIZE_ARGS[@]}" --updates_per_stage="$UPDATES_PER_STAGE" --save_every="$SAVE_EVERY" \
      --total_updates="$TOTAL_UPDATES" --drift_growth="$DRIFT_GROWTH" --drift_max_updates="$DRIFT_MAX_UPDATES" 9>&- || exit 1
else
  # stage s has μ = mu_grpo/launch.py plan's updates_per_stage (records.StagePlan), until 0; several nodes: node 0's plan
  s=0 POLICY=$MODEL STATE_ARGS=()      # stage s > 0 continues stage s-1's fp32 weights, AdamW moments, update count
  plan=($($PY -m mu_grpo.launch --command=plan --stage=0))     # this stage's μ and its prompts, μ × PROMPTS_PER_UPDATE
  while (( plan[0] > 0 )); do
    STAGE_DIR=$RUN/stage_$s
    (( NODE_RANK > 0 )) || $PY -m mu_grpo.tracking --command=where --run_dir="$RUN" --total_updates="$RUN_UPDATES" --stage=$s
    phase "generate_$s" $s $PY generate.py --policy="$POLICY" --stage=$s "${GENERATE_ARGS[@]}" \
        --prompts_per_stage="${plan[1]}"
    phase "optimize_$s" $s "${TRAIN[@]}" optimize.py --stage_dir="$STAGE_DIR" --policy="$POLICY" \
        "${OPTIMIZE_ARGS[@]}" --updates_per_stage="${plan[0]}" "${STATE_ARGS[@]}"
    POLICY=$STAGE_DIR/policy STATE_ARGS=(--init_state="$STAGE_DIR/train_state")
    if (( s > 0 && NODE_RANK == 0 )) && [[ "$KEEP_TRAIN_STATES" != true ]]; then  # fp32 weights + AdamW: ~12 bytes
      rm -rf "$RUN/stage_$((s - 1))/train_state"                  # per parameter; stage s carries it on
    fi
    NEXT=$( (( NODE_RANK > 0 )) || $PY -m mu_grpo.launch --command=plan --stage=$((s + 1)) )   # a failure stops the run here
    next=($(share "planned/$((s + 1))" "$NEXT"))
    if (( EVAL_EVERY > 0 && next[0] == 0 )); then    # the last policy (the others: the next stage's engines)
      phase "eval_$s" $s $PY evaluate.py --policy="$POLICY" --stage=$s "${EVAL_ARGS[@]}"
    fi
    s=$((s + 1)) plan=("${next[@]}")
  done
fi
if (( NODE_RANK > 0 )); then echo "node $NODE_RANK: run $RUN done (node 0 summarizes it)"; exit 0; fi
$PY tools/plot.py --run_dir="$RUN" --summary=true | tee "$RUN/logs/summary.log"
touch "$RUN/.done/all"
