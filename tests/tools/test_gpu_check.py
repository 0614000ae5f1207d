"""tools/gpu_check.py: on a CPU-only machine it says so, lists what it skipped and exits 0; its list of CUDA
tests stays complete; it reads the figures from the outputs it runs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu_check.py"


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU: gpu_check would run every check")
def test_without_cuda_it_lists_the_skipped_checks_and_exits_0():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("gpu_check: no CUDA device (torch ") and lines[0].endswith("nothing was run."), lines[0]
    assert lines[1] == "skipped checks:"
    names = [line.split()[0] for line in lines[2:]]
    assert names == ["cuda-tests", "generate", "vllm", "decode-1b", "recipe", "actor-update"], p.stdout
    assert "tests/generation/test_cuda_graphs.py" in lines[2] and "--device cuda" in lines[3]


def test_the_cuda_test_list_is_complete():
    """Every test file that skips without CUDA is one gpu_check runs."""
    needs_cuda = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                        if "torch.cuda.is_available()" in p.read_text() and p != Path(__file__))
    assert needs_cuda == sorted(_tool().CUDA_TESTS)


def test_figures_come_from_the_bench_table_and_the_run_metrics(tmp_path):
    tool = _tool()
    # bench_generate's table on CUDA: batch, native, hf, ratio, eager, graphs/eager, [vllm, native/vllm], bound, native/bw
    out = ("SmolLM2-135M bfloat16 (random weights), NVIDIA H100, 64 new tokens, greedy\n"
           "batch native tok/s   hf tok/s  ratio     eager tok/s    graphs/eager  vllm tok/s native/vllm bw bound tok/s native/bw\n"
           "    1         282.0       51.2   5.51            40.3            7.00       300.0        0.94           5600     0.050\n"
           "   64       14847.0     2151.7   6.90          2000.0            7.42     16000.0        0.93         300000     0.049\n")
    assert tool._figure_of_bench(out, vllm=False) == ("batch 64: 14847 tok/s, 6.90x HF, 7.42x without graphs, "
                                                      "5% of the memory bound")
    assert tool._figure_of_bench(out, vllm=True).endswith(", 0.93x vLLM, 5% of the memory bound")
    assert tool._figure_of_bench("no table here\n", vllm=False) == ""
    kernel = out + "decode attention at batch 64, uncompiled step: kernel 40598.9 tok/s, SDPA 34220.4 tok/s: 1.19x\n"
    assert tool._figure_of_bench(kernel, vllm=False).endswith(
        "5% of the memory bound; kernel 40598.9 tok/s, SDPA 34220.4 tok/s: 1.19x")
    agent = ("side                 s/traj    tok/s  turns  model tok  prefill tok\n"
             "native                0.064   2946.4   7.84      187.5        237.5\n"
             "native-single         0.013  14900.5   1.00      188.0        110.0\n"
             "decode steps of the last native run: 320 decode, 41 of them riding observations, 2 extends of their "
             "own; single-turn: 188 decode\n"
             "native: agent / single-turn = 0.20x (model tokens per second)\n")
    assert tool._figure_of_agent(agent) == ("agent 2946 tok/s (7.84 turns), single-turn 14900 tok/s: 0.20x; decode "
                                            "steps 320 (41 riding, eager; 2 extends) against 188 single-turn")
    warmup = ("decode:              run  warm-up s  steady s\n"  # bench_warmup's own lines (a CPU run's)
              "              uncompiled        3.1      2.16\n"
              "          first compiled      104.2      1.94\n"
              "         second compiled        5.0      1.95\n"
              "decode: first compiled / uncompiled 33.36x; second compiled / uncompiled: ratio 1.60x\n")
    assert tool._figure_of_warmup(warmup) == ("warm-up uncompiled 3.1 s, compiled 104.2 s, compiled again 5.0 s: "
                                              "1.60x")
    assert tool._figure_of_warmup(warmup.split("decode: first")[0]) == ""  # a run cut short: no figure
    rows = [{"step": s, "timing_s/step": 2.0 + s, "critic/score/mean": 0.25, "timing_s/update_actor": 0.5,
             "actor/grad_norm": 1.5} for s in range(1, tool.RECIPE_STEPS + 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    step, update = tool._figures_of_recipe(str(tmp_path))
    assert step == f"{2.0 + tool.RECIPE_STEPS:.2f} s/step (step {tool.RECIPE_STEPS}), score 0.250"
    assert update == "0.50 s, grad norm 1.5"
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert tool._figures_of_recipe(str(tmp_path))[0] == f"1 of {tool.RECIPE_STEPS} steps logged"


def test_table_has_one_row_per_result():
    tool = _tool()
    text = tool.table([tool.Result("cuda-tests", "pass", "3 passed"), tool.Result("vllm", "skipped (no vLLM)")])
    lines = text.splitlines()
    assert len(lines) == 4 and re.match(r"^\| check +\| result +\| figure +\|$", lines[0]), text
    assert lines[2].startswith("| cuda-tests | pass ") and "3 passed" in lines[2]


def _random_model_tool():
    spec = importlib.util.spec_from_file_location("random_model", ROOT / "tools" / "bench" / "random_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_moe_row_builds_its_model_first_and_its_shape_has_the_1b_shapes_active_parameters(tmp_path):
    """With ``--models`` holding ``1b`` and no ``moe-1b``, the MoE model is made (from 1b's tokenizer) before its
    row runs. Its shape's active parameters (`utils.flops`: the blocks' weights with top-8 of 32 experts, and the
    tied embedding) are the dense 1b shape's (the GPU kit's mkmodels.py numbers), so the two rows' MFU compare."""
    import transformers

    from torchrlhf.trainer.explain import model_shape

    (tmp_path / "1b").mkdir()
    found = [c.name for c in _tool().checks(str(tmp_path / "out"), vllm_ok=False, models=str(tmp_path))]
    assert "make-moe-1b" in found and found.index("make-moe-1b") < found.index("train-moe-1b")
    moe = model_shape(str(ROOT / _tool().MOE_SHAPE))
    active = moe.flops.block_params + moe.vocab * moe.hidden
    dense = transformers.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
    with torch.device("meta"):
        dense_params = sum(p.numel() for p in transformers.LlamaForCausalLM(dense).parameters())
    assert abs(active - dense_params) / dense_params < 0.01, (active, dense_params)
    assert 3.4e9 < moe.params < 3.6e9 and moe.experts == 32 and moe.top_k == 8


def test_random_model_writes_a_loadable_bf16_model_with_the_tokenizer_beside_it(tmp_path):
    import transformers

    from torchrlhf.models import save_tiny_model

    shape = save_tiny_model(tmp_path / "shape", family="qwen3_moe", tokenizer_from="smollm2")
    n = _random_model_tool().make(shape, tmp_path / "out", shape, "cpu", torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert n == sum(p.numel() for p in model.parameters()) and model.dtype == torch.bfloat16
    assert model.config.model_type == "qwen3_moe" and (tmp_path / "out" / "tokenizer.json").is_file()
