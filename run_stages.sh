#!/usr/bin/env bash
# μ-GRPO: a few large stages of generate.py → optimize.py → evaluate.py, each its own process.
# Rerunning continues from the first unfinished phase; a finished run does nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# (an argument would be ignored)
(( $# == 0 )) || { echo "run_stages.sh takes no arguments, got '$*': knobs are environment" \
                         "variables (LR=1e-3 bash run_stages.sh)" >&2; exit 2; }
# every knob below is exported: mu_grpo/launch.py checks them all against one table before any phase
# runs
set -a

GIVEN=" $(compgen -e | tr '\n' ' ') "   # the knobs the environment gives: they win over every
                                        # default here and in presets
# ------------------------------------------------------------------------------ hyperparameters
# Homes: this block for the loop's knobs (the paper preset's values), the phase scripts' blocks for
# theirs (empty here: the block decides); presets.sh: what a PRESET changes; loss.py PRESETS: a
# LOSS; the environment wins (STAGES=2 ...)
# ---- the run
PRESET=${PRESET:-auto}          # auto (paper on a GPU box, toy otherwise) | paper | toy | lab |
                                # lab-fork (ablate.sh's tasks)
LOSS=${LOSS:-mu-grpo}           # a row of loss.py's PRESETS: the objective and its settings (the
                                # README's LOSS table)
LOSS_ARGS=${LOSS_ARGS:-}        # optimize.py flags over the row's, e.g. "--clip_high=1.2" or
                                # "--objective_args=eps_max=4"
NAV_DELTA=${NAV_DELTA:-}        # NAV's δ for a LOSS with NAV (empty: its row's, 1e-4; a LOSS
                                # without NAV ignores it)
RUN=${RUN:-}                    # run directory (default runs/<preset>-<loss>)
SEED=${SEED:-0}                 # seeds the prompt order, the sampling and the minibatch order
REPORT_TO=${REPORT_TO:-none}    # none | tensorboard | wandb | a comma list: live metrics
                                # (mu_grpo/tracking.py; WANDB_MODE)
TRACKER_GROUP=${TRACKER_GROUP:-}  # the tracker group of this run (frontier.sh and ablate.sh set one
                                  # per frontier)
# ---- the stages (MODEL one of the paper's five: its own TEMPLATE and lengths,
# mu_grpo/model_cards.py)
MODEL=${MODEL:-Qwen/Qwen2.5-Math-7B}  # initial policy (HF name or directory)
TRAIN_DATA=${TRAIN_DATA:-data/deepscaler.jsonl}  # training problems (JSONL: id, problem, answer;
                                                 # data/prepare.py)
EVAL_DATA_DIR=${EVAL_DATA_DIR:-data/benchmarks}  # <benchmark>.jsonl files
BENCHMARKS=${BENCHMARKS:-amc23,amc24,aime24,aime25,math500}  # the evaluated sets
TEMPLATE=${TEMPLATE:-default}   # default | chat | chat-system | plain: how a problem becomes a
                                # prompt (mu_grpo/model_cards.py)
STAGES=${STAGES:-4}             # generate → optimize stages
UPDATES_PER_STAGE=${UPDATES_PER_STAGE:-1024}  # μ: optimizer updates per stage, each on its own
                                              # minibatch
PROMPTS_PER_UPDATE=${PROMPTS_PER_UPDATE:-64}  # prompts per minibatch
GROUP_SIZE=${GROUP_SIZE:-8}     # G responses per prompt
MAX_PROMPT=${MAX_PROMPT:-1536}  # tokens (longer prompts are skipped and counted)
MAX_RESPONSE=${MAX_RESPONSE:-2560}  # tokens
STAGE_END=${STAGE_END:-fixed}   # fixed: STAGES stages of UPDATES_PER_STAGE | drift: each ends on
                                # optimize.py's drift warning, the next one's μ planned from there
                                # (stage_rules.StagePlan), until TOTAL_UPDATES
TOTAL_UPDATES=${TOTAL_UPDATES:-}  # drift: the run's updates (default STAGES × UPDATES_PER_STAGE)
DRIFT_GROWTH=${DRIFT_GROWTH:-1.25}  # drift: after a warning at update u the next stage plans
                                    # ceil(growth · u) updates
DRIFT_MAX_UPDATES=${DRIFT_MAX_UPDATES:-}  # drift: the largest μ a stage is planned with (default 4
                                          # × UPDATES_PER_STAGE)
DRIFT_ARGS=${DRIFT_ARGS:-}      # drift: optimize.py's warning, e.g. "--drift_window=16
                                # --drift_min_updates=16"
# ---- the phase scripts' knobs (LR=3e-5 bash run_stages.sh, LR optimize.py's lr; the README's table
# names each one's flag): their homes are those scripts' blocks; given here or by a preset, each is
# passed as its flag (launch.py KNOBS)
# ---- evaluation and what is kept
EVAL_EVERY=${EVAL_EVERY:-1}     # evaluate after every N-th stage (and always after the last); 0:
                                # never
EVAL_CACHE=${EVAL_CACHE:-}      # kept evaluations: the initial policy's taken from there under this
                                # protocol, else made and kept (runs from one MODEL, as
                                # frontier.sh's, evaluate it once; evaluate.py --cache)
SAVE_EVERY=${SAVE_EVERY:-}      # resident: policy, train state saved every N stages and at the end
                                # (default EVAL_EVERY)
KEEP_TRAIN_STATES=${KEEP_TRAIN_STATES:-false}  # true: keep every stage's train_state/ (else only
                                               # the last)
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-64}  # a resumable train state every N updates within a stage
                                          # (0: none)
# ---- the box
GPUS=${GPUS:-}                  # GPUs of every phase (empty: every GPU torch sees; 0: the CPU)
ENGINES=${ENGINES:-}            # vLLM engines, one process each (default: one per GPU, 1 on a CPU)
TRAIN_RANKS=${TRAIN_RANKS:-}    # torchrun ranks (one per GPU; ENGINES=2 TRAIN_RANKS=2 on a CPU: the
                                # 4×H200 box's shape)
RESIDENT=${RESIDENT:-false}     # true: two long-lived processes run every stage (small μ: no
                                # starts; mu_grpo/handoff.py)
HANDOFF=${HANDOFF:-transfer}    # resident: transfer (vLLM's weight-transfer API: CUDA IPC on GPUs,
                                # shared memory on a CPU) | files (each policy written and read back
                                # as files, for a box without IPC)
RESIDENT_GPU_MEMORY=${RESIDENT_GPU_MEMORY:-auto}  # resident, GPU: each engine's share (auto: what
                                                  # the trainer leaves)
PREFLIGHT=${PREFLIGHT:-auto}    # mu_grpo/preflight.py first (a pass cached): auto (paper) | 1 | 0 |
                                # force (on after a FAIL)
PREFLIGHT_ARGS=${PREFLIGHT_ARGS:-}  # more preflight flags, e.g. its miniature's size: "--prompts=8
                                    # --updates=2"
PREFLIGHT_REPORT=${PREFLIGHT_REPORT:-}  # the preflight whose hand-off decision (files where the
                                # transfer failed) a resident run follows (default
                                # RUN/preflight.json; table1.sh: its model's preparation's)
PREFLIGHT_ONLY=${PREFLIGHT_ONLY:-false}  # true: stop after the preflight (its throughputs:
                                # frontier.sh's estimate) and, with EVAL_CACHE, the initial policy's
                                # evaluation kept there (table1.sh's per model)
# ---- several nodes (README, Several nodes): the same command on each, RUN, MODEL and data on a
# shared filesystem
NNODES=${NNODES:-1}             # nodes running this script together; node 0 keeps the run-level
                                # files (mu_grpo/nodes.py)
NODE_RANK=${NODE_RANK:-0}       # this node: 0..NNODES-1
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}  # node 0's address as the other nodes reach it
MASTER_PORT=${MASTER_PORT:-29500}  # node 0's ports: this one for the nodes' store, the next for
                                   # torchrun's rendezvous
JOIN_TIMEOUT=${JOIN_TIMEOUT:-600}  # seconds the nodes wait for each other to start
DEAD_AFTER=${DEAD_AFTER:-10}    # seconds without a node's heartbeat before the others stop (naming
                                # it)
COLLECTIVE_TIMEOUT=${COLLECTIVE_TIMEOUT:-60}  # seconds the trainers' ranks have to reach each other
                                              # after the join
HSDP=${HSDP:-false}             # true: shard the trainer within each node, replicate across nodes
                                # (16 bytes/parameter)
# ------------------------------------------------------------------------------

# torchrun's variables are for optimize.py's ranks, which torchrun sets itself: the engines must not
# see them (vLLM reads LOCAL_RANK, mu_grpo/engine.py TORCHRUN_VARIABLES); torchrun reads its flags
# from PET_<FLAG> too (a cluster's would win)
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK \
      ROLE_WORLD_SIZE
for v in "${!PET_@}"; do unset "$v"; done
bash setup.sh >&2
PY=${MU_GRPO_VENV:-.venv}/bin/python     # the run's environment (setup.sh); tests point
                                         # MU_GRPO_VENV at theirs
# PRESET=auto: paper with GPUs, else toy
out=$($PY -m mu_grpo.launch --command=preset) || exit 2; eval "$out"
source presets.sh                # what the preset changes, unless given
# every knob checked before any phase runs (a typo fails here, not after the first evaluation),
# defaults resolved, the
out=$($PY -m mu_grpo.launch --command=settings) || exit 2; eval "$out"     # run's line said
set +a
export -n MASTER_ADDR MASTER_PORT    # this script's own: torchrun sets its ranks' from its flags
TEMPLATE_ARG=($TEMPLATE_FLAG)    # the prompt's text: the problem alone for TEMPLATE plain and
                                 # chat-system (mu_grpo/model_cards.py)
# a new run refused before its first phase leaves nothing
[[ -e "$RUN" ]] && NEW_RUN=false || NEW_RUN=true
mkdir -p "$LOGS" "$RUN/.done"
# one run_stages.sh per RUN (and node), held on fd 9 till it ends
exec 9>"$LOCK"; $PY -m mu_grpo.launch --command=lock || exit 1
# several nodes: each node's watch (node 0's serves the store) beats every second and stops this
# script within seconds once another node fails or stops answering (mu_grpo/nodes.py); a successful
# end tells it so (SIGUSR1)
NODE_ARGS=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --store="$MASTER_ADDR:$MASTER_PORT")
WATCH= TRACKING=
if (( NNODES > 1 )); then
  $PY -m mu_grpo.nodes --command=watch "${NODE_ARGS[@]}" --pid=$$ --join_timeout_s="$JOIN_TIMEOUT" \
      --dead_after_s="$DEAD_AFTER" --errors="$LOGS/stderr.log" 9>&- &
  WATCH=$!
  # this script's stderr copied: its last line is what the other nodes are told when this one fails
  : > "$LOGS/stderr.log"
  exec 2> >(exec tee -i -a "$LOGS/stderr.log" >&2 9>&-)
fi
# the trackers' last pass over the records; several nodes: a successful end tells this node's watch
on_exit() {
  local st=$?
  if [[ -n "$TRACKING" ]]; then touch "$LOGS/tracking.stop.$$"; wait "$TRACKING" \
    || echo "[tracking] ended with an error: see $LOGS/tracking.log (the records are complete;" \
            "a rerun logs them)" >&2
    rm -f "$LOGS/tracking.stop.$$"; fi
  if (( st == 0 )) && [[ -n "$WATCH" ]]; then kill -USR1 "$WATCH"; wait "$WATCH" || st=$?; fi
  # however it ends (mu_grpo/launch.py end)
  $PY -m mu_grpo.launch --command=end --status="$st" --new_run="$NEW_RUN" 9>&- || true
  exit $st
}
trap on_exit EXIT
trap 'exit 130' INT              # a Ctrl-C: on_exit's line, not bash's death by the signal
# share KEY VALUE: node 0's VALUE on every node (its decision from files another node's NFS cache
# may not show yet)
share() {
  if (( NNODES == 1 )); then echo "$2"; return; fi
  kill -0 "$WATCH" 2>/dev/null \
    || { echo "[node $NODE_RANK] this node's watch process has ended: stopping" >&2; exit 1; }
  $PY -m mu_grpo.nodes --command=share "${NODE_ARGS[@]}" --key="$1" --value="$2" 9>&-
}

# before any compute (mu_grpo/launch.py start): node 0 builds the toy and lab tasks, fetches data,
# the others wait for it; MODEL a local directory; several nodes: all here with the same settings,
# model and data, then the trainers' network; START (its assignments on descriptor 3, its output on
# this script's stdout)
{ out=$($PY -m mu_grpo.launch --command=start --logs="$LOGS" --store="$MASTER_ADDR:$MASTER_PORT" \
    3>&1 >&4 9>&-) || exit $?; } 4>&1; eval "$out"
# the trackers' follower: node 0 alone (its records are the run's), in a session of its own, so that
# a kill of this script's process group leaves it its last pass and the trackers' close
# (mu_grpo/tracking.py)
if [[ "$REPORT_TO" != none ]] && (( NODE_RANK == 0 )); then
  setsid $PY -m mu_grpo.tracking --command=follow --run_dir="$RUN" --report_to="$REPORT_TO" \
      --pid=$$ --group="$TRACKER_GROUP" --stop_file="$LOGS/tracking.stop.$$" \
      --settings="$SETTINGS" >> "$LOGS/tracking.log" 2>&1 9>&- &
  TRACKING=$!
  echo "[tracking] $REPORT_TO: every update, stage and evaluation as it is recorded" \
       "($LOGS/tracking.log)"
fi

# phase NAME STAGE CMD...: skipped when the run's records say it is finished (mu_grpo/records.py
# phase_finished, the rule of both modes); its whole output in $LOGS/NAME.log, on the terminal
# without the libraries' chatter; timed into timeline.jsonl. Several nodes: node 0 decides and
# records
phase() {
  local name=$1 stage=$2; shift 2
  local done=0 t0 t1
  (( NODE_RANK > 0 )) || done=$($PY -m mu_grpo.launch --command=finished --name="$name") || exit 1
  done=$(share "done/$name" "$done")
  if [[ "$done" == 1 ]]; then echo "[$name] done already"; return; fi
  echo "[$name] $*"
  t0=$(date +%s.%N)
  if ! { "$@" 2>&1 | tee "$LOGS/$name.log" | $PY -u -m mu_grpo.launch --command=view; } 9>&-; then
    # the lock stays with this script, not its children
    echo "[$name] failed; its whole output is in $LOGS/$name.log" >&2
    exit 1
  fi
  t1=$(date +%s.%N)
  (( NODE_RANK == 0 )) || return 0
  $PY -m mu_grpo.launch --command=row --name="$name" --stage="$stage" --start="$t0" --end="$t1"
}
if [[ $(share done/all "$([[ -f "$RUN/.done/all" ]] && echo 1 || echo 0)") == 1 ]]; then
  echo "run $RUN is complete; nothing to do (delete $RUN/.done/all to re-summarize, or the run" \
       "directory to start over)"
  exit 0
fi

# π_ref: the initial one
KL_ARGS=(); [[ $(awk "BEGIN {print ($KL_COEF > 0)}") == 0 ]] || KL_ARGS=(--ref_policy="$MODEL")
# minutes of checks before days of run, at the run's settings, before anything else; several nodes:
# node 0's
[[ "$PREFLIGHT" == 0 ]] || (( NODE_RANK > 0 )) \
  || KL="${KL_ARGS[*]}" $PY -m mu_grpo.launch --command=preflight 9>&-

# files if the preflight found IPC failing
[[ "$RESIDENT" != true ]] || HANDOFF=$($PY -m mu_grpo.launch --command=handoff)
# this attempt's start, a zero-length row: the time from the last record before it is not the run's
# (records.pauses)
(( NODE_RANK > 0 )) || $PY -m mu_grpo.launch --command=attempt
# each phase's flags: the loop's knobs, and the phase knobs a preset or the environment gives
# (mu_grpo/launch.py KNOBS: $OPTIMIZE_FLAGS, $GENERATE_FLAGS, $EVALUATE_FLAGS); the evaluation
# protocol given once, to both its users
EVAL_PROTOCOL="--benchmarks=$BENCHMARKS --data_dir=$EVAL_DATA_DIR $EVALUATE_FLAGS"
EVAL_ARGS=($EVAL_PROTOCOL --max_prompt_tokens="$MAX_PROMPT" --max_response_tokens="$MAX_RESPONSE"
           --results="$RUN/results.jsonl" --run_start="$START" --skip_evaluated=true --gpus="$GPUS"
           --engines="$ENGINES" "${TEMPLATE_ARG[@]}" "${NODE_ARGS[@]}")
GENERATE_ARGS=(--data="$TRAIN_DATA" --run_dir="$RUN" --group_size=$GROUP_SIZE
               --max_prompt_tokens=$MAX_PROMPT --max_response_tokens=$MAX_RESPONSE --gpus="$GPUS"
               --engines="$ENGINES" --seed="$SEED" $GENERATE_FLAGS "${TEMPLATE_ARG[@]}"
               "${NODE_ARGS[@]}"
               # and the evaluation due before the stage, by its engines:
               --eval_args="$EVAL_PROTOCOL" --results="$RUN/results.jsonl" --run_start="$START")
RELEASE_OLDER=$([[ "$KEEP_TRAIN_STATES" == true ]] && echo false || echo true)
OPTIMIZE_ARGS=(--prompts_per_update=$PROMPTS_PER_UPDATE --seed="$SEED" $OPTIMIZE_FLAGS $LOSS_FLAGS
               $LOSS_ARGS "${KL_ARGS[@]}" --checkpoint_every="$CHECKPOINT_EVERY"
               --stage_end="$STAGE_END" --hsdp="$HSDP"
               --release_older_states=$RELEASE_OLDER $DRIFT_ARGS)
# every node's ranks in one torchrun world: rank 0 on node 0 (static rendezvous)
if (( NNODES > 1 )); then
  TRAIN=($PY -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK"
         --nproc_per_node="$TRAIN_RANKS" --master_addr="$MASTER_ADDR"
         --master_port=$((MASTER_PORT + 1)) --rdzv_conf=timeout="$JOIN_TIMEOUT")
elif (( TRAIN_RANKS > 1 )); then
  TRAIN=($PY -m torch.distributed.run --standalone --nproc_per_node="$TRAIN_RANKS")
else TRAIN=($PY); fi

# the engines evaluate each policy before the stage it generates, the initial one too, unless a kept
# evaluation does
[[ -z "$EVAL_CACHE" ]] || (( EVAL_EVERY == 0 )) || phase eval_init -1 $PY evaluate.py \
    --policy="$MODEL" --stage=-1 "${EVAL_ARGS[@]}" --cache="$EVAL_CACHE"
if [[ "$PREFLIGHT_ONLY" == true ]]; then
  (( NODE_RANK > 0 )) || echo "the preflight and the initial evaluation only"; exit 0
fi
# two processes for every stage (a failed one stops the other); a rerun resumes
if [[ "$RESIDENT" == true ]]; then
  $PY -m mu_grpo.launch --command=resident --logs="$RUN/logs" \
      $PY generate.py --resident=true --stage=0 --policy="$MODEL" "${GENERATE_ARGS[@]}" \
      --prompts_per_stage="$PROMPTS_PER_STAGE" --evaluate="$EVALUATE_INITIAL" \
      --gpu_memory_utilization="$RESIDENT_GPU_MEMORY" --policy_handoff="$HANDOFF" \
      :: "${TRAIN[@]}" optimize.py --resident=true --run_dir="$RUN" --policy="$MODEL" \
      "${OPTIMIZE_ARGS[@]}" --stages="$STAGES" --updates_per_stage="$UPDATES_PER_STAGE" \
      --total_updates="$TOTAL_UPDATES" --drift_growth="$DRIFT_GROWTH" \
      --drift_max_updates="$DRIFT_MAX_UPDATES" --eval_every="$EVAL_EVERY" \
      --save_every="$SAVE_EVERY" --policy_handoff="$HANDOFF" --engines="$ENGINES" 9>&- || exit 1
else
  # stage s > 0 continues stage s-1's fp32 weights, AdamW moments, update count
  s=0 POLICY=$MODEL STATE_ARGS=()
  # stage s decided once (stage_rules.StagePlan.stage, its line on stderr; several nodes: node 0's)
  while :; do
    # a failure stops the run here
    STAGE=$( (( NODE_RANK > 0 )) || $PY -m mu_grpo.launch --command=stage --stage=$s )
    # STAGE_UPDATES (0: the run is over), STAGE_PROMPTS, EVALUATE
    STAGE=$(share "stage/$s" "$STAGE"); eval "$STAGE"
    (( STAGE_UPDATES > 0 )) || break
    # its engines evaluate $POLICY first if due
    phase "generate_$s" $s $PY generate.py --policy="$POLICY" --stage=$s "${GENERATE_ARGS[@]}" \
        --prompts_per_stage="$STAGE_PROMPTS" --evaluate="$EVALUATE"
    phase "optimize_$s" $s "${TRAIN[@]}" optimize.py --stage_dir="$RUN/stage_$s" \
        --policy="$POLICY" "${OPTIMIZE_ARGS[@]}" --updates_per_stage="$STAGE_UPDATES" \
        "${STATE_ARGS[@]}"
    POLICY=$RUN/stage_$s/policy STATE_ARGS=(--init_state="$RUN/stage_$s/train_state") s=$((s + 1))
  done
  # the last policy (the others: the next stage's engines)
  [[ "$EVALUATE" != true ]] || phase "eval_$((s - 1))" $((s - 1)) $PY evaluate.py \
      --policy="$POLICY" --stage=$((s - 1)) "${EVAL_ARGS[@]}"
fi
if (( NODE_RANK > 0 )); then
  echo "node $NODE_RANK: run $RUN done (node 0 summarizes it)"; exit 0
fi
$PY tools/plot.py --run_dir="$RUN" --summary=true | tee "$RUN/logs/summary.log"
touch "$RUN/.done/all"
