"""LoRA actor + rollout scenarios run as real jobs by tests/workers/test_rollout.py.

    python lora_scenarios.py colocated ENGINE MODEL_DIR                    # world size 1 (hybrid engine)
    torchrun --nproc_per_node=3 lora_scenarios.py split ENGINE MODEL_DIR   # actor [0], rollout [1, 2]

Split syncs versions 1 and 2 directly into the idle engine, then 3 and 4 through the asynchronous relay
(`WeightRelay`, as ``trainer.mode=async`` does).

The classic bug this catches: after an update, the next rollout must use the *new* adapter (not the base,
not the previous merge). Greedy tokens are checked against PEFT's forward of the HF base model carrying
the trained adapter (an independent implementation), and must have moved. Split and async syncs must
carry the adapter factors only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from rollout_scenarios import ACTOR_KW, GREEDY, check, prompts, training_batch  # noqa: E402

from torchrlhf.data import Batch  # noqa: E402
from torchrlhf.rollouts import Replicas, WeightSync  # noqa: E402
from torchrlhf.runtime import colocate, launch, local_worker, set_stall_timeout  # noqa: E402
from torchrlhf.workers import ActorWorker, RolloutWorker  # noqa: E402

# Not every projection: the rollout side must complete vLLM's fused q/k/v from the base.
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def peft_greedy(model_dir: str, adapters: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    """Greedy tokens of PEFT's LoRA model: the HF base with ``adapters`` (our names) loaded as PEFT keys."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    modules = sorted({n.rsplit(".", 1)[0] for n in adapters})
    model = get_peft_model(base, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=modules))
    result = set_peft_model_state_dict(model, {f"base_model.model.{n}.weight": t for n, t in adapters.items()})
    assert not result.unexpected_keys, result.unexpected_keys
    out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False,
                         max_new_tokens=GREEDY.max_tokens, min_new_tokens=GREEDY.max_tokens, pad_token_id=2)
    return out[:, batch["input_ids"].shape[1]:]


def adapters() -> dict[str, torch.Tensor]:
    """The actor's adapter factors, read in the controller's process (rank 0 holds the actor)."""
    return {n: p.detach().clone() for n, p in local_worker("actor").model.named_parameters() if p.requires_grad}


def main(mode: str, engine_component: str, model_dir: str) -> None:
    engine = {"_component_": engine_component, "max_batch_size": 8, "max_seq_len": 64}
    actor_kw = {**ACTOR_KW, "lora": LORA}
    rollout_kw = dict(model_path=model_dir, engine=engine, lora=LORA)
    if mode == "colocated":
        g = colocate({"actor": (ActorWorker, (model_dir,), actor_kw),
                      "rollout": (RolloutWorker, (), {**rollout_kw, "actor_group": "actor"})})
        actor, rollout, sync = g["actor"], g["rollout"], None
    else:
        actor = colocate({"actor": (ActorWorker, (model_dir,), actor_kw)}, [0])["actor"]
        rollout = colocate({"rollout": (RolloutWorker, (), rollout_kw)}, [1, 2])["rollout"]
        sync = WeightSync(actor, Replicas(rollout, colocated=False, pad_id=2), dtype="float32", bucket_bytes=4 << 10)

    initial = adapters()
    before = rollout.generate(prompts(0), GREEDY, version=0)
    check("before training, greedy equals PEFT with the initial adapter (B = 0: the base)",
          torch.equal(before["responses"], peft_greedy(model_dir, initial, prompts(0))))

    # each path's second update checks that a merge starts from the base, not from the last merge
    versions = (1, 2) if sync is None else (1, 2, 3, 4)
    for version in versions:
        actor.update(training_batch(before), temperature=1.0)
        if sync is not None:
            relay = version > 2
            stats = sync(version, to_relay=relay)
            adapter_bytes = sum(t.numel() * 4 for t in adapters().values())
            full_bytes = sum(p.numel() * 4 for p in local_worker("actor").model.parameters())
            check(f"v{version} ({'relay' if relay else 'direct'}): only the adapter factors travelled",
                  stats["weight_sync/bytes"] == adapter_bytes and adapter_bytes < full_bytes / 10,
                  f"{stats} vs {adapter_bytes} adapter bytes, {full_bytes} in the model")
        after = rollout.generate(prompts(version), GREEDY, version=version)
        trained = adapters()
        check(f"v{version}: the update changed the adapter", any(not torch.equal(trained[k], initial[k]) for k in trained))
        check(f"v{version}: the next rollout uses the new adapter (PEFT greedy)",
              torch.equal(after["responses"], peft_greedy(model_dir, trained, prompts(version))))
        check(f"v{version}: the greedy tokens moved", not torch.equal(after["responses"], before["responses"]))
        check(f"v{version}: samples carry the version", after["weight_version"].tolist() == [version] * 4)
        before, initial = after, trained
    print("ALL PASSED", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    set_stall_timeout(240)  # a hung call ends the job with every rank's stack, before the test's timeout
    launch(main, *sys.argv[1:4])
