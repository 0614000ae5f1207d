"""The scheduler's pieces on their own: `prefill` against transformers' forward, the two turn policies, and the
turns a scheduler hands its policy."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from torchrlhf.generation.session import TurnResult
from torchrlhf.generation.kv_cache import KVCache
from torchrlhf.generation.model import CachedDecoder
from torchrlhf.generation.sampling import SamplingParams
from torchrlhf.generation.scheduler import AgentTurns, EndedTurn, Resumed, Scheduler, SingleTurn, prefill, right_padded

from gen_helpers import VOCAB, tiny_model


def _last_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' logits at the last token of one unpadded sequence: the independent reference."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def test_right_padded_rows():
    toks, lens = right_padded([[5, 6, 7], [8]], torch.device("cpu"))
    assert toks.tolist() == [[5, 6, 7], [8, 0, 0]] and lens.tolist() == [3, 1]


def test_prefill_computes_each_prompt_after_what_its_slot_already_holds():
    """Two prompts computed whole and one whose slot holds its first 6 tokens give transformers' logits at
    each last token; the held one's first 6 tokens were computed by an earlier prefill into its slot."""
    model = tiny_model("qwen2")
    decoder = CachedDecoder(model, 32, torch.device("cpu"), torch.float32)
    cache = KVCache(decoder.dims(1), 4, 32, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (7, 11, 4)]
    with torch.no_grad():
        prefill(decoder, cache, [prompts[1][:6]], [2], [0])  # slot 2 holds prompt 1's first 6 tokens
        logits = prefill(decoder, cache, prompts, [0, 2, 3], [0, 6, 0])
    assert logits.shape == (3, VOCAB)
    for row, tokens in enumerate(prompts):
        torch.testing.assert_close(logits[row], _last_logits(model, tokens), atol=1e-4, rtol=1e-4)


def test_single_turn_samples_are_the_n_samples_of_each_prompt():
    policy = SingleTurn([torch.tensor([4, 5]), torch.tensor([6])], limits=[3, 9], n=2)
    assert policy.prompts == [[4, 5], [6]]
    assert policy.prompt_of == [0, 0, 1, 1] and policy.budgets == [3, 3, 9, 9]
    assert policy.records and not policy.parked and policy.riding() == []


class _Session:
    def __init__(self, prompt: list[int], budget: int) -> None:
        self.prompt_tokens, self.budget, self.turns = prompt, budget, []

    def turn_budget(self) -> int:
        return self.budget

    def end_turn(self, tokens, reason) -> Future:
        self.turns.append((list(tokens), reason))
        future = Future()
        future.set_result(TurnResult([40, 41]))
        return future


def test_agent_turns_share_equal_contexts_and_park_ended_turns_until_their_observation_rides():
    sessions = [_Session([4, 5], 3), _Session([6], 2), _Session([4, 5], 0)]
    policy = AgentTurns(sessions)
    assert policy.prompts == [[4, 5], [6]] and policy.prompt_of == [0, 1, 0]
    assert policy.budgets == [3, 2, 0] and not policy.records
    # slot 0 runs sample 1, slot 1 sample 0: both are parked, none finished
    assert policy.turns_ended([EndedTurn(0, 1, True, [9, 8, 7]), EndedTurn(1, 0, False, [5, 6])]) == []
    assert sessions[1].turns == [([9, 8, 7], "stop")] and sessions[0].turns == [([5, 6], "length")]
    assert set(policy.parked) == {0, 1}
    policy.move(2, 1)  # compaction: slot 1's sample moves to slot 2
    assert set(policy.parked) == {0, 2}
    # observations ready while others decode: they ride in the next step, nothing is prefilled now
    assert policy.resume(block=False, can_ride=True) == Resumed([], [])
    assert policy.ready == {0: [40, 41], 2: [40, 41]}
    assert policy.resume(block=False, can_ride=True) is None  # nothing left waiting
    assert sorted(policy.riding()) == [(0, [40, 41]), (2, [40, 41])]
    assert not policy.parked and not policy.ready


def test_agent_turns_prefill_now_when_nothing_decodes_and_finish_done_sessions():
    sessions = [_Session([4, 5], 3), _Session([6], 2)]
    sessions[1].end_turn = lambda tokens, reason: _done()
    policy = AgentTurns(sessions)
    policy.turns_ended([EndedTurn(0, 0, True, [1]), EndedTurn(3, 1, True, [2])])
    assert policy.resume(block=True, can_ride=False) == Resumed([3], [(0, [40, 41])])
    assert not policy.parked and not policy.ready


def _done() -> Future:
    future = Future()
    future.set_result(TurnResult(None))
    return future


def test_scheduler_hands_each_ended_turn_its_own_tokens():
    """The scheduler cuts each ended turn from the slot's model tokens, from where its previous turn ended."""
    model = tiny_model("qwen2")
    decoder = CachedDecoder(model, 32, torch.device("cpu"), torch.float32)
    cache = KVCache(decoder.dims(1), 2, 32, torch.device("cpu"), torch.float32)
    seen: list[EndedTurn] = []

    class Recording(AgentTurns):
        def turns_ended(self, ended):
            seen.extend(ended)
            return super().turns_ended(ended)

    sessions = [_Session([4, 5], 2)]
    sessions[0].end_turn = lambda tokens, reason: _done() if len(seen) > 1 else _observation()
    run = Scheduler(decoder, decoder.decode, cache, SamplingParams(temperature=0, max_tokens=8, logprobs=False),
                    Recording(sessions), [0], stop_ids=[], check_every=1)
    run.run()
    first, second = seen
    assert len(first.tokens) == 2 and len(second.tokens) == 2  # each turn its own budget of 2 tokens
    assert run.results.tokens[0, :4].tolist() == first.tokens + second.tokens
    assert run.results.lengths.tolist() == [4]


def _observation() -> Future:
    future = Future()
    future.set_result(TurnResult([7]))
    return future
