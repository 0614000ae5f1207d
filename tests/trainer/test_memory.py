"""The traced memory estimate against memory measured from the operating system on real tensors.

The measurement: a subprocess loads the real model, builds its optimizer and runs one warm-up training
step (so optimizer states exist and libraries' lazily loaded code is in), then resets the kernel's
peak-RSS counter (``/proc/self/clear_refs`` = 5) and runs another step; the step's peak RSS growth
(``VmHWM`` − ``VmRSS`` before it) is what the step allocated on top of the persistent state. glibc is
told to serve every block ≥ 64 KiB with its own mmap (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor
leaves RSS at once and the peak is the live bytes, not the allocator's history. The estimate it is
compared with is the traced peak less the persistent state (parameters, buffers, optimizer states).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchrlhf.models.lora import LoRAConfig
from torchrlhf.trainer.memory import as_held, trace_micro_batch, trace_shared_prefix_update

ROOT = Path(__file__).resolve().parents[2]

MEASURE = r"""
import re, sys, torch
from torchrlhf.models.loading import load_causal_lm
from torchrlhf.models.lm_head import LogProbHead
from torchrlhf.trainer.memory import actor_loss
from torchrlhf.utils.optim import build_optimizer

def kib(key):
    return int(re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

path, micro, p, r, passes = sys.argv[1], *map(int, sys.argv[2:])
torch.manual_seed(0)
model = load_causal_lm(path, dtype=torch.float32)
LogProbHead.install(model)
opt, _ = build_optimizer(model.parameters(), {"lr": 1e-6})
ids = torch.randint(0, 1000, (micro, p + r))
mask, pos = torch.ones_like(ids), torch.arange(p + r).expand(micro, p + r)

def step():
    for _ in range(passes):  # gradient accumulation: micro-batches after the first sum into the gradients
        actor_loss(model, ids, mask, pos, r, False).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

step()
open("/proc/self/clear_refs", "w").write("5")
before = kib("VmRSS")
step()
print("growth", kib("VmHWM") - before)
"""

PERSISTENT = ("parameters", "buffers", "optimizer states")


def _measured_growth(model_dir: str, micro: int, prompt: int, response: int, passes: int = 1) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", MEASURE, model_dir, str(micro), str(prompt), str(response), str(passes)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return int(re.search(r"growth (\d+)", p.stdout).group(1))


@pytest.fixture(scope="module")
def wider_model_dir(tmp_path_factory) -> str:
    """Hidden 256 (the shared tiny model's is 64), so the blocks' activations weigh against the head."""
    from torchrlhf.models import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("wider_lm"), hidden_size=256, intermediate_size=768,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
@pytest.mark.parametrize("model,micro,prompt,response,passes,low,high", [
    ("wider_model_dir", 16, 16, 96, 1, 0.9, 1.1),
    # two micro-batches of a mini-batch: the second runs beside the first one's gradients (``accumulating``)
    ("wider_model_dir", 16, 16, 96, 2, 0.9, 1.1),
    # few tokens against a 49k x 256 tied head: the peak is the head's and the embedding's [V, D] gradient
    # temporaries, which the trace counts at 3 while the process touches pages of fewer (measured: 1.45x)
    ("wider_model_dir", 8, 32, 32, 1, 0.9, 1.6),
])
def test_traced_step_against_measured_rss_growth(request, model, micro, prompt, response, passes, low, high):
    model_dir = request.getfixturevalue(model)
    traced = trace_micro_batch(model_dir, dtype=torch.float32, micro=micro, prompt_len=prompt, response_len=response,
                               accumulating=passes > 1)
    estimate = sum(v for k, v in traced.items() if k not in PERSISTENT)
    measured = _measured_growth(model_dir, micro, prompt, response, passes)
    assert low * measured <= estimate <= high * measured, (estimate, measured, traced)


def test_the_head_scores_in_the_tiles_of_the_device_it_will_train_on(wider_model_dir):
    """The trace runs on fake CPU tensors, but a GPU worker's head works in [2048, 16384] tiles: one float32 tile of
    logits is 128 MiB, where a CPU tile ([256, 4096]) is 4 MiB. Traced for "cuda", the temporaries hold at least
    one GPU tile in the update; for "cpu", less than one."""
    kw = dict(dtype=torch.float32, micro=1, prompt_len=8, response_len=2048)
    cpu = trace_micro_batch(wider_model_dir, device_type="cpu", **kw)
    gpu = trace_micro_batch(wider_model_dir, device_type="cuda", **kw)
    gpu_tile = 2048 * 16384 * 4
    assert gpu["temporaries"] >= gpu_tile > cpu["temporaries"], (cpu, gpu)


@pytest.mark.parametrize("train, shared", [(True, False), (False, False), (True, True)])
def test_the_trace_runs_a_few_head_tiles_and_peaks_as_with_all_of_them(wider_model_dir, monkeypatch, train, shared):
    """On fake tensors the head runs its first two tiles and its last (`algorithms.logprob._chunks`): here 3 of 8
    position chunks × 3 of 12 vocabulary tiles (CPU tiles over 16 × 128 responses and a 49k vocabulary), with the
    peak of every tile run, kind by kind."""
    from torchrlhf.algorithms import logprob

    folds = []
    fold = logprob._fold_tile
    monkeypatch.setattr(logprob, "_fold_tile", lambda *a: folds.append(1) or fold(*a))
    kw = dict(dtype=torch.float32, prompt_len=16, response_len=128, train=train)

    def trace() -> dict[str, float]:
        folds.clear()
        if shared:
            return trace_shared_prefix_update(wider_model_dir, prompts=4, n=4, micro=16, suffix_passes=1, **kw)
        return trace_micro_batch(wider_model_dir, micro=16, **kw)

    few = trace()
    assert len(folds) == 3 * 3
    monkeypatch.setattr(logprob, "is_fake", lambda t: False)
    every = trace()
    assert len(folds) == 8 * 12
    assert few == every


def test_persistent_state_is_the_models_and_adamws(tiny_model_dir):
    # Independent count: the loaded model's parameters (fp32), AdamW's two states per trainable value
    # (+ a step counter per parameter tensor).
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = list(model.parameters())  # tied weights once
    n = sum(p.numel() for p in params)
    traced = trace_micro_batch(tiny_model_dir, dtype=torch.float32, micro=2, prompt_len=4, response_len=4)
    assert traced["parameters"] == 4 * n
    step_counters = traced["optimizer states"] - 2 * 4 * n
    assert 0 <= step_counters <= 4 * len(params) * 4  # a scalar step per tensor, padded to the allocator's unit
    frozen = trace_micro_batch(tiny_model_dir, dtype=torch.float32, micro=2, prompt_len=4, response_len=4, train=False)
    assert "optimizer states" not in frozen and "gradients" not in frozen
    # a micro-batch after its mini-batch's first: every parameter's gradient is alive at its peak
    accumulating = trace_micro_batch(tiny_model_dir, dtype=torch.float32, micro=2, prompt_len=4, response_len=4,
                                     accumulating=True)
    assert accumulating["gradients"] >= 4 * n > traced["gradients"]


def test_lora_trace_holds_the_base_in_the_compute_dtype_and_adapter_states_only(tiny_model_dir):
    lora = LoRAConfig(rank=4)
    traced = trace_micro_batch(tiny_model_dir, dtype=torch.bfloat16, micro=2, prompt_len=4, response_len=4, lora=lora)
    full = trace_micro_batch(tiny_model_dir, dtype=torch.bfloat16, micro=2, prompt_len=4, response_len=4)
    assert traced["optimizer states"] < full["optimizer states"] / 20  # adapters only
    # sharded over 2 ranks, a LoRA base stays in bf16 and a full model's state becomes fp32 masters
    held = as_held(traced, dtype=torch.bfloat16, shards=2, tp=1, layout="fsdp", lora=True)
    assert held["parameters"] == traced["parameters"] / 2
    held_full = as_held(full, dtype=torch.bfloat16, shards=2, tp=1, layout="fsdp")
    assert held_full["parameters"] == full["parameters"] * 2 / 2
    assert held_full["activations"] == full["activations"]
    # on one rank training in bf16: float32 weights, gradients and states, and the bf16 compute copies on top
    held_one = as_held(full, dtype=torch.bfloat16, shards=1, tp=1, layout="copies")
    assert held_one["parameters"] == full["parameters"] * (2 + 1)
    assert held_one["optimizer states"] == full["optimizer states"] * 2
    assert held_one["activations"] == full["activations"]



def test_shared_prefix_trace_moves_the_prompt_pass_to_the_host(tiny_model_dir):
    """With offload the traced activations fall by what the prompt pass saved, and the host holds exactly what
    the same pass moves on real tensors (`prefix_forward` on the loaded model)."""
    from torchrlhf.data import Batch
    from torchrlhf.models.loading import load_causal_lm
    from torchrlhf.workers.shared_prefix import SharedPrefixPlan, prefix_forward

    shape = dict(prompts=2, n=3, micro=3, prompt_len=12, response_len=5)
    kept = trace_shared_prefix_update(tiny_model_dir, dtype=torch.float32, **shape)
    moved = trace_shared_prefix_update(tiny_model_dir, dtype=torch.float32, offload=True, **shape)
    assert kept["offloaded"] == 0 and moved["offloaded"] > 0
    assert moved["activations"] < kept["activations"]
    assert moved["parameters"] == kept["parameters"] and moved["optimizer states"] == kept["optimizer states"]

    ids = torch.zeros(2, 12, dtype=torch.long)
    ids[:, 0] = torch.arange(2)
    responses = torch.zeros(6, 5, dtype=torch.long)
    batch = Batch({"input_ids": torch.cat([ids.repeat_interleave(3, 0), responses], 1), "responses": responses,
                   "attention_mask": torch.ones(6, 17, dtype=torch.long)})
    real = prefix_forward(load_causal_lm(tiny_model_dir), SharedPrefixPlan(batch), "cpu", offload_to="cpu")
    assert real.offloaded_bytes == moved["offloaded"]


MEASURE_SHARED = r"""
import re, sys, torch
from torchrlhf.data import Batch
from torchrlhf.workers import ActorWorker, Batching

def kib(key):
    return int(re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

path, prompts, n, micro, p, r = sys.argv[1], *map(int, sys.argv[2:])
torch.manual_seed(0)
ids = torch.randint(3, 1000, (prompts, p)).repeat_interleave(n, 0)  # distinct prompts, n samples each
responses = torch.randint(3, 1000, (prompts * n, r))
batch = Batch({"input_ids": torch.cat([ids, responses], 1), "responses": responses,
               "attention_mask": torch.ones(prompts * n, p + r, dtype=torch.long),
               "response_mask": torch.ones(prompts * n, r), "advantages": torch.randn(prompts * n, r)})
actor = ActorWorker(path, optim={"lr": 1e-6}, run={"rollout_n": n}, shared_prefix=True,
                    batching=Batching(ppo_mini_batch_size=prompts, ppo_micro_batch_size_per_device=micro))
actor.update(batch, temperature=1.0)
open("/proc/self/clear_refs", "w").write("5")
before = kib("VmRSS")
actor.update(batch, temperature=1.0)
print("growth", kib("VmHWM") - before)
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's resettable peak RSS")
def test_shared_prefix_trace_against_measured_rss_growth(wider_model_dir):
    """`ActorWorker.update` with shared prefixes (8 prompts of 48 tokens once, then 4 micro-batches of 8 samples
    x (1 + 32) tokens) against its trace: the prompts' pass lives through the micro-batches."""
    shape = dict(prompts=8, n=4, micro=8, prompt_len=48, response_len=32)
    traced = trace_shared_prefix_update(wider_model_dir, dtype=torch.float32, **shape)
    estimate = sum(v for k, v in traced.items() if k not in (*PERSISTENT, "offloaded"))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [str(shape[k]) for k in ("prompts", "n", "micro", "prompt_len", "response_len")]
    proc = subprocess.run([sys.executable, "-c", MEASURE_SHARED, wider_model_dir, *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    measured = int(re.search(r"growth (\d+)", proc.stdout).group(1))
    # measured on an AMD host: 1.26x (243 MB traced, 193 MB grown); the dense micro-batch of the old estimate
    # traced 161 MB (0.84x), below what the update holds
    assert 0.9 * measured <= estimate <= 1.45 * measured, (estimate, measured, traced)
