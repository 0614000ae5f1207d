from __future__ import annotations

import textwrap

import pytest

# Tools and environments with every kind of bad behaviour, importable by workers as `agent_user_tools:NAME`.
USER_TOOLS = textwrap.dedent(
    '''
    import time


    def echo(text: str) -> str:
        """Return the text unchanged.

        Args:
            text: what to echo.
        """
        return text


    def add(a: int, b: int = 0) -> str:
        """Add two integers.

        Args:
            a: the first integer.
            b: the second integer.
        """
        return str(a + b)


    def boom(text: str) -> str:
        """Always fails.

        Args:
            text: ignored.
        """
        raise RuntimeError("tool exploded")


    def sleepy(seconds: float) -> str:
        """Sleep, then answer.

        Args:
            seconds: how long to sleep.
        """
        time.sleep(seconds)
        return "awake"


    def number(text: str) -> str:
        """Returns a number, not a string.

        Args:
            text: ignored.
        """
        return 42


    def undocumented(x: int) -> str:
        return str(x)


    class Counter:
        """Counts the model's turns; done on the third; reward 0.5 a turn."""

        def __init__(self, start: int = 0):
            self.n = start
            self.closed = 0

        def reset(self, row):
            self.n = 0
            return "count with me"

        def step(self, text):
            self.n += 1
            return (f"turn {self.n}", 0.5, self.n >= 3)

        def close(self):
            self.closed += 1


    class BadReset:
        def reset(self, row):
            raise ValueError("no reset today")

        def step(self, text):
            return None, 0.0, True


    class BadStep:
        def reset(self, row):
            return None

        def step(self, text):
            raise KeyError("lost")


    class NotAnEnv:
        pass
    '''
)


@pytest.fixture
def user_tools(tmp_path, monkeypatch):
    (tmp_path / "agent_user_tools.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "agent_user_tools.py"


@pytest.fixture(scope="session")
def smollm2_tok():
    from torchrlhf.models import smollm2_tokenizer

    return smollm2_tokenizer()
