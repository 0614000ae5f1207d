"""The scheduler's pieces on their own: `prefill` against transformers' forward, the two turn policies."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from torchrlhf.generation.session import TurnResult
from torchrlhf.generation.kv_cache import KVCache
from torchrlhf.generation.model import CachedDecoder
from torchrlhf.generation.scheduler import AgentTurns, SingleTurn, prefill, right_padded

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


class _Run:
    """What `AgentTurns` reads from its scheduler when it parks or resumes a slot."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.slot_sample, self.slot_turn = [1, 0, -1], [0, 2, 0]
        self.state = type("S", (), {"out_tok": torch.tensor([[9, 8, 7, 0], [3, 4, 5, 6], [0, 0, 0, 0]])})()
        self.observed = None

    def finish(self, slots, reasons):
        raise AssertionError("no trajectory is done")

    def observe(self, going, logits):
        self.observed = (going, logits)


def test_agent_turns_share_equal_contexts_and_park_ended_turns_until_their_observation_rides():
    sessions = [_Session([4, 5], 3), _Session([6], 2), _Session([4, 5], 0)]
    policy = AgentTurns(sessions)
    assert policy.prompts == [[4, 5], [6]] and policy.prompt_of == [0, 1, 0]
    assert policy.budgets == [3, 2, 0] and not policy.records
    run = _Run()
    policy.turns_ended(run, [(0, True, 3), (1, False, 4)])  # slot 0 runs sample 1, slot 1 sample 0
    assert sessions[1].turns == [([9, 8, 7], "stop")]
    assert sessions[0].turns == [([5, 6], "length")]  # slot 1's turn started at its token 2
    assert run.slot_turn == [3, 4, 0]  # their next turns start where these ended (no read at the observation)
    assert set(policy.parked) == {0, 1}
    policy.move(2, 1)  # compaction: slot 1's sample moves to slot 2
    assert set(policy.parked) == {0, 2}
    assert policy.resume(run, block=False, can_ride=True)
    assert run.observed is None and policy.ready == {0: [40, 41], 2: [40, 41]}
    assert sorted(policy.riding()) == [(0, [40, 41]), (2, [40, 41])]
    assert not policy.parked and not policy.ready
