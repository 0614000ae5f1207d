"""The judge role: a generative reward model that reads each response and writes a verdict, parsed to a score.

It owns a `RolloutEngine` (the native engine or vLLM: the rollout's engine contract,
`torchrlhf.generation.base`) built from its own ``model_path``, on the ranks ``placement.judge`` names (by
default the actor's, beside the training roles: the judge keeps its weights and cache resident). With
``tp_size`` > 1 each engine spans that many adjacent ranks (tensor parallel, the native engine's layout), so
a judge larger than one device's memory fits. Samples are split across the engines and judged ``batch_size``
prompts per `generate` call.

Texts cross tokenizers: responses are decoded with the policy's tokenizer and the judge's prompt is
tokenized with the judge's own, so the judge may be any causal LM with a tokenizer.

Failures are scores, not errors (`torchrlhf.rewards.judge`): an unparseable verdict, a parser call past
``parser.timeout_s``, a judge prompt longer than the engine's sequence, and every sample not started within
``timeout_s`` of the call score ``on_failure_score`` and are flagged in the returned columns.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchrlhf.config import as_section, get_component
from torchrlhf.data import Batch
from torchrlhf.generation import SamplingParams
from torchrlhf.hybrid.broadcast import local_shard
from torchrlhf.models import SafetensorsReader, load_tokenizer, safetensors_files
from torchrlhf.rewards.judge import DEFAULT_TEMPLATE, ParserSpec, VerdictParser, check_template, render_judge_prompt
from torchrlhf.runtime.worker import Dispatch, Worker, register
from torchrlhf.workers.base import resolve_dtype

JUDGE_COLUMNS = ("judge_scores", "judge_parse_failed", "judge_timed_out", "judge_too_long")


def question_of(messages: Any, raw_prompt: str) -> str:
    """The question a sample answers: its last user message, else the prompt text the policy saw."""
    if isinstance(messages, Sequence) and not isinstance(messages, str):
        users = [m.get("content") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return raw_prompt


@dataclass(frozen=True)
class JudgeSampling:
    """The ``judge.sampling`` section: how a verdict is sampled (greedy and short by default). ``seed``: the
    base sampling seed, with a temperature above 0."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.params()  # SamplingParams' own checks, naming the key

    def params(self) -> SamplingParams:
        return SamplingParams(n=1, temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              seed=self.seed, logprobs=False)



class JudgeWorker(Worker):
    """An LLM judge on an engine. Arguments mirror the ``judge`` config section.

    Args:
        model_path: the judge model (an HF directory, or ``smollm2``).
        policy_tokenizer_path: decodes the policy's responses (the run's tokenizer; set by the recipe).
        engine: ``_component_`` (a `RolloutEngine` class, default `torchrlhf.generation.NativeEngine`) and
            its keyword arguments (``max_seq_len``, ``max_batch_size``, ...).
        template: the judge's prompt, with ``{question}``, ``{response}`` and ``{reference}`` (the sample's
            ground truth) fields.
        apply_chat_template: wrap the prompt as one user message in the judge tokenizer's chat template.
        parser: how a verdict becomes a score (`ParserSpec`: ``regex``, or a function ``fn`` run in a worker
            process under ``timeout_s``); default ``Score: <number>``.
        sampling: the verdict's sampling (`JudgeSampling`: ``max_tokens``, ``temperature`` (0: greedy),
            ``top_p``, ``seed``).
        batch_size: judge prompts per engine call.
        timeout_s: samples not started this long after a call began are not judged (they fail).
        on_failure_score: the score of a failed sample (unparseable, timed out, prompt too long).
        weight: the judge's score enters the reward as ``weight * score`` (the rule reward's: ``reward.weight``),
            composed by `torchrlhf.rollouts.Scorer`.
        dtype: the judge's weights.
        tp_size: ranks per judge engine (tensor parallel; must divide the judge's ranks).
        sleep: free the engine's weights and KV cache between judge calls (`release`) and read the weights
            back from ``model_path``'s safetensors at the next call: a judge on the training ranks then holds
            no memory while the actor generates and trains, for one read of its weights per step.
    """

    def __init__(
        self,
        model_path: str,
        *,
        policy_tokenizer_path: str,
        engine: dict[str, Any] | None = None,
        template: str = DEFAULT_TEMPLATE,
        apply_chat_template: bool = True,
        parser: ParserSpec = ParserSpec(),
        sampling: JudgeSampling = JudgeSampling(),
        batch_size: int = 16,
        timeout_s: float = 600.0,
        on_failure_score: float = 0.0,
        weight: float = 1.0,
        dtype: str = "float32",
        tp_size: int = 1,
        sleep: bool = False,
    ) -> None:
        super().__init__(tp=tp_size)
        if batch_size < 1 or timeout_s < 0:
            raise ValueError(f"judge: need batch_size >= 1 and timeout_s >= 0, got {batch_size}, {timeout_s}")
        self.template = check_template(template)
        self.apply_chat_template = apply_chat_template
        self.parser = VerdictParser(as_section(ParserSpec, parser))
        sampling = as_section(JudgeSampling, sampling)
        self.sampling = sampling.params()
        self.batch_size, self.timeout_s = batch_size, float(timeout_s)
        self.on_failure_score, self.weight = float(on_failure_score), float(weight)
        self.tokenizer = load_tokenizer(model_path)
        self.policy_tokenizer = self.tokenizer if policy_tokenizer_path == model_path else \
            load_tokenizer(policy_tokenizer_path)
        spec = dict(engine or {})
        engine_cls = get_component(spec.pop("_component_", "torchrlhf.generation.NativeEngine"))
        self.tp_mesh = self.build_meshes()[1] if self.parallel_dims.tp > 1 else None
        self.engine = engine_cls(model_path, tokenizer=self.tokenizer, device=self.device, dtype=resolve_dtype(dtype),
                                 tp_mesh=self.tp_mesh, **spec)
        self.max_prompt_tokens = self.engine.max_seq_len
        if self.max_prompt_tokens is not None:
            self.max_prompt_tokens -= sampling.max_tokens
        self.model_path, self.sleep = model_path, sleep
        if sleep:
            safetensors_files(model_path)  # a missing or non-safetensors judge fails here, not at the first step
            self.engine.release()

    @register(dispatch=Dispatch.DP_COMPUTE)
    def judge(self, batch: Batch) -> Batch:
        """`JUDGE_COLUMNS` ``[B]`` for generated samples (``responses``, ``response_mask``, ``raw_prompt``,
        optional ``messages`` and ``ground_truth``): the parsed score (``on_failure_score`` where it failed)
        and why a sample failed. ``weight`` is applied where rewards are composed (`torchrlhf.rollouts.Scorer`)."""
        if not self.sleep:
            return self._judge(batch)
        self._wake()
        try:
            return self._judge(batch)
        finally:
            self.engine.release()

    def _wake(self) -> None:
        """Re-allocate what `release` freed and refill the weights from the judge's files (with TP, each rank
        keeps its own shard of each tensor it reads)."""
        self.engine.resume(("weights",))
        dims = self.engine.param_shard_dims()
        reader = SafetensorsReader(self.model_path)
        try:
            self.engine.update_weights((name, local_shard(self.engine, name, reader.get(name), dims))
                                       for name in sorted(reader.keys()))
        finally:
            reader.close()
        self.engine.resume(("kv_cache",))

    def _judge(self, batch: Batch) -> Batch:
        start = time.monotonic()
        n = len(batch)
        mask = batch["response_mask"].bool()
        responses = self.policy_tokenizer.batch_decode(
            [batch["responses"][i][mask[i]].tolist() for i in range(n)], skip_special_tokens=True)
        messages = batch.get("messages", [None] * n)
        truths = batch.get("ground_truth", [None] * n)
        prompts = [self._tokens(render_judge_prompt(self.template, question_of(messages[i], batch["raw_prompt"][i]),
                                                    responses[i], truths[i])) for i in range(n)]
        too_long = [self.max_prompt_tokens is not None and len(p) > self.max_prompt_tokens for p in prompts]
        todo = [i for i in range(n) if not too_long[i]]
        verdicts: dict[int, str] = {}
        timed_out = [False] * n
        for lo in range(0, len(todo), self.batch_size):
            chunk = todo[lo:lo + self.batch_size]
            if time.monotonic() - start > self.timeout_s:
                for i in todo[lo:]:
                    timed_out[i] = True
                break
            verdicts.update(zip(chunk, self._generate([prompts[i] for i in chunk])))
        judged = sorted(verdicts)
        parsed, parse_timed_out = self.parser([verdicts[i] for i in judged])
        scores: list[float | None] = [None] * n
        for i, score, late in zip(judged, parsed, parse_timed_out):
            scores[i], timed_out[i] = score, late
        parse_failed = [i in verdicts and scores[i] is None and not timed_out[i] for i in range(n)]
        final = torch.tensor([self.on_failure_score if s is None else s for s in scores], dtype=torch.float32)
        return Batch({
            "judge_scores": final,
            "judge_parse_failed": torch.tensor(parse_failed),
            "judge_timed_out": torch.tensor(timed_out),
            "judge_too_long": torch.tensor(too_long),
        }, meta=batch.meta)

    def _tokens(self, text: str) -> list[int]:
        if self.apply_chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _generate(self, prompts: list[list[int]]) -> list[str]:
        """Verdict texts of left-padded ``prompts`` (one engine call)."""
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
        out = self.engine.generate(Batch({"input_ids": input_ids.to(self.device),
                                          "attention_mask": attention_mask.to(self.device)}), self.sampling)
        resp, rmask = out["responses"].cpu(), out["response_mask"].cpu().bool()
        return self.tokenizer.batch_decode([resp[i][rmask[i]].tolist() for i in range(len(prompts))],
                                           skip_special_tokens=True)
