"""The test oracle of agent rollouts: sessions generated greedily with a plain HF forward, no cache across turns.

Each turn prefills the *whole* conversation so far and decodes greedily (a KV cache lives only
within the turn), so its outputs are what any cache-reusing engine must reproduce: turn k+1 after
reusing the cache equals a fresh prefill of the whole conversation. Slow; tests import it as
`agent_reference` (tests/agents is on their path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchrlhf.agents.session import AgentSession, Trajectory


@torch.no_grad()
def run_sessions_reference(model: Any, tokenizer: Any, sessions: Sequence[AgentSession], *,
                           stop_token_ids: Sequence[int] | None = None) -> list[Trajectory]:
    """Drive each session to its end with greedy decoding; a turn stops at a stop token (default: EOS)."""
    stops = set(stop_token_ids) if stop_token_ids is not None else {tokenizer.eos_token_id}
    device = next(model.parameters()).device
    for session in sessions:
        while (budget := session.turn_budget()) > 0:
            ids = torch.tensor([session.tokens], device=device)
            out = model(input_ids=ids, use_cache=True)
            past, turn = out.past_key_values, []
            while True:
                token = int(out.logits[0, -1].argmax())
                turn.append(token)
                if token in stops or len(turn) == budget:
                    break
                out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
                past = out.past_key_values
            session.end_turn(turn, "stop" if turn[-1] in stops else "length").result()
    return [session.result() for session in sessions]
