"""The house's import rules, read from the source with ``ast``.

Imports point one way: ``flows -> tasks -> driver -> policy -> engines/storage -> envs,
config -> rl``. ``rl`` and ``envs`` import none of the other parts, ``storage`` never imports
``engines``, and inside ``engines`` the trainer (``engines.train``) knows nothing of rollout
or agents, and ``engines.cluster`` nothing of the rest. No part imports another by its bare
folder name (everything is ``sluice.<part>``), and no module reaches itself through a chain
of imports. ``benchmarks`` (measurement, run from a checkout and not shipped) may import any
part, and no part imports it. Function-local imports count like top-level ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each part of the ``sluice`` namespace and its folder in the checkout.
FOLDERS = {
    "flows": "flows",
    "tasks": "tasks",
    "driver": "driver",
    "policy": "policy",
    "engines": "engines",
    "storage": "storage",
    "config": "sluice/config",
    "rl": "rl",
    "envs": "envs",
    "sim": "sim",
}
PARTS = tuple(FOLDERS)
# What each part may import besides itself.
ALLOWED: dict[str, set[str]] = {
    "rl": set(),
    "envs": set(),
    "config": {"rl"},
    "storage": {"rl", "envs", "config"},
    "engines": {"storage", "rl", "envs", "config"},
    "policy": {"engines", "storage", "rl", "envs", "config"},
    "sim": {"rl", "config"},
    "driver": {"policy", "engines", "storage", "rl", "envs", "config"},
    "tasks": {"driver", "policy", "engines", "storage", "rl", "envs", "config"},
    "flows": {"tasks", "driver", "policy", "engines", "storage", "rl", "envs", "config", "sim"},
    "sluice": set(PARTS),
    "benchmarks": {*PARTS, "sluice"},
}
# Inside engines: the sub-packages one may not import.
ENGINES_FORBIDDEN = {
    "train": {"rollout", "agents"},
    "cluster": {"rollout", "agents", "train"},
}


def _modules() -> dict[str, Path]:
    """Module name (``sluice.storage.ledger``, ``benchmarks.suite``) -> file, for every module
    of the package and of the benchmarks."""
    found = {"sluice": ROOT / "sluice" / "__init__.py"}
    for part, folder in (*FOLDERS.items(), ("benchmarks", "benchmarks")):
        for file in sorted((ROOT / folder).rglob("*.py")):
            names = list(file.relative_to(ROOT / folder).with_suffix("").parts)
            if names[-1] == "__init__":
                names.pop()
            prefix = ["benchmarks"] if part == "benchmarks" else ["sluice", part]
            found[".".join([*prefix, *names])] = file
    return found


MODULES = _modules()


def _imports(name: str, file: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``file``, nested ones included."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base]) if base else ".".join(up)
            # `from sluice.storage import ledger` imports a module: resolve it when it is one.
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((node.lineno, full if full in MODULES else base))
    return out


def _part(module: str) -> str | None:
    names = module.split(".")
    if names[0] == "benchmarks":
        return "benchmarks"
    if names[0] != "sluice":
        return None
    return names[1] if len(names) > 1 and names[1] in PARTS else "sluice"


def _engines_package(module: str) -> str | None:
    names = module.split(".")
    return names[2] if names[:2] == ["sluice", "engines"] and len(names) > 3 else None


def _graph() -> dict[str, set[str]]:
    return {
        name: {m for _, m in _imports(name, file) if m in MODULES} for name, file in MODULES.items()
    }


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down_and_use_the_namespace(name: str) -> None:
    file, me = MODULES[name], _part(name)
    assert me is not None
    wrong = []
    for line, module in _imports(name, file):
        head = module.split(".")[0]
        if head in PARTS:
            wrong.append(f"{file.name}:{line} imports {module!r}: write sluice.{module}")
        part = _part(module)
        if part is not None and part != me and part not in ALLOWED[me]:
            wrong.append(f"{file.name}:{line}: {me} may not import {module} ({part})")
        inside, target = _engines_package(name), _engines_package(module)
        if target in ENGINES_FORBIDDEN.get(inside or "", set()):
            wrong.append(f"{file.name}:{line}: engines.{inside} may not import {module}")
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_rules_see_nested_imports(tmp_path: Path) -> None:
    """A function-local upward import is found like a top-level one."""
    file = tmp_path / "x.py"
    file.write_text("def f():\n    from sluice.flows.cli import app\n    import storage.ledger\n")
    found = [m for _, m in _imports("sluice.storage.x", file)]
    assert found == ["sluice.flows.cli", "storage.ledger"]
