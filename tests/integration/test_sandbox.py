"""Model-written code runs in a real subprocess under real limits; every limit is hit here
and comes back as an outcome the model is shown, never as an exception."""

import os
import socket
import tempfile
from pathlib import Path

import pytest

from sluice.envs.sandbox import SandboxLimits, run_python
from sluice.envs.tools import PythonTool

pytestmark = pytest.mark.integration

FAST = SandboxLimits(wall_s=3.0, cpu_s=1, memory_mib=256, file_bytes=64 << 10, processes=8)


def test_code_runs_and_its_output_comes_back():
    result = run_python("import math\nprint(math.factorial(20))", FAST)
    assert (result.kind, result.output) == ("ok", "2432902008176640000")
    tool = PythonTool(FAST)({"code": "print(6 * 7)"})
    assert (tool.text, tool.error) == ("42", None)


def test_an_exception_is_an_error_with_the_traceback_tail():
    result = run_python("raise ValueError('boom')", FAST)
    assert result.kind == "error" and "ValueError: boom" in result.output


def test_a_loop_that_never_ends_hits_the_cpu_limit():
    result = run_python("while True:\n    pass", FAST)
    assert result.kind == "cpu" and result.observation().startswith("CPU time limit")


def test_code_that_waits_forever_is_killed_at_the_wall_time():
    result = run_python("import time\ntime.sleep(600)", SandboxLimits(wall_s=1.0))
    assert result.kind == "timeout" and result.seconds < 10
    assert result.observation() == "timed out"


def test_allocation_without_bound_hits_the_memory_limit():
    result = run_python("x = bytearray(4 * 1024**3)", FAST)
    assert result.kind == "memory" and result.observation().startswith("memory limit")


def test_megabytes_of_output_hit_the_file_size_limit_and_are_cut():
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", FAST)
    assert result.kind == "output"
    assert len(result.output) < FAST.output_chars + 100


def test_a_fork_bomb_hits_the_process_limit_and_leaves_nothing_behind():
    marker = "sluice-sandbox-fork-test"
    code = f"import os, time\nfor _ in range(64):\n    os.fork()\ntime.sleep(30)  # {marker}"
    result = run_python(code, FAST)
    assert result.kind == "processes"
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmd(p).find(marker) >= 0]
    assert left == []


def _cmd(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_code_cannot_write_outside_its_folder():
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o777)  # writable by anyone: only the sandbox stops the write
        target = Path(folder) / "escaped"
        result = run_python(f"open({str(target)!r}, 'w').write('x')\nprint('wrote')", FAST)
        assert result.kind == "error" and "Read-only file system" in result.output
        assert not target.exists()
    inside = run_python("open('notes.txt', 'w').write('x')\nprint(open('notes.txt').read())", FAST)
    assert (inside.kind, inside.output) == ("ok", "x")


def test_code_has_no_network():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)"
        result = run_python(code, FAST)
    finally:
        server.close()
    assert result.kind == "error" and "Network is unreachable" in result.output


@pytest.mark.parametrize("code", ["import numpy", "import sluice"])
def test_only_the_standard_library_is_there(code):
    assert "ModuleNotFoundError" in run_python(code, FAST).output
