"""What a chat template puts after a sampled turn, found from the template itself (the test
model folder's ChatML)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sluice.engines.agents.chat_template import TemplateError, TurnFormat


@pytest.fixture(scope="module")
def chatml(bpe_policy):
    return AutoTokenizer.from_pretrained(str(bpe_policy))


def test_the_rest_of_the_turn_and_the_next_message_follow_a_sampled_turn(chatml):
    turns = TurnFormat(chatml)
    end = chatml.convert_tokens_to_ids("<|im_end|>")
    word = chatml("hello", add_special_tokens=False)["input_ids"]
    tool = [{"role": "tool", "content": "42"}]
    assert turns.closing == "<|im_end|>\n"
    # stopped at its end-of-turn token: only the newline after it was not sampled
    assert turns.after_turn([*word, end], tool) == (
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    # cut at its token limit: the whole ending of the turn comes first
    assert turns.after_turn(word, [{"role": "user", "content": "go on"}]) == (
        "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    )
    first = turns.first([{"role": "user", "content": "2+2?"}])
    assert first == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_a_tokenizer_without_a_usable_template_is_refused(chatml):
    class NoTemplate:
        chat_template = None

    with pytest.raises(TemplateError, match="no chat template"):
        TurnFormat(NoTemplate())

    class DropsReplies:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(m["content"] for m in messages if m["role"] != "assistant")

    with pytest.raises(TemplateError, match="does not render an assistant's content"):
        TurnFormat(DropsReplies())
