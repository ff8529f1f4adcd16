"""The chat endpoint with a real ``openai`` client and a real chat template (the test BPE
model folder's tokenizer), the engine stood in for by a fixed reply: sessions continue
token-exactly, and bad calls get OpenAI-shaped errors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from sluice.engines.agents.endpoint import ChatEndpoint, Generated
from sluice.engines.agents.sessions import ChatSessions
from sluice.envs import Problem

PROBLEM = Problem("p/0", "chat", "What is 2+3?", "5", "train")
SILENT = Problem("p/1", "chat", "Say nothing.", "", "train")  # its first reply is empty
ROOT = Path(__file__).parents[4]


@pytest.fixture
def served(bpe_policy):
    tokenizer = AutoTokenizer.from_pretrained(str(bpe_policy))
    reply_ids = tokenizer("The sum is 5", add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    asked: list[list[int]] = []

    def generate(session, ids, max_tokens, choice):
        """The fixed reply; a call's further replies (n > 1) end in their own number."""
        if choice == 0:
            asked.append(list(ids))
        text = "The sum is 5" if choice == 0 else f"The sum is {5 + choice}"
        if session.problem is SILENT and session.calls == 0:
            text = ""
        reply = tokenizer(text, add_special_tokens=False)["input_ids"]
        done: Future[Generated] = Future()
        tokens = [*reply, end][:max_tokens]
        done.set_result(Generated(tokens, [-0.25] * len(tokens), 3, len(tokens) <= max_tokens))
        return done

    sessions = ChatSessions()
    endpoint = ChatEndpoint(sessions, tokenizer, generate)
    yield endpoint, sessions, tokenizer, asked, [*reply_ids, end]
    endpoint.close()


def test_an_openai_client_plays_two_turns_and_the_session_is_token_exact(served):
    endpoint, sessions, tokenizer, asked, sampled = served
    session = sessions.open("s1", PROBLEM)
    client = openai.OpenAI(base_url=endpoint.base_url("s1"), api_key="none")
    messages = [{"role": "user", "content": PROBLEM.prompt}]
    first = client.chat.completions.create(model="any", messages=messages)
    assert first.choices[0].message.content == "The sum is 5"
    assert first.choices[0].finish_reason == "stop"
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Are you sure?"},
    ]
    client.chat.completions.create(model="any", messages=messages)
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True)
    assert session.prompt_ids == list(prompt["input_ids"])
    added = tokenizer(
        "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    assert session.token_ids == sampled + added + sampled
    assert session.mask == [1] * len(sampled) + [0] * len(added) + [1] * len(sampled)
    assert asked == [session.prompt_ids, session.prompt_ids + sampled + added]
    assert session.marks == [(0, 3)] and session.calls == 2


def test_bad_calls_get_errors_and_a_rewritten_history_fails_the_session(served):
    endpoint, sessions, _, _, _ = served
    sessions.open("s2", PROBLEM)
    client = openai.OpenAI(base_url=endpoint.base_url("s2"), api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="no open session"):
        openai.OpenAI(base_url=endpoint.base_url("nobody"), api_key="x").chat.completions.create(
            model="any", messages=messages
        )
    with pytest.raises(openai.BadRequestError, match="n must be a whole number from 1 to 16"):
        client.chat.completions.create(model="any", messages=messages, n=17)
    client.chat.completions.create(model="any", messages=messages)
    rewritten = [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]
    with pytest.raises(openai.BadRequestError, match="do not continue this session"):
        client.chat.completions.create(model="any", messages=rewritten)
    assert sessions.get("s2").failed is not None
    sessions.close("s2")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="any", messages=messages)


def test_an_agent_that_leaves_out_an_empty_reply_continues_its_session(served):
    """The OpenAI Agents SDK keeps its history as output items and drops a reply with no
    text: the next call repeats the conversation without it."""
    endpoint, sessions, tokenizer, _, sampled = served
    session = sessions.open("quiet", SILENT)
    client = openai.OpenAI(base_url=endpoint.base_url("quiet"), api_key="none", max_retries=0)
    messages = [{"role": "user", "content": SILENT.prompt}]
    first = client.chat.completions.create(model="any", messages=messages)
    assert first.choices[0].message.content == ""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert session.token_ids == [end]
    messages.append({"role": "user", "content": "Say it."})  # no assistant message between
    second = client.chat.completions.create(model="any", messages=messages)
    assert second.choices[0].message.content == "The sum is 5"
    added = tokenizer(
        "\n<|im_start|>user\nSay it.<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    assert session.token_ids == [end, *added, *sampled]
    assert session.mask == [1] + [0] * len(added) + [1] * len(sampled)
    left_out = [*messages, {"role": "user", "content": "Once more."}]  # a full reply dropped
    with pytest.raises(openai.BadRequestError, match="do not continue this session"):
        client.chat.completions.create(model="any", messages=left_out)


def test_a_streamed_call_gets_the_same_reply_and_the_session_the_same_tokens(served):
    endpoint, sessions, _, _, sampled = served
    streamed, plain = sessions.open("st", PROBLEM), sessions.open("pl", PROBLEM)
    messages = [{"role": "user", "content": PROBLEM.prompt}]
    client = openai.OpenAI(base_url=endpoint.base_url("st"), api_key="none")
    events = list(
        client.chat.completions.create(
            model="any",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
        )
    )
    assert all(e.object == "chat.completion.chunk" for e in events)
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == (
        "The sum is 5"
    )
    finished = [e.choices[0].finish_reason for e in events if e.choices]
    assert finished == [None, None, "stop"]
    assert len(events[1].choices[0].logprobs.content) == len(sampled)
    assert events[-1].usage.completion_tokens == len(sampled)
    assert events[2].model_extra["sluice"] == {"session": "st", "version": 3}
    openai.OpenAI(base_url=endpoint.base_url("pl"), api_key="none").chat.completions.create(
        model="any", messages=messages
    )
    assert streamed.token_ids == plain.token_ids == sampled
    assert streamed.prompt_ids == plain.prompt_ids and streamed.marks == plain.marks


def test_n_replies_come_back_and_the_session_continues_with_the_one_sent_back(served):
    endpoint, sessions, tokenizer, _, sampled = served
    session = sessions.open("n3", PROBLEM)
    client = openai.OpenAI(base_url=endpoint.base_url("n3"), api_key="none", max_retries=0)
    messages = [{"role": "user", "content": PROBLEM.prompt}]
    first = client.chat.completions.create(model="any", messages=messages, n=3)
    texts = [c.message.content for c in first.choices]
    assert texts == ["The sum is 5", "The sum is 6", "The sum is 7"]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert session.token_ids == sampled  # the first, until the agent says otherwise
    kept = first.choices[2].model_extra["token_ids"]
    with pytest.raises(openai.BadRequestError, match="none of the replies"):
        client.chat.completions.create(
            model="any",
            messages=[
                *messages,
                {"role": "assistant", "content": "The sum is 8"},
                {"role": "user", "content": "Sure?"},
            ],
        )
    sessions.open("n3b", PROBLEM)
    again = openai.OpenAI(base_url=endpoint.base_url("n3b"), api_key="none")
    first = again.chat.completions.create(model="any", messages=messages, n=3)
    messages += [
        first.choices[2].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Are you sure?"},
    ]
    again.chat.completions.create(model="any", messages=messages)
    added = tokenizer(
        "\n<|im_start|>user\nAre you sure?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    session = sessions.get("n3b")
    assert session.token_ids == kept + added + sampled
    assert session.mask == [1] * len(kept) + [0] * len(added) + [1] * len(sampled)
    assert session.marks == [(0, 3)] and session.calls == 2


def test_n_streamed_replies_come_as_chunks_of_their_own_index(served):
    endpoint, sessions, *_ = served
    sessions.open("ns", PROBLEM)
    client = openai.OpenAI(base_url=endpoint.base_url("ns"), api_key="none")
    events = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "hi"}], n=2, stream=True
    )
    texts = ["", ""]
    for event in events:
        for choice in event.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == ["The sum is 5", "The sum is 6"]


def test_tool_calls_come_back_in_the_openai_form_and_a_tool_result_continues(bpe_policy):
    tokenizer = AutoTokenizer.from_pretrained(str(bpe_policy))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    reply_ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(session, ids, max_tokens, choice):
        done: Future[Generated] = Future()
        done.set_result(Generated([*reply_ids, end], [-0.5] * (len(reply_ids) + 1), 0, True))
        return done

    sessions = ChatSessions()
    endpoint = ChatEndpoint(sessions, tokenizer, generate)
    try:
        session = sessions.open("t1", PROBLEM)
        client = openai.OpenAI(base_url=endpoint.base_url("t1"), api_key="none")
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
        messages = [{"role": "user", "content": "6*7?"}]
        first = client.chat.completions.create(model="any", messages=messages, tools=tools)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        (tool_call,) = message.tool_calls
        assert tool_call.function.name == "calculator"
        assert json.loads(tool_call.function.arguments) == {"expression": "6*7"}
        messages += [
            message.model_dump(exclude_none=True),  # sent back as the SDKs do: with tool_calls
            {"role": "tool", "tool_call_id": tool_call.id, "content": "42"},
        ]
        client.chat.completions.create(model="any", messages=messages, tools=tools)
        sessions.open("t2", PROBLEM)  # streamed: the same call in the delta, with its index
        streamed = openai.OpenAI(base_url=endpoint.base_url("t2"), api_key="none")
        events = list(
            streamed.chat.completions.create(
                model="any", messages=messages[:1], tools=tools, stream=True
            )
        )
        (delta_call,) = events[1].choices[0].delta.tool_calls
        assert (delta_call.index, delta_call.function.name) == (0, "calculator")
        assert delta_call.function.arguments == tool_call.function.arguments
        assert events[2].choices[0].finish_reason == "tool_calls"
    finally:
        endpoint.close()
    added = tokenizer(
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )["input_ids"]
    sampled = [*reply_ids, end]
    assert session.token_ids == sampled + added + sampled


def test_many_agents_connect_at_once_while_the_decoding_loop_holds_the_gil(served):
    """Every episode of a worker may call at once while its decoding loop keeps the GIL
    busy; with socketserver's backlog of 5, most such connections were reset."""
    endpoint, sessions, *_ = served
    n = 100
    for i in range(n):
        sessions.open(f"s{i:04d}", PROBLEM)
    stop = threading.Event()

    def decoding_loop() -> None:  # pure Python: holds the GIL between switches
        while not stop.is_set():
            sum(range(100_000))

    busy = threading.Thread(target=decoding_loop)
    busy.start()
    try:
        host = endpoint.base_url("x").split("/s/")[0]
        calls = subprocess.run(
            [sys.executable, "-m", "tests.support.many_calls", host, str(n)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    finally:
        stop.set()
        busy.join()
    assert calls.returncode == 0, calls.stderr[-2000:]
    assert json.loads(calls.stdout) == {"ok": n}
