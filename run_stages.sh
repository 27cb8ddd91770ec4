#!/usr/bin/env bash
# μ-GRPO: a few large stages of generate.py → optimize.py → evaluate.py, each its own process.
# Rerunning continues from the first unfinished phase; a finished run does nothing.
# Every variable below can also be set from the environment: STAGES=2 LOSS=grpo bash run_stages.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# ------------------------------------------------------------------------------ hyperparameters
PRESET=${PRESET:-auto}          # auto (paper on a GPU box, toy otherwise) | paper | toy | lab | lab-fork (ablate.sh's tasks)
LOSS=${LOSS:-mu-grpo}           # mu-grpo | grpo | dapo | m2po | relaxed-no-nav | nav-none | nav-T | nav-S | nav-seq
                                # | offpolicy-grpo (clip [0.8, 1.2] + β·KL to the initial policy)
RUN=${RUN:-}                    # run directory (default runs/<preset>-<loss>)
EVAL_EVERY=${EVAL_EVERY:-1}     # evaluate after every N-th stage (and always after the last); 0: never
STAGE_END=${STAGE_END:-fixed}   # fixed: STAGES stages of UPDATES updates | drift: a stage ends early once the policy
                                # has drifted from its rollouts (optimize.py's drift warning on E[ρ | A<0]), the next
                                # stage's μ is planned from where it ended (rollouts.planned_updates), until
                                # TOTAL_UPDATES; UPDATES is then the first stage's μ
TOTAL_UPDATES=${TOTAL_UPDATES:-}  # drift: the run's updates (default STAGES × UPDATES)
DRIFT_GROWTH=${DRIFT_GROWTH:-1.25}  # drift: after a warning at update u the next stage plans ceil(growth · u) updates
                                # (after a stage without one: twice its μ)
DRIFT_MAX_UPDATES=${DRIFT_MAX_UPDATES:-}  # drift: the largest μ a stage is planned with (default 4 × UPDATES)
DRIFT_ARGS=${DRIFT_ARGS:-}      # drift: optimize.py's warning, e.g. "--drift_window=16 --drift_threshold=0.01
                                # --drift_min_updates=16" (its defaults)
RESET_OPTIMIZER=${RESET_OPTIMIZER:-false}  # true: each stage starts AdamW and warmup afresh from the saved policy
KL_COEF=${KL_COEF:-}            # β of the KL penalty to the initial policy (default: 0; offpolicy-grpo 0.04)
KEEP_TRAIN_STATES=${KEEP_TRAIN_STATES:-false}  # true: keep every stage's train_state/ (else only the last)
SEED=${SEED:-0}                 # seeds the prompt order, the sampling and the minibatch order
PER_REQUEST_SEED=${PER_REQUEST_SEED:-true}  # true: each rollout prompt samples from its own seed, so a response is
                                # the same whichever engine, shard or resumed attempt makes it; false: the engines'
                                # seed alone (faster on vLLM's V1 GPU sampler, unmeasured; generate.py per_request_seed)
PREFLIGHT=${PREFLIGHT:-auto}    # preflight.py first, at the run's settings (cached once passed): auto (the paper
                                # preset only) | 1 (any preset) | 0 (never) | force (and start after a FAIL)
PREFLIGHT_ARGS=${PREFLIGHT_ARGS:-}  # more preflight.py flags, e.g. its miniature's size: "--prompts=8 --updates=2"
PREFLIGHT_ONLY=${PREFLIGHT_ONLY:-false}  # true: stop after the preflight (its throughputs: frontier.sh's estimate)
RESIDENT=${RESIDENT:-false}     # true: two long-lived processes (the engines, the trainer) run every stage, handing
                                # rollouts and policies over through files (handoff.py): small-μ runs without a
                                # process start, model load and engine start per stage
SAVE_EVERY=${SAVE_EVERY:-}      # resident: policy and train state into stage_<s>/ every N stages and at the end
                                # (default EVAL_EVERY; 0: at the end only)
RESIDENT_GPU_MEMORY=${RESIDENT_GPU_MEMORY:-auto}  # resident, GPU: each engine's share of its GPU (the trainer keeps
                                # its fp32 weights and AdamW there while the engine is awake); auto: the largest share
                                # that leaves the trainer its memory less a margin of 0.05 (handoff.py
                                # check_engine_share: 0.78 for 7B on 4×H200, estimate); on a CPU it is unused
NNODES=${NNODES:-1}             # nodes running this script together, each with the same settings and RUN, MODEL and
                                # the data on a filesystem they all see: generate.py and evaluate.py use every node's
                                # engines, optimize.py runs under torchrun across them, node 0 keeps the run-level files
                                # (done markers, timeline, results, plots) and the others follow it (nodes.py)
NODE_RANK=${NODE_RANK:-0}       # this node: 0..NNODES-1
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}  # node 0's address as the other nodes reach it
MASTER_PORT=${MASTER_PORT:-29500}  # node 0's ports: this one for the nodes' store, the next for torchrun's rendezvous
JOIN_TIMEOUT=${JOIN_TIMEOUT:-600}  # seconds the nodes wait for each other to start
DEAD_AFTER=${DEAD_AFTER:-10}    # seconds without a node's heartbeat before the others stop (naming it)
COLLECTIVE_TIMEOUT=${COLLECTIVE_TIMEOUT:-60}  # seconds the trainers' ranks of every node have to reach each other
                                # right after the join (one all-reduce over NCCL or gloo): a blocked port or a wrong
                                # interface fails then, not in the first update
REPORT_TO=${REPORT_TO:-none}    # none | tensorboard | wandb | a comma list: live metrics of every update, stage and
                                # evaluation in those trackers, read from the run's records by one process beside the
                                # phases (tracking.py; W&B's mode and project: WANDB_MODE, WANDB_PROJECT)
TRACKER_GROUP=${TRACKER_GROUP:-}  # the tracker group of this run (frontier.sh and ablate.sh set one per frontier)
HSDP=${HSDP:-false}             # several nodes: true shards the trainer's model within each node and replicates it
                                # across nodes (only the gradients' all-reduce crosses them); for models whose weights,
                                # gradients and AdamW (16 bytes/parameter) fit one node
# the rest is set per preset below, unless given in the environment:
#   MODEL            initial policy (HF name or directory)
#   TRAIN_DATA       prepared training problems (JSONL)
#   BENCHMARKS       comma list evaluated after every stage, from EVAL_DATA_DIR
#   STAGES           number of generate → optimize stages                    (paper 4)
#   UPDATES          μ, optimizer updates per stage                          (paper 1024)
#   PROMPTS_PER_UPDATE  prompts per minibatch (× G responses)                (paper 64)
#   GROUP_SIZE       G                                                       (paper 8)
#   LR               AdamW learning rate                                     (paper 1e-6)
#   MAX_PROMPT, MAX_RESPONSE  token limits                                   (paper 1536, 2560)
#   TEMPERATURE      sampling temperature for rollouts                       (paper 1.0)
#   EVAL_K, EVAL_TEMPERATURE, EVAL_TOP_P  avg@k protocol                     (paper 4, 1.0, 0.7)
#   GPUS             GPUs used by every phase: generate's and evaluate's data-parallel
#                    engines, optimize's torchrun ranks (paper: all; toy 0 = CPU)
#   ENGINES          vLLM engines, one process each (default: one per GPU; 1 on a CPU)
#   TRAIN_RANKS      optimize.py's torchrun ranks (default: one per GPU; 1 on a CPU). On a CPU,
#                    ENGINES=2 TRAIN_RANKS=2 runs the 4×H200 box's control flow (engines in child
#                    processes, FSDP2 over gloo ranks), as the tests do
#   WARMUP           linear warmup updates, counted over the whole run        (paper 0)
#   NAV_DELTA        NAV trigger threshold δ of the LOSS presets with NAV     (paper 1e-4; losses.sh)
# ------------------------------------------------------------------------------

# torchrun's variables are for optimize.py's ranks, which torchrun sets itself: the engines must not see them (vLLM
# reads LOCAL_RANK, engine.py TORCHRUN_VARIABLES); MASTER_ADDR and MASTER_PORT stay this script's own
export -n MASTER_ADDR MASTER_PORT
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE ROLE_RANK ROLE_WORLD_SIZE
for v in "${!PET_@}"; do unset "$v"; done     # torchrun reads its flags from PET_<FLAG> too (a cluster's would win)
bash setup.sh >&2
PY=${MU_GRPO_VENV:-.venv}/bin/python     # the run's environment (setup.sh); tests point MU_GRPO_VENV at theirs
# the GPUs this process can use (torch: CUDA_VISIBLE_DEVICES honoured, MIG instances as CUDA sees them), not every
# line of nvidia-smi -L
VISIBLE_GPUS=$($PY -c "import common; print(common.gpu_count())")

if [[ "$PRESET" == auto ]]; then
  if (( VISIBLE_GPUS > 0 )); then PRESET=paper; else PRESET=toy; fi
  echo "PRESET=auto: using the '$PRESET' preset ($( [[ $PRESET == paper ]] && echo "$VISIBLE_GPUS GPU(s) found" || echo no GPU found))"
fi
if [[ "$PRESET" == paper ]] && (( VISIBLE_GPUS == 0 )); then
  echo "PRESET=paper needs GPUs and torch sees none here (CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES-}'); on a CPU machine use PRESET=toy or PRESET=lab" >&2
  exit 2
fi
case "$PRESET" in
  paper)
    : "${MODEL:=Qwen/Qwen2.5-Math-7B}" "${TRAIN_DATA:=data/deepscaler.jsonl}" "${EVAL_DATA_DIR:=data/benchmarks}"
    : "${BENCHMARKS:=amc23,amc24,aime24,aime25,math500}" "${STAGES:=4}" "${UPDATES:=1024}" "${PROMPTS_PER_UPDATE:=64}"
    : "${GROUP_SIZE:=8}" "${LR:=1e-6}" "${MAX_PROMPT:=1536}" "${MAX_RESPONSE:=2560}" "${TEMPERATURE:=1.0}"
    : "${EVAL_K:=4}" "${EVAL_TEMPERATURE:=1.0}" "${EVAL_TOP_P:=0.7}" "${GPUS:=$VISIBLE_GPUS}" "${TEMPLATE:=default}" "${WARMUP:=0}"
    : "${MICRO_BATCH_TOKENS:=16384}" "${GRAD_CKPT:=true}" "${SHARD_PROMPTS:=4096}" ;;
  toy)
    : "${MODEL:=data/toy/model}" "${TRAIN_DATA:=data/toy/train.jsonl}" "${EVAL_DATA_DIR:=data/toy}"
    : "${BENCHMARKS:=test}" "${STAGES:=3}" "${UPDATES:=8}" "${PROMPTS_PER_UPDATE:=16}"
    : "${GROUP_SIZE:=8}" "${LR:=2e-4}" "${MAX_PROMPT:=64}" "${MAX_RESPONSE:=16}" "${TEMPERATURE:=1.0}"
    : "${EVAL_K:=4}" "${EVAL_TEMPERATURE:=1.0}" "${EVAL_TOP_P:=1.0}" "${GPUS:=0}" "${TEMPLATE:=plain}" "${WARMUP:=0}"
    : "${MICRO_BATCH_TOKENS:=4096}" "${GRAD_CKPT:=false}" "${SHARD_PROMPTS:=64}" ;;
  lab|lab-fork)   # the CPU lab tasks of ablate.sh: data/lab.py (3–8-step arithmetic chains, 32–77-token
                  # solutions) and data/lab_fork.py (the same chains, most demonstrations taking a doomed detour)
    LAB_DIR=data/${PRESET/-/_}
    : "${MODEL:=$LAB_DIR/model}" "${TRAIN_DATA:=$LAB_DIR/train.jsonl}" "${EVAL_DATA_DIR:=$LAB_DIR}"
    : "${BENCHMARKS:=test}" "${STAGES:=8}" "${UPDATES:=32}" "${PROMPTS_PER_UPDATE:=4}"
    : "${GROUP_SIZE:=8}" "${LR:=1e-4}" "${MAX_PROMPT:=64}" "${TEMPERATURE:=1.0}"
    : "${MAX_RESPONSE:=$([[ $PRESET == lab-fork ]] && echo 160 || echo 128)}"
    : "${EVAL_K:=1}" "${EVAL_TEMPERATURE:=1.0}" "${EVAL_TOP_P:=1.0}" "${GPUS:=0}" "${TEMPLATE:=plain}" "${WARMUP:=0}"
    : "${MICRO_BATCH_TOKENS:=4096}" "${GRAD_CKPT:=false}" "${SHARD_PROMPTS:=1024}" ;;
  *) echo "PRESET must be auto, paper, toy, lab or lab-fork, got '$PRESET'" >&2; exit 2 ;;
esac
# loss presets (losses.sh): the paper's method and the baselines it is compared with, on the same loop
source losses.sh
loss_args "$LOSS" || exit 2
: "${KL_COEF:=0}"

# every setting is checked before any phase runs: a typo fails here, not after the first evaluation
[[ "$GPUS" =~ ^[0-9]+$ ]] || { echo "GPUS must be a whole number, got '$GPUS'" >&2; exit 2; }
: "${ENGINES:=$(( GPUS > 0 ? GPUS : 1 ))}" "${TRAIN_RANKS:=$(( GPUS > 0 ? GPUS : 1 ))}"
for v in STAGES UPDATES PROMPTS_PER_UPDATE GROUP_SIZE MAX_PROMPT MAX_RESPONSE EVAL_K GPUS SHARD_PROMPTS \
         MICRO_BATCH_TOKENS EVAL_EVERY WARMUP SEED ENGINES TRAIN_RANKS NNODES NODE_RANK MASTER_PORT JOIN_TIMEOUT \
         DEAD_AFTER COLLECTIVE_TIMEOUT; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || { echo "$v must be a whole number, got '${!v}'" >&2; exit 2; }
done
for v in STAGES UPDATES PROMPTS_PER_UPDATE MICRO_BATCH_TOKENS SHARD_PROMPTS ENGINES TRAIN_RANKS NNODES COLLECTIVE_TIMEOUT; do
  (( ${!v} >= 1 )) || { echo "$v must be at least 1, got '${!v}'" >&2; exit 2; }
done
if (( GPUS > 0 )); then
  for v in ENGINES TRAIN_RANKS; do
    (( ${!v} <= GPUS )) || { echo "$v=${!v} is more than GPUS=$GPUS (one engine, one trainer rank per GPU)" >&2; exit 2; }
  done
fi
(( GROUP_SIZE >= 2 )) || { echo "GROUP_SIZE must be at least 2, got '$GROUP_SIZE'" >&2; exit 2; }
for v in LR TEMPERATURE EVAL_TEMPERATURE EVAL_TOP_P KL_COEF; do
  [[ "${!v}" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] || { echo "$v must be a non-negative number, got '${!v}'" >&2; exit 2; }
done
: "${SAVE_EVERY:=$EVAL_EVERY}"
[[ "$SAVE_EVERY" =~ ^[0-9]+$ ]] || { echo "SAVE_EVERY must be a whole number, got '$SAVE_EVERY'" >&2; exit 2; }
[[ "$RESIDENT_GPU_MEMORY" =~ ^0?\.[0-9]+$|^1(\.0*)?$|^auto$ ]] || { echo "RESIDENT_GPU_MEMORY must be auto or a fraction in (0, 1], got '$RESIDENT_GPU_MEMORY'" >&2; exit 2; }
for v in GRAD_CKPT RESET_OPTIMIZER KEEP_TRAIN_STATES RESIDENT PREFLIGHT_ONLY HSDP PER_REQUEST_SEED; do
  [[ "${!v}" == true || "${!v}" == false ]] || { echo "$v must be true or false, got '${!v}'" >&2; exit 2; }
done
[[ "$PREFLIGHT" =~ ^(auto|0|1|force)$ ]] || { echo "PREFLIGHT must be auto, 0, 1 or force, got '$PREFLIGHT'" >&2; exit 2; }
[[ "$PREFLIGHT" == auto ]] && PREFLIGHT=$([[ "$PRESET" == paper ]] && echo 1 || echo 0)
[[ "$REPORT_TO" == none ]] || $PY tracking.py --command=check --report_to="$REPORT_TO" || exit 2
[[ "$STAGE_END" == fixed || "$STAGE_END" == drift ]] || { echo "STAGE_END must be fixed or drift, got '$STAGE_END'" >&2; exit 2; }
: "${TOTAL_UPDATES:=$((STAGES * UPDATES))}" "${DRIFT_MAX_UPDATES:=$((4 * UPDATES))}"
for v in TOTAL_UPDATES DRIFT_MAX_UPDATES; do
  [[ "${!v}" =~ ^[0-9]+$ ]] && (( ${!v} >= 1 )) || { echo "$v must be a whole number ≥ 1, got '${!v}'" >&2; exit 2; }
done
[[ "$DRIFT_GROWTH" =~ ^[0-9]*\.?[0-9]+$ ]] || { echo "DRIFT_GROWTH must be a positive number, got '$DRIFT_GROWTH'" >&2; exit 2; }
(( NODE_RANK < NNODES )) || { echo "NODE_RANK must be in 0..$((NNODES - 1)) (NNODES=$NNODES), got $NODE_RANK" >&2; exit 2; }
if [[ "$RESIDENT" == true ]] && (( NNODES > 1 )); then
  echo "RESIDENT=true runs on one node (its hand-off goes through one machine's /dev/shm); use RESIDENT=false on $NNODES nodes" >&2; exit 2
fi
if [[ "$RESIDENT" == true && "$RESET_OPTIMIZER" == true ]]; then
  echo "RESIDENT=true keeps one AdamW for the whole run: RESET_OPTIMIZER=true is for the process-per-phase loop" >&2; exit 2
fi
RUN=${RUN:-runs/$PRESET-$LOSS}
PROMPTS_PER_STAGE=$((UPDATES * PROMPTS_PER_UPDATE))
TEMPLATE_ARG=(); [[ "$TEMPLATE" == plain ]] && TEMPLATE_ARG=("--prompt_template={problem}")  # plain: the problem alone
LOGS=$RUN/logs$( (( NODE_RANK == 0 )) || echo "/node$NODE_RANK")     # node 0's phase logs, and each other node's
mkdir -p "$LOGS" "$RUN/.done"
LOCK=$RUN/.lock$( (( NODE_RANK == 0 )) || echo ".node$NODE_RANK")
exec 9>"$LOCK"         # one run_stages.sh per run directory (and node): a second one would race on the same files
# flock -E: the status when another process holds the lock; any other failure is flock's own (on a filesystem without
# lock support, e.g. Lustre mounted without -o flock: "No locks available"), said as it is
lock_status=0; lock_error=$(flock -n -E 75 9 2>&1) || lock_status=$?
if (( lock_status == 75 )); then
  echo "another run_stages.sh is running on $RUN (it holds $LOCK); wait for it or choose another RUN" >&2; exit 1
elif (( lock_status != 0 )); then
  echo "cannot lock $LOCK (${lock_error:-flock exited with $lock_status}): RUN's filesystem may not support locks (Lustre:" \
       "mount it with -o flock), or choose a RUN on another filesystem" >&2; exit 1
fi
# several nodes: each one's watch process (node 0's serves the nodes' store) beats every second and stops this
# script (and everything it started) within seconds once another node fails or stops answering; a successful end
# tells it so (SIGUSR1), and node 0's serves the store until every node has ended
NODE_ARGS=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --coordinator="$MASTER_ADDR:$MASTER_PORT")
WATCH=
if (( NNODES > 1 )); then
  $PY nodes.py --command=watch "${NODE_ARGS[@]}" --pid=$$ --join_timeout_s="$JOIN_TIMEOUT" --dead_after_s="$DEAD_AFTER" \
      --errors="$LOGS/stderr.log" 9>&- &
  WATCH=$!
  # from here this script's stderr is copied to a file: its last line is what the other nodes are told when this one
  # fails (the watch keeps the terminal's stderr: its last words must not wait on the tee it stops with the rest)
  : > "$LOGS/stderr.log"
  exec 2> >(exec tee -i -a "$LOGS/stderr.log" >&2 9>&-)
fi
TRACKING=
on_exit() {    # the trackers' last pass over the records; several nodes: a successful end tells this node's watch
  local st=$?
  if [[ -n "$TRACKING" ]]; then touch "$LOGS/tracking.stop.$$"; wait "$TRACKING" \
    || echo "[tracking] ended with an error: see $LOGS/tracking.log (the records are complete; a rerun logs them)" >&2
    rm -f "$LOGS/tracking.stop.$$"; fi
  if (( st == 0 )) && [[ -n "$WATCH" ]]; then kill -USR1 "$WATCH"; wait "$WATCH" || st=$?; fi
  exit $st
}
trap on_exit EXIT
# share KEY VALUE: node 0's VALUE on every node (a decision node 0 takes from the filesystem, which another node's
# NFS cache may not show yet); on one node, VALUE
share() {
  if (( NNODES == 1 )); then echo "$2"; return; fi
  kill -0 "$WATCH" 2>/dev/null || { echo "[node $NODE_RANK] this node's watch process has ended: stopping" >&2; exit 1; }
  $PY nodes.py --command=share "${NODE_ARGS[@]}" --key="$1" --value="$2" 9>&-
}
if [[ "$STAGE_END" == drift ]]; then
  echo "run $RUN: $PRESET preset, loss $LOSS; stages that end on drift, the first of $UPDATES updates, until" \
       "$TOTAL_UPDATES updates of $PROMPTS_PER_UPDATE prompts × G=$GROUP_SIZE; model $MODEL; GPUs $GPUS"
else
  echo "run $RUN: $PRESET preset, loss $LOSS; $STAGES stages × $UPDATES updates × $PROMPTS_PER_UPDATE prompts × G=$GROUP_SIZE" \
       "($PROMPTS_PER_STAGE prompts per stage); model $MODEL; GPUs $GPUS"
fi

# the toy task and its warm-started policy are built locally; the paper's data comes from the hub (on several nodes
# node 0 makes them, the others check they see them: nodes.py join)
MODEL_NAME=$MODEL
if (( NODE_RANK == 0 )); then
  if [[ "$PRESET" == toy && "$MODEL" == data/toy/model && ! -f data/toy/model/config.json ]]; then
    $PY data/toy.py --out_dir=data/toy
  fi
  if [[ "$PRESET" == lab* && "$MODEL" == "$LAB_DIR/model" && ! -f "$LAB_DIR/model/config.json" ]]; then
    $PY "$LAB_DIR.py" --out_dir="$LAB_DIR"
  fi
  if [[ "$PRESET" == paper && ! -f "$TRAIN_DATA" ]]; then
    $PY data/prepare.py --name=deepscaler --out="$TRAIN_DATA"
  fi
  if (( NNODES > 1 )); then    # the benchmarks evaluate.py would fetch on every node at once
    $PY -c "import engine, sys; engine.benchmark_sets(sys.argv[1].split(','), sys.argv[2])" "$BENCHMARKS" "$EVAL_DATA_DIR"
  fi
fi
MODEL_IS_DIR=$([[ -d "$MODEL" ]] && echo 1 || echo 0)
if (( NNODES > 1 )); then     # node 0 says its model and data are there; the others wait for that before they look,
                              # and take MODEL for a directory when node 0 does (the join says if it is not here)
  MODEL_IS_DIR=$($PY nodes.py --command=ready "${NODE_ARGS[@]}" --join_timeout_s="$JOIN_TIMEOUT" \
                 --value="$MODEL_IS_DIR" 9>&-)
fi
if [[ "$MODEL_IS_DIR" == 0 ]]; then  # a hub name: download once (on each node), then every phase reads the local copy
  MODEL=$($PY -c "import common, sys; print(common.local_dir(sys.argv[1]))" "$MODEL")
fi
SETTINGS=""          # the run's settings: every node must agree on them (nodes.py join); the trackers' config
for v in PRESET LOSS LOSS_ARGS RUN MODEL_NAME TRAIN_DATA EVAL_DATA_DIR BENCHMARKS STAGES UPDATES PROMPTS_PER_UPDATE \
         GROUP_SIZE LR MAX_PROMPT MAX_RESPONSE TEMPERATURE EVAL_K EVAL_TEMPERATURE EVAL_TOP_P EVAL_EVERY SAVE_EVERY \
         GPUS ENGINES TRAIN_RANKS SHARD_PROMPTS MICRO_BATCH_TOKENS GRAD_CKPT WARMUP SEED TEMPLATE STAGE_END \
         TOTAL_UPDATES DRIFT_GROWTH DRIFT_MAX_UPDATES DRIFT_ARGS RESET_OPTIMIZER KL_COEF KEEP_TRAIN_STATES PREFLIGHT \
         NNODES MASTER_PORT HSDP PER_REQUEST_SEED RESIDENT; do
  SETTINGS+="$v=${!v}"$'\n'
done
if (( NNODES > 1 )); then     # before any compute: all nodes here, with the same settings, model and data
  $PY nodes.py --command=join "${NODE_ARGS[@]}" --join_timeout_s="$JOIN_TIMEOUT" --run_dir="$RUN" --model="$MODEL" \
      --data="$TRAIN_DATA$(for b in ${BENCHMARKS//,/ }; do printf ',%s' "$EVAL_DATA_DIR/$b.jsonl"; done)" \
      --settings="$SETTINGS" 9>&-
  # the trainers' network, now and not in the first update: every rank of every node (torchrun at MASTER_PORT + 1,
  # optimize.py's backend and devices) all-reduces one number within COLLECTIVE_TIMEOUT; `timeout` bounds a hang
  if ! timeout -k 10 $((2 * COLLECTIVE_TIMEOUT + 30)) $PY -m torch.distributed.run --nnodes="$NNODES" \
      --node_rank="$NODE_RANK" --nproc_per_node="$TRAIN_RANKS" --master_addr="$MASTER_ADDR" \
      --master_port=$((MASTER_PORT + 1)) --rdzv_conf=timeout="$COLLECTIVE_TIMEOUT" nodes.py --command=collective \
      "${NODE_ARGS[@]}" --collective_timeout_s="$COLLECTIVE_TIMEOUT" > "$LOGS/collective.log" 2>&1 9>&-; then
    line=$(grep -m1 "process group across" "$LOGS/collective.log" || true)     # a rank's own line, else this one
    : "${line:=node $NODE_RANK: the trainers' ranks did not all reach each other within $COLLECTIVE_TIMEOUT s (torchrun's
rendezvous at $MASTER_ADDR:$((MASTER_PORT + 1)), then one all-reduce): likely a blocked port or the wrong interface
(NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME)}"
    echo "${line//$'\n'/ } (whole output: $LOGS/collective.log)" >&2
    exit 1
  fi
  (( NODE_RANK > 0 )) || grep "reached each other" "$LOGS/collective.log" || true
fi
$PY -c "import common, sys; rows = common.load_problems(sys.argv[1]); assert rows, sys.argv[1] + ': no problems'" "$TRAIN_DATA" \
  || { echo "TRAIN_DATA=$TRAIN_DATA is not a prepared problem file (see data/prepare.py)" >&2; exit 2; }
if [[ "$RESIDENT" == true ]] && (( GPUS > 0 )); then   # the engines' share must leave the resident trainer its memory
  RESIDENT_GPU_MEMORY=$($PY -c "import handoff, sys; print(handoff.check_engine_share(*sys.argv[1:]))" "$MODEL" \
      "$TRAIN_RANKS" "$RESIDENT_GPU_MEMORY" "$KL_COEF") || exit 2
elif [[ "$RESIDENT_GPU_MEMORY" == auto ]]; then
  RESIDENT_GPU_MEMORY=0.1      # a CPU engine's own (engine.make_llm): there the share is unused
fi
(( NODE_RANK > 0 )) || [[ -f "$RUN/.done/start" ]] || date +%s > "$RUN/.done/start"
START=$(share start "$( (( NODE_RANK > 0 )) || cat "$RUN/.done/start")")
# the trackers' follower: node 0 alone (its records are the run's), in a session of its own, so that a kill of this
# script's process group leaves it its last pass and the trackers' close (tracking.py)
if [[ "$REPORT_TO" != none ]] && (( NODE_RANK == 0 )); then
  setsid $PY tracking.py --command=follow --run_dir="$RUN" --report_to="$REPORT_TO" --pid=$$ --group="$TRACKER_GROUP" \
      --stop_file="$LOGS/tracking.stop.$$" --settings="$SETTINGS" >> "$LOGS/tracking.log" 2>&1 9>&- &
  TRACKING=$!
  echo "[tracking] $REPORT_TO: every update, stage and evaluation as it is recorded ($LOGS/tracking.log)"
fi
RUN_UPDATES=$([[ "$STAGE_END" == fixed ]] && echo $((STAGES * UPDATES)) || echo "$TOTAL_UPDATES")

# phase NAME STAGE CMD...: skipped when done; its whole output in $RUN/logs/NAME.log, the terminal shows it without
# the libraries' chatter (progress bars, summaries and errors stay); timed into timeline.jsonl; marked done only
# after the command succeeded (so its outputs are complete)
# (several nodes: every node runs it, node 0 decides whether it is done and alone keeps the timeline and markers)
phase() {
  local name=$1 stage=$2; shift 2
  local done
  done=$(share "done/$name" "$([[ -f "$RUN/.done/$name" ]] && echo 1 || echo 0)")
  if [[ "$done" == 1 ]]; then echo "[$name] done already"; return; fi
  echo "[$name] $*"
  local t0 t1; t0=$(date +%s.%N)
  if ! { "$@" 2>&1 | tee "$LOGS/$name.log" | "${VIEW[@]}"; } 9>&-; then
    echo "[$name] failed; its whole output is in $LOGS/$name.log" >&2   # the lock stays with this script, not its children
    exit 1
  fi
  t1=$(date +%s.%N)
  (( NODE_RANK == 0 )) || return 0
  echo "{\"phase\": \"${name%_*}\", \"name\": \"$name\", \"stage\": $stage, \"start\": $t0, \"end\": $t1, \"seconds\": $(awk "BEGIN {print $t1 - $t0}")}" >> "$RUN/timeline.jsonl"
  touch "$RUN/.done/$name"
}

DONE=$(share done/all "$([[ -f "$RUN/.done/all" ]] && echo 1 || echo 0)")
if [[ "$DONE" == 1 ]]; then
  echo "run $RUN is complete; nothing to do (delete $RUN/.done/all to re-summarize, or the run directory to start over)"
  exit 0
fi

EVAL_ARGS=(--benchmarks="$BENCHMARKS" --data_dir="$EVAL_DATA_DIR" --k="$EVAL_K" --temperature="$EVAL_TEMPERATURE"
           --top_p="$EVAL_TOP_P" --max_prompt_tokens="$MAX_PROMPT" --max_response_tokens="$MAX_RESPONSE"
           --results="$RUN/results.jsonl" --run_start="$START" --gpus="$GPUS" --engines="$ENGINES" "${TEMPLATE_ARG[@]}"
           "${NODE_ARGS[@]}")
VIEW=($PY -u -c "import common, sys; common.terminal_view(sys.stdin.buffer, sys.stdout.buffer)")

KL_ARGS=(--kl_coef="$KL_COEF")   # π_ref: the run's initial policy
[[ $(awk "BEGIN {print ($KL_COEF > 0)}") == 1 ]] && KL_ARGS+=(--ref_policy="$MODEL")
# minutes of checks before days of run, at the run's settings, before anything else (the initial evaluation of a 7B
# model alone takes ~10 minutes); on several nodes, node 0's (the others wait for it)
if [[ "$PREFLIGHT" != 0 ]] && (( NODE_RANK == 0 )); then
  $PY preflight.py --policy="$MODEL" --data="$TRAIN_DATA" --out="$RUN/preflight.json" --gpus="$GPUS" \
      --engines="$ENGINES" --train_ranks="$TRAIN_RANKS" --run_dir="$RUN" --stages="$STAGES" \
      --micro_batch_tokens="$MICRO_BATCH_TOKENS" --max_prompt_tokens="$MAX_PROMPT" --max_response_tokens="$MAX_RESPONSE" \
      --optimize_args="--gradient_checkpointing=$GRAD_CKPT $LOSS_ARGS ${KL_ARGS[*]}" \
      --temperature="$TEMPERATURE" --group_size="$GROUP_SIZE" --force=$([[ $PREFLIGHT == force ]] && echo true || echo false) \
      --estimate_stage_prompts="$PROMPTS_PER_STAGE" --resident="$RESIDENT" --resident_gpu_memory="$RESIDENT_GPU_MEMORY" \
      --stage_updates="$UPDATES" --stage_end="$STAGE_END" --total_updates="$TOTAL_UPDATES" \
      --drift_max_updates="$DRIFT_MAX_UPDATES" --save_every="$SAVE_EVERY" --keep_train_states="$KEEP_TRAIN_STATES" \
      $(grep -o -- '--drift_min_updates=[0-9]*' <<< "$DRIFT_ARGS" | tail -1) \
      "${TEMPLATE_ARG[@]}" $PREFLIGHT_ARGS 9>&-
fi
if [[ "$PREFLIGHT_ONLY" == true ]]; then
  (( NODE_RANK == 0 )) || exit 0
  [[ -f "$RUN/preflight.json" ]] || { echo "PREFLIGHT_ONLY=true with PREFLIGHT=0: nothing ran" >&2; exit 2; }
  echo "preflight only: $RUN/preflight.json"; exit 0
fi
(( EVAL_EVERY == 0 )) || [[ "$RESIDENT" == true ]] \
  || phase eval_init -1 $PY evaluate.py --policy="$MODEL" --stage=-1 "${EVAL_ARGS[@]}"

POLICY=$MODEL
STATE_ARGS=()      # stage s > 0 continues stage s-1's fp32 weights, AdamW moments and update count
RELEASE=$([[ "$KEEP_TRAIN_STATES" == true ]] && echo false || echo true)   # stage s deletes s-1's state once it has its own
if (( NNODES > 1 )); then     # every node's ranks in one torchrun world: rank 0 on node 0 (static rendezvous)
  TRAIN=($PY -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$TRAIN_RANKS"
         --master_addr="$MASTER_ADDR" --master_port=$((MASTER_PORT + 1)) --rdzv_conf=timeout="$JOIN_TIMEOUT")
elif (( TRAIN_RANKS > 1 )); then TRAIN=($PY -m torch.distributed.run --standalone --nproc_per_node="$TRAIN_RANKS")
else TRAIN=($PY); fi
GENERATE_ARGS=(--data="$TRAIN_DATA" --run_dir="$RUN" --group_size=$GROUP_SIZE
               --temperature=$TEMPERATURE --max_prompt_tokens=$MAX_PROMPT --max_response_tokens=$MAX_RESPONSE
               --shard_prompts=$SHARD_PROMPTS --gpus="$GPUS" --engines="$ENGINES" --seed="$SEED"
               --per_request_seed="$PER_REQUEST_SEED" "${TEMPLATE_ARG[@]}"
               "${NODE_ARGS[@]}")
OPTIMIZE_ARGS=(--updates_per_stage=$UPDATES --prompts_per_update=$PROMPTS_PER_UPDATE --lr=$LR
               --micro_batch_tokens=$MICRO_BATCH_TOKENS --gradient_checkpointing=$GRAD_CKPT --warmup_updates=$WARMUP
               --seed="$SEED" --checkpoint_every=$(( UPDATES >= 64 ? 64 : 0 )) $LOSS_ARGS "${KL_ARGS[@]}"
               --release_init_state=$RELEASE --stage_end="$STAGE_END" --hsdp="$HSDP" $DRIFT_ARGS)

if [[ "$RESIDENT" == true ]]; then
  # the two processes; a failed one stops the other (by the pid it announced), and each also watches the other
  # while it waits for it; a rerun resumes (the engine at the first stage without a manifest, the trainer at the
  # last train state saved)
  stop_resident() {
    local role pid
    for role in engine trainer; do
      pid=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['pid'])" "$RUN/resident/$role.json" 2>/dev/null) \
        && kill -TERM "$pid" 2>/dev/null || true
    done
    sleep 10 & wait $! || true
    kill -KILL "$@" 2>/dev/null || true
  }
  $PY -c "import handoff, sys; handoff.reset(sys.argv[1])" "$RUN"
  echo "[resident] the engine process ($ENGINES engine(s)) and the trainer ($TRAIN_RANKS rank(s)) for every stage:" \
       "$RUN/logs/engine.log, trainer.log"
  t0=$(date +%s.%N)
  { $PY generate.py --resident=true --stage=0 --policy="$MODEL" "${GENERATE_ARGS[@]}" \
      --prompts_per_stage="$PROMPTS_PER_STAGE" \
      --gpu_memory_utilization="$RESIDENT_GPU_MEMORY" --eval_every="$EVAL_EVERY" --eval_benchmarks="$BENCHMARKS" \
      --eval_data_dir="$EVAL_DATA_DIR" --eval_k="$EVAL_K" --eval_temperature="$EVAL_TEMPERATURE" \
      --eval_top_p="$EVAL_TOP_P" --results="$RUN/results.jsonl" --run_start="$START" 2>&1 \
      | tee -a "$RUN/logs/engine.log" | "${VIEW[@]}"; } 9>&- &
  engine_job=$!
  { "${TRAIN[@]}" optimize.py --resident=true --run_dir="$RUN" --stages="$STAGES" --policy="$MODEL" \
      "${OPTIMIZE_ARGS[@]}" --save_every="$SAVE_EVERY" --total_updates="$TOTAL_UPDATES" --drift_growth="$DRIFT_GROWTH" \
      --drift_max_updates="$DRIFT_MAX_UPDATES" 2>&1 | tee -a "$RUN/logs/trainer.log" | "${VIEW[@]}"; } 9>&- &
  trainer_job=$!
  status=0
  wait -n "$engine_job" "$trainer_job" || status=$?
  if (( status == 0 )); then wait "$engine_job" || status=$?; fi
  if (( status == 0 )); then wait "$trainer_job" || status=$?; fi
  if (( status != 0 )); then
    stop_resident "$engine_job" "$trainer_job"
    # the handed-over policies (up to two, 15 GB each at 7B, in /dev/shm) are not kept for a resume: the trainer
    # hands its policy over again from the run directory or its train state
    $PY -c "import handoff, sys; handoff.clear_policies(sys.argv[1])" "$RUN" || true
    echo "[resident] failed (exit $status); see $RUN/logs/engine.log and trainer.log; rerun to resume" >&2
    exit 1
  fi
  $PY -c "import handoff, sys; handoff.clear_policies(sys.argv[1])" "$RUN"
  t1=$(date +%s.%N)
  last=$(( $(compgen -G "$RUN/stage_*/stage_end.json" | wc -l) - 1 ))      # the stages trained
  echo "{\"phase\": \"resident\", \"name\": \"resident\", \"stage\": $last, \"start\": $t0, \"end\": $t1, \"seconds\": $(awk "BEGIN {print $t1 - $t0}")}" >> "$RUN/timeline.jsonl"
fi

# planned S: the μ of stage S, 0 once the run is over: UPDATES for each of the STAGES stages, or with STAGE_END=drift
# from the records of the stage before (where and why it ended: stage_<s>/stage_end.json), so a rerun plans the same
planned() {
  if [[ "$STAGE_END" == fixed ]]; then echo $(( $1 < STAGES ? UPDATES : 0 )); return; fi
  $PY -c "import rollouts, sys; print(rollouts.planned_updates(sys.argv[1], int(sys.argv[2]), first=$UPDATES,
growth=$DRIFT_GROWTH, max_updates=$DRIFT_MAX_UPDATES, total=$TOTAL_UPDATES))" "$RUN" "$1"
}
s=0
MU=$([[ "$RESIDENT" == true ]] && echo 0 || planned 0)      # resident: every stage is done above
while (( MU > 0 )); do
  STAGE_DIR=$RUN/stage_$s
  (( NODE_RANK > 0 )) || $PY tracking.py --command=where --run_dir="$RUN" --total_updates="$RUN_UPDATES" --stage=$s
  phase "generate_$s" $s $PY generate.py --policy="$POLICY" --stage=$s "${GENERATE_ARGS[@]}" \
      --prompts_per_stage=$((MU * PROMPTS_PER_UPDATE))
  phase "optimize_$s" $s "${TRAIN[@]}" optimize.py --stage_dir="$STAGE_DIR" --policy="$POLICY" "${OPTIMIZE_ARGS[@]}" \
      --updates_per_stage="$MU" "${STATE_ARGS[@]}"
  POLICY=$STAGE_DIR/policy
  [[ "$RESET_OPTIMIZER" == true ]] || STATE_ARGS=(--init_state="$STAGE_DIR/train_state")
  if (( s > 0 && NODE_RANK == 0 )) && [[ "$KEEP_TRAIN_STATES" != true ]]; then  # fp32 weights + AdamW: ~12 bytes
    rm -rf "$RUN/stage_$((s - 1))/train_state"                  # per parameter; stage s carries it on
  fi
  NEXT=$( (( NODE_RANK > 0 )) || planned $((s + 1)) )        # several nodes: node 0's plan, from its records
  NEXT=$(share "planned/$((s + 1))" "$NEXT")
  if (( EVAL_EVERY > 0 && ((s + 1) % EVAL_EVERY == 0 || NEXT == 0) )); then
    phase "eval_$s" $s $PY evaluate.py --policy="$POLICY" --stage=$s "${EVAL_ARGS[@]}"
  fi
  s=$((s + 1))
  MU=$NEXT
done

if (( NODE_RANK > 0 )); then echo "node $NODE_RANK: run $RUN done (node 0 summarizes it)"; exit 0; fi
$PY plot.py --run_dir="$RUN" --summary=true | tee "$RUN/logs/summary.log"
touch "$RUN/.done/all"
