#!/usr/bin/env bash
# The test suite: sets up .venv (CPU requirements) if needed, then runs pytest. Extra arguments go
# to pytest, e.g. `bash test.sh tests/test_loss.py -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash setup.sh cpu
exec .venv/bin/python -m pytest "$@"
