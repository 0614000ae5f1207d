"""Rollout-role scenarios run as real jobs (one process, or torchrun) by tests/workers/test_rollout.py.

    python rollout_scenarios.py colocated ENGINE MODEL_DIR                      # world size 1
    torchrun --nproc_per_node=3 rollout_scenarios.py split ENGINE MODEL_DIR     # actor [0], rollout [1, 2]

Split placement ends with rollout rank 2 dying in a third rollout, which the controller must name (one job
for both: each start of a split job costs two engine starts).

Each checks on the controller against HF ``generate`` (an independent implementation) and prints
``PASS <name>`` lines.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from torchrlhf.data import Batch
from torchrlhf.generation import SamplingParams
from torchrlhf.rollouts import Replicas, WeightSync
from torchrlhf.runtime import Dispatch, WorkerError, colocate, launch, local_worker, register, set_stall_timeout
from torchrlhf.workers import ActorWorker, RolloutWorker
from torchrlhf.workers.microbatch import Batching

GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=6, ignore_eos=True)
ACTOR_KW = dict(optim={"lr": 5e-2}, batching=Batching(ppo_mini_batch_size=4, ppo_micro_batch_size_per_device=4))


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise AssertionError(f"FAIL {name} {detail}")
    print(f"PASS {name}", flush=True)


def prompts(version: int) -> Batch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (4, 5), generator=gen)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 2, 0  # one left-padded prompt
    return Batch({"input_ids": ids, "attention_mask": mask})


def hf_greedy(model_dir: str, state: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state)
    out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                         max_new_tokens=GREEDY.max_tokens, min_new_tokens=GREEDY.max_tokens, pad_token_id=2)
    return out[:, batch["input_ids"].shape[1]:]


def training_batch(gen: Batch) -> Batch:
    """The rollout's own samples with fixed advantages: one update that moves the greedy tokens."""
    adv = torch.linspace(-1.0, 1.0, len(gen))[:, None].expand_as(gen["response_mask"]).contiguous()
    return Batch({k: gen[k] for k in ("responses", "input_ids", "attention_mask", "position_ids",
                                       "response_mask")} | {"advantages": adv * 5})


def actor_state() -> dict[str, torch.Tensor]:
    """The trained weights, read in the controller's process (rank 0 holds the actor in every scenario)."""
    return {k: v.detach().clone() for k, v in local_worker("actor").model.state_dict().items()}


def build(mode: str, engine: dict, model_dir: str):
    rollout_kw = dict(model_path=model_dir, engine=engine)
    if mode == "colocated":
        g = colocate({"actor": (ActorWorker, (model_dir,), ACTOR_KW),
                      "rollout": (RolloutWorker, (), {**rollout_kw, "actor_group": "actor"})})
        return g["actor"], g["rollout"], None
    actor = colocate({"actor": (ActorWorker, (model_dir,), ACTOR_KW)}, [0])["actor"]
    rollout = colocate({"rollout": (DyingRollout, (), rollout_kw)}, [1, 2])["rollout"]
    # 16 KiB buckets: the tiny model's weights travel in many buckets, and some tensors alone exceed one
    replicas = Replicas(rollout, colocated=False, pad_id=2)
    return actor, rollout, WeightSync(actor, replicas, dtype="float32", bucket_bytes=16 << 10)


class DyingRollout(RolloutWorker):
    """Rank 2 of the rollout group dies in the middle of its third rollout."""

    calls = 0

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate(self, prompts: Batch, sampling: SamplingParams, **kwargs) -> Batch:
        DyingRollout.calls += 1
        if DyingRollout.calls == 3 and dist.get_rank() == 2:
            os._exit(1)
        return super().generate(prompts, sampling, **kwargs)


def main(mode: str, engine_component: str, model_dir: str) -> None:
    engine = {"_component_": engine_component, "max_batch_size": 8, "max_seq_len": 64}
    actor, rollout, sync = build(mode, engine, model_dir)
    before = rollout.generate(prompts(0), GREEDY, version=0)
    initial = actor_state()
    check("greedy equals HF generate", torch.equal(before["responses"], hf_greedy(model_dir, initial, prompts(0))))
    check("samples carry version 0", before["weight_version"].tolist() == [0] * 4)
    actor.update(training_batch(before), temperature=1.0)
    if sync is not None:
        stats = sync(1)
        nbytes = sum(p.numel() * 4 for p in local_worker("actor").model.parameters())  # tied weights once
        check("weights went by bucketed broadcast", stats["weight_sync/buckets"] > 1
              and stats["weight_sync/bytes"] == nbytes, f"{stats} vs {nbytes} bytes")
    after = rollout.generate(prompts(1), GREEDY, version=1)
    trained = actor_state()
    check("the update changed the weights", any(not torch.equal(trained[k], initial[k]) for k in trained))
    check("the next rollout uses the new weights",
          torch.equal(after["responses"], hf_greedy(model_dir, trained, prompts(1))))
    check("the greedy tokens moved", not torch.equal(after["responses"], before["responses"]))
    check("samples carry version 1", after["weight_version"].tolist() == [1] * 4)
    print("ALL PASSED", flush=True)
    if sync is not None:
        try:
            rollout.generate(prompts(0), GREEDY, version=1)
        except WorkerError as e:
            check("a dead rollout rank is named", e.rank == 2 and "did not answer" in str(e), str(e))
            return
        raise AssertionError("FAIL the dead rank went unnoticed")


if __name__ == "__main__":
    torch.set_num_threads(1)
    set_stall_timeout(240)  # a hung call ends the job with every rank's stack, before the test's timeout
    launch(main, *sys.argv[1:4])
