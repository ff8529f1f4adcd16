"""The process users' agent functions run in (``python -m sluice.envs.agent_child``).

``AgentPool`` (``envs/agents.py``) starts it and talks to it in JSON lines, nothing pickled.
The first argument is a JSON object: the agent's import path and fixed arguments, extra
import roots, the address-space limit in MiB and the time limit of one run. Each request
line is ``{"id": n, "args": {...}}`` (the keyword arguments of one run: the episode's
``base_url``, its ``prompt`` and the problem's fields), answered by ``{"id": n, "ok":
value}`` or ``{"id": n, "error": "..."}`` when that run ends, in any order: runs are tasks
on one event loop, so many wait on the endpoint at once; a plain function runs on a thread
of its own. A run past its time limit is cancelled and answered as an error. Whatever the
agent prints goes to stderr. The process ends when its standard input closes (the pool
closed it, or the worker that held it died), whatever its runs are doing.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TextIO

from sluice.envs.reward_child import _jsonable, start_child

THREADS = 256  # plain (not async) agents running at once


def _answer(out: TextIO, lock: threading.Lock, message: dict[str, Any]) -> None:
    with lock:
        out.write(json.dumps(message, allow_nan=True) + "\n")
        out.flush()


async def _run(
    agent: Any, takes: frozenset[str] | None, args: dict[str, Any], timeout: float
) -> Any:
    chosen = args if takes is None else {k: v for k, v in args.items() if k in takes}
    if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(
        getattr(agent, "func", None)
    ):
        return await asyncio.wait_for(agent(**chosen), timeout)
    result = await asyncio.wait_for(asyncio.to_thread(agent, **chosen), timeout)
    if inspect.isawaitable(result):
        result = await asyncio.wait_for(result, timeout)
    return result


async def _serve(agent: Any, takes: frozenset[str] | None, timeout: float, out: TextIO) -> None:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(THREADS, "agent"))
    lock = threading.Lock()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    tasks: set[asyncio.Task[None]] = set()

    async def one(request: dict[str, Any]) -> None:
        try:
            value = await _run(agent, takes, request["args"], timeout)
            message = {"id": request["id"], "ok": _jsonable(value)}
        except TimeoutError:
            message = {"id": request["id"], "error": f"timed out after {timeout:g} s"}
        except MemoryError:
            message = {"id": request["id"], "error": "memory limit: the agent ran out of memory"}
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
        agent = import_function(setup["agent"])
        if setup.get("args"):
            agent = partial(agent, **setup["args"])
    except Exception as error:
        answers.write(json.dumps({"fatal": f"{type(error).__name__}: {error}"}) + "\n")
        answers.flush()
        return 1
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    asyncio.run(_serve(agent, accepted_names(agent), float(setup["timeout_s"]), answers))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
