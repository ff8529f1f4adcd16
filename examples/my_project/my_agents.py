"""An agent written as plain Python against the ``openai`` client, for ``env.agent``.

Sluice calls it once per episode with the episode's endpoint (``base_url``: this episode's
session on a rollout worker, serving the policy being trained), the problem's prompt and
its reference answer; it talks to the model as it would to any OpenAI-compatible server and
returns the episode's reward. Sluice records every call's tokens, so the trajectory it
trains on is exactly what the model saw and sampled.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from sluice.envs.verifiers import final_number


def final(text: str) -> str:
    """The result a reply ends with: what follows its last ``|`` (the addition
    environment's answers show their column work first, ``7+5=12,4+8+1=13|132``)."""
    return text.rsplit("|", 1)[-1].strip()


async def show_your_work(base_url: str, prompt: str, answer: str) -> dict:
    """Ask; when the reply gives no result after a ``|``, ask once more for it. Reward 1
    when the result is the answer's."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": prompt}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
    text = reply.choices[0].message.content or ""
    asked_again = not final(text).isdigit()
    if asked_again:
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "End with |result."},
        ]
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=32
        )
        text = reply.choices[0].message.content or ""
    correct = final(text) == final(answer)
    return {"reward": float(correct), "correct": correct, "asked_again": float(asked_again)}


async def ask_for_the_number(base_url: str, messages: list[dict], answer: str) -> dict:
    """A chat model's two turns (``smollm2_agent.yaml``): the data row's own messages; when
    the reply holds no number, ask once more for just the number. Scored by the reply's last
    number, as ``sluice.envs.verifiers:final_number`` scores a single turn."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(messages)
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
    text = reply.choices[0].message.content or ""
    asked_again = not final_number(text, answer)["parsed"]
    if asked_again:
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Answer with just the number."},
        ]
        reply = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=16
        )
        text = reply.choices[0].message.content or ""
    verdict = final_number(text, answer)
    return {
        "reward": verdict["reward"],
        "correct": verdict["correct"],
        "asked_again": float(asked_again),
    }
