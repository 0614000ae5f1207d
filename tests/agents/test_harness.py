"""The OpenAI-compatible endpoint for black-box agent harnesses, driven by the real ``openai`` client: calls
recorded token-exact with the engine's log-probs (checked against HF transformers), splits counted, bad
harnesses made error samples, and the recipe run for 2 steps on SmolLM2 with a harness."""

from __future__ import annotations

import functools

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from torchrlhf.agents import build_agent
from torchrlhf.agents.harness import HarnessRunner
from torchrlhf.config import ConfigError, load_callable
from torchrlhf.generation import NativeEngine, SamplingParams
from torchrlhf.generation.base import sample_sessions
from torchrlhf.models import load_tokenizer, save_tiny_model

# Only the tests whose harnesses speak through the `openai` client skip without it (`harness_module`, and those that
# import it); the endpoint's parsing and its config checks do not need it.
ROOT = Path(__file__).resolve().parents[2]

HARNESSES = textwrap.dedent(
    '''
    import time

    import openai


    def client(base_url):
        return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


    def two_calls(base_url, row):
        """A chat, a tool result as the next message, a second chat: one token-exact trajectory."""
        c = client(base_url)
        messages = list(row["prompt"])
        first = c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Result: 42"})
        second = c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        return float(len(second.choices[0].message.content or ""))


    def restarts(base_url, row):
        """A second call that does not extend the first: two segments, the last one kept."""
        c = client(base_url)
        c.chat.completions.create(model="policy", messages=list(row["prompt"]), max_tokens=5)
        c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Start over."}],
                                  max_tokens=5)
        return 1.0


    def concurrent_calls(base_url, row):
        """Two calls at once in one session, neither extending the other: both answered, a split counted."""
        from concurrent.futures import ThreadPoolExecutor

        c = client(base_url)
        ask = lambda _: c.chat.completions.create(model="policy", messages=list(row["prompt"]), max_tokens=4)
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(ask, range(2)))
        return float(sum(r.choices[0].finish_reason in ("stop", "length") for r in replies))


    def late_and_slow(base_url, row):
        """Row 0 starts late (after the others' first calls are sampled) and every row works between its
        calls: each trajectory is still one token-exact conversation of two turns."""
        if row["index"] == 0:
            time.sleep(1.0)
        c = client(base_url)
        messages = list(row["prompt"])
        first = c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        time.sleep(0.3 * row["index"])
        messages.append(first.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "Result: 42"})
        c.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        return 1.0


    def completions(base_url, row):
        out = client(base_url).completions.create(model="policy", prompt="Once upon a time", max_tokens=5)
        return 0.5 if isinstance(out.choices[0].text, str) else 0.0


    def raises(base_url, row):
        client(base_url).chat.completions.create(model="policy", messages=list(row["prompt"]), max_tokens=4)
        raise RuntimeError("the harness broke")


    def hangs(base_url, row):
        time.sleep(30)
        return 1.0


    def not_a_number(base_url, row):
        return "high"


    def bad_request(base_url, row):
        try:
            client(base_url).chat.completions.create(model="policy", messages=list(row["prompt"]), n=2)
        except openai.BadRequestError as e:
            return 2.0 if "n must be 1" in str(e) else 0.0
        return 0.0
    '''
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_harness"), tokenizer_from="smollm2",
                               initializer_range=1.0))


@pytest.fixture(scope="module")
def harness_module(tmp_path_factory):
    pytest.importorskip("openai")
    d = tmp_path_factory.mktemp("harnesses")
    (d / "user_harnesses.py").write_text(HARNESSES)
    sys.path.insert(0, str(d))
    yield "user_harnesses"
    sys.path.remove(str(d))


@pytest.fixture(scope="module")
def engine(tiny_dir) -> NativeEngine:
    return NativeEngine(tiny_dir, max_batch_size=8, max_seq_len=256)


ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "index": i} for i in range(3)]
PARAMS = SamplingParams(temperature=1.0, max_tokens=16, logprobs=True)


def _run(engine, tiny_dir, harness_module, name, rows=ROWS, timeout_s: float = 300.0, **spec):
    tok = load_tokenizer(tiny_dir)
    agent = build_agent({"harness": {"fn": f"{harness_module}:{name}", "timeout_s": timeout_s}, "reward": "env", **spec},
                        tok, max_tokens=16, max_trajectory_tokens=256)
    runner = HarnessRunner(agent, agent.harness)
    try:
        return tok, runner.run(rows, [7 + i for i in range(len(rows))], functools.partial(sample_sessions, engine.generate, PARAMS))
    finally:
        runner.close()


def _template(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_calls_are_one_token_exact_trajectory_with_the_engines_log_probs(engine, tiny_dir, harness_module,
                                                                        monkeypatch):
    """The native engine parks each trajectory's slot between its calls: the second call's new tokens are
    computed after the first's cached keys/values, its prompt is not computed again."""
    extended = []
    extend = engine.decoder.extend

    def spy(tokens, starts, lengths, *rest):
        extended.extend(zip(starts.tolist(), lengths.tolist()))
        return extend(tokens, starts, lengths, *rest)

    monkeypatch.setattr(engine.decoder, "extend", spy)
    tok, (trajectories, logps) = _run(engine, tiny_dir, harness_module, "two_calls")
    _check_two_calls(tiny_dir, tok, (trajectories, logps))
    for traj in trajectories:
        (_, first_end), (second_start, _) = traj.turn_spans
        held = len(traj.prompt_tokens) + first_end - 1  # the first turn's last token is computed with the rest
        assert (held, second_start - first_end + 1) in extended


def test_a_round_based_engine_serves_the_harness_too(tmp_path, harness_module):
    """vLLM runs the harness's sessions in rounds (every waiting call sampled together): the same token-exact
    trajectories with the model's log-probs."""
    from torchrlhf.generation import VLLMEngine, vllm_available

    available, why = vllm_available()
    if not available:
        pytest.skip(f"vLLM is not importable here ({why})")
    # vLLM's CPU attention needs head_dim >= 32: 4 heads of 32
    model_dir = str(save_tiny_model(tmp_path / "wide", tokenizer_from="smollm2", initializer_range=1.0,
                                    hidden_size=128, intermediate_size=192, head_dim=32))
    engine = VLLMEngine(model_dir, max_batch_size=8, max_seq_len=256)
    try:
        _check_two_calls(model_dir, *_run(engine, model_dir, harness_module, "two_calls"))
    finally:
        engine.shutdown()


def _check_two_calls(model_dir, tok, result) -> None:
    trajectories, logps = result
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for row, traj, lp in zip(ROWS, trajectories, logps):
        assert not traj.error and traj.metrics == {"num_turns": 2.0, "harness_splits": 0.0}
        # the prompt is the chat template's render of the row (computed by HF, independently)
        assert traj.prompt_tokens == _template(tok, row["prompt"])
        (s0, e0), (s1, e1) = traj.turn_spans
        assert s0 == 0 and traj.loss_mask == [1] * e0 + [0] * (s1 - e0) + [1] * (e1 - s1)
        observation = tok.decode(traj.response_tokens[e0:s1])
        assert "Result: 42" in observation and observation.rstrip().endswith("assistant")
        assert traj.env_reward == float(len(tok.decode(traj.response_tokens[s1:e1], skip_special_tokens=True)))
        # the engine's log-probs are the model's: an HF forward over the whole trajectory
        ids = torch.tensor([traj.prompt_tokens + traj.response_tokens])
        with torch.no_grad():
            logits = hf(ids).logits[0, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][len(traj.prompt_tokens) - 1:]
        model = torch.tensor(traj.loss_mask, dtype=torch.bool)
        assert len(lp) == int(model.sum())
        torch.testing.assert_close(torch.tensor(lp), ref[model], atol=2e-3, rtol=0)


def test_check_tokens_re_renders_the_trajectorys_conversation(tiny_dir, harness_module):
    """``check_tokens`` re-renders the conversation from text: 0 differing tokens where the model's turns are the
    tokenizer's own encodings of their text; "abc" sampled letter by letter re-renders as other tokens, counted
    (``metric``) or stopping the run (``error``). The model's turns are scripted (each call's budget is 6)."""
    from torchrlhf.generation.session import run_rounds

    tok = load_tokenizer(tiny_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    letters = [tok.convert_tokens_to_ids(c) for c in "abc"]
    assert tok.encode("abc", add_special_tokens=False) != letters

    def run(first: list[int], check: str):
        agent = build_agent({"harness": {"fn": f"{harness_module}:two_calls"}, "reward": "env", "check_tokens": check}, tok,
                            max_tokens=16, max_trajectory_tokens=256)
        runner = HarnessRunner(agent, agent.harness)

        def drive(sessions, seeds):
            def sample(live, _round):
                turns = [first if not [c for c in sessions[k].session.calls if c.completion] else
                         tok.encode("ok", add_special_tokens=False) for k in live]
                return [(t + [im_end], [0.0] * (len(t) + 1), "stop") for t in turns]

            return run_rounds(sessions, sample)

        try:
            return runner.run(ROWS[:1], [0], drive)[0][0]
        finally:
            runner.close()

    exact = run(tok.encode("abc", add_special_tokens=False), "metric")
    assert exact.metrics == {"num_turns": 2.0, "harness_splits": 0.0, "token_mismatches": 0.0}
    split = run(letters, "metric")
    assert split.response_tokens[:3] == letters and split.metrics["token_mismatches"] > 0
    with pytest.raises(ValueError, match="re-rendering the conversation from text differs"):
        run(letters, "error")


def test_a_call_that_does_not_extend_the_trajectory_is_split_and_counted(engine, tiny_dir, harness_module):
    tok, (trajectories, _) = _run(engine, tiny_dir, harness_module, "restarts")
    restart = _template(tok, [{"role": "user", "content": "Start over."}])
    for traj in trajectories:
        assert traj.metrics == {"num_turns": 1.0, "harness_splits": 1.0}
        assert traj.prompt_tokens == restart and traj.env_reward == 1.0


AGENTS_SDK_HARNESS = textwrap.dedent(
    '''
    import openai
    from agents import Agent, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool


    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b


    def run_agent(base_url, row):
        """An OpenAI Agents SDK agent with one function tool, on the endpoint's chat completions."""
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        agent = Agent(name="adder", instructions="Add numbers with the add tool.", tools=[add],
                      model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
        result = Runner.run_sync(agent, row["prompt"][-1]["content"], run_config=RunConfig(tracing_disabled=True))
        return 1.0 if "5" in str(result.final_output) else 0.0
    '''
)


def test_an_openai_agents_sdk_agent_calls_its_tool_through_the_endpoint(tiny_dir, tmp_path, monkeypatch):
    """The Agents SDK (``openai-agents``) runs its own tool loop against the endpoint: the model's Hermes
    tool call reaches it as OpenAI ``tool_calls``, it runs ``add`` and sends the result back as a ``tool``
    message, which is appended as the chat template's delta. A random model never writes a tool call, so
    the turns are scripted (a drive that answers each call with fixed tokens): the trajectory holds exactly
    those tokens, the tool's result between them, and the SDK's final output is the second turn."""
    pytest.importorskip("agents")
    from torchrlhf.generation.session import run_rounds

    (tmp_path / "sdk_harness.py").write_text(AGENTS_SDK_HARNESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = load_tokenizer(tiny_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = [tok('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
                 add_special_tokens=False)["input_ids"] + [end],
             tok("The sum is 5.", add_special_tokens=False)["input_ids"] + [end]]

    def scripted(segments, seeds):
        return run_rounds(segments, lambda live, round_: [(turns[round_], [-0.5] * len(turns[round_]), "stop")
                                                          for _ in live])

    agent = build_agent({"harness": {"fn": "sdk_harness:run_agent"}, "reward": "env"}, tok, max_tokens=64,
                        max_trajectory_tokens=256)
    runner = HarnessRunner(agent, agent.harness)
    try:
        trajectories, logps = runner.run(ROWS[:2], [1, 2], scripted)
    finally:
        runner.close()
    for traj, lp in zip(trajectories, logps):
        assert not traj.error and traj.env_reward == 1.0
        assert traj.metrics == {"num_turns": 2.0, "harness_splits": 0.0}
        (s0, e0), (s1, e1) = traj.turn_spans
        assert traj.response_tokens[s0:e0] == turns[0] and traj.response_tokens[s1:e1] == turns[1]
        observation = tok.decode(traj.response_tokens[e0:s1])
        assert "<|im_start|>tool\n5<|im_end|>" in observation.replace(" ", "")
        assert lp == [-0.5] * (len(turns[0]) + len(turns[1]))


@pytest.mark.parametrize("together", [False, True])
def test_concurrent_calls_of_one_trajectory_are_both_answered(engine, tiny_dir, harness_module, monkeypatch,
                                                               together):
    """Two calls at once in one trajectory: the first is sampled and the trajectory's session ends after
    it, the second waits for the next ``generate`` (a new segment). ``together``: the first batch is held
    until both calls of every trajectory wait, so that one ``generate`` opens the first call while the
    second waits outside it (before the fix, that session waited for a next call that could not come)."""
    if together:
        gather, held = HarnessRunner._gather, []

        def gather_both(self, sessions, pending):
            while not held and len(pending) < 2 * len(sessions):
                pending.append(self.server.requests.get(timeout=30))
            held.append(True)
            return gather(self, sessions, pending)

        monkeypatch.setattr(HarnessRunner, "_gather", gather_both)  # (a call that never comes: queue.Empty)
    _, (trajectories, _) = _run(engine, tiny_dir, harness_module, "concurrent_calls", timeout_s=20.0)
    for traj in trajectories:
        assert traj.env_reward == 2.0 and not traj.error
        assert traj.metrics == {"num_turns": 1.0, "harness_splits": 1.0}


def test_a_late_or_busy_harness_keeps_its_trajectory_whole(engine, tiny_dir, harness_module):
    """A first call that comes after the others' are being sampled waits for the next ``generate``; a
    harness busy between its calls keeps its slot parked. Either way the trajectory is one conversation."""
    tok, (trajectories, logps) = _run(engine, tiny_dir, harness_module, "late_and_slow")
    for row, traj, lp in zip(ROWS, trajectories, logps):
        assert not traj.error and traj.env_reward == 1.0
        assert traj.metrics == {"num_turns": 2.0, "harness_splits": 0.0}
        assert traj.prompt_tokens == _template(tok, row["prompt"])
        assert len(lp) == sum(traj.loss_mask)


def test_completions_endpoint(engine, tiny_dir, harness_module):
    tok, (trajectories, logps) = _run(engine, tiny_dir, harness_module, "completions", rows=ROWS[:1])
    assert trajectories[0].prompt_tokens == tok("Once upon a time")["input_ids"]
    assert trajectories[0].env_reward == 0.5 and len(logps[0]) == len(trajectories[0].response_tokens) > 0


@pytest.mark.parametrize("name", ["raises", "hangs", "not_a_number"])
def test_a_failing_or_hanging_harness_is_an_error_sample(engine, tiny_dir, harness_module, name):
    _, (trajectories, logps) = _run(engine, tiny_dir, harness_module, name, timeout_s=1.0)
    assert [t.error for t in trajectories] == [True] * len(ROWS)
    assert all(t.finish_reason == "error" for t in trajectories)


def test_a_bad_request_is_an_openai_error_the_harness_sees(engine, tiny_dir, harness_module):
    _, (trajectories, _) = _run(engine, tiny_dir, harness_module, "bad_request", rows=ROWS[:1])
    assert trajectories[0].env_reward == 2.0 and not trajectories[0].error


def test_config_errors(tiny_dir, tmp_path, monkeypatch):
    (tmp_path / "plain_harness.py").write_text("def two_calls(base_url, row):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    harness_module = "plain_harness"
    tok = load_tokenizer(tiny_dir)
    with pytest.raises(ConfigError, match="set reward: env"):
        build_agent({"harness": {"fn": f"{harness_module}:two_calls"}}, tok, max_tokens=8)
    with pytest.raises(ConfigError, match="leave tools, env and verifiers unset"):
        build_agent({"harness": {"fn": f"{harness_module}:two_calls"}, "tools": ["calculator"], "reward": "env"}, tok,
                    max_tokens=8)
    with pytest.raises(ConfigError, match="rollout.agent.harness.fn: "):
        build_agent({"harness": {"fn": f"{harness_module}:missing"}, "reward": "env"}, tok, max_tokens=8)
    with pytest.raises(ConfigError, match="tool_calls.format, max_turns do not apply to a harness: your agent runs its"):
        build_agent({"harness": {"fn": f"{harness_module}:two_calls"}, "reward": "env", "max_turns": 1,
                     "tool_calls": {"format": "tags"}}, tok, max_tokens=8)
    with pytest.raises(ConfigError, match="harness.timeout_s apply only with a harness or verifiers"):
        build_agent({"tools": ["calculator"], "harness": {"timeout_s": 5}}, tok, max_tokens=8)
    with pytest.raises(ConfigError, match="rollout.agent.harness.batch_wait_s: must be >= 0, got -1"):
        build_agent({"harness": {"fn": f"{harness_module}:two_calls", "batch_wait_s": -1}, "reward": "env"}, tok,
                    max_tokens=8)
    with pytest.raises(ConfigError, match="rollout.agent.harness: moved to rollout.agent.harness.fn"):
        build_agent({"harness": f"{harness_module}:two_calls", "reward": "env"}, tok, max_tokens=8)
    with pytest.raises(ConfigError, match=r"rollout.agent.harness: unknown key 'timeout' \(did you mean 'timeout_s'"):
        build_agent({"harness": {"fn": f"{harness_module}:two_calls", "timeout": 5}, "reward": "env"}, tok,
                    max_tokens=8)


def test_the_endpoint_takes_every_trajectory_connecting_at_once():
    """Twice, 128 openai clients (a step of 16 prompts x 8 trajectories) call the endpoint together, without
    retries: every connection is accepted (with a listen backlog of 5 some were refused)."""
    import threading

    openai = pytest.importorskip("openai")

    from torchrlhf.agents.harness import HarnessServer

    server = HarnessServer()
    reply = {"id": "c", "object": "chat.completion", "created": 0, "model": "policy", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}]}

    def answer(n: int) -> None:
        for _ in range(n):
            HarnessRunner._answer(server.requests.get(timeout=300), 200, reply)  # a hang guard only

    errors: list[str] = []

    def call(i: int) -> None:
        client = openai.OpenAI(base_url=server.base_url(f"s{i}"), api_key="unused", max_retries=0, timeout=300)
        try:
            assert client.chat.completions.create(model="policy", messages=[]).choices[0].message.content == "ok"
        except Exception as e:  # noqa: BLE001 - every failure is counted, not raised in a thread
            errors.append(repr(e))

    try:
        for _ in range(2):
            threads = [threading.Thread(target=answer, args=(128,))]
            threads += [threading.Thread(target=call, args=(i,)) for i in range(128)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=600)
            assert not any(t.is_alive() for t in threads)
    finally:
        server.close()
    assert errors == [], (len(errors), errors[:3])


def test_the_clients_reply_models_are_built_before_the_harness_threads_start():
    """openai builds its pydantic models at first use, and two threads doing that at once can read a half-built
    one (``BaseModel cannot be instantiated directly`` failed a harness in CI): the runner builds every model
    of a chat or completions reply first. Checked in a fresh process, where they start deferred."""
    pytest.importorskip("openai")
    script = textwrap.dedent(
        """
        import pydantic, typing
        from openai.types.chat import ChatCompletion, ChatCompletionMessage
        from openai.types.chat.chat_completion import ChoiceLogprobs
        from openai.types import Completion, CompletionUsage
        models = [ChatCompletion, ChatCompletionMessage, ChoiceLogprobs, Completion, CompletionUsage]
        assert not any(m.__pydantic_complete__ for m in models), "openai no longer defers its models"
        from torchrlhf.agents.harness import build_openai_reply_models
        build_openai_reply_models()
        print([m.__pydantic_complete__ for m in models])
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DEFER_PYDANTIC_BUILD": "true"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[True, True, True, True, True]"


def test_recipe_trains_two_steps_with_a_harness_on_smollm2(tmp_path):
    """recipes/configs/grpo_calculator_harness_cpu.yaml (the calculator agent as an openai-client harness), cut
    to 2 steps of 2 prompts x 2 trajectories."""
    import os
    import subprocess

    pytest.importorskip("openai")

    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "recipes/ppo.py", "--config", "recipes/configs/grpo_calculator_harness_cpu.yaml",
         "trainer.total_steps=2", "data.train_batch_size=2", "rollout.n=2", "rollout.max_tokens=32",
         "actor.batching.ppo_mini_batch_size=2", "actor.batching.ppo_micro_batch_size_per_device=4",
         "trainer.val_before_train=false", "trainer.test_freq=0", f"trainer.output_dir={out}",
         "trainer.loggers=[jsonl]"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m.get("step", 0) >= 1]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["agent/agent_error/mean"] == 0.0 and m["agent/harness_splits/mean"] == 0.0
        assert m["num_turns/min"] >= 1 and m["rollout/weight_version"] == m["step"] - 1
        assert m["critic/score/mean"] == m["agent/env_reward/mean"]  # the harness's return is the score
        assert "perf/reshard_s" in m  # the rollout ran in generate_with_current_weights, as any colocated one


STOP_HARNESS = textwrap.dedent(
    '''
    import json
    import urllib.error
    import urllib.request


    def chat(base_url, **body):
        request = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())["choices"][0]


    def run_agent(base_url, row):
        """Asks with a stop string, then goes on from the answer it got (a plain HTTP client: no openai needed)."""
        messages = list(row["prompt"])
        first = chat(base_url, model="policy", messages=messages, stop=["STOP"], max_tokens=32)
        messages += [first["message"], {"role": "user", "content": "Result: 42"}]
        second = chat(base_url, model="policy", messages=messages, stop="never said")
        ok = first["message"]["content"] == "abc " and first["finish_reason"] == "stop"
        return 1.0 if ok and second["finish_reason"] == "stop" else 0.0


    def bad_stop(base_url, row):
        try:
            chat(base_url, model="policy", messages=list(row["prompt"]), stop=[""])
        except urllib.error.HTTPError as e:
            return 2.0 if e.code == 400 and "'stop' must be a non-empty string" in e.read().decode() else 0.0
        return 0.0
    '''
)


def test_a_requests_stop_strings_end_its_turn(tiny_dir, tmp_path, monkeypatch):
    """``stop``: the reply's text ends before the stop string (finish_reason ``stop``) and the recorded turn ends
    with the token that completes it, as `SamplingParams.stop` keeps it; the tokens the engine sampled after it
    are dropped, so the next call is sampled from its own prompt (the cut turn's tokens and the new message), never
    after them. The trajectory stays one token-exact conversation. Scripted turns, as a random model never says
    STOP."""
    from torchrlhf.generation.session import run_rounds

    (tmp_path / "stop_harness.py").write_text(STOP_HARNESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = load_tokenizer(tiny_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first = tok("abc STOP def ghi", add_special_tokens=False)["input_ids"] + [end]
    second = tok("Done.", add_special_tokens=False)["input_ids"] + [end]
    kept = next(k for k in range(1, len(first)) if "STOP" in tok.decode(first[:k]))  # the tokens up to "STOP"
    drives = []

    def scripted(segments, seeds):
        drives.append(len(segments))
        turn = first if len(drives) == 1 else second
        return run_rounds(segments, lambda live, round_: [(turn, [-0.25] * len(turn), "stop") for _ in live])

    agent = build_agent({"harness": {"fn": "stop_harness:run_agent"}, "reward": "env"}, tok, max_tokens=64,
                        max_trajectory_tokens=256)
    runner = HarnessRunner(agent, agent.harness)
    try:
        (traj,), (logps,) = runner.run(ROWS[:1], [3], scripted)
    finally:
        runner.close()
    assert drives == [1, 1] and not traj.error and traj.env_reward == 1.0  # the harness saw "abc " and "stop"
    (s0, e0), (s1, e1) = traj.turn_spans
    assert traj.response_tokens[s0:e0] == first[:kept] and traj.response_tokens[s1:e1] == second
    assert traj.metrics == {"num_turns": 2.0, "harness_splits": 0.0}  # the second call extends the cut turn
    assert logps == [-0.25] * (kept + len(second))
    runner = HarnessRunner(agent, load_callable("stop_harness:bad_stop"))
    try:
        (traj,), _ = runner.run(ROWS[:1], [3], scripted)
    finally:
        runner.close()
    assert traj.env_reward == 2.0 and drives == [1, 1]  # refused with its reason, before any sampling


def test_the_harness_is_imported_once_per_rank(tiny_dir, tmp_path):
    """Rank 0 both checks the config (the controller) and serves the rollout: the spec is checked there, crosses
    the RPC hop as itself (pickled), and the worker builds its agent from it. The harness file named by path runs
    its top level once in that process (it ran 4 times: the check, the worker's re-validation, the agent and the
    rollout worker each imported it)."""
    import pickle

    from torchrlhf.agents import AgentSpec

    imports = tmp_path / "imports.txt"
    (tmp_path / "counted_harness.py").write_text(
        f"with open({str(imports)!r}, 'a') as f:\n    f.write('imported\\n')\n\n\n"
        "def run_agent(base_url, row):\n    return 0.0\n")
    spec = AgentSpec(harness={"fn": f"{tmp_path / 'counted_harness.py'}:run_agent"}, reward="env")
    spec.check()  # the controller's config check
    agent = build_agent(pickle.loads(pickle.dumps(spec)), load_tokenizer(tiny_dir), max_tokens=8)  # the worker
    runner = HarnessRunner(agent, agent.harness)
    runner.close()
    assert imports.read_text().splitlines() == ["imported"]
