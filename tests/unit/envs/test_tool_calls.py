"""Tool calls are read by our own parser, never raise, and the calculator is not eval."""

import pytest

from sluice.envs.tool_calls import BadCall, ToolCall, parse_tool_calls, tool_response
from sluice.envs.tools import Calculator, call_tool


def test_a_hermes_call_is_read_with_its_arguments():
    call = '{"name": "calculator", "arguments": {"expression": "2*3"}}'
    text = f"Let me compute.<tool_call>\n{call}\n</tool_call>"
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2*3"})]
    as_string = '<tool_call>{"name": "c", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_tool_calls(as_string) == [ToolCall("c", {"x": 1})]
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("<tool_call>{not json}</tool_call>", "not JSON"),
        ("<tool_call>[1, 2]</tool_call>", "not a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "c", "arguments": 3}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "c", "arguments": "oops"}</tool_call>', "string that is not"),
        ('<tool_call>{"name": "c"', "never closed"),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "longer than"),
        ("<tool_call>" + "[" * 5_000 + "</tool_call>", "not JSON"),
    ],
)
def test_a_malformed_call_is_a_bad_call_with_its_reason(text, reason):
    (call,) = parse_tool_calls(text)
    assert isinstance(call, BadCall) and reason in call.error
    result = call_tool(call, {"c": Calculator()})
    assert result.error == "bad_call" and reason in result.text


def test_too_many_calls_are_cut_and_named():
    calls = parse_tool_calls('<tool_call>{"name": "c"}</tool_call>' * 5, max_calls=2)
    assert calls[:2] == [ToolCall("c"), ToolCall("c")]
    assert isinstance(calls[2], BadCall) and "more than 2" in calls[2].error


@pytest.mark.parametrize(
    ("expression", "value"),
    [("123*456", "56088"), ("(7+5)//5", "2"), ("-3**2", "-9"), ("10/4", "2.5"), ("2**10", "1024")],
)
def test_the_calculator_does_arithmetic(expression, value):
    assert Calculator()({"expression": expression}).text == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "not arithmetic"),
        ("(1).__class__", "not arithmetic"),
        ("9**9**9", "exponent too large"),
        ("10**50 * 10**60", "out of range"),
        ("1/0", "division by zero"),
        ("1 +", "not an expression"),
        ("1+" * 200 + "1", "longer than"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, reason):
    result = Calculator()({"expression": expression})
    assert result.error == "error" and reason in result.text


def test_unknown_tools_and_bad_arguments_are_errors_the_model_sees():
    tools = {"calculator": Calculator()}
    assert call_tool(ToolCall("search", {}), tools).error == "unknown_tool"
    assert "calculator" in call_tool(ToolCall("search", {}), tools).text
    assert call_tool(ToolCall("calculator", {"expr": "1"}), tools).error == "bad_arguments"
    assert tool_response("7") == "<tool_response>\n7\n</tool_response>"
