#!/usr/bin/env bash
# Set everything up (scripts/setup.sh) and start polyinfer on the embedded
# default: built-in engine workers on the bundled tiny model pair, on
# http://127.0.0.1:8000. Extra arguments go to `polyinfer serve`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${POLYINFER_VENV:-$ROOT/.venv}
"$ROOT/scripts/setup.sh"
exec "$VENV/bin/polyinfer" serve "$@"
