"""Agent functions for the agent pool's tests: each misbehaves in one way."""

from __future__ import annotations

import asyncio
import os
import time


async def waits(base_url: str, prompt: str, delay: float = 0.5) -> float:
    await asyncio.sleep(delay)
    return 1.0 if base_url.endswith(prompt) else 0.5


def plain(base_url: str) -> dict:
    return {"reward": 0.25, "correct": True, "calls": 3}


def raises(base_url: str) -> float:
    raise KeyError("no plan")


async def hangs(base_url: str) -> float:
    await asyncio.sleep(3600)
    return 1.0


def blocks_the_loop_sync(base_url: str) -> float:
    time.sleep(3600)
    return 1.0


async def blocks_the_loop(base_url: str) -> float:
    time.sleep(3600)  # never yields: the process stops answering
    return 1.0


def junk(base_url: str) -> str:
    return "great"


def dies(base_url: str) -> float:
    os._exit(3)


async def two_turns(base_url: str, prompt: str, answer: str) -> dict:
    """An agent as a user would write it: the ``openai`` client, two calls, its own check."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="sluice", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and the answer is"},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    correct = answer in second.choices[0].message.content
    return {"reward": float(correct), "correct": correct, "calls": 2}


async def streamed_two_turns(base_url: str, prompt: str, answer: str) -> dict:
    """``two_turns`` with its first reply streamed, read as streaming clients read it: the
    deltas' text joined."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="sluice", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    stream = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=6, stream=True
    )
    reply = "".join([e.choices[0].delta.content or "" async for e in stream if e.choices])
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and the answer is"},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    correct = answer in second.choices[0].message.content
    return {"reward": float(correct), "correct": correct, "calls": 2}


async def best_of_two(base_url: str, prompt: str, answer: str) -> dict:
    """``two_turns`` asking for two first replies (``n=2``) and going on with the second."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="sluice", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(
        model="policy", messages=messages, max_tokens=6, n=2
    )
    messages += [
        first.choices[1].message.model_dump(exclude_none=True),
        {"role": "user", "content": "and the answer is"},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    correct = answer in second.choices[0].message.content
    return {"reward": float(correct), "correct": correct, "calls": 2}


async def someone_elses_session(base_url: str, prompt: str) -> float:
    from openai import AsyncOpenAI

    other = base_url.rsplit("/s/", 1)[0] + "/s/0123456789abcdef/v1"
    client = AsyncOpenAI(base_url=other, api_key="sluice", max_retries=0)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": prompt}]
    )
    return 1.0


def never_calls(base_url: str, prompt: str) -> float:
    return 1.0


async def agents_sdk(base_url: str, prompt: str, answer: str) -> dict:
    """An agent on the OpenAI Agents SDK: its chat-completions model over the episode's
    endpoint; one run, then a second that continues the first's conversation."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    client = AsyncOpenAI(base_url=base_url, api_key="sluice", max_retries=0)
    agent = Agent(
        name="adder",
        instructions="Add the numbers.",
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
        model_settings=ModelSettings(max_tokens=6),
    )
    first = await Runner.run(agent, prompt, max_turns=1)
    followup = [*first.to_input_list(), {"role": "user", "content": "and the answer is"}]
    second = await Runner.run(agent, followup, max_turns=1)
    correct = answer in str(second.final_output)
    return {"reward": float(correct), "correct": correct, "calls": 2}


async def langchain_chat(base_url: str, prompt: str, answer: str) -> dict:
    """An agent on LangChain's ``ChatOpenAI``: the first reply streamed (``astream``, which
    asks for the usage in the stream), the second invoked on the conversation so far."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI

    def chat(max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(
            model="policy", base_url=base_url, api_key="sluice", max_retries=0,
            max_tokens=max_tokens, stream_usage=True,
        )  # fmt: skip

    messages: list = [HumanMessage(prompt)]
    reply = "".join([str(chunk.content) async for chunk in chat(6).astream(messages)])
    messages += [AIMessage(reply), HumanMessage("and the answer is")]
    second = await chat(4).ainvoke(messages)
    correct = answer in str(second.content)
    return {"reward": float(correct), "correct": correct, "calls": 2}


async def pydantic_ai_chat(base_url: str, prompt: str, answer: str) -> dict:
    """An agent on pydantic-ai over the endpoint: a streamed run, then a run that continues
    its message history."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=base_url, api_key="sluice")
    agent = Agent(OpenAIChatModel("policy", provider=provider))
    async with agent.run_stream(prompt, model_settings={"max_tokens": 6}) as first:
        await first.get_output()
    second = await agent.run(
        "and the answer is",
        message_history=first.all_messages(),
        model_settings={"max_tokens": 4},
    )
    correct = answer in str(second.output)
    return {"reward": float(correct), "correct": correct, "calls": 2}
