"""What a chat template puts between a sampled assistant turn and the next one.

A conversation that goes on after the model's turn (a tool's result, a user's reply) must
reach the model as the template would render it, but without re-rendering, let alone
re-tokenizing, the turns already sampled. ``TurnFormat`` finds the text once, from the
template itself: the rest of an assistant turn after its content (ChatML: ``<|im_end|>\\n``),
and the rendering of new messages after a finished conversation, with the generation
prompt. ``after_turn`` is that text for one turn: the part of the turn's ending the model
did not sample (after its end-of-turn token, or all of it when the turn was cut at its token
limit), then the new messages. It is tokenized once and appended; the tokens it adds are
trained on by nobody (loss mask 0).

Used by the chat sessions of agents (``engines/agents/sessions.py``) and by multi-turn
environments whose observations are chat messages (``EnvStep.role``).
"""

from __future__ import annotations

from typing import Any

_USER = "sluice-probe-question"
_REPLY = "sluice-probe-reply"


class TemplateError(ValueError):
    """The template cannot continue a conversation after a sampled turn."""


class TurnFormat:
    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self._base = [
            {"role": "user", "content": _USER},
            {"role": "assistant", "content": _REPLY},
        ]
        rendered = self._render(self._base, False)
        if _REPLY not in rendered:
            raise TemplateError("the chat template does not render an assistant's content")
        self._rendered = rendered
        self.closing = rendered[rendered.rindex(_REPLY) + len(_REPLY) :]
        self._special = set(getattr(tokenizer, "all_special_ids", ()))

    def _render(self, messages: list[dict[str, Any]], generation: bool, **kwargs: Any) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation, **kwargs
            )
        )

    def first(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The whole rendering of a conversation's first messages, ready for a reply."""
        return self._render(messages, True, **kwargs)

    def after_turn(self, sampled: list[int], messages: list[dict[str, Any]]) -> str:
        """The text that follows an assistant turn of ``sampled`` tokens when ``messages``
        come next, up to the generation prompt of the next turn."""
        full = self._render([*self._base, *messages], True)
        if not full.startswith(self._rendered):
            raise TemplateError(
                "the chat template renders a finished conversation differently once new "
                "messages follow it: cannot continue after a sampled turn"
            )
        ending = self.closing
        if sampled and sampled[-1] in self._special:  # it stopped at an end-of-turn token
            last = self.tokenizer.decode(sampled[-1:], skip_special_tokens=False)
            if last and ending.startswith(last):
                ending = ending[len(last) :]  # the model sampled that part itself
        return ending + full[len(self._rendered) :]
