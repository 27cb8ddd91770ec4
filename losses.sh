# The LOSS presets: μ-GRPO and the baselines and ablations the paper compares it with, each as what it changes in
# optimize.py's loss block (whose values are μ-GRPO's: its home). Sourced by run_stages.sh and ablate.sh:
# `loss_args NAME` sets LOSS_ARGS (and KL_COEF's default for offpolicy-grpo), or fails naming the presets.
NAV_DELTA=${NAV_DELTA:-}        # NAV's trigger threshold δ for every preset with NAV (empty: optimize.py's nav_delta)
LOSS_PRESETS="mu-grpo grpo dapo m2po relaxed-no-nav relaxed-low relaxed-high nav-none nav-T nav-S nav-seq offpolicy-grpo"
NAV_PRESETS="mu-grpo relaxed-low relaxed-high nav-none nav-T nav-S nav-seq"   # the presets with NAV (δ their knob)
loss_args() {
  [[ -z "$NAV_DELTA" || "$NAV_DELTA" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] \
    || { echo "NAV_DELTA must be a positive number, got '$NAV_DELTA'" >&2; return 2; }
  case "$1" in
    mu-grpo)        LOSS_ARGS="" ;;                                   # clip [0, 5], NAV δ scope H: optimize.py's own
    grpo)           LOSS_ARGS="--clip_low=0.8 --clip_high=1.2 --nav_delta=none" ;;
    dapo)           LOSS_ARGS="--clip_low=0.8 --clip_high=1.28 --nav_delta=none" ;;
    m2po)           LOSS_ARGS="--clip_high=1e9 --nav_delta=none --m2po_tau=0.04" ;;
    relaxed-no-nav) LOSS_ARGS="--nav_delta=none" ;;
    relaxed-low)    LOSS_ARGS="--clip_high=1.2" ;;         # μ-GRPO with one side of GRPO's clip back: the upper
    relaxed-high)   LOSS_ARGS="--clip_low=0.8" ;;          # ... the lower
    offpolicy-grpo) LOSS_ARGS="--clip_low=0.8 --clip_high=1.2 --nav_delta=none --kl_estimator=k3"
                    : "${KL_COEF:=0.04}" ;;   # our choice (DeepSeekMath's GRPO β); the lag v is UPDATES_PER_STAGE
    nav-none|nav-T|nav-S|nav-seq)
                    LOSS_ARGS="--nav_scope=${1#nav-}" ;;
    *) echo "LOSS must be one of $LOSS_PRESETS, got '$1'" >&2; return 2 ;;
  esac
  if [[ -n "$NAV_DELTA" && " $NAV_PRESETS " == *" $1 "* ]]; then LOSS_ARGS+="${LOSS_ARGS:+ }--nav_delta=$NAV_DELTA"; fi
}
