"""An agent written as plain Python against the ``openai`` client, for ``env.agent``.

Sluice calls it once per episode with the episode's endpoint (``base_url``: this episode's
session on a rollout worker, serving the policy being trained), the problem's prompt and
its reference answer; it talks to the model as it would to any OpenAI-compatible server and
returns the episode's reward. Sluice records every call's tokens, so the trajectory it
trains on is exactly what the model saw and sampled.
"""

from __future__ import annotations

from openai import AsyncOpenAI


async def answer_then_confirm(base_url: str, prompt: str, answer: str) -> dict:
    """Ask, then ask for the final answer; reward 1 if the final reply holds the answer."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Final answer, digits only:"},
    ]
    final = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    correct = final.choices[0].message.content.strip() == answer
    return {"reward": float(correct), "correct": correct}
