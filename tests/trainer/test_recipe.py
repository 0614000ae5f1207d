"""The recipe end to end, as users run it: learning, every algorithm's path, 2 ranks, resume."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_ok, free_port, metrics_of, run_recipe, write_config

from torchrlhf.generation import vllm_available

ROOT = Path(__file__).resolve().parents[2]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _scores(output_dir: Path) -> list[float]:
    return [m["critic/score/mean"] for m in metrics_of(output_dir)]


def _gain(scores: list[float]) -> float:
    return _mean(scores[-5:]) - _mean(scores[:5])


def test_recipe_ranks_fork_from_a_server_that_imported_the_recipe():
    """The tests' ranks start warm: the forkserver preloads `warm_processes` by name and skips it silently when
    it cannot import it (as it did on Python 3.11, which does not apply the caller's sys.path there), and
    then every rank imports torch, transformers and the recipe again."""
    import warm_processes

    probe = warm_processes.WARM.Process(target=exec,
                                        args=("import sys; sys.exit(0 if 'recipes.ppo' in sys.modules else 3)",))
    probe.start()
    probe.join(timeout=300)
    assert probe.exitcode == 0, "the forkserver did not preload the recipe"


def test_grpo_learns(tiny_model_dir, tmp_path):
    """30 GRPO steps raise the reward (share of 'e' characters) from ~0.10: learning, not just running.

    The last five steps beat the first five by, over trainer seeds 0-3: +0.062 / +0.065 / +0.142 / +0.077 on
    an Intel Xeon host, +0.039 / +0.067 / +0.072 / +0.103 on an AMD EPYC host (float rounding differs between
    CPUs, which moves a run as much as a new seed does): about 0.03 apart, so one seed would sit too close to
    a margin. The mean of seeds 0-2 (+0.090 and +0.059 there) has about 0.018; a run that does not learn
    gains 0 +- 0.008 per run, 0 +- 0.005 over three. The margin +0.02 is 2-3 standard deviations from both.
    """
    gains = []
    for seed in (0, 1, 2):
        out = tmp_path / f"out{seed}"
        cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, actor={"optim": {"lr": 3e-2}},
                           trainer={"total_steps": 30, "output_dir": str(out), "loggers": ["jsonl"], "seed": seed})
        assert_ok(run_recipe(cfg))
        scores = _scores(out)
        assert len(scores) == 30
        gains.append(_gain(scores))
    assert _mean(gains) > 0.02, gains


def test_ppo_with_critic_learns(tiny_model_dir, tmp_path):
    """PPO: GAE over a critic (zero-initialised value head) raises the reward too, and the critic fits it.

    40 steps: over trainer seeds 0-3 the last five steps beat the first five by +0.064 / +0.220 / +0.058 /
    +0.045 on an Intel Xeon host and +0.118 / +0.113 / +0.094 / +0.023 on an AMD EPYC host (20 steps were not
    enough for every seed: +0.028, +0.139, +0.004, +0.018). The mean of seeds 0-2 (+0.114 and +0.108 there)
    against the margin +0.02, as for GRPO.
    """
    gains = []
    for seed in (0, 1, 2):
        out = tmp_path / f"out{seed}"
        cfg = write_config(
            tmp_path / "c.yaml", tiny_model_dir, actor={"optim": {"lr": 3e-2}},
            algorithm={"adv_estimator": "gae", "gamma": 1.0, "lam": 1.0},
            critic={"model_path": "${model_path}", "optim": {"lr": 1e-3}, "init_head_std": 0.0,
                    "batching": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 16}},
            trainer={"total_steps": 40, "output_dir": str(out), "loggers": ["jsonl"], "seed": seed},
        )
        assert_ok(run_recipe(cfg))
        metrics = metrics_of(out)
        gains.append(_gain(_scores(out)))
        assert metrics[0]["critic/values/mean"] == pytest.approx(0.0, abs=1e-6)  # zero head: V = 0 before training
        assert metrics[-1]["critic/values/mean"] > 0.05  # and it moves toward the ~0.1-0.2 returns
    assert _mean(gains) > 0.02, gains


# Each algorithm's own branch of the dataflow, two steps each; the keys prove the branch ran.
ALGORITHMS = {
    # ... and user subclasses named by ``_component_`` (tests/trainer/custom_components.py) are what runs.
    "rloo_custom_components": ({"algorithm": {"adv_estimator": "rloo"},
                                "actor": {"_component_": "custom_components.MarkedActor", "marker": 7.0},
                                "reward": {"_component_": "custom_components.ShiftedRewardManager",
                                           "score_shift": 10.0}},
                               ["actor/marker"]),
    "reinforce_pp_baseline": ({"algorithm": {"adv_estimator": "reinforce_pp_baseline"}}, []),
    "remax": ({"algorithm": {"adv_estimator": "remax"}, "rollout": {"n": 1},
               "actor": {"batching": {"ppo_micro_batch_size_per_device": 4}}}, ["timing_s/gen_baseline"]),
    "dapo": ({"algorithm": {"adv_estimator": "grpo", "filter_groups": {"enable": True},
                            "overlong_buffer": {"len": 4}},
              "actor": {"loss": {"clip_ratio_high": 0.28, "agg_mode": "token-mean"}}},
             ["train/num_gen_batches", "train/dropped_groups", "reward/overlong_penalty_mean"]),
    "dr_grpo_seq_mean": ({"algorithm": {"adv_estimator": "dr_grpo"},
                          "actor": {"loss": {"agg_mode": "seq-mean-token-sum-norm"}}}, []),
    "gspo": ({"actor": {"loss": {"policy_loss": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}}}, []),
    "cispo": ({"actor": {"loss": {"policy_loss": "cispo", "clip_ratio_low": 1.0, "clip_ratio_high": 4.0}}}, []),
    "grpo_kl_loss": ({"actor": {"loss": {"use_kl_loss": True, "kl_loss_type": "low_var_kl"}}}, ["actor/kl_loss", "timing_s/ref"]),
    "ppo_kl_in_reward_rm": ({"algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True,
                                           "kl_ctrl": {"type": "adaptive"}},
                             "critic": {"model_path": "${model_path}", "batching": {"ppo_mini_batch_size": 4,
                                        "ppo_micro_batch_size_per_device": 16}},
                             "reward_model": {"model_path": "${model_path}"}},
                            ["actor/reward_kl_penalty", "actor/kl_coef", "critic/vf_loss",
                             "training/rollout_probs_diff_max"]),
    "safe_rlhf": ({"algorithm": {"adv_estimator": "reinforce_pp", "lagrangian": {"threshold": 0.0}},
                   "reward_model": {"model_path": "${model_path}"}, "cost_model": {"model_path": "${model_path}"}},
                  ["safe_rlhf/lambda", "safe_rlhf/cost_mean"]),
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_algorithm_runs(tiny_model_dir, tmp_path, name):
    sections, keys = ALGORITHMS[name]
    out = tmp_path / "out"
    sections = {**sections, "trainer": {"total_steps": 2, "output_dir": str(out), "loggers": ["jsonl"]}}
    assert_ok(run_recipe(write_config(tmp_path / "c.yaml", tiny_model_dir, **sections)))
    metrics = metrics_of(out)
    assert [m["training/global_step"] for m in metrics] == [1, 2]
    for m in metrics:
        for key in ["actor/pg_loss", "actor/grad_norm", "critic/advantages/mean", *keys]:
            assert key in m, f"{name}: {key} missing from {sorted(m)}"
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
        # The engine samples with the weights training has (step 2 follows an update): same probabilities.
        assert m.get("training/rollout_probs_diff_max", 0.0) < 1e-3, m
    if name == "rloo_custom_components":
        assert all(m["actor/marker"] == 7.0 and m["critic/score/mean"] >= 10.0 for m in metrics), metrics
    if name == "safe_rlhf":  # cost above the threshold 0 pushes lambda up; below it, down
        assert metrics[1]["safe_rlhf/lambda"] != metrics[0]["safe_rlhf/lambda"]


USER_ESTIMATOR = """
import sys
import custom_components  # registers `best_of_group` with its traits: all that a new estimator takes
from torchrlhf.trainer.run import train

train(sys.argv[1])
"""


def test_an_estimator_registered_in_a_users_module_trains(tiny_model_dir, tmp_path):
    """`custom_components.best_of_group` (group=True) runs a recipe step through `train`: the trainer hands it the
    group uids, and its advantages, +1 for each group's best response and -1/(n-1) = -1/3 for the others, are
    the step's."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, algorithm={"adv_estimator": "best_of_group"},
                       trainer={"total_steps": 1, "output_dir": str(out), "loggers": ["jsonl"]})
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    env.pop("WORLD_SIZE", None)
    p = subprocess.run([sys.executable, "-c", USER_ESTIMATOR, str(cfg)], capture_output=True, text=True,
                       timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    (m,) = metrics_of(out)
    assert m["critic/advantages/max"] == 1.0 and m["critic/advantages/min"] == pytest.approx(-1 / 3), m
    assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), m


def test_every_pass_logs_its_mfu(tiny_model_dir, tmp_path):
    """PPO with a critic, a KL loss (the reference) and two mini-batches (old log-probs recomputed): every
    pass logs its MFU against the peak each role's ranks measured at start-up (`torchrlhf.utils.flops`)."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, algorithm={"adv_estimator": "gae"},
                       actor={"loss": {"use_kl_loss": True}, "batching": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 4}},
                       critic={"model_path": "${model_path}", "batching": {"ppo_mini_batch_size": 2,
                                                                          "ppo_micro_batch_size_per_device": 4}},
                       trainer={"total_steps": 2, "test_freq": 0, "output_dir": str(out), "loggers": ["jsonl"]})
    assert_ok(run_recipe(cfg))
    for m in metrics_of(out):
        for role in ("actor", "critic", "ref", "rollout"):
            assert m[f"perf/peak_flops/{role}"] > 1e8, m  # any CPU does 0.1 GFLOP/s
        for name in ("actor", "critic", "ref", "old_log_prob", "values", "rollout"):
            assert 0 < m[f"perf/mfu/{name}"] < 1, (name, m)


def test_two_ranks_resume_continues_the_same_run(tiny_model_dir, tmp_path):
    """2 FSDP ranks: stop after a checkpoint at step 2, resume; step 3 equals an uninterrupted run's."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = {"actor": {"optim": {"lr": 3e-2}, "batching": {"ppo_micro_batch_size_per_device": 4}}, "trainer": {"test_freq": 0}}

    def config(out: Path, steps: int, save_freq: int) -> Path:
        trainer = {"total_steps": steps, "checkpoint": {"save_freq": save_freq}, "output_dir": str(out),
                   "loggers": ["jsonl"]}
        return write_config(tmp_path / f"{out.name}{steps}.yaml", tiny_model_dir, actor=common["actor"],
                            trainer=trainer)

    assert_ok(run_recipe(config(straight, 3, 0), nproc=2))
    assert_ok(run_recipe(config(resumed, 2, 2), nproc=2))
    assert (resumed / "global_step_2" / "COMPLETE").is_file()
    proc = run_recipe(config(resumed, 3, 0), nproc=2)
    assert_ok(proc)
    want, got = metrics_of(straight), metrics_of(resumed)
    assert [m["training/global_step"] for m in got] == [1, 2, 3]  # the resumed run logged step 3 only
    for key in ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"]:
        assert got[2][key] == pytest.approx(want[2][key], rel=1e-4, abs=1e-6), key


def test_split_placement_syncs_weights_and_resumes(tiny_model_dir, tmp_path):
    """4 ranks: the actor FSDP2-sharded on ranks 0-1, the rollout on ranks 2-3 (weights pushed by
    bucketed broadcast from rank 0).

    Two mini-batches per step make the actor recompute old log-probs, so every step compares the rollout
    ranks' sampling probabilities with the actor's: a stale engine (weights not synced) shows as a gap.
    A run resumed from step 2 must sync the loaded weights too, and then equals the uninterrupted run.
    """
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    sections = {"actor": {"optim": {"lr": 3e-2}, "batching": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 4}},
                "placement": {"actor": [0, 1], "rollout": [2, 3]}, "rollout": {"weight_sync_bucket_mb": 1}}

    def config(out: Path, steps: int, save_freq: int) -> Path:
        trainer = {"total_steps": steps, "checkpoint": {"save_freq": save_freq}, "test_freq": 0, "output_dir": str(out),
                   "loggers": ["jsonl"]}
        return write_config(tmp_path / f"{out.name}{steps}.yaml", tiny_model_dir, trainer=trainer, **sections)

    assert_ok(run_recipe(config(straight, 3, 0), nproc=4))
    want = metrics_of(straight)
    assert [m["training/rollout_probs_diff_max"] < 1e-3 for m in want] == [True] * 3, want
    assert all(m["rollout/staleness/max"] == 0 and m["weight_sync/buckets"] >= 1 for m in want), want
    assert [m["rollout/weight_version"] for m in want] == [0, 1, 2]
    assert_ok(run_recipe(config(resumed, 2, 2), nproc=4))
    assert_ok(run_recipe(config(resumed, 3, 0), nproc=4))
    got = metrics_of(resumed)
    assert [m["training/global_step"] for m in got] == [1, 2, 3]
    assert got[2]["training/rollout_probs_diff_max"] < 1e-3, got[2]
    for key in ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"]:
        assert got[2][key] == pytest.approx(want[2][key], rel=1e-4, abs=1e-6), key


@pytest.mark.skipif(not vllm_available()[0], reason=f"vLLM is not importable here: {vllm_available()[1]}")
@pytest.mark.parametrize("split", [False, True], ids=["colocated", "split"])
def test_vllm_rollouts_train_with_the_current_weights(tmp_path, split):
    """The recipe with `VLLMEngine` rollouts, colocated (one process: vLLM in-process) or on a rank of its own
    (2 ranks: weights pushed by broadcast after each update): two mini-batches make the actor recompute
    log-probs, so every step compares vLLM's sampling probabilities with the training forward's; weights
    that did not reach vLLM after an update would show as a gap."""
    from torchrlhf.models import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "tiny32", initializer_range=1.0, hidden_size=128, head_dim=32))
    out = tmp_path / "out"  # head_dim 32: vLLM's CPU attention needs >= 32
    cfg = write_config(tmp_path / "c.yaml", model_dir,
                       actor={"optim": {"lr": 3e-2}, "batching": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 4}},
                       rollout={"engine": {"_component_": "torchrlhf.generation.VLLMEngine", "max_batch_size": 16,
                                           "max_seq_len": 80, "kv_cache_gib": 0.25}},
                       trainer={"total_steps": 3, "test_freq": 0, "output_dir": str(out), "loggers": ["jsonl"]},
                       **({"placement": {"actor": [0], "rollout": [1]}} if split else {}))
    assert_ok(run_recipe(cfg, nproc=2 if split else 1))
    metrics = metrics_of(out)
    assert [m["training/global_step"] for m in metrics] == [1, 2, 3]
    assert [m["training/rollout_probs_diff_max"] < 1e-3 for m in metrics] == [True] * 3, metrics
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1, 2]
    if split:
        assert all(m["weight_sync/buckets"] >= 1 for m in metrics), metrics


def test_default_config_one_step_on_smollm2(tmp_path):
    """The README's main job (SmolLM2, GRPO, 2 ranks), cut to one step with validation and a checkpoint."""
    out = tmp_path / "out"
    proc = run_recipe(ROOT / "recipes/configs/grpo_arithmetic_cpu.yaml", "trainer.total_steps=1",
                      "trainer.test_freq=1", "trainer.checkpoint.save_freq=1", f"trainer.output_dir={out}",
                      "data.val_max_samples=8", nproc=2)
    assert_ok(proc)
    before, m = metrics_of(out)
    assert before["step"] == 0 and 0.0 <= before["val/arithmetic/acc"] <= 1.0
    assert 0.0 <= m["val/arithmetic/acc"] <= 1.0 and m["response_length/mean"] > 0
    # The reward grades the final number, so the untrained model already scores on some samples.
    assert m["critic/score/mean"] > 0
    acc = f"val/arithmetic/acc {before['val/arithmetic/acc']:.3f} -> {m['val/arithmetic/acc']:.3f}"
    assert f"validation before -> after training: {acc}" in proc.stdout
    assert (out / "global_step_1" / "COMPLETE").is_file()


def test_two_torchrun_agents_equal_one_node(tiny_model_dir, tmp_path):
    """The multi-node launch: two torchrun agents (``--nnodes 2 --node_rank 0/1 --rdzv_endpoint``), one rank
    each, run the FSDP2 + hybrid-engine recipe to the same numbers as one agent with two ranks."""
    import os
    import subprocess
    import sys

    from conftest import RECIPE

    one, two = tmp_path / "one", tmp_path / "two"

    def config(out: Path) -> Path:
        trainer = {"total_steps": 3, "output_dir": str(out), "loggers": ["jsonl"]}
        return write_config(tmp_path / f"{out.name}.yaml", tiny_model_dir, trainer=trainer,
                            actor={"optim": {"lr": 3e-2}, "batching": {"ppo_micro_batch_size_per_device": 8}})

    assert_ok(run_recipe(config(one), nproc=2))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                                "--nproc_per_node=1", f"--rdzv_endpoint=127.0.0.1:{port}", str(RECIPE),
                                "--config", str(config(two))],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
              for node in (0, 1)]
    for agent in agents:
        out, err = agent.communicate(timeout=600)
        assert agent.returncode == 0, f"agent failed ({agent.returncode}):\n{out[-2000:]}\n{err[-4000:]}"
    want, got = metrics_of(one), metrics_of(two)
    assert len(got) == 3
    for key in ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"]:
        assert [m[key] for m in got] == pytest.approx([m[key] for m in want], rel=1e-5, abs=1e-7), key
