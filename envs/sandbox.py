"""Model-written Python, run in a subprocess with limits: the Python tool's sandbox.

``run_python(code, limits)`` writes ``code`` into a private temporary folder and runs it
with the interpreter in isolated mode (``-I -S``: no site-packages, no environment
variables, no user folders) in a process group of its own. Before the code runs, the
process isolates itself (``_LAUNCHER``): a network namespace of its own (no interface but
a loopback that is down), a mount namespace in which every mount is read-only except its
folder, and then no privileges (root drops to ``nobody``; anyone else gets a user
namespace and gives up its capabilities in it). Then it limits CPU seconds, address
space, file size (stdout and stderr go to files, so this bounds the output too), open
files and processes (``RLIMIT_NPROC``). The caller waits at most ``wall_s`` and then
kills the process group; the folder is removed afterwards.

Nothing here raises for what the code does: the outcome (``SandboxResult``) says how it
ended (``ok``, ``error``, ``timeout``, ``cpu``, ``memory``, ``output``, ``processes``, or
``sandbox`` when this machine cannot isolate a process), with the output cut to
``output_chars``. Called by the Python tool (``envs/tools.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Runs in the sandboxed interpreter before the code: the limits, the network namespace,
# then the code itself as __main__. It prints nothing of its own on success.
_LAUNCHER = r"""
import ctypes, json, os, resource, runpy, signal, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
here = os.getcwd()
def check(result, what):
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")
class MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("set", "clr", "propagation", "userns_fd")]
def read_only(path, on, recursive):
    attr = MountAttr(1, 0, 0, 0) if on else MountAttr(0, 1, 0, 0)  # MOUNT_ATTR_RDONLY
    flags = 0x8000 if recursive else 0  # AT_RECURSIVE
    check(libc.syscall(442, -100, path, flags, ctypes.byref(attr), ctypes.sizeof(attr)),
          "mount_setattr")
root = os.geteuid() == 0
try:
    # Network and mounts of its own (and, unprivileged, a user namespace to make them in).
    check(libc.unshare(0x40000000 | 0x00020000 | (0 if root else 0x10000000)), "unshare")
    check(libc.mount(None, b"/", None, 0x44000, None), "private")  # MS_REC | MS_PRIVATE
    check(libc.mount(here.encode(), here.encode(), None, 0x1000, None), "bind")  # MS_BIND
    read_only(b"/", True, True)  # every mount read-only, then this folder writable again
    read_only(here.encode(), False, False)
    os.chdir(here)
    if root:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    else:  # drop what the user namespace gave: no capabilities, no way back to them
        check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
        header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
        check(libc.capset(header, data), "capset")
except OSError as error:
    sys.stderr.write(f"sandbox: cannot isolate the process: {error}\n")
    sys.exit(cfg["setup_exit"])
def limit(kind, value):
    resource.setrlimit(kind, (value, value))
limit(resource.RLIMIT_CPU, cfg["cpu_s"])
limit(resource.RLIMIT_AS, cfg["memory_mib"] << 20)
limit(resource.RLIMIT_FSIZE, cfg["file_bytes"])
limit(resource.RLIMIT_NPROC, cfg["processes"])
limit(resource.RLIMIT_NOFILE, 64)
limit(resource.RLIMIT_CORE, 0)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""
_SETUP_EXIT = 87  # the launcher could not isolate the process (no namespace, no nobody)


def _usable_by_all(path: str) -> bool:
    """Whether any user may run ``path``: every folder above it is searchable by others."""
    real = Path(path).resolve()
    return all(p.stat().st_mode & 0o001 for p in [real, *real.parents])


def interpreter() -> str | None:
    """The Python the sandbox runs: this one, unless it lives where ``nobody`` cannot go
    (a pyenv under /root) and we are root; then the system's. None if there is none."""
    candidates = [sys.executable, shutil.which("python3") or "", "/usr/bin/python3"]
    for path in filter(os.path.exists, candidates):
        if os.geteuid() != 0 or _usable_by_all(path):
            return str(Path(path).resolve())
    return None


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; the defaults fit a calculator-sized snippet."""

    wall_s: float = 5.0
    cpu_s: int = 2
    memory_mib: int = 256
    file_bytes: int = 1 << 20
    processes: int = 8
    output_chars: int = 2000


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended: ``kind`` is ``ok``, ``error`` (the code raised or exited non-zero),
    ``timeout``, ``cpu``, ``memory``, ``output``, ``processes`` or ``sandbox`` (it could
    not be isolated); ``output`` is stdout then stderr, cut to the limit."""

    kind: str
    output: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    def observation(self) -> str:
        """What the model is shown: the output, or the limit that stopped the code."""
        if self.kind == "ok":
            return self.output
        reason = {
            "timeout": "timed out",
            "cpu": "CPU time limit",
            "memory": "memory limit",
            "output": "output limit",
            "processes": "process limit",
            "sandbox": "sandbox unavailable",
        }.get(self.kind, "error")
        return f"{reason}: {self.output}".rstrip(": \n")


def _cut(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars] + f"\n... [{len(text) - chars} chars cut]"


def _read(path: Path, chars: int) -> str:
    with path.open("rb") as f:
        data = f.read(chars * 4 + 4)
    return data.decode("utf-8", errors="replace")


def _kind(returncode: int, stderr: str, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode == _SETUP_EXIT and stderr.startswith("sandbox:"):
        return "sandbox"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"  # the soft limit sends SIGXCPU; a process that ignores it gets SIGKILL
    if returncode == -signal.SIGXFSZ or "File too large" in stderr:
        return "output"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    if "Resource temporarily unavailable" in stderr or "BlockingIOError" in stderr:
        return "processes"
    return "error"


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` under ``limits``; never raises for what the code does."""
    limits = limits or SandboxLimits()
    started = time.monotonic()
    python = interpreter()
    if python is None:
        return SandboxResult(
            "sandbox", "no Python that user nobody may run (install python3 readable by all)", 0.0
        )
    with tempfile.TemporaryDirectory(prefix="sluice-sandbox-") as folder:
        root = Path(folder)
        (root / "main.py").write_text(code, encoding="utf-8")
        if os.geteuid() == 0:  # the code runs as nobody: its folder is its own
            os.chown(root, 65534, 65534)
        config = {
            "cpu_s": limits.cpu_s,
            "memory_mib": limits.memory_mib,
            "file_bytes": limits.file_bytes,
            "processes": limits.processes,
            "setup_exit": _SETUP_EXIT,
        }
        out, err = root / "stdout", root / "stderr"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            process = subprocess.Popen(
                [python, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(config)],
                cwd=root,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                env={"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"},
                start_new_session=True,
            )
            timed_out = False
            try:
                process.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            # The whole group: whatever the code started goes with it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        stdout_text = _read(out, limits.output_chars)
        stderr_text = _read(err, limits.output_chars)
    kind = _kind(process.returncode, stderr_text, timed_out)
    text = stdout_text if kind == "ok" else (stdout_text + stderr_text)
    if kind == "error":  # the last lines of a traceback say what went wrong
        text = stdout_text + "\n".join(stderr_text.strip().splitlines()[-3:])
    return SandboxResult(
        kind, _cut(text.strip("\n"), limits.output_chars), time.monotonic() - started
    )
