from __future__ import annotations

import pytest
import torch

from agent_reference import run_sessions_reference

from torchrlhf.agents import AgentSession, build_agent
from torchrlhf.models import build_tiny_causal_lm

IM_END = 2


@pytest.fixture(scope="module")
def tiny_lm():
    torch.manual_seed(0)
    return build_tiny_causal_lm(seed=0, initializer_range=1.0).eval()


def greedy_without_cache(model, prefix: list[int], stops: set[int], budget: int) -> list[int]:
    """Independent reference: every token from a full forward over the whole sequence, no KV cache."""
    seq, out = list(prefix), []
    with torch.no_grad():
        while len(out) < budget:
            token = int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax())
            out.append(token)
            seq.append(token)
            if token in stops:
                break
    return out


def test_reference_driver_turns_equal_a_fresh_full_prefill(tiny_lm, smollm2_tok, user_tools):
    tok = smollm2_tok
    stops = {IM_END} | set(range(0, tok.vocab_size, 5))  # frequent stops: a random model's turns end early
    agent = build_agent({"env": {"_component_": "agent_user_tools.Counter"}, "reward": "env", "max_turns": 4},
                        tok, max_tokens=40)
    rows = [{"prompt": "Count."}, {"prompt": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Count to three."}]}]
    sessions = [AgentSession(agent, row) for row in rows]
    trajectories = run_sessions_reference(tiny_lm, tok, sessions, stop_token_ids=stops)
    for traj in trajectories:
        assert traj.metrics["num_turns"] >= 2
        response = traj.response_tokens
        for k, (start, end) in enumerate(traj.turn_spans):
            model_turn = response[start:end]
            assert all(traj.loss_mask[start:end])
            budget = 40 - sum(e - s for s, e in traj.turn_spans[:k])
            assert model_turn == greedy_without_cache(tiny_lm, traj.prompt_tokens + response[:start], stops, budget)
            if k + 1 < len(traj.turn_spans):  # the observation delta between this turn and the next
                obs = response[end:traj.turn_spans[k + 1][0]]
                assert obs and not any(traj.loss_mask[end:traj.turn_spans[k + 1][0]])
                expected = agent.renderer.delta_tokens(model_turn, [{"role": "user", "content": f"turn {k + 1}"}])
                assert obs == expected
        assert len(traj.loss_mask) == len(response) and sum(traj.loss_mask) == sum(e - s for s, e in traj.turn_spans)
        assert traj.finish_reason in ("env_done", "length", "max_turns")
