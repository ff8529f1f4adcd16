"""An installed Sluice adds one import name, ``sluice``, works from outside the checkout, and
ships no measurement code (``benchmarks/`` runs from a checkout only)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("flows", "tasks", "driver", "engines", "policy", "storage", "rl", "envs", "sim")


def _source_copy(into: Path) -> Path:
    """What an sdist holds, copied: a build writes its build/ folder into the source tree."""
    source = into / "src"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for part in ("sluice", *PARTS, "benchmarks"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__"))
    return source


def test_the_wheel_holds_only_the_sluice_package(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(_source_copy(tmp_path)),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sluice-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"sluice"}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["sluice"]
    # Every module of the house is in it, under its namespace name, and the package data.
    for part in ("sluice", *PARTS):
        for file in (ROOT / part).rglob("*.py"):
            inside = file.relative_to(ROOT / part).as_posix()
            assert f"sluice/{inside if part == 'sluice' else f'{part}/{inside}'}" in names
    assert "sluice/sim/profiles/cpu2core.json" in names
    # Measurement stays in the checkout: no benchmark, and nothing that finds the repository
    # from its own file (in site-packages that path is not a checkout).
    assert not [n for n in names if "benchmark" in n], names
    for name in (n for n in names if n.endswith(".py")):
        text = zipfile.ZipFile(wheel).read(name).decode()
        assert not re.search(r"__file__\)(\.resolve\(\))?\.parents", text), name
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "sluice = sluice.flows.cli:app" in zipfile.ZipFile(wheel).read(entry).decode()


def test_import_sluice_from_outside_the_checkout(tmp_path: Path) -> None:
    code = (
        "import sys, sluice; "
        "assert callable(sluice.run) and sluice.Environment and sluice.load_config; "
        "print(sluice.__file__); "
        # Importing sluice must not pull in the heavy stack.
        "print(sorted(m for m in ('ray', 'prefect', 'torch', 'vllm') if m in sys.modules)); "
        "from sluice.storage.ledger import Ledger"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout.split("\n")
    assert Path(out[0]).resolve() == ROOT / "sluice" / "__init__.py"
    assert out[1] == "[]"
