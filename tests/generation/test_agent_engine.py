"""Multi-turn agent rollouts on the native engine: token-exact against a reference that re-prefills the whole
conversation every turn, and only the new tokens prefilled between turns."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from torchrlhf.agents import AgentSession, build_agent
from torchrlhf.data import Batch
from torchrlhf.generation import NativeEngine, SamplingParams, generate_in_rounds
from torchrlhf.models import load_tokenizer, save_tiny_model

sys.path.insert(0, str(Path(__file__).parents[1] / "agents"))
from agent_reference import run_sessions_reference  # noqa: E402

# The agent tests' tools and environments (tests/agents/conftest.py), importable as `agent_user_tools`.
USER_TOOLS = runpy.run_path(str(Path(__file__).parents[1] / "agents" / "conftest.py"))["USER_TOOLS"]

IM_END = 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_agent"), tokenizer_from="smollm2", initializer_range=1.0))


@pytest.fixture(scope="module")
def env_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent_tools")
    (d / "agent_user_tools.py").write_text(USER_TOOLS)
    sys.path.insert(0, str(d))
    yield "agent_user_tools"
    sys.path.remove(str(d))


def _rows(n_prompts: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Count to {i + 3}."}], "index": i} for i in range(n_prompts)]


def _prompt_batch(rows: list[dict]) -> Batch:
    """The engine reads its prompts from the sessions; the batch only carries the rows' other columns."""
    return Batch({"input_ids": torch.ones(len(rows), 1, dtype=torch.long),
                  "attention_mask": torch.ones(len(rows), 1, dtype=torch.long)},
                 {"index": [r["index"] for r in rows]})


class Counting:
    """Wraps the engine's decoder to count the tokens its prefill and extend passes compute (``rides``: the
    extends done inside a decode step's forward)."""

    def __init__(self, engine: NativeEngine) -> None:
        self.prefill_tokens = self.extend_tokens = self.rides = 0
        prefill, extend, both = engine.decoder.prefill, engine.decoder.extend, engine.decoder.decode_and_extend

        def counted_prefill(tokens, lengths, *args):
            self.prefill_tokens += int(lengths.sum())
            return prefill(tokens, lengths, *args)

        def counted_extend(tokens, starts, lengths, *args):
            self.extend_tokens += int(lengths.sum())
            return extend(tokens, starts, lengths, *args)

        def counted_both(tokens, positions, span, kv_len, ext_tokens, ext_starts, ext_lengths, *args):
            self.extend_tokens += int(ext_lengths.sum())
            self.rides += 1
            return both(tokens, positions, span, kv_len, ext_tokens, ext_starts, ext_lengths, *args)

        engine.decoder.prefill, engine.decoder.extend = counted_prefill, counted_extend
        engine.decoder.decode_and_extend = counted_both


# 2 slots: trajectories wait for slots, slots are reused; check_every 3: turns end on the device and reach
# their sessions at the host's next look; compiled: the decode step is compiled, observations still ride
@pytest.mark.parametrize("max_batch_size, check_every, compiled", [(16, 1, False), (2, 1, False), (2, 3, False),
                                                                   (16, 1, True)])
def test_native_engine_turns_equal_a_full_reprefill_and_prefill_only_new_tokens(tiny_dir, env_module,
                                                                                  max_batch_size, check_every,
                                                                                  compiled):
    tok = load_tokenizer(tiny_dir)
    stops = [IM_END] + list(range(0, tok.vocab_size, 7))  # frequent stops: a random model's turns end early
    spec = {"env": {"_component_": f"{env_module}.Counter"}, "reward": "env", "max_turns": 4}
    rows = _rows(3)
    n = 2
    engine = NativeEngine(tiny_dir, max_batch_size=max_batch_size, max_seq_len=256, check_every=check_every,
                          compile=compiled)
    counting = Counting(engine)
    agent = build_agent(spec, tok, max_tokens=40, max_trajectory_tokens=256)
    sessions = [AgentSession(agent, row) for row in rows for _ in range(n)]
    sampling = SamplingParams(n=n, temperature=0.0, max_tokens=40, stop_token_ids=stops)
    out = engine.generate(_prompt_batch(rows), sampling, sessions=sessions)

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    reference = run_sessions_reference(hf, tok, [AgentSession(agent, row) for row in rows for _ in range(n)],
                                       stop_token_ids=stops)
    assert len(out) == len(rows) * n
    for i, (session, want) in enumerate(zip(sessions, reference)):
        got = session.result()
        assert got.response_tokens == want.response_tokens, i  # token for token, observations included
        assert got.loss_mask == want.loss_mask and got.turn_spans == want.turn_spans
        r = len(got.response_tokens)
        assert out["responses"][i, :r].tolist() == got.response_tokens
        assert out["response_mask"][i, :r].tolist() == got.loss_mask  # 0 exactly on observation tokens
        assert out["attention_mask"][i, -out["responses"].shape[1]:][:r].tolist() == [1] * r
        assert out["index"][i] == rows[i // n]["index"]
    assert max(t.metrics["num_turns"] for t in reference) >= 2
    # Every prompt is prefilled once (its n samples share it); after that only [last sampled token] +
    # observation tokens go through the model, never the conversation again.
    prompts = {tuple(s.prompt_tokens) for s in sessions}
    assert counting.prefill_tokens == sum(len(p) for p in prompts)
    observed = sum(1 + (b[0] - a[1]) for t in (s.result() for s in sessions)
                   for a, b in zip(t.turn_spans, t.turn_spans[1:]))
    assert counting.extend_tokens == observed
    # With 16 slots others decode while a turn's observation comes (the environment answers inside end_turn,
    # so this does not depend on timing): those observations ride in a decode step's forward (an eager one
    # where the step is compiled), and the tokens above equal the reference's all the same.
    if max_batch_size == 16:
        assert counting.rides > 0
    assert out.meta["rollout/riding_steps"] == counting.rides  # what a GPU profile needs: the eager steps


def test_rollout_log_probs_of_model_tokens_match_a_full_forward(tiny_dir, env_module):
    """The engine's log-probs are the policy's on the whole trajectory as context (observations included),
    0 on observation tokens."""
    tok = load_tokenizer(tiny_dir)
    stops = [IM_END] + list(range(0, tok.vocab_size, 7))
    agent = build_agent({"env": {"_component_": f"{env_module}.Counter"}, "reward": "env"}, tok, max_tokens=30,
                        max_trajectory_tokens=256)
    rows = _rows(2)
    engine = NativeEngine(tiny_dir, max_batch_size=8, max_seq_len=256)
    sampling = SamplingParams(n=2, temperature=0.8, max_tokens=30, stop_token_ids=stops, seed=3)
    sessions = [AgentSession(agent, row) for row in rows for _ in range(2)]
    out = engine.generate(_prompt_batch(rows), sampling, sessions=sessions)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    r = out["responses"].shape[1]
    with torch.no_grad():
        logits = hf(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                    position_ids=out["position_ids"]).logits[:, -r - 1 : -1] / 0.8
    want = torch.log_softmax(logits.float(), -1).gather(-1, out["responses"][..., None]).squeeze(-1)
    model = out["response_mask"].bool()
    torch.testing.assert_close(out["rollout_log_probs"][model], want[model], atol=1e-4, rtol=1e-4)
    assert (out["rollout_log_probs"][~model] == 0).all()
    assert (~model & out["attention_mask"][:, -r:].bool()).any()  # there are observation tokens


class SingleTurn:
    """The native engine as an engine without agent sessions: its `generate` samples single turns only."""

    def __init__(self, engine: NativeEngine) -> None:
        self.engine, self.calls = engine, 0

    def generate(self, prompts, sampling):
        self.calls += 1
        return self.engine.generate(prompts, sampling)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rounds_give_a_single_turn_engine_multi_turn_trajectories(tiny_dir, env_module, temperature):
    """`generate_in_rounds` (the driver vLLM uses) over any single-turn `generate`: greedy, token for token what
    the reference gives; sampled, the model tokens' log-probs are the policy's on the whole trajectory."""
    tok = load_tokenizer(tiny_dir)
    stops = [IM_END] + list(range(0, tok.vocab_size, 7))
    agent = build_agent({"env": {"_component_": f"{env_module}.Counter"}, "reward": "env", "max_turns": 4}, tok,
                        max_tokens=30, max_trajectory_tokens=256)
    rows = _rows(3)
    engine = SingleTurn(NativeEngine(tiny_dir, max_batch_size=4, max_seq_len=256))
    sampling = SamplingParams(n=2, temperature=temperature, max_tokens=30, stop_token_ids=stops, seed=5)
    sessions = [AgentSession(agent, row) for row in rows for _ in range(2)]
    out = generate_in_rounds(engine.generate, _prompt_batch(rows), sampling, sessions, pad_id=0)
    assert engine.calls == max(len(s.result().turn_spans) for s in sessions) >= 2  # one call per round
    assert len(out) == 6 and list(out["index"]) == [0, 0, 1, 1, 2, 2]
    for i, session in enumerate(sessions):
        got = session.result()
        r = len(got.response_tokens)
        assert out["responses"][i, :r].tolist() == got.response_tokens
        assert out["response_mask"][i, :r].tolist() == got.loss_mask
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    if temperature == 0.0:
        reference = run_sessions_reference(hf, tok, [AgentSession(agent, row) for row in rows for _ in range(2)],
                                           stop_token_ids=stops)
        for i, (session, want) in enumerate(zip(sessions, reference)):
            got = session.result()
            assert got.response_tokens == want.response_tokens and got.loss_mask == want.loss_mask, i
        return
    r = out["responses"].shape[1]
    with torch.no_grad():
        logits = hf(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                    position_ids=out["position_ids"]).logits[:, -r - 1 : -1] / temperature
    want = torch.log_softmax(logits.float(), -1).gather(-1, out["responses"][..., None]).squeeze(-1)
    model = out["response_mask"].bool()
    torch.testing.assert_close(out["rollout_log_probs"][model], want[model], atol=1e-4, rtol=1e-4)
    assert (out["rollout_log_probs"][~model] == 0).all() and (~model & out["attention_mask"][:, -r:].bool()).any()


def test_vllm_engine_turns_equal_a_full_reprefill(tmp_path, env_module):
    """vLLM runs the same sessions in rounds (whole sequences, its prefix cache reusing earlier turns):
    token for token what the reference gives, observations included."""
    from torchrlhf.generation import VLLMEngine, vllm_available

    available, why = vllm_available()
    if not available:
        pytest.skip(f"vLLM is not importable here ({why})")
    # vLLM's CPU attention needs head_dim >= 32: 4 heads of 32
    model_dir = str(save_tiny_model(tmp_path / "wide", tokenizer_from="smollm2", initializer_range=1.0,
                                    hidden_size=128, intermediate_size=192, head_dim=32))
    tok = load_tokenizer(model_dir)
    stops = [IM_END] + list(range(0, tok.vocab_size, 7))
    spec = {"env": {"_component_": f"{env_module}.Counter"}, "reward": "env", "max_turns": 4}
    agent = build_agent(spec, tok, max_tokens=30, max_trajectory_tokens=256)
    rows = _rows(2)
    sessions = [AgentSession(agent, row) for row in rows for _ in range(2)]
    engine = VLLMEngine(model_dir, max_batch_size=8, max_seq_len=256)
    try:
        out = engine.generate(_prompt_batch(rows), SamplingParams(n=2, temperature=0.0, max_tokens=30,
                                                                  stop_token_ids=stops), sessions=sessions)
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = run_sessions_reference(hf, tok, [AgentSession(agent, row) for row in rows for _ in range(2)],
                                       stop_token_ids=stops)
    for i, (session, want) in enumerate(zip(sessions, reference)):
        got = session.result()
        assert got.response_tokens == want.response_tokens and got.loss_mask == want.loss_mask, i
        r = len(got.response_tokens)
        assert out["response_mask"][i, :r].tolist() == got.loss_mask
    assert max(t.metrics["num_turns"] for t in reference) >= 2
