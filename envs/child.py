"""The process user code runs in (``python -m sluice.envs.child``): reward functions, an
environment's steps and agents, many calls at once.

``IsolatedPool`` (``envs/isolated.py``) starts it and talks to it in JSON lines over its
stdin and stdout, nothing pickled either way. The first argument is a JSON object: the
functions' import paths and fixed arguments, extra import roots, the address-space limit in
MiB (on top of what the interpreter itself maps), the time limit of one call and the shape
of its answers (``"reward"``: a number, a mapping of names to numbers, or a list of them,
as reward functions and agents return; ``"json"``: any JSON data). It first answers
``{"ready": true, "batched": [...]}`` (which functions take a whole group), or
``{"fatal": "..."}`` when a function does not import.

Each request line is ``{"calls": [{"id": n, "fn": i, "args": {...}}, ...]}`` (function
``i`` with these keyword arguments, for each call: a group's calls travel together), each
call answered by ``{"id": n, "ok": value}`` or ``{"id": n, "error": "..."}`` when it ends,
in any order: many calls run at once (``_Calls``). A call past its time limit is answered
as an error (an async one is cancelled; a plain one's thread cannot be stopped and runs on,
which the pool counts). Whatever the user's code prints goes to stderr, so it cannot
corrupt the answers. The process ends when its stdin closes (the pool closed it, or the
worker that held it died), whatever its calls are doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import resource
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TextIO

THREADS = 256  # plain (not async) calls running at once
SLOW_S = 0.05  # a plain call running this long no longer holds up the calls behind it


def _mapped_mib() -> int:
    """This process's address space now, in MiB (0 where /proc cannot say)."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) // 1024
    return 0


def _limit_memory(mib: int | None) -> None:
    """``mib`` of address space beyond what the interpreter maps before user code runs."""
    if mib:
        limit = (_mapped_mib() + mib) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def reward_value(value: Any) -> Any:
    """``value`` as JSON data: a number, a mapping of names to numbers and bools, or a list
    of them. Anything else is refused here with its type, so that the answer names what was
    wrong."""
    if isinstance(value, bool) or value is None:
        raise TypeError(f"returned {value!r}, not a number")
    if isinstance(value, int | float):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # numpy and torch scalars
        return reward_value(value.item())
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"returned a mapping with the key {key!r}, not a string")
            out[key] = item if isinstance(item, bool) else reward_value(item)
        return out
    if isinstance(value, list | tuple):
        return [reward_value(item) for item in value]
    raise TypeError(f"returned a {type(value).__name__}, not a number or a mapping")


def json_value(value: Any) -> Any:
    """``value`` if it is JSON data (else ``TypeError`` naming why)."""
    return json.loads(json.dumps(value, allow_nan=True))


class _Answers:
    """The real stdout, written one whole line at a time from any thread."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.lock = out, threading.Lock()

    def __call__(self, *messages: dict[str, Any]) -> None:
        # NaN and infinities travel as JSON's NaN/Infinity; the pool refuses them by name.
        lines = "".join(json.dumps(message, allow_nan=True) + "\n" for message in messages)
        with self.lock:
            self.out.write(lines)
            self.out.flush()


def _failure(error: BaseException) -> str:
    if isinstance(error, MemoryError):
        return "memory limit: it ran out of memory"
    try:
        detail = str(error)
    except Exception:
        detail = "<unprintable>"
    return f"raised {type(error).__name__}: {detail}"


def _is_async(function: Any) -> bool:
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "func", None)  # through a partial
    )


@dataclass(eq=False)
class _Queue:
    """Plain calls of one request, run in turn on one thread while each is quick: one
    thread and one write a group, where a thread a call would cost more than the calls."""

    calls: deque[tuple[int, Callable[..., Any], dict[str, Any]]]
    since: float = 0.0  # when the call running now started
    answers: list[dict[str, Any]] = field(default_factory=list)  # ready, not written yet


class _Calls:
    """Runs each request's calls: an async function's on an event loop of a thread of its
    own, a plain function's in turn on a thread of the pool. A watcher answers the calls
    whose time is up (a plain call's thread cannot be stopped and runs on), and gives each
    call still waiting behind one that has run for ``SLOW_S`` a thread of its own, so that
    no call waits behind a slow one."""

    def __init__(
        self,
        functions: list[Callable[..., Any]],
        timeout: float,
        shape: Callable[[Any], Any],
        answer: _Answers,
    ) -> None:
        from sluice.envs.rewards import accepted_names

        self.functions, self.timeout, self.shape, self.answer = functions, timeout, shape, answer
        self.names = [accepted_names(fn) for fn in functions]
        self.threads = ThreadPoolExecutor(THREADS, "call")
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="async-calls", daemon=True).start()
        self.lock = threading.Lock()
        self.running: dict[int, float] = {}  # plain calls started, not answered: deadlines
        self.queues: set[_Queue] = set()  # with a call running
        threading.Thread(target=self._watch, name="call-watch", daemon=True).start()

    def start(self, requests: list[dict[str, Any]]) -> None:
        plain: deque[tuple[int, Callable[..., Any], dict[str, Any]]] = deque()
        for request in requests:
            fn, call_id, args = request["fn"], request["id"], request["args"]
            function, takes = self.functions[fn], self.names[fn]
            chosen = args if takes is None else {k: v for k, v in args.items() if k in takes}
            if _is_async(function):
                running = self._run_async(call_id, function, chosen)
                asyncio.run_coroutine_threadsafe(running, self.loop)
            else:
                plain.append((call_id, function, chosen))
        if plain:
            self.threads.submit(self._run_queue, _Queue(plain))

    def _run_queue(self, queue: _Queue) -> None:
        while True:
            with self.lock:
                if not queue.calls:
                    self.queues.discard(queue)
                    answers, queue.answers = queue.answers, []
                    break
                call_id, function, args = queue.calls.popleft()
                queue.since = time.monotonic()
                self.running[call_id] = queue.since + self.timeout
                self.queues.add(queue)
            message = self._run_plain(call_id, function, args)
            with self.lock:
                if self.running.pop(call_id, None) is not None:  # else: answered as timed out
                    queue.answers.append(message)
        self.answer(*answers)

    def _run_plain(
        self, call_id: int, function: Callable[..., Any], args: dict[str, Any]
    ) -> dict[str, Any]:
        try:
            result = function(**args)
            if inspect.isawaitable(result):  # a plain function that returned a coroutine
                result = asyncio.run_coroutine_threadsafe(_awaited(result), self.loop).result()
            return {"id": call_id, "ok": self.shape(result)}
        except BaseException as error:  # user code: any failure is an answer
            return {"id": call_id, "error": _failure(error)}

    async def _run_async(
        self, call_id: int, function: Callable[..., Any], args: dict[str, Any]
    ) -> None:
        try:
            result = await asyncio.wait_for(function(**args), self.timeout)
            message = {"id": call_id, "ok": self.shape(result)}
        except TimeoutError:
            message = {"id": call_id, "error": f"timed out after {self.timeout:g} s"}
        except BaseException as error:  # user code: any failure is an answer
            message = {"id": call_id, "error": _failure(error)}
        self.answer(message)

    def _watch(self) -> None:
        while True:
            time.sleep(SLOW_S)
            now = time.monotonic()
            with self.lock:
                late = [call_id for call_id, due in self.running.items() if now >= due]
                for call_id in late:
                    del self.running[call_id]
                answers = [
                    {"id": call_id, "error": f"timed out after {self.timeout:g} s"}
                    for call_id in late
                ]
                moved: list[tuple[int, Callable[..., Any], dict[str, Any]]] = []
                for queue in self.queues:
                    if now - queue.since >= SLOW_S:  # its call is slow: nothing waits on it
                        moved += queue.calls
                        queue.calls = deque()
                        answers += queue.answers  # the quick ones before the slow one
                        queue.answers = []
            if answers:
                self.answer(*answers)
            for call in moved:
                self.threads.submit(self._run_queue, _Queue(deque([call])))


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _serve(calls: _Calls) -> None:
    for line in sys.stdin.buffer:
        calls.start(json.loads(line)["calls"])
    # Standard input closed: the pool closed, or its worker died. Nobody waits for the calls
    # still going, and a hung one must not keep this process alive.
    os._exit(0)


def start_child(setup: Mapping[str, Any]) -> TextIO:
    """What a process of user code does first: answers go to the real stdout (returned),
    the user's prints to stderr; the address-space limit; the user's import roots."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _limit_memory(setup.get("memory_mib"))
    sys.path[:0] = [root for root in setup.get("roots", []) if root not in sys.path]
    return answers


def main(argv: list[str]) -> int:
    setup = json.loads(argv[0])
    answer = _Answers(start_child(setup))
    # After the limit: the user's imports count against it.
    from sluice.envs.rewards import import_function, is_batched

    try:
        functions = [
            partial(import_function(path), **args) if args else import_function(path)
            for path, args in zip(setup["functions"], setup["args"], strict=True)
        ]
    except Exception as error:  # the caller checked these paths; a failure here is reported
        answer({"fatal": f"{type(error).__name__}: {error}"})
        return 1
    answer({"ready": True, "batched": [is_batched(fn) for fn in functions]})
    shape = reward_value if setup.get("answers", "reward") == "reward" else json_value
    _serve(_Calls(functions, float(setup["timeout_s"]), shape, answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
