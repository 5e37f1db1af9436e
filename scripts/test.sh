#!/usr/bin/env bash
# Set everything up (scripts/setup.sh) and run every test, vLLM ones included.
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not vllm" tests/engine
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${POLYINFER_VENV:-$ROOT/.venv}
"$ROOT/scripts/setup.sh" || exit 1
cd "$ROOT"
"$VENV/bin/python" -m pytest -ra --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests for this selection"
  rc=0
fi
exit "$rc"
