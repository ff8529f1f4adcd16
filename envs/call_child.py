"""The process a user's function runs in, many calls at once (``python -m
sluice.envs.call_child``): agents (``envs/agents.py``) and multi-turn environments' steps
(``engines/rollout/episodes.py``).

``IsolatedCalls`` (``envs/isolated.py``) starts it and talks to it in JSON lines, nothing
pickled. The first argument is a JSON object: the function's import path and fixed
arguments, extra import roots, the address-space limit in MiB, the time limit of one call
and the shape of its answers (``"reward"``: a number or a mapping of numbers, as agents
return; ``"json"``: any JSON data). Each request line is ``{"id": n, "args": {...}}``
(the keyword arguments of one call), answered by ``{"id": n, "ok": value}`` or
``{"id": n, "error": "..."}`` when that call ends, in any order: calls are tasks on one
event loop, so many wait at once; a plain function runs on a thread of its own. A call
past its time limit is cancelled and answered as an error. Whatever the function prints
goes to stderr. The process ends when its standard input closes (the pool closed it, or
the worker that held it died), whatever its calls are doing.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TextIO

from sluice.envs.reward_child import _jsonable, start_child

THREADS = 256  # plain (not async) calls running at once


def _json_data(value: Any) -> Any:
    """``value`` if it is JSON data (else ``TypeError`` naming why)."""
    return json.loads(json.dumps(value, allow_nan=True))


def _answer(out: TextIO, lock: threading.Lock, message: dict[str, Any]) -> None:
    with lock:
        out.write(json.dumps(message, allow_nan=True) + "\n")
        out.flush()


async def _run(
    function: Any, takes: frozenset[str] | None, args: dict[str, Any], timeout: float
) -> Any:
    chosen = args if takes is None else {k: v for k, v in args.items() if k in takes}
    if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "func", None)
    ):
        return await asyncio.wait_for(function(**chosen), timeout)
    result = await asyncio.wait_for(asyncio.to_thread(function, **chosen), timeout)
    if inspect.isawaitable(result):
        result = await asyncio.wait_for(result, timeout)
    return result


async def _serve(
    function: Any,
    takes: frozenset[str] | None,
    timeout: float,
    answers: Callable[[Any], Any],
    out: TextIO,
) -> None:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(THREADS, "call"))
    lock = threading.Lock()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()

    async def one(request: dict[str, Any]) -> None:
        try:
            value = await _run(function, takes, request["args"], timeout)
            message = {"id": request["id"], "ok": answers(value)}
        except TimeoutError:
            message = {"id": request["id"], "error": f"timed out after {timeout:g} s"}
        except MemoryError:
            message = {"id": request["id"], "error": "memory limit: it ran out of memory"}
        except Exception as error:
            try:
                detail = str(error)
            except Exception:
                detail = "<unprintable>"
            message = {"id": request["id"], "error": f"raised {type(error).__name__}: {detail}"}
        _answer(out, lock, message)

    while line := await reader.readline():
        task = asyncio.create_task(one(json.loads(line)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    # Standard input closed: the pool closed, or its worker died. Nobody waits for the runs
    # still going, and a hung one must not keep this process alive.
    os._exit(0)


def main(argv: list[str]) -> int:
    setup = json.loads(argv[0])
    answers = start_child(setup)
    from sluice.envs.rewards import accepted_names, import_function

    try:
        function = import_function(setup["function"])
        if setup.get("args"):
            function = partial(function, **setup["args"])
    except Exception as error:
        answers.write(json.dumps({"fatal": f"{type(error).__name__}: {error}"}) + "\n")
        answers.flush()
        return 1
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    shape = _jsonable if setup.get("answers", "reward") == "reward" else _json_data
    timeout = float(setup["timeout_s"])
    asyncio.run(_serve(function, accepted_names(function), timeout, shape, answers))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
