"""The built-in tools a multi-turn environment can offer the model: a calculator and a
Python executor.

A tool is called with the arguments of a parsed call (``envs/tool_calls.py``) and answers
with a ``ToolResult``: the text the model is shown, and ``error`` (a short kind, counted in
the run's metrics) when the call failed. Tools never raise for what the model wrote.
The calculator evaluates arithmetic with its own small evaluator over Python's parse tree
(numbers and + - * / // % ** only, with bounded sizes), never ``eval``; the Python tool runs
code in the sandbox (``envs/sandbox.py``).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.envs.sandbox import SandboxLimits, run_python
from sluice.envs.tool_calls import BadCall, ToolCall

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 100  # larger intermediate results are refused


@dataclass(frozen=True)
class ToolResult:
    text: str
    error: str | None = None
    """None on success, else the kind of failure: bad_call, unknown_tool, bad_arguments,
    or a sandbox outcome (error, timeout, cpu, memory, output, processes)."""


class Tool(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult: ...


_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message is shown to the model."""


def _too_big(value: int | float) -> bool:
    return abs(value) >= 10**MAX_DIGITS


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise CalculatorError("not arithmetic: a truth value")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or _too_big(left)):
            raise CalculatorError("exponent too large")
        try:
            result = _OPS[type(node.op)](left, right)
        except ZeroDivisionError as error:
            raise CalculatorError("division by zero") from error
        if isinstance(result, complex) or _too_big(result):
            raise CalculatorError("result out of range")
        return result
    raise CalculatorError(f"not arithmetic: {ast.dump(node)[:60]}")


def calculate(expression: str) -> str:
    """``expression``'s value as text; ``CalculatorError`` when it is not plain arithmetic."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError) as error:
        raise CalculatorError("not an expression") from error
    try:
        value = _evaluate(tree)
    except RecursionError as error:
        raise CalculatorError("nested too deeply") from error
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


@dataclass(frozen=True)
class Calculator:
    name: str = "calculator"
    description: str = 'Evaluates arithmetic. Arguments: {"expression": "12*34"}'

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return ToolResult('error: give {"expression": "..."}', "bad_arguments")
        try:
            return ToolResult(calculate(expression))
        except CalculatorError as error:
            return ToolResult(f"error: {error}", "error")


@dataclass(frozen=True)
class PythonTool:
    """Runs ``{"code": "..."}`` in the sandbox and answers with what it printed."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    name: str = "python"
    description: str = 'Runs Python code and returns what it prints. Arguments: {"code": "..."}'

    def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult('error: give {"code": "..."}', "bad_arguments")
        result = run_python(code, self.limits)
        return ToolResult(result.observation(), None if result.ok else result.kind)


def call_tool(call: ToolCall | BadCall, tools: Mapping[str, Tool]) -> ToolResult:
    """One parsed call's result; a bad call or an unknown tool is an error result."""
    if isinstance(call, BadCall):
        return ToolResult(f"error: {call.error}", "bad_call")
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolResult(f"error: no tool named {call.name!r} (tools: {known})", "unknown_tool")
    return tool(call.arguments)
