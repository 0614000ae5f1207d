"""SlotState: the decode loop's per-slot state on the device, checked on hand-worked greedy steps.

Logits are one-hot rows, so the greedy token of each row is known by construction and its log-prob is that
of a one-hot softmax: log(e^s / (e^s + V - 1)).
"""

from __future__ import annotations

import math

import torch

from torchrlhf.generation.sampling import SamplingParams
from torchrlhf.generation.slot_state import SlotState

V, SCORE = 8, 5.0
GREEDY = SamplingParams(temperature=0, max_tokens=4)
LP = math.log(math.exp(SCORE) / (math.exp(SCORE) + V - 1))


def _logits(tokens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(tokens), V)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = SCORE
    return out


def _state(slots: int = 4, stop: tuple[int, ...] = (7,)) -> SlotState:
    return SlotState(slots, 4, torch.tensor(stop), scratch=31, device=torch.device("cpu"))


def test_a_new_turn_takes_its_first_token_and_a_one_token_budget_ends_it_at_once():
    state = _state()
    state.start_turn(torch.tensor([2, 0]), _logits([3, 5]), GREEDY, pos=torch.tensor([10, 6]),
                     budget=torch.tensor([3, 1]), version=0)
    assert state.out_tok[[2, 0], 0].tolist() == [3, 5]
    torch.testing.assert_close(state.out_lp[[2, 0], 0], torch.tensor([LP, LP]))
    assert state.cur[[2, 0]].tolist() == [3, 5] and state.pos[[2, 0]].tolist() == [10, 6]
    assert state.step[[2, 0]].tolist() == [1, 1] and state.limit[[2, 0]].tolist() == [3, 1]
    assert state.live.tolist() == [0, 0, 1, 0]  # slot 0's budget was one token: already ended
    assert not state.stopped.any()  # ended by length, not by a stop id


def test_a_step_advances_live_slots_only_and_ends_turns_on_the_device():
    state = _state()
    state.start_turn(torch.tensor([0, 1, 2]), _logits([3, 4, 5]), GREEDY, pos=torch.tensor([5, 6, 7]),
                     budget=torch.tensor([4, 2, 4]), version=0)
    state.live[2] = 0  # as if parked: it must keep its token and write nothing
    state.advance(_logits([7, 1, 2, 6]), GREEDY, version=0)  # slot 3 holds no sample
    assert state.out_tok[:, 1].tolist() == [7, 1, 0, 0]
    assert state.cur.tolist() == [7, 1, 5, 0]
    assert state.pos.tolist() == [6, 7, 7, 31] and state.step.tolist() == [2, 2, 1, 0]
    # slot 0 sampled the stop id, slot 1 spent its budget of 2
    assert state.live.tolist() == [0, 0, 0, 0]
    assert state.stopped.tolist() == [True, False, False, False]


def test_a_later_turn_continues_the_token_count():
    state = _state()
    state.start_turn(torch.tensor([1]), _logits([3]), GREEDY, pos=torch.tensor([4]), budget=torch.tensor([1]),
                     version=0)
    state.start_turn(torch.tensor([1]), _logits([6]), GREEDY, pos=torch.tensor([9]), budget=torch.tensor([2]),
                     version=0)  # after an observation: token index 1, two more tokens allowed
    assert state.out_tok[1, :2].tolist() == [3, 6]
    assert state.step[1] == 2 and state.limit[1] == 3 and state.live[1] == 1 and state.pos[1] == 9


def test_weight_versions_are_written_only_when_asked_for():
    for versions, expected in ((True, [4, 9]), (False, [0, 0])):
        state = SlotState(2, 4, torch.tensor([7]), scratch=31, device=torch.device("cpu"), versions=versions)
        state.start_turn(torch.tensor([0]), _logits([3]), GREEDY, pos=torch.tensor([2]), budget=torch.tensor([4]),
                         version=torch.tensor([4]))
        state.advance(_logits([2, 0]), GREEDY, version=9)
        assert state.out_ver[0, :2].tolist() == expected


def test_a_non_finite_log_prob_is_flagged_for_the_host():
    state = _state()
    state.start_turn(torch.tensor([0]), _logits([3]), GREEDY, pos=torch.tensor([2]), budget=torch.tensor([4]),
                     version=0)
    state.end_turns(torch.tensor([0]), torch.tensor([3]), torch.tensor([float("nan")]))
    assert state.read([0])[4] == [1]


def test_read_take_and_move():
    state = _state()
    state.start_turn(torch.tensor([3]), _logits([2]), GREEDY, pos=torch.tensor([5]), budget=torch.tensor([4]),
                     version=0)
    state.advance(_logits([0, 0, 0, 4]), GREEDY, version=0)
    assert state.read([3]) == ([1], [0], [6], [2], [0])  # live, stopped, pos, step, nonfinite
    state.move([0], [3])
    assert state.read([0, 3]) == ([1, 0], [0, 0], [6, 31], [2, 0], [0, 0])
    assert state.out_tok[0, :2].tolist() == [2, 4]
    tokens, _, _, lengths = state.take([0])
    assert tokens[0, :2].tolist() == [2, 4] and lengths.tolist() == [2]
    assert state.read([0]) == ([0], [0], [31], [0], [0])  # free: the scratch position, no tokens


def test_a_cut_ends_the_turn_where_a_stop_string_completed():
    state = _state()
    state.start_turn(torch.tensor([0]), _logits([3]), GREEDY, pos=torch.tensor([5]), budget=torch.tensor([4]),
                     version=0)
    for tok in (4, 5):
        state.advance(_logits([tok]), GREEDY, version=0)
    state.cut(0, step=2, token=4, pos=7)  # the string ended at the second token: the third is dropped
    assert state.read([0]) == ([0], [1], [7], [2], [0])
    assert state.cur[0] == 4
