# The PRESETs other than the paper's: what each one changes, sourced by run_stages.sh once PRESET is resolved
# (mu_grpo/launch.py preset: auto is paper on a GPU box, toy otherwise). The paper preset's values are the knobs'
# homes: run_stages.sh's block for the loop's knobs, each phase script's block for its own (an empty knob: that
# block decides); with MODEL one of the paper's five, that model's own template and lengths (mu_grpo/model_cards.py).
# A knob given in the environment wins over all of them (GIVEN: run_stages.sh's list of them).
unless_given() { local kv; for kv in "$@"; do [[ "$GIVEN" == *" ${kv%%=*} "* ]] || export "$kv"; done; }
case "$PRESET" in
  paper)
    out=$($PY -m mu_grpo.model_cards) || exit 2; eval "$out" ;;   # MODEL's own TEMPLATE, MAX_PROMPT, MAX_RESPONSE
  toy)
    unless_given MODEL=data/toy/model TRAIN_DATA=data/toy/train.jsonl EVAL_DATA_DIR=data/toy BENCHMARKS=test STAGES=3 \
        UPDATES_PER_STAGE=8 PROMPTS_PER_UPDATE=16 LR=2e-4 MAX_PROMPT=64 MAX_RESPONSE=16 EVAL_TOP_P=1.0 GPUS=0 \
        TEMPLATE=plain MICRO_BATCH_TOKENS=4096 GRAD_CKPT=false SHARD_PROMPTS=64 ;;
  lab|lab-fork)   # the CPU lab tasks of ablate.sh: data/lab.py (3–8-step arithmetic chains, 32–77-token
                  # solutions) and data/lab_fork.py (the same chains, most demonstrations taking a doomed detour)
    LAB_DIR=data/${PRESET/-/_}
    unless_given MODEL=$LAB_DIR/model TRAIN_DATA=$LAB_DIR/train.jsonl EVAL_DATA_DIR=$LAB_DIR BENCHMARKS=test STAGES=8 \
        UPDATES_PER_STAGE=32 PROMPTS_PER_UPDATE=4 LR=1e-4 MAX_PROMPT=64 MAX_RESPONSE=$([[ $PRESET == lab-fork ]] \
        && echo 160 || echo 128) EVAL_K=1 EVAL_TOP_P=1.0 GPUS=0 TEMPLATE=plain MICRO_BATCH_TOKENS=4096 \
        GRAD_CKPT=false SHARD_PROMPTS=1024 ;;
esac
