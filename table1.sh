#!/usr/bin/env bash
# The paper's Table 1 in one command: every model × method is one run_stages.sh run, then tools/table1.py's table of
# their records beside the paper's numbers (table1.md, table1.json: every cell with its results row).
#   bash table1.sh                          # the runs in turn on this box (a GPU box: 5 models × 4 methods)
#   SCHEDULER=slurm bash table1.sh          # a cluster: one Slurm job per run, an array over slurm/table1.sbatch
#   python tools/table1.py --runs_dir=runs/table1-paper     # the table of what has run so far, any time
# Rerunning resumes: a finished run does nothing and a killed one resumes where it stopped (run_stages.sh); so does
# resubmitting the array. Every variable below can be set from the environment; run_stages.sh's pass through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

# ------------------------------------------------------------------------------ hyperparameters
PRESET=${PRESET:-auto}          # auto (paper on a GPU box, lab on a CPU) | paper | lab (CPU stand-ins) | toy (the tests)
OUT=${OUT:-}                    # runs.txt, <model>/<loss>-mu<μ>/ per run, table1.md (default runs/table1-<preset>)
SCHEDULER=${SCHEDULER:-local}   # local: the runs one after another here | slurm: sbatch one array job per run
SBATCH_ARGS=${SBATCH_ARGS:-}    # slurm: more sbatch flags, e.g. "--partition=h200 --account=rl" (slurm/table1.sbatch
                                # asks 4 GPUs, the whole node and 72 hours per run: the paper's longest run is 68 h)
ARRAY_LIMIT=${ARRAY_LIMIT:-}    # slurm: at most this many runs at once (the boxes you may hold; empty: Slurm's limit)
# ---- set per preset, unless given in the environment
#   MODELS          the models: hub names or directories (PRESET=paper with MODEL=, presets.sh picks each one's
#                   settings), or run_stages.sh's CPU presets toy, lab, lab-fork standing in for models
#   METHODS         LOSS preset:μ per method, the first the baseline of the speed-ups (the paper's: GRPO μ = 4)
#   TOTAL_UPDATES   every run's updates (TOTAL_UPDATES / μ stages of μ); EVAL_UPDATES: evaluated every so many
#   RESIDENT_MAX_MU μ up to this run resident (RESIDENT=true): stages too short to pay a process start each, as the
#                   paper's GRPO ran resident in verl
if [[ "$PRESET" == auto ]]; then   # run_stages.sh's rule (mu_grpo/launch.py preset: GPUs torch sees), here, not on a cluster
  [[ "$SCHEDULER" != slurm ]] || { echo "SCHEDULER=slurm: give PRESET=paper (or lab): this host's GPUs are not the" \
                                        "compute nodes', and PRESET=auto would read this host's" >&2; exit 2; }
  export MU_GRPO_VENV=${MU_GRPO_VENV:-.venv}; bash setup.sh >&2
  PRESET=$(PRESET=auto "$MU_GRPO_VENV/bin/python" -m mu_grpo.launch --command=preset | sed -n 's/^PRESET=//p')
  [[ "$PRESET" == paper ]] || PRESET=lab
fi
case "$PRESET" in
  paper) : "${MODELS:=meta-llama/Llama-3.2-3B-Instruct Qwen/Qwen2.5-Math-7B Qwen/Qwen3-1.7B-Base Qwen/Qwen3-8B-Base deepseek-ai/DeepSeek-R1-Distill-Qwen-7B}"
         : "${METHODS:=grpo:4 grpo:1024 m2po:1024 mu-grpo:1024}" "${TOTAL_UPDATES:=4096}" "${EVAL_UPDATES:=1024}"
         : "${RESIDENT_MAX_MU:=64}" ;;
  lab)   : "${MODELS:=toy lab}" "${METHODS:=grpo:4 grpo:16 m2po:16 mu-grpo:16}" "${TOTAL_UPDATES:=64}"
         : "${EVAL_UPDATES:=16}" "${RESIDENT_MAX_MU:=4}" ;;   # the paper's shape: 4 stages at large μ, per phase
  toy)   : "${MODELS:=toy}" "${METHODS:=grpo:2 mu-grpo:4}" "${TOTAL_UPDATES:=4}" "${EVAL_UPDATES:=4}"
         : "${RESIDENT_MAX_MU:=2}" ;;
  *) echo "PRESET must be auto, paper, lab or toy, got '$PRESET'" >&2; exit 2 ;;
esac
OUT=${OUT:-runs/table1-$PRESET}
# ------------------------------------------------------------------------------

export MU_GRPO_VENV=${MU_GRPO_VENV:-.venv}
PY=$MU_GRPO_VENV/bin/python
# the plan, checked before anything runs (the standard library alone: on a cluster's login node there is no venv, and
# none is built there: each task's run_stages.sh sets up the environment of its own node's kind, setup.sh):
# $OUT/prepare.txt, each model's preflight and initial evaluation, and $OUT/runs.txt, one run per line
read -r m n < <(python3 tools/table1.py --command=plan --runs_dir="$OUT" --preset="$PRESET" --models="$MODELS" \
    --methods="$METHODS" --total_updates="$TOTAL_UPDATES" --eval_updates="$EVAL_UPDATES" \
    --resident_max_mu="$RESIDENT_MAX_MU") || exit 2
echo "table 1: $n runs ($MODELS × $METHODS, $TOTAL_UPDATES updates each) in $OUT, after $m preparation(s)"
case "$SCHEDULER" in
  slurm)   # each array task runs one line of its file (slurm/table1.sbatch); the runs once every preparation passed
    job=$(sbatch --parsable --array="0-$((m - 1))" --export="ALL,TABLE1_RUNS=$OUT/prepare.txt" $SBATCH_ARGS \
          slurm/table1.sbatch); job=${job%%;*}; job=${job##* }
    sbatch --array="0-$((n - 1))${ARRAY_LIMIT:+%$ARRAY_LIMIT}" --dependency="afterok:$job" \
        --export="ALL,TABLE1_RUNS=$OUT/runs.txt" $SBATCH_ARGS slurm/table1.sbatch
    echo "submitted; once the jobs end (any time for the table so far): python tools/table1.py --runs_dir=$OUT" ;;
  local)
    bash setup.sh >&2
    for file in prepare.txt runs.txt; do
      mapfile -t RUNS < "$OUT/$file"
      for i in "${!RUNS[@]}"; do
        echo "[table1] $file line $((i + 1)) of ${#RUNS[@]}: ${RUNS[$i]}"
        env ${RUNS[$i]} bash run_stages.sh || { echo "[table1] $file line $((i + 1)) failed; rerun to resume" >&2; exit 1; }
      done
    done
    $PY tools/table1.py --runs_dir="$OUT" ;;
  *) echo "SCHEDULER must be local or slurm, got '$SCHEDULER'" >&2; exit 2 ;;
esac
