#!/usr/bin/env bash
# The paper's question in one command: accuracy against wall-clock across μ, at equal updates (bash frontier.sh)
#   0. the lab tasks: candidate builds, each built and probed in order, until the rule has enough builds of each regime
#      (tools/regimes.py; "the builds" below)
#   1. every point — a LOSS preset (with each NAV δ of NAV_DELTAS where the preset has NAV) at a μ of MUS — on every
#      build and seed is one run_stages.sh run of TOTAL_UPDATES updates of the preset's prompts per update:
#      TOTAL_UPDATES / μ stages, evaluated every EVAL_UPDATES updates (after every stage when μ is larger), in
#      resident mode up to μ = RESIDENT_MAX_MU (stages too short to pay a process start, a model load and an engine
#      start each, as the paper's GRPO baseline ran resident in verl), processes per phase above it
#   2. tools/frontier.py: the table (frontier.md), every number (frontier.json) and the figures (plots/) from the
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
LOSSES=${LOSSES:-grpo mu-grpo}  # LOSS presets (loss.py PRESETS)
NAV_DELTAS=${NAV_DELTAS:-1e-4 0.1}  # NAV δ of the presets with NAV (one point each; grpo has none)
SEEDS=${SEEDS:-0}               # run_stages.sh's SEED: prompt order, sampling, minibatch order. One by default: the
                                # comparisons are over builds (each build's seeds averaged), so a second seed narrows
                                # a build's difference but adds no degree of freedom, and doubles the key points' runs
                                # (SEEDS="0 1": the two-seed frontier of docs/frontier.md, 66 runs: its time there)
KEY_POINTS=${KEY_POINTS-$([[ $PRESET == lab* ]] && echo "grpo:4 grpo:64 grpo:256 mu-grpo-d1e-4:64 mu-grpo-d1e-4:256 mu-grpo-d0.1:256 mu-grpo-d1e-4:4" || :)}
                                # the points the paper's claims rest on: run on every build and seed; the others (the
                                # rest of the μ sweep) only on SWEEP_BUILDS × SWEEP_SEEDS. Empty: every point everywhere.
                                # The lab's: μ = 64 is the paper's shape (4 stages, μ/4 = 16), μ = 256 one stage on the
                                # initial policy's rollouts (another experiment: docs/multistage.md)
SWEEP_BUILDS=${SWEEP_BUILDS:-first}  # "first": the first build of each regime the rule keeps (else of BUILDS)
SWEEP_SEEDS=${SWEEP_SEEDS:-0}
# ---- the builds (lab tasks: the builder's --seed, i.e. the task and its warm-started policy; 0 is data/<task>/, b > 0
# data/<task>_build<b>/). Each candidate is built, then probed: GRPO at the smallest μ for PROBE_UPDATES updates (seed
# PROBE_SEED, none of SEEDS), whose records give the build's regime (tools/regimes.py regime_name: saturated, learns,
# stalls; $OUT/regimes/build<b>.json). The rule: candidates in CANDIDATES' order until it has each regime's quota of
# REGIMES (with too few in a regime, the next candidates of REGIMES, in order, up to MIN_BUILDS); the frontier runs on
# those (how many it looked at and kept: frontier.md)
BUILDS=${BUILDS:-}              # given: exactly these builds, no probe and no rule (the toy and paper presets: 0)
CANDIDATES=${CANDIDATES:-0 1 2 3 4 5 6 7}
REGIMES=${REGIMES:-learns:3 stalls:1}  # <regime>:<quota>, the first quota candidates of each: the paper's setting (a
                                # model that solves some problems at the start and that GRPO at small μ improves) on
                                # three builds, so each claim has df 2 there; the lab's first builds' (GRPO barely
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
POINTS=${POINTS:-}              # only these points, label:μ, e.g. "grpo:4 mu-grpo-d1e-4:1024"
                                # (default: all), in this order; label:μ@lr runs at that LR
                                # ("grpo:64@3e-5"); probes: the rule's probes and builds only
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
                                # a GPU box each run also gets GPUS / JOBS of the GPUs (gpu_slices in mu_grpo/pool.py)
# ------------------------------------------------------------------------------

export MU_GRPO_VENV=${MU_GRPO_VENV:-.venv}
bash setup.sh >&2
# REPORT_TO (run_stages.sh's trackers) passes through to every run; they form one group, this frontier
export TRACKER_GROUP=${TRACKER_GROUP:-$(basename "$OUT")}
# the settings checked, the preflights, the builds, the runs JOBS at a time (mu_grpo/pool.py) and the table: tools/sweep.py
exec "$MU_GRPO_VENV/bin/python" tools/sweep.py --preset="$PRESET" --out="$OUT" --mus="$MUS" \
    --total_updates="$TOTAL_UPDATES" --eval_updates="$EVAL_UPDATES" --benchmarks="$BENCHMARKS" --eval_k="$EVAL_K" \
    --losses="$LOSSES" --nav_deltas="$NAV_DELTAS" --seeds="$SEEDS" --key_points="$KEY_POINTS" \
    --sweep_builds="$SWEEP_BUILDS" --sweep_seeds="$SWEEP_SEEDS" --builds="$BUILDS" --candidates="$CANDIDATES" \
    --regimes="$REGIMES" --min_builds="$MIN_BUILDS" --probe_updates="$PROBE_UPDATES" --probe_seed="$PROBE_SEED" \
    --baseline="$BASELINE" --resident_max_mu="$RESIDENT_MAX_MU" --drift_first="$DRIFT_FIRST" --costs="$COSTS" \
    --eval_cache="$EVAL_CACHE" --points="$POINTS" --estimate="$ESTIMATE" --preflight="$PREFLIGHT" --gpus="$GPUS" \
    --jobs="$JOBS"
