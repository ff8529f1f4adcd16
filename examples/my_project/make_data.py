"""Write this example's data files: addition problems as JSONL, one problem a line.

    python examples/my_project/make_data.py

They are the problems Sluice's built-in ``addition`` environment draws for
``configs/default.yaml`` (its training pool and held-out set, same seeds), so a run on the
files can be set beside a run on the built-in environment. Any JSONL with a prompt column
works the same way; this script only makes one.

``chat.jsonl`` holds the training problems again as chat messages (for ``chat.yaml``, which
runs a model folder with a chat template), the sum as the answer, and a ``digits`` column
that reaches the reward.
"""

from __future__ import annotations

import json
from pathlib import Path

from sluice import load_config, make_env

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def main() -> None:
    cfg = load_config(ROOT / "configs" / "default.yaml")
    env = make_env("addition", digits=cfg.env.digits, scratch=cfg.env.scratch)
    splits = {
        "train": env.problems("train", cfg.env.train_prompts, cfg.seed),
        "heldout": env.problems("heldout", cfg.eval.prompts, cfg.seed + 1),
    }
    (HERE / "data").mkdir(exist_ok=True)
    for split, problems in splits.items():
        unique = {p.prompt: p for p in problems}.values()  # as the built-in pool dedupes
        with open(HERE / "data" / f"{split}.jsonl", "w", encoding="utf-8") as out:
            for p in unique:
                out.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
        print(f"wrote {len(unique)} rows to {HERE / 'data' / f'{split}.jsonl'}")
    with open(HERE / "data" / "chat.jsonl", "w", encoding="utf-8") as out:
        rows = {p.prompt: p for p in splits["train"]}
        for prompt in rows:
            a, b = prompt.rstrip("?=").split("+")
            messages = [
                {"role": "system", "content": "Reply with the sum only."},
                {"role": "user", "content": f"What is {a} + {b}?"},
            ]
            row = {
                "messages": messages,
                "answer": str(int(a) + int(b)),
                "digits": max(len(a), len(b)),
            }
            out.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {HERE / 'data' / 'chat.jsonl'}")


if __name__ == "__main__":
    main()
