"""Which task a pretrained model can learn by RL here: greedy accuracy against sampled.

For each candidate task (chat prompts through the model folder's template, the reward
``sluice.envs.verifiers:final_number`` on the reply's last number) it measures on held-out
problems the greedy accuracy and, at each temperature, mean@k (the share of k samples that
are right) and pass@k (the share of problems with at least one right sample). RL needs a task whose
greedy accuracy starts clearly above 0 and well below the ceiling, and where sampling finds
right answers the greedy policy misses (pass@k well above mean@1): the groups GRPO learns
from. ``configs/smollm2.yaml`` trains the one this chose.

    .venv/bin/python -m benchmarks.real_tasks --model models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.tables import markdown_table

Task = Callable[[random.Random], tuple[str, str]]


def add2(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a}+{b}? Answer with just the number.", str(a + b)


def add3(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return f"What is {a}+{b}? Answer with just the number.", str(a + b)


def sub2(rng: random.Random) -> tuple[str, str]:
    a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
    return f"What is {a}-{b}? Answer with just the number.", str(a - b)


def mul1x2(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 9), rng.randint(10, 99)
    return f"What is {a}*{b}? Answer with just the number.", str(a * b)


def add1x2(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 9), rng.randint(10, 99)
    return f"What is {a}+{b}? Answer with just the number.", str(a + b)


def larger(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(range(10, 1000), 2)
    return f"Which number is larger, {a} or {b}? Answer with just the number.", str(max(a, b))


TASKS: dict[str, Task] = {
    "add 2+2 digits": add2,
    "add 3+3 digits": add3,
    "add 1+2 digits": add1x2,
    "subtract 2-2 digits": sub2,
    "multiply 1x2 digits": mul1x2,
    "larger of two": larger,
}


def score(completion: str, answer: str) -> bool:
    from sluice.envs.verifiers import final_number

    return bool(final_number(completion, answer)["correct"])


def write_data(task: str, folder: Path, train: int, heldout: int) -> None:
    """``task``'s problems as chat-message JSONL for ``env.name: dataset``: ``heldout.jsonl``
    (the probe's held-out problems first) and ``train.jsonl``, no question in both."""
    rng = random.Random(f"heldout/{task}")
    held = list(dict.fromkeys(TASKS[task](rng) for _ in range(heldout * 4)))[:heldout]
    seen = {q for q, _ in held}
    rng = random.Random(f"train/{task}")
    rows: dict[str, str] = {}
    while len(rows) < train:
        q, a = TASKS[task](rng)
        if q not in seen:
            rows[q] = a
    folder.mkdir(parents=True, exist_ok=True)
    for name, pairs in (("heldout", held), ("train", list(rows.items()))):
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as out:
            for q, a in pairs:
                out.write(json.dumps({"messages": [{"role": "user", "content": q}], "answer": a}))
                out.write("\n")
        print(f"wrote {len(pairs)} rows to {folder / f'{name}.jsonl'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--problems", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument(
        "--write-data",
        type=Path,
        help="measure nothing: write the first --tasks task's train.jsonl (4,000 problems) "
        "and heldout.jsonl (512) into this folder",
    )
    args = parser.parse_args()
    if args.write_data:
        write_data(args.tasks[0], args.write_data, 4000, 512)
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from sluice.engines.rollout.vllm_engine import engine_args

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    llm = LLM(model=str(args.model), seed=0, **engine_args(False, "float32", None, None, 0.9))
    rows, records = [], []
    for name in args.tasks:
        rng = random.Random(f"heldout/{name}")
        problems = [TASKS[name](rng) for _ in range(args.problems)]
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q, _ in problems
        ]
        start = time.monotonic()
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
        right = [score(o.outputs[0].text, a) for o, (_, a) in zip(greedy, problems, strict=True)]
        record = {
            "task": name,
            "greedy": sum(right) / len(right),
            "example": greedy[0].outputs[0].text,
        }
        for t in args.temperatures:
            sampled = llm.generate(
                prompts, SamplingParams(n=args.k, temperature=t, max_tokens=args.max_tokens, seed=1)
            )
            hits = [
                [score(c.text, a) for c in o.outputs]
                for o, (_, a) in zip(sampled, problems, strict=True)
            ]
            record[f"mean@{args.k} T={t:g}"] = sum(map(sum, hits)) / (len(hits) * args.k)
            record[f"pass@{args.k} T={t:g}"] = sum(map(any, hits)) / len(hits)
        record["seconds"] = round(time.monotonic() - start, 1)
        records.append(record)
        print(json.dumps(record), flush=True)
    keys = [k for k in records[0] if k not in ("task", "example")]
    for r in records:
        rows.append(
            [r["task"], *(f"{100 * r[k]:.1f}%" if k != "seconds" else f"{r[k]:.0f}" for k in keys)]
        )
    print("\n".join(markdown_table(["task", *keys], rows)))
    if args.out:
        args.out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
