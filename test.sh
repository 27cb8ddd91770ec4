#!/usr/bin/env bash
# The test suite: sets up .venv (CPU requirements) if needed, then runs pytest. Extra arguments go
# to pytest, e.g. `bash test.sh tests/test_loss.py -x`. Two pytest-xdist workers, each on its own core
# (tests/conftest.py); TEST_WORKERS=0 runs everything in one process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash setup.sh cpu
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
