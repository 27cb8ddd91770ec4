# The PRESETs: each one's defaults for the knobs run_stages.sh leaves to it (its header lists them), a knob given in
# the environment winning. Sourced by run_stages.sh once PRESET is resolved (mu_grpo/launch.py preset: auto is paper on a GPU
# box, toy otherwise).
case "$PRESET" in
  paper)
    : "${MODEL:=Qwen/Qwen2.5-Math-7B}"
    out=$($PY -m mu_grpo.model_cards) || exit 2; eval "$out"   # the model's own settings (mu_grpo/model_cards.py: the paper's five), unless given
    : "${TRAIN_DATA:=data/deepscaler.jsonl}" "${EVAL_DATA_DIR:=data/benchmarks}"
    : "${BENCHMARKS:=amc23,amc24,aime24,aime25,math500}" "${STAGES:=4}" "${UPDATES_PER_STAGE:=1024}"
    : "${PROMPTS_PER_UPDATE:=64}" "${GROUP_SIZE:=8}" "${LR:=1e-6}" "${MAX_PROMPT:=1536}" "${MAX_RESPONSE:=2560}"
    : "${TEMPERATURE:=1.0}" "${EVAL_K:=4}" "${EVAL_TEMPERATURE:=1.0}" "${EVAL_TOP_P:=0.7}" "${GPUS:=$VISIBLE_GPUS}"
    : "${TEMPLATE:=default}" "${WARMUP:=0}" "${MICRO_BATCH_TOKENS:=16384}" "${GRAD_CKPT:=true}" "${SHARD_PROMPTS:=4096}" ;;
  toy)
    : "${MODEL:=data/toy/model}" "${TRAIN_DATA:=data/toy/train.jsonl}" "${EVAL_DATA_DIR:=data/toy}"
    : "${BENCHMARKS:=test}" "${STAGES:=3}" "${UPDATES_PER_STAGE:=8}" "${PROMPTS_PER_UPDATE:=16}"
    : "${GROUP_SIZE:=8}" "${LR:=2e-4}" "${MAX_PROMPT:=64}" "${MAX_RESPONSE:=16}" "${TEMPERATURE:=1.0}"
    : "${EVAL_K:=4}" "${EVAL_TEMPERATURE:=1.0}" "${EVAL_TOP_P:=1.0}" "${GPUS:=0}" "${TEMPLATE:=plain}" "${WARMUP:=0}"
    : "${MICRO_BATCH_TOKENS:=4096}" "${GRAD_CKPT:=false}" "${SHARD_PROMPTS:=64}" ;;
  lab|lab-fork)   # the CPU lab tasks of ablate.sh: data/lab.py (3–8-step arithmetic chains, 32–77-token
                  # solutions) and data/lab_fork.py (the same chains, most demonstrations taking a doomed detour)
    LAB_DIR=data/${PRESET/-/_}
    : "${MODEL:=$LAB_DIR/model}" "${TRAIN_DATA:=$LAB_DIR/train.jsonl}" "${EVAL_DATA_DIR:=$LAB_DIR}"
    : "${BENCHMARKS:=test}" "${STAGES:=8}" "${UPDATES_PER_STAGE:=32}" "${PROMPTS_PER_UPDATE:=4}"
    : "${GROUP_SIZE:=8}" "${LR:=1e-4}" "${MAX_PROMPT:=64}" "${TEMPERATURE:=1.0}"
    : "${MAX_RESPONSE:=$([[ $PRESET == lab-fork ]] && echo 160 || echo 128)}"
    : "${EVAL_K:=1}" "${EVAL_TEMPERATURE:=1.0}" "${EVAL_TOP_P:=1.0}" "${GPUS:=0}" "${TEMPLATE:=plain}" "${WARMUP:=0}"
    : "${MICRO_BATCH_TOKENS:=4096}" "${GRAD_CKPT:=false}" "${SHARD_PROMPTS:=1024}" ;;
esac
