"""A scripted engine for JudgeWorker tests: it writes a hand-chosen verdict for each graded answer."""

from __future__ import annotations

import re

import torch

from torchrlhf.data import Batch

# graded answer -> the verdict the "judge" writes
VERDICTS = {"4": "Score: 1", "5": "Score: 0", "five": "I cannot tell", "0.5": "score: 0.5"}


class ScriptedEngine:
    """Follows the engine contract's `generate` (left-padded ``input_ids``/``attention_mask`` in;
    right-padded ``responses``/``response_mask`` out); records each call's prompt texts. ``clock``: a list
    whose first item each call advances by ``seconds_per_call`` (a fake `time.monotonic`)."""

    calls: list[list[str]] = []
    clock = [0.0]
    seconds_per_call = 0.0

    def __init__(self, model_or_path, tokenizer=None, *, device=None, dtype=None, tp_mesh=None, max_seq_len=2048):
        self.tokenizer, self.max_seq_len = tokenizer, max_seq_len

    def generate(self, prompts: Batch, sampling=None) -> Batch:
        mask = prompts["attention_mask"].bool()
        texts = [self.tokenizer.decode(prompts["input_ids"][i][mask[i]].tolist()) for i in range(len(prompts))]
        ScriptedEngine.calls.append(texts)
        ScriptedEngine.clock[0] += ScriptedEngine.seconds_per_call
        answers = [re.search(r"Answer to grade: (.*)\n", t).group(1) for t in texts]
        ids = [self.tokenizer(VERDICTS[a], add_special_tokens=False)["input_ids"] for a in answers]
        width = max(len(x) for x in ids)
        responses = torch.zeros(len(ids), width, dtype=torch.long)
        response_mask = torch.zeros(len(ids), width, dtype=torch.long)
        for row, x in enumerate(ids):
            responses[row, :len(x)] = torch.tensor(x)
            response_mask[row, :len(x)] = 1
        return Batch({"responses": responses, "response_mask": response_mask})
