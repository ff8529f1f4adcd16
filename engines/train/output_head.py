"""The policy's vocabulary projection, taken out of its forward pass.

A causal LM's forward ends with ``logits = lm_head(hidden)`` over every position. The
trainer needs the logits of the response positions alone, a chunk at a time
(``rl.losses.chunked_token_stats``), so it runs the forward with the head swapped for an
identity (the forward then returns the final hidden states as its "logits") and applies
the head itself. Engines that wrap the model (DDP, FSDP2, DeepSpeed, peft) still run their
hooks: the swap is inside the wrapped model, and the head is called as a module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)


class OutputHead:
    """The model's output-embedding module and where it hangs, to bypass it for a forward."""

    def __init__(self, owner: torch.nn.Module, attr: str, module: torch.nn.Module) -> None:
        self.owner, self.attr, self.module = owner, attr, module

    @classmethod
    def of(cls, model: torch.nn.Module, device: torch.device) -> OutputHead | None:
        """The head of ``model``, or None when applying it outside the forward would not give
        the model's own logits (a model that scales or soft-caps them after the head, or
        has no ``get_output_embeddings``): the trainer then uses the logits whole."""
        get = getattr(model, "get_output_embeddings", None)
        module = get() if callable(get) else None
        if not isinstance(module, torch.nn.Module):
            return None
        name = next((n for n, m in model.named_modules() if m is module), None)
        if not name:
            return None
        owner_name, _, attr = name.rpartition(".")
        head = cls(model.get_submodule(owner_name) if owner_name else model, attr, module)
        if not head.matches(model, device):
            log.info(
                "%s changes its logits after the output head; the trainer computes them whole",
                type(model).__name__,
            )
            return None
        return head

    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """The model's forward returns its final hidden states in place of the logits."""
        setattr(self.owner, self.attr, torch.nn.Identity())
        try:
            yield
        finally:
            setattr(self.owner, self.attr, self.module)

    @torch.no_grad()
    def matches(self, model: torch.nn.Module, device: torch.device) -> bool:
        """Whether the head applied to the bypassed forward's output gives the logits."""
        vocab = int(model.config.vocab_size)
        ids = (torch.arange(2, 10) % vocab)[None].to(device)
        training = model.training
        model.eval()  # no dropout between the two passes
        try:
            logits = model(input_ids=ids, use_cache=False).logits
            with self.bypassed():
                hidden = model(input_ids=ids, use_cache=False).logits
        finally:
            model.train(training)
        if hidden.shape[-1] == logits.shape[-1] and hidden.shape[-1] == vocab:
            return False  # the swap did not reach the head the forward calls
        return torch.allclose(self.module(hidden).float(), logits.float(), atol=1e-4, rtol=1e-4)
