"""The rollout role with every engine, colocated (hybrid engine) and split (weights broadcast to its own ranks).

Each case is a real job (tests/workers/rollout_scenarios.py, lora_scenarios.py): one process for colocated,
3 ranks with torchrun's variables (actor on rank 0, rollout on ranks 1 and 2) for split placement, forked from
a process that imported torch and torchrlhf once (`warm_processes`). A split job checks
several things in turn (it ends with a dying rollout rank; a LoRA job syncs directly, then through the
asynchronous relay): each start of one costs an engine start on every rollout rank.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from dist_helpers import free_port
import warm_processes

from torchrlhf.generation import vllm_available

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("rollout_scenarios.py")
LORA_SCENARIOS = Path(__file__).with_name("lora_scenarios.py")
VLLM_OK, VLLM_WHY = vllm_available()
ENGINES = [
    "torchrlhf.generation.NativeEngine",
    pytest.param("torchrlhf.generation.VLLMEngine",
                 marks=pytest.mark.skipif(not VLLM_OK, reason=f"vLLM is not importable here: {VLLM_WHY}")),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from torchrlhf.models import save_tiny_model

    # head_dim 32: vLLM's CPU attention needs >= 32
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_from=None, vocab_size=128,
                               hidden_size=128, head_dim=32))


def _run(nproc: int, *args: str, timeout: float = 300, grace: float = 0.0,
         script: Path = SCENARIOS) -> subprocess.CompletedProcess:
    """``python script args`` (one process) or its ranks as torchrun starts them, forked warm
    (`warm_processes`); ``grace``: seconds a failed rank leaves the others before they are stopped."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    envs = warm_processes.one_node(nproc, env, free_port(span=2))
    return warm_processes.run_forked(list(args), envs, ROOT, timeout, script=script, end_all_on_failure=True,
                                     grace=grace)


@pytest.mark.parametrize("engine", ENGINES)
def test_next_colocated_rollout_uses_the_updated_weights(model_dir, engine):
    p = _run(1, "colocated", engine, model_dir)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "ALL PASSED" in p.stdout, out[-6000:]


@pytest.mark.parametrize("engine", ENGINES)
def test_split_rollout_gets_broadcast_weights_and_a_dying_rank_ends_the_job_naming_it(model_dir, engine):
    # torchrun would tear the job down as soon as it sees the dead rank, racing the controller's report: a
    # grace as long as a slow monitor's lets the controller (the runtime, not torchrun) notice and end it.
    p = _run(3, "split", engine, model_dir, timeout=300, grace=20)  # a hang: TimeoutExpired
    out = p.stdout + p.stderr
    assert "ALL PASSED" in p.stdout and "PASS weights went by bucketed broadcast" in p.stdout, out[-6000:]
    assert "PASS a dead rollout rank is named" in p.stdout, out[-6000:]
    assert p.returncode != 0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("mode, nproc", [("colocated", 1), ("split", 3)])
def test_next_rollout_uses_the_updated_lora_adapter(model_dir, engine, mode, nproc):
    """A LoRA actor: merged weights into the colocated engine; adapter factors only to rollout ranks of their
    own, merged there: versions 1 and 2 directly, 3 and 4 through the asynchronous relay. Checked against
    PEFT greedy decoding."""
    p = _run(nproc, mode, engine, model_dir, script=LORA_SCENARIOS, timeout=400)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "ALL PASSED" in p.stdout, out[-6000:]
    if mode == "split":
        for version, path in ((1, "direct"), (2, "direct"), (3, "relay"), (4, "relay")):
            assert f"PASS v{version} ({path}): only the adapter factors travelled" in p.stdout, out[-6000:]
