"""A generative judge: a language model in a vLLM engine answering the question the run's
``reward.judge.prompt`` puts about each completion. Held by a ``ServedModelActor``
(``served.py``); greedy, so a verdict depends on the question only."""

from __future__ import annotations

from typing import Any

from sluice.engines.rollout.vllm_engine import engine_args

Answer = tuple[Any, str | None]  # (the verdict or score, or None; why not)


class JudgeEngine:
    """``__call__`` answers each question; one that does not fit the judge's context gets
    an error instead, and the others are still answered."""

    def __init__(
        self,
        model_dir: str,
        seed: int,
        max_new_tokens: int,
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
    ) -> None:
        import torch
        from vllm import LLM

        self._llm = LLM(
            model=model_dir,
            seed=seed,
            max_model_len=max_model_len,
            load_format="safetensors",  # never a pickled pytorch_model.bin
            **engine_args(torch.cuda.is_available(), kv_cache_gib=kv_cache_gib),  # type: ignore[arg-type]
        )
        self._tokenizer = self._llm.get_tokenizer()
        self._context = int(self._llm.llm_engine.model_config.max_model_len)
        self.max_new_tokens = max_new_tokens

    def prompt_ids(self, question: str) -> list[int]:
        """The question's tokens, as a user's message under the folder's chat template when
        it has one (the template adds any BOS itself)."""
        tok = self._tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
            return list(tok(str(text), add_special_tokens=False)["input_ids"])
        return list(tok(question)["input_ids"])

    def __call__(self, questions: list[str]) -> list[Answer]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [self.prompt_ids(q) for q in questions]
        room = self._context - self.max_new_tokens
        fits = [i for i, one in enumerate(ids) if len(one) <= room]
        answers: list[Answer] = [
            (None, f"the judge's question is {len(one)} tokens, over the {room} its context "
                   f"of {self._context} leaves beside judge.max_new_tokens")
            for one in ids
        ]  # fmt: skip
        if fits:
            params = SamplingParams(temperature=0.0, max_tokens=self.max_new_tokens)
            outputs = self._llm.generate(
                [TokensPrompt(prompt_token_ids=ids[i]) for i in fits],
                params,
                use_tqdm=False,
            )
            for i, out in zip(fits, outputs, strict=True):
                answers[i] = (out.outputs[0].text, None)
        return answers
