"""A multi-turn verifiers taskset with a tool, written with verifiers' API: the taskset
brings its own harness (an in-process chat loop) that offers a calculator; a tool call gets
its result, and a reply without one gets the calculator's answer as a user message and a
second turn. The reward reads the last reply. Id ``vftest_calc`` (see ``vftest_qa``)."""

from __future__ import annotations

import json
from typing import Any

import verifiers.v1 as vf
from openai import AsyncOpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Multiply two whole numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


class ProductData(vf.TaskData):
    a: int
    b: int


class ProductTask(vf.Task[ProductData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(str(self.data.a * self.data.b) in (trace.last_reply or ""))


class CalculatorChat(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):  # type: ignore[no-untyped-def]
        messages: list[dict[str, Any]] = [{"role": "user", "content": data.prompt}]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for turn in range(2):
                reply = await client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=[CALCULATOR], max_tokens=24
                )
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if message.tool_calls:
                    for call in message.tool_calls:
                        args = json.loads(call.function.arguments or "{}")
                        result = int(args.get("a", 0)) * int(args.get("b", 0))
                        messages.append(
                            {"role": "tool", "tool_call_id": call.id, "content": str(result)}
                        )
                elif turn == 0:
                    product = data.a * data.b
                    messages.append({"role": "user", "content": f"The calculator says {product}."})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class ProductTaskset(vf.Taskset[ProductTask]):
    def load(self) -> list[ProductTask]:
        return [
            ProductTask(ProductData(prompt=f"What is {a}*{a + 7}?", a=a, b=a + 7), self.config.task)
            for a in range(11, 31)
        ]


__all__ = ["CalculatorChat", "ProductTaskset"]
