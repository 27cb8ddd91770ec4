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
  # pip compiles every installed .py to bytecode one file at a time (87 s of the CPU install on 2 cores);
  # compileall does the same on every core (43 s). A file that does not compile on this Python is reported
  # and skipped, as pip skips it (torch ships one with 3.12-only syntax in its test helpers).
  .venv/bin/python -m pip install -q --no-compile -r "$req"
  if [[ "$kind" == cpu ]]; then
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  .venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages \
    || echo "setup.sh: the files named above did not compile to bytecode (pip would skip them too)"
  rm -f .venv/.installed-* && touch "$stamp"
fi
