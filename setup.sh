#!/usr/bin/env bash
# Creates .venv (once) and installs what this machine needs: requirements.txt on a GPU box
# (nvidia-smi finds a GPU), requirements-cpu.txt otherwise. Re-running is a no-op until a
# requirements file changes. Usage: source setup.sh   (or: bash setup.sh [cpu|gpu])
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
kind="${1:-${MU_GRPO_DEVICE:-auto}}"
if [[ "$kind" == auto ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then kind=gpu; else kind=cpu; fi
fi
case "$kind" in
  cpu) req=requirements-cpu.txt ;;
  gpu) req=requirements.txt ;;
  *) echo "setup.sh: device must be cpu, gpu or auto, got '$kind'" >&2; exit 2 ;;
esac
[[ -x .venv/bin/python ]] || python3 -m venv .venv
stamp=".venv/.installed-$kind-$(sha256sum "$req" | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  echo "setup.sh: installing $req into .venv (first time only; a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r "$req"
  if [[ "$kind" == cpu ]]; then
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  rm -f .venv/.installed-* && touch "$stamp"
fi
