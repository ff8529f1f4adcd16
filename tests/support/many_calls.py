"""Many agents calling one chat endpoint at once (``python -m tests.support.many_calls
BASE_URL N``): session ``s0000`` ... of the URL's host, one call each; prints a JSON count
of the outcomes ("ok" or the error's type)."""

from __future__ import annotations

import asyncio
import collections
import json
import sys

from openai import AsyncOpenAI


async def one(host: str, i: int) -> str:
    client = AsyncOpenAI(base_url=f"{host}/s/s{i:04d}/v1", api_key="x", max_retries=0)
    try:
        await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "2+3?"}], max_tokens=4
        )
        return "ok"
    except Exception as error:
        return f"{type(error).__name__}: {error.__cause__!r}"


async def main(host: str, n: int) -> None:
    outcomes = await asyncio.gather(*(one(host, i) for i in range(n)))
    print(json.dumps(collections.Counter(outcomes)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
