"""A reward model: a sequence-classification folder (transformers) scoring whole texts,
held by a ``ServedModelActor`` (``served.py``). One label: the sigmoid of its logit is the
reward; more: the probability of the last label. Either lies in [0, 1]."""

from __future__ import annotations

from sluice.engines.reward_models.judge import Answer


class ClassifierEngine:
    """``__call__`` scores texts ``batch_size`` at a time, each cut to its last
    ``max_length`` tokens."""

    def __init__(self, model_dir: str, max_length: int, batch_size: int) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer.truncation_side = "left"  # the completion is at the end
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, use_safetensors=True, dtype=torch.float32
        ).eval()
        if self.model.config.pad_token_id is None:  # it finds each text's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_length, self.batch_size = max_length, batch_size

    def __call__(self, texts: list[str]) -> list[Answer]:
        import torch

        scores: list[Answer] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                logits = self.model(**batch).logits.float()
                if logits.shape[-1] == 1:
                    probs = torch.sigmoid(logits[:, 0])
                else:
                    probs = torch.softmax(logits, dim=-1)[:, -1]
                scores += [(float(p), None) for p in probs]
        return scores
