"""The process a user's reward functions run in (``python -m sluice.envs.reward_child``).

``RewardPool`` (``envs/rewards.py``) starts one per pool slot and talks to it over its
stdin and stdout in JSON lines, nothing pickled either way. The first argument is a JSON
object: the functions' import paths, extra import roots, and the address-space limit in
MiB. Each request line is ``{"fn": index, "args": {...}}`` (keyword arguments of the call),
answered by one line ``{"ok": value}`` or ``{"error": "..."}``; or ``{"fn": index, "each":
[{...}, ...]}`` (a group's calls, run in turn), answered by one such line a call, each as
soon as its call returns (the pool's per-call timeout runs from the previous answer).
An async function is run to completion on this process's event loop. Whatever the user's
code prints goes to stderr, so it cannot corrupt the answers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import resource
import sys
from collections.abc import Mapping
from functools import partial
from typing import Any, TextIO


def _limit_memory(mib: int | None) -> None:
    if mib:
        limit = mib * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _jsonable(value: Any) -> Any:
    """``value`` as JSON data: a number, or a mapping of names to numbers and bools.

    Anything else is refused here with its type, so that the answer names what was wrong.
    """
    if isinstance(value, bool) or value is None:
        raise TypeError(f"returned {value!r}, not a number")
    if isinstance(value, int | float):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # numpy and torch scalars
        return _jsonable(value.item())
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"returned a mapping with the key {key!r}, not a string")
            out[key] = item if isinstance(item, bool) else _jsonable(item)
        return out
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    raise TypeError(f"returned a {type(value).__name__}, not a number or a mapping")


def _answer(out: TextIO, message: dict[str, Any]) -> None:
    # NaN and infinities travel as JSON's NaN/Infinity; the pool refuses them by name.
    out.write(json.dumps(message, allow_nan=True) + "\n")
    out.flush()


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
    answers = start_child(setup)
    # After the limit: imports count against it too.
    from sluice.envs.rewards import accepted_names, import_function, is_batched

    try:
        functions = [
            partial(import_function(path), **args) if args else import_function(path)
            for path, args in zip(setup["functions"], setup["args"], strict=True)
        ]
    except Exception as error:  # the pool checked these paths; a failure here is reported
        _answer(answers, {"fatal": f"{type(error).__name__}: {error}"})
        return 1
    names = [accepted_names(fn) for fn in functions]
    _answer(answers, {"ready": True, "batched": [is_batched(fn) for fn in functions]})
    loop = asyncio.new_event_loop()

    def call(fn: Any, takes: frozenset[str] | None, args: dict[str, Any]) -> dict[str, Any]:
        """One call's answer: ``{"ok": value}`` or ``{"error": "..."}``."""
        try:
            result = fn(**(args if takes is None else {k: args[k] for k in takes & set(args)}))
            if inspect.isawaitable(result):
                result = loop.run_until_complete(result)
        except MemoryError:
            return {"error": "memory limit: the reward function ran out of memory"}
        except Exception as error:
            try:
                detail = str(error)
            except Exception:
                detail = "<unprintable>"
            return {"error": f"raised {type(error).__name__}: {detail}"}
        try:
            return {"ok": _jsonable(result)}
        except TypeError as error:
            return {"error": str(error)}

    for line in sys.stdin:
        request = json.loads(line)
        fn, takes = functions[request["fn"]], names[request["fn"]]
        for args in request["each"] if "each" in request else [request["args"]]:
            _answer(answers, call(fn, takes, args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
