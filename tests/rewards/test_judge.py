"""The judge's text side: its prompt, and verdict -> score by a regex or a user function, failures included."""

from __future__ import annotations

import textwrap

import pytest

from torchrlhf.rewards.judge import (
    DEFAULT_TEMPLATE,
    ParserSpec,
    VerdictParser,
    check_template,
    correct_or_wrong,
    render_judge_prompt,
)

PARSERS = textwrap.dedent(
    """
    import time

    def last_word(verdict):
        word = verdict.split()[-1].lower()
        return {"correct": 1.0, "wrong": 0.0}.get(word)

    def hangs_or_raises(verdict):
        if verdict == "hang":
            time.sleep(60)
        if verdict == "raise":
            raise RuntimeError("bad parser")
        if verdict == "text":
            return "high"
        return 0.5
    """
)


def test_template_renders_every_field():
    text = render_judge_prompt("Q={question} A={response} R={reference}", "2+2?", "4", 4)
    assert text == "Q=2+2? A=4 R=4"
    assert render_judge_prompt("{response}|{reference}", "q", "x", None) == "x|"
    assert "{question}" in DEFAULT_TEMPLATE and check_template(DEFAULT_TEMPLATE) == DEFAULT_TEMPLATE


@pytest.mark.parametrize("template,why", [("{answer} {response}", "only the fields"),
                                          ("{question}", "no {response}")])
def test_bad_template_is_refused(template, why):
    with pytest.raises(ValueError, match="judge.template") as e:
        check_template(template)
    assert why in str(e.value)


def test_default_regex_reads_score():
    scores, late = VerdictParser()(["Score: 1", "The answer is wrong. score: 0", "Score:0.5 since...",
                                    "Score: -2", "I think it is right", ""])
    assert scores == [1.0, 0.0, 0.5, -2.0, None, None]
    assert late == [False] * 6


def test_custom_regex_group_or_whole_match():
    assert VerdictParser(ParserSpec(r"(\d+)/10"))(["rated 7/10", "no rating"])[0] == [7.0, None]
    assert VerdictParser(ParserSpec(r"\d+"))(["grade 3", "grade x"])[0] == [3.0, None]
    # a group that matched nothing numeric is a failure, not a crash
    assert VerdictParser(ParserSpec(r"Score: (\w+)"))(["Score: high"])[0] == [None]


def test_bad_parser_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a regular expression"):
        ParserSpec("(unclosed")
    with pytest.raises(ValueError, match="not both"):
        ParserSpec(r"\d", fn=f"{tmp_path}/p.py:fn")
    with pytest.raises(Exception, match="nope.py"):
        ParserSpec(fn=f"{tmp_path}/nope.py:fn")


def test_function_parser_failures_and_timeout(tmp_path):
    path = tmp_path / "parsers.py"
    path.write_text(PARSERS)
    parser = VerdictParser(ParserSpec(fn=f"{path}:last_word", timeout_s=30.0))
    try:
        assert parser(["it is correct", "that is wrong", "no idea"]) == ([1.0, 0.0, None], [False, False, False])
    finally:
        parser.close()
    parser = VerdictParser(ParserSpec(fn=f"{path}:hangs_or_raises", timeout_s=2.0))
    try:
        scores, late = parser(["ok", "raise", "text", "hang", "ok"])
        assert scores == [0.5, None, None, None, 0.5]
        assert late == [False, False, False, True, False]
    finally:
        parser.close()


def test_correct_or_wrong_reads_the_first_word():
    verdicts = [" correct\n", "Wrong.", "YES, it is", "no", "incorrect answer", "maybe correct", "", "42"]
    assert [correct_or_wrong(v) for v in verdicts] == [1.0, 0.0, 1.0, 0.0, 0.0, None, None, None]
