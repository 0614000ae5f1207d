from __future__ import annotations

import random

import pytest

from torchrlhf.agents import CallError, ToolCall, ToolCallParser, load_tool, load_tools
from torchrlhf.agents.builtin import calculator


def test_schema_from_signature_and_docstring(user_tools):
    tool = load_tool("agent_user_tools:add")
    assert tool.name == "add" and tool.parameters == ("a", "b")
    fn = tool.schema["function"]
    assert tool.schema["type"] == "function" and fn["name"] == "add"
    assert fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "the first integer."},
        "b": {"type": "integer", "description": "the second integer."},
    }
    assert fn["parameters"]["required"] == ["a"]


def test_tool_specs_builtin_dotted_file_and_errors(user_tools):
    assert load_tool("calculator").fn is calculator
    assert load_tool("agent_user_tools.echo").target == "agent_user_tools.echo"
    assert load_tool(f"{user_tools}:echo").fn("x") == "x"
    assert load_tool(calculator).target is calculator
    with pytest.raises(ValueError, match="docstring"):
        load_tool("agent_user_tools:undocumented")
    with pytest.raises(ValueError, match="is a class"):
        load_tool("agent_user_tools:Counter")
    with pytest.raises(FileNotFoundError):
        load_tool(f"{user_tools.parent}/missing.py:fn")
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        load_tools(["agent_user_tools:echo", f"{user_tools}:echo"])


def test_calculator_matches_python_arithmetic():
    rng = random.Random(0)
    for _ in range(200):
        a, b, c = rng.randint(-999, 999), rng.randint(1, 99), rng.randint(0, 9999)
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        expr = f"{a} {op1} {b} {op2} ({c} - {b})"
        assert calculator(expr) == str(eval(expr)), expr  # eval only on the test's own integer expressions
    assert calculator("7 / 2") == "3.5" and calculator("7 // 2") == "3" and calculator("2 ** 10") == "1024"
    assert calculator("1,234 * 2") == "2468" and calculator("3 × 4") == "12" and calculator("2^3") == "8"


@pytest.mark.parametrize("expr, message", [
    ("__import__('os').system('true')", "unsupported syntax"),
    ("x + 1", "unsupported syntax"),
    ("1 / 0", "division by zero"),
    ("9 ** 9 ** 9", "exponents"),
    ("2 ** 0.5", "exponents"),
    ("(10 ** 60) ** 2", "digits"),
    ("1 +", "Error"),
    ("1" * 300, "longer than"),
])
def test_calculator_rejects_unsafe_or_unbounded_input_before_computing(expr, message):
    result = calculator(expr)  # "9 ** 9 ** 9" computed would not return: the guard's message says what refused it
    assert result.startswith("Error:") and message in result


def test_hermes_parallel_calls_and_errors(user_tools):
    tools = load_tools(["agent_user_tools:add", "agent_user_tools:echo"])
    parser = ToolCallParser(tools, "hermes")
    text = ('Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
            '<tool_call>\n{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": "two"}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"c": 1}}</tool_call>'
            '<tool_call>["add"]</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "unclosed"}')
    calls = parser.parse(text)
    assert calls[:2] == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("echo", {"text": "hi"})]
    errors = calls[2:]
    assert all(isinstance(c, CallError) for c in errors) and len(errors) == 6
    assert "not valid JSON" in errors[0].message
    assert errors[1].name == "search" and "unknown tool 'search'" in errors[1].message
    assert "'a' must be int" in errors[2].message
    assert "bad arguments for 'add'" in errors[3].message
    assert "JSON object" in errors[4].message
    assert "not closed" in errors[5].message
    assert parser.parse("The answer is 5.") == []


def test_hermes_calls_as_openai_tool_calls():
    """The endpoint's view of a turn (a harness's, a verifiers episode's): OpenAI ``tool_calls`` with JSON-string
    arguments, the text around them as the content; a block that is no call (not JSON, not closed) stays in the content."""
    import json

    from torchrlhf.agents.parsing import openai_tool_calls

    content, calls = openai_tool_calls('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
                                       '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call> Done.')
    assert content == "Let me add. Done." and [c["type"] for c in calls] == ["function", "function"]
    assert [c["function"] for c in calls] == [{"name": "add", "arguments": json.dumps({"a": 1})},
                                              {"name": "echo", "arguments": '{"text": "hi"}'}]
    assert len({c["id"] for c in calls}) == 2
    assert openai_tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>')[0] is None  # only a call
    for text in ("<tool_call>not json</tool_call>", '<tool_call>{"name": "add"', "The answer is 5."):
        assert openai_tool_calls(text) == (text, [])
    content, calls = openai_tool_calls('<tool_call>[1]</tool_call>ok<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert content == "<tool_call>[1]</tool_call>ok" and len(calls) == 1


def test_tag_calls(user_tools):
    tools = load_tools(["calculator", "agent_user_tools:echo"])
    parser = ToolCallParser(tools, "tags", {"calc": "calculator", "say": "echo"})
    calls = parser.parse("<calc> 231 * 47 </calc> and <say>hi</say> then <calc>1 + 1")
    assert calls[:2] == [ToolCall("calculator", {"expression": "231 * 47"}), ToolCall("echo", {"text": "hi"})]
    assert isinstance(calls[2], CallError) and "not closed" in calls[2].message
    assert ToolCallParser(tools, "tags").parse("<calculator>2*3</calculator>") == [
        ToolCall("calculator", {"expression": "2*3"})]
    with pytest.raises(ValueError, match="not configured"):
        ToolCallParser(tools, "tags", {"calc": "search"})
    with pytest.raises(ValueError, match="only used with format 'tags'"):
        ToolCallParser(tools, "hermes", {"calc": "calculator"})
