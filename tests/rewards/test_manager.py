from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from torchrlhf.data import Batch
from torchrlhf.rewards import RewardManager, load_reward_fn

USER_REWARDS = textwrap.dedent(
    """
    import time

    def length_score(solution_str, ground_truth, **kw):
        return float(len(solution_str))

    def scaled(solution_str, ground_truth, scale=1.0):
        return {"score": scale * (solution_str == ground_truth), "extra": 1}

    def boom(solution_str, ground_truth, **kw):
        raise RuntimeError("bad reward")

    def not_a_number(solution_str, ground_truth, **kw):
        return "high"

    def by_text(solution_str, ground_truth, **kw):
        if solution_str == "hang":
            time.sleep(60)
        if solution_str == "raise":
            raise RuntimeError("bad reward")
        return 1.0
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_rewards.py"


class CharTokenizer:
    """ids are character codes; 0 is the special pad/eos token."""

    def batch_decode(self, ids, skip_special_tokens=False):
        return ["".join(chr(i) for i in seq if not (skip_special_tokens and i == 0)) for seq in ids]


def test_load_reward_fn_by_dotted_and_file_path(user_module):
    assert load_reward_fn("my_rewards:length_score")("abc", None) == 3.0
    assert load_reward_fn("my_rewards.length_score")("ab", None) == 2.0
    assert load_reward_fn(f"{user_module}:length_score")("a", None) == 1.0
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_reward_fn(f"{user_module.parent}/nope.py:fn")
    with pytest.raises(ValueError, match="'missing' not found"):
        load_reward_fn(f"{user_module}:missing")


def test_call_places_score_on_last_response_token():
    # Responses "7", "12" + stop token (id 0, special), "x": right-padded with 0.
    responses = torch.tensor([[ord("7"), 0, 0], [ord("1"), ord("2"), 0], [ord("x"), 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    batch = Batch.from_dict({"responses": responses, "response_mask": mask,
                             "ground_truth": ["7", "12", "3"], "data_source": ["arithmetic"] * 3})
    manager = RewardManager(tokenizer=CharTokenizer())
    scores, metrics = manager(batch)
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert torch.equal(scores, expected) and scores.dtype == torch.float32
    assert metrics == {"reward/errors": 0.0, "reward/timeouts": 0.0}


def test_agent_trajectories_are_graded_on_their_final_turn():
    """Model turns "7" then "12" (the tool's answer in between is masked out): the final turn "12" is graded,
    not the joined turns "712"."""
    responses = torch.tensor([[ord("7"), 0, ord("5"), ord("1"), ord("2"), 0]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    columns = {"responses": responses, "response_mask": mask, "ground_truth": ["12"], "data_source": ["arithmetic"]}
    manager = RewardManager(tokenizer=CharTokenizer())
    assert manager(Batch.from_dict(columns))[0].sum() == 0.0  # without agent columns: "712"
    scores, _ = manager(Batch.from_dict({**columns, "final_text": ["12"]}))
    assert torch.equal(scores, torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]))


def test_in_process_user_functions_and_per_source_mapping(user_module):
    manager = RewardManager({"mine": "my_rewards:scaled"}, reward_kwargs={"scale": 2.0}, isolate=False)
    scores, metrics = manager.score(["a", "b"], ["a", "a"], ["mine", "mine"])
    assert scores == [2.0, 0.0] and metrics["reward/errors"] == 0
    manager = RewardManager("my_rewards:not_a_number", isolate=False, on_error_score=-1.0)
    scores, metrics = manager.score(["a"], ["a"], ["x"])
    assert scores == [-1.0] and metrics["reward/errors"] == 1
    with pytest.raises(ValueError, match="no built-in reward for data_source 'other'"):
        RewardManager({"mine": "my_rewards:scaled"}).score(["a"], ["a"], ["other"])


def test_raising_and_hanging_user_reward_are_counted(user_module):
    with RewardManager(f"{user_module}:by_text", timeout_s=1.0, num_workers=2, on_error_score=-1.0) as manager:
        texts = ["ok", "hang", "raise", "ok", "ok"]
        scores, metrics = manager.score(texts, [None] * 5, ["x"] * 5)
        assert scores == [1.0, -1.0, -1.0, 1.0, 1.0]
        assert metrics == {"reward/errors": 1.0, "reward/timeouts": 1.0}
        # The pool was restarted after the timeout and keeps working.
        scores, metrics = manager.score(["ok"], [None], ["x"])
        assert scores == [1.0] and metrics["reward/timeouts"] == 0


def test_unpicklable_function_is_a_clear_error():
    manager = RewardManager(lambda s, g: 1.0)
    with pytest.raises(ValueError, match="cannot be sent to a worker process"):
        manager.score(["a"], ["a"], ["x"])
    assert RewardManager(lambda s, g: 1.0, isolate=False).score(["a"], ["a"], ["x"])[0] == [1.0]


OWNER = """
import sys
from torchrlhf.utils.isolated import IsolatedPool

pool = IsolatedPool(num_workers=2)._get_pool()  # starts the worker processes and waits until each answers
print(" ".join(str(pid) for pid in pool._processes), flush=True)
sys.stdin.read()  # until killed
"""


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc (Linux)")
def test_reward_workers_exit_when_their_owner_is_sigkilled():
    """A rank killed with SIGKILL (e.g. before torchrun restarts the job) leaves no reward (or tool) workers behind."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        workers = [int(pid) for pid in owner.stdout.readline().split()]
        assert len(workers) == 2 and not any(_gone(pid) for pid in workers), workers
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 60  # they notice at once (pidfd) or within 2 s (polling); 60 s for a loaded host
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(pid) for pid in workers), [pid for pid in workers if not _gone(pid)]
