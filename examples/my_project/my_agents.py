"""An agent written as plain Python against the ``openai`` client, for ``env.agent``.

Sluice calls it once per episode with the episode's endpoint (``base_url``: this episode's
session on a rollout worker, serving the policy being trained), the problem's prompt and
its reference answer; it talks to the model as it would to any OpenAI-compatible server and
returns the episode's reward. Sluice records every call's tokens, so the trajectory it
trains on is exactly what the model saw and sampled.
"""

from __future__ import annotations

from openai import AsyncOpenAI


async def answer_in_digits(base_url: str, prompt: str, answer: str) -> dict:
    """Ask; when the reply is not a number, ask once more for digits only. Reward 1 when
    the last reply is the answer."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    text = (reply.choices[0].message.content or "").strip()
    asked_again = not text.isdigit()
    if asked_again:
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Digits only."},
        ]
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=8
        )
        text = (reply.choices[0].message.content or "").strip()
    correct = text == answer
    return {"reward": float(correct), "correct": correct, "asked_again": float(asked_again)}
