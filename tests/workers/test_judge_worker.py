"""JudgeWorker: hand-written verdicts through the worker's real path (prompt, tokenization, batching, decode,
parse) with a scripted engine; failures score ``on_failure_score`` and are flagged; one real engine run."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from judge_engines import ScriptedEngine  # noqa: E402

from torchrlhf.data import Batch  # noqa: E402
from torchrlhf.models import load_tokenizer, save_tiny_model  # noqa: E402
from torchrlhf.workers.judge import JudgeWorker, question_of  # noqa: E402

ENGINE = {"_component_": "judge_engines.ScriptedEngine"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_judge"), tokenizer_from="smollm2"))


def generations(model_dir: str, answers: list[str]) -> Batch:
    """Policy samples answering "What is 2+2?" with ``answers`` (right-padded response tokens)."""
    tok = load_tokenizer(model_dir)
    ids = [tok(a, add_special_tokens=False)["input_ids"] for a in answers]
    width = max(len(x) for x in ids) + 1
    responses = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for row, x in enumerate(ids):
        responses[row, :len(x)], mask[row, :len(x)] = torch.tensor(x), 1
    n = len(answers)
    return Batch.from_dict({"responses": responses, "response_mask": mask, "raw_prompt": ["<chat>What is 2+2?"] * n,
                            "messages": [[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "What is 2+2?"}]] * n,
                            "ground_truth": ["4"] * n})


@pytest.fixture(autouse=True)
def fresh_script(monkeypatch):
    ScriptedEngine.calls, ScriptedEngine.clock, ScriptedEngine.seconds_per_call = [], [0.0], 0.0
    # the judge's clock only: patching ``time.monotonic`` itself froze every clock of the process (a
    # multiprocessing wait with timeout 0 then never ends, since its deadline is never passed)
    monkeypatch.setattr("torchrlhf.workers.judge.time", SimpleNamespace(monotonic=lambda: ScriptedEngine.clock[0]))


def test_question_is_the_last_user_message():
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert question_of(chat, "raw") == "c"
    assert question_of(None, "raw") == "raw" and question_of([{"role": "system", "content": "s"}], "raw") == "raw"


def test_scores_and_failures_from_hand_written_verdicts(model_dir):
    judge = JudgeWorker(model_dir, policy_tokenizer_path=model_dir, engine=ENGINE, batch_size=2,
                        on_failure_score=-1.0)
    out = judge.judge(generations(model_dir, ["4", "5", "five", "0.5", "4"]))
    assert out["judge_scores"].tolist() == [1.0, 0.0, -1.0, 0.5, 1.0]
    assert out["judge_parse_failed"].tolist() == [False, False, True, False, False]
    assert not out["judge_timed_out"].any() and not out["judge_too_long"].any()
    assert [len(c) for c in ScriptedEngine.calls] == [2, 2, 1]  # batch_size prompts per engine call
    first = ScriptedEngine.calls[0][0]
    assert "Question: What is 2+2?\nReference answer: 4\nAnswer to grade: 4\n" in first
    assert first.startswith("<|im_start|>") and "<|im_start|>assistant" in first  # the judge's chat template


def test_timeout_fails_the_samples_not_started(model_dir):
    ScriptedEngine.seconds_per_call = 10.0  # each engine call "takes" 10 s on the fake clock
    judge = JudgeWorker(model_dir, policy_tokenizer_path=model_dir, engine=ENGINE, batch_size=2, timeout_s=15.0,
                        on_failure_score=-1.0)
    out = judge.judge(generations(model_dir, ["4", "5", "4", "4", "5"]))
    # calls start at 0 s and 10 s (within 15 s); the third would start at 20 s: its sample times out
    assert out["judge_scores"].tolist() == [1.0, 0.0, 1.0, 1.0, -1.0]
    assert out["judge_timed_out"].tolist() == [False, False, False, False, True]
    assert not out["judge_parse_failed"].any()
    assert len(ScriptedEngine.calls) == 2


def test_too_long_prompt_fails_without_calling_the_engine(model_dir):
    judge = JudgeWorker(model_dir, policy_tokenizer_path=model_dir, engine={**ENGINE, "max_seq_len": 40},
                        sampling={"max_tokens": 8}, on_failure_score=0.25)
    out = judge.judge(generations(model_dir, ["4", "4"]))
    assert out["judge_scores"].tolist() == [0.25, 0.25] and out["judge_too_long"].all()
    assert ScriptedEngine.calls == []


def test_native_engine_verdicts_are_parsed_like_the_engine_wrote_them(model_dir):
    """A real (random tiny) judge on the native engine: its greedy verdict, decoded independently from the
    engine's own output, parses to the score the worker reports (here almost surely a parse failure)."""
    from torchrlhf.generation import NativeEngine, SamplingParams

    judge = JudgeWorker(model_dir, policy_tokenizer_path=model_dir, engine={"max_seq_len": 256, "max_batch_size": 4},
                        sampling={"max_tokens": 6}, template="{question} {response} Score:", parser={"regex": r"(\d)"},
                        apply_chat_template=False, on_failure_score=-1.0)
    out = judge.judge(generations(model_dir, ["4", "5"]))
    tok = load_tokenizer(model_dir)
    engine = NativeEngine(model_dir, tok, max_seq_len=256, max_batch_size=4, dtype=torch.float32)
    for row, answer in enumerate(["4", "5"]):
        ids = torch.tensor([tok(f"What is 2+2? {answer} Score:", add_special_tokens=False)["input_ids"]])
        gen = engine.generate(Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}),
                              SamplingParams(temperature=0.0, max_tokens=6, logprobs=False))
        verdict = tok.decode(gen["responses"][0][gen["response_mask"][0].bool()].tolist(), skip_special_tokens=True)
        digits = [c for c in verdict if c.isdigit()]
        want = float(digits[0]) if digits else -1.0
        assert out["judge_scores"][row].item() == want, verdict
        assert out["judge_parse_failed"][row].item() == (not digits)


def test_a_sleeping_judge_frees_its_engine_between_calls_and_judges_the_same(model_dir):
    """``sleep``: between calls the engine holds no KV cache and no weight storage; each call reads the weights
    back from the files, so two calls give the verdicts of a judge that never slept. (Without CPU prepacking,
    which would free the plain weights of both judges once packed.)"""
    engine = {"max_seq_len": 256, "max_batch_size": 4, "cpu_prepack": False}
    kw = dict(policy_tokenizer_path=model_dir, engine=engine, sampling={"max_tokens": 6},
              template="{question} {response} Score:", parser={"regex": r"(\d)"}, apply_chat_template=False,
              on_failure_score=-1.0)
    batches = [generations(model_dir, ["4", "5"]), generations(model_dir, ["5", "4", "4"])]
    awake = JudgeWorker(model_dir, **kw)
    want = [awake.judge(b) for b in batches]
    asleep = JudgeWorker(model_dir, sleep=True, **kw)
    for batch, expected in zip(batches, want):
        assert asleep.engine.cache is None
        assert all(p.untyped_storage().nbytes() == 0 for p in asleep.engine.model.parameters())
        got = asleep.judge(batch)
        for key in ("judge_scores", "judge_parse_failed"):
            assert torch.equal(got[key], expected[key]), key
    # what a call runs on: the weights read back equal the never-released judge's, tensor for tensor
    asleep._wake()
    woken, kept = asleep.engine.model.state_dict(), awake.engine.model.state_dict()
    assert woken.keys() == kept.keys() and all(torch.equal(woken[k], kept[k]) for k in kept)
    assert asleep.engine.cache is not None


TP_JUDGE = dict(engine={"max_seq_len": 256, "max_batch_size": 4, "cpu_prepack": False}, sampling={"max_tokens": 6},
                template="{question} {response} Score:", parser={"regex": r"(\d)"}, apply_chat_template=False,
                on_failure_score=-1.0)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
ANSWERS = ("4", "3")


def _tp_judge(rank: int, world: int, model_dir: str, out_dir: str) -> None:
    """One rank of a sleeping TP=2 judge: each wake reads this rank's shard of every tensor from the files."""
    import torch.distributed as dist

    from torchrlhf.runtime.worker import WorkerContext, set_current_context

    set_current_context(WorkerContext("judge", [0, 1], rank, dist.group.WORLD, torch.device("cpu")))
    judge = JudgeWorker(model_dir, policy_tokenizer_path=model_dir, tp_size=world, sleep=True, **TP_JUDGE)
    out = judge.judge(generations(model_dir, ["4", "5", "four"]))
    judge._wake()
    verdicts = judge._generate([judge._tokens(f"What is 2+2? {a} Score:") for a in ANSWERS])
    torch.save({"scores": out["judge_scores"], "failed": out["judge_parse_failed"], "verdicts": verdicts,
                "q_rows": judge.engine.param_local_shapes()[Q_PROJ][0]}, f"{out_dir}/rank{rank}.pt")


def test_a_tensor_parallel_sleeping_judge_judges_as_one_rank_does(tmp_path):
    """``tp_size=2``: one engine over 2 ranks (each holds half of q_proj's rows), woken from the files shard by
    shard; its verdicts and scores equal a one-rank judge's. (Large random weights: the verdicts differ by prompt,
    where a default tiny model writes the same token whatever it reads.)"""
    from dist_helpers import run_ranks

    model_dir = str(save_tiny_model(tmp_path / "judge", tokenizer_from="smollm2", initializer_range=1.0, seed=1))
    run_ranks(_tp_judge, 2, model_dir, str(tmp_path), timeout=180)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    single = JudgeWorker(model_dir, policy_tokenizer_path=model_dir, **TP_JUDGE)
    out = single.judge(generations(model_dir, ["4", "5", "four"]))
    want = single._generate([single._tokens(f"What is 2+2? {a} Score:") for a in ANSWERS])
    assert len(set(want)) == len(ANSWERS)  # a judge that reads its prompt
    full_rows = single.engine.param_local_shapes()[Q_PROJ][0]
    for r in (r0, r1):
        assert r["q_rows"] * 2 == full_rows
        assert r["verdicts"] == want
        assert torch.equal(r["scores"], out["judge_scores"]) and torch.equal(r["failed"], out["judge_parse_failed"])


def test_a_sleeping_vllm_judge_reads_its_weights_back_at_each_call(tmp_path):
    """``sleep`` with the vLLM engine: each call re-reads the judge's files into vLLM (fused q/k/v and gate/up
    loaded together), so a judge whose engine weights were overwritten between calls judges as before. On CPU
    vLLM's `release` frees nothing (no sleep mode there); what this checks is the wake's weight reload."""
    from torchrlhf.generation import vllm_available

    available, why = vllm_available()
    if not available:
        pytest.skip(f"vLLM is not importable here ({why})")
    # 4 heads of 32 (vLLM's CPU attention needs head_dim >= 32); large random weights: verdicts differ by prompt
    model_dir = str(save_tiny_model(tmp_path / "judge", hidden_size=128, intermediate_size=192, head_dim=32,
                                    initializer_range=1.0, seed=1))
    kw = {**TP_JUDGE, "engine": {"_component_": "torchrlhf.generation.VLLMEngine", "max_seq_len": 256,
                                 "max_batch_size": 4}}
    judge = JudgeWorker(model_dir, policy_tokenizer_path=model_dir, sleep=True, **kw)
    try:
        prompts = [judge._tokens(f"What is 2+2? {a} Score:") for a in ANSWERS]
        judge._wake()
        want = judge._generate(prompts)
        assert len(set(want)) == len(ANSWERS)
        first = judge.judge(generations(model_dir, ["4", "5", "four"]))
        shapes = judge.engine.param_local_shapes()
        judge.engine.update_weights((name, torch.full(shape, 0.01)) for name, shape in shapes.items())
        assert judge._generate(prompts) != want  # the overwrite reached the engine
        again = judge.judge(generations(model_dir, ["4", "5", "four"]))  # wakes: the files' weights again
        assert torch.equal(again["judge_scores"], first["judge_scores"])
        judge._wake()
        assert judge._generate(prompts) == want
    finally:
        judge.engine.shutdown()
