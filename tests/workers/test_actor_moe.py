"""ActorWorker on a mixture-of-experts policy (tiny Qwen3-MoE): its PPO gradient, with and without the
load-balancing loss and the router z-loss, equals the one derived by hand from transformers' own model,
``load_balancing_loss_func`` and (Switch Transformers') ``router_z_loss_func``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

sys.path.insert(0, str(Path(__file__).parent))
import torch.distributed as dist  # noqa: E402
from dist_helpers import full_params, grouped, rollout_batch, run_ranks  # noqa: E402

from torchrlhf.data import Batch  # noqa: E402
from torchrlhf.generation import NativeEngine, SamplingParams  # noqa: E402
from torchrlhf.hybrid import generate_with_current_weights, generation_mesh, training_mesh  # noqa: E402
from torchrlhf.models import save_tiny_model  # noqa: E402
from torchrlhf.workers.actor import ActorWorker  # noqa: E402

COEF = 0.05  # large enough that the aux term's gradient is far above the comparison's tolerance


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_moe"), family="qwen3_moe", tokenizer_from=None,
                               vocab_size=128, initializer_range=0.2))


@pytest.mark.parametrize("shared_prefix, coef, z_coef", [(True, 0.0, 0.0), (False, 0.0, 0.0), (False, COEF, 0.0),
                                                          (True, COEF, 0.0), (False, 0.0, COEF), (True, COEF, COEF)])
def test_gradient_is_the_ppo_loss_plus_transformers_aux_loss(moe_dir, shared_prefix, coef, z_coef):
    """One micro-batch of 6 samples, 3 prompts of 2 (GRPO groups): with shared prompts, each prompt token counts
    once per sample in the aux loss and the z-loss (logical prefix tokens), as in the dense rows transformers
    sees. The z-loss's reference is transformers' over the real tokens of every layer (padding left out)."""
    batch = rollout_batch(6, temperature=0.8, seed=3, group_size=2)
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    r = batch["responses"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], output_router_logits=True)
    lp = torch.log_softmax(out.logits[:, -r - 1 : -1] / 0.8, -1).gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"].float()
    noise = 0.2 * torch.rand(lp.shape, generator=torch.Generator().manual_seed(1)) - 0.1
    batch["old_log_probs"] = (lp.detach() + noise) * mask  # ratios inside the clip range
    pg_loss = -(batch["advantages"] * torch.exp(lp - batch["old_log_probs"]) * mask).sum() / mask.sum()
    aux = load_balancing_loss_func(out.router_logits, 8, 2, batch["attention_mask"])
    real = batch["attention_mask"].reshape(-1).bool()
    z = router_z_loss_func(torch.cat([layer[real] for layer in out.router_logits])[None])
    (pg_loss + coef * aux + z_coef * z).backward()

    actor = ActorWorker(moe_dir, shared_prefix=shared_prefix, moe={"aux_loss_coef": coef, "z_loss_coef": z_coef},
                        **grouped(ppo_mini_batch_size=6, rollout_n=1, ppo_micro_batch_size_per_device=6))
    stats = actor._train_mini_batch(batch, {"temperature": 0.8})
    assert stats["actor/pg_loss"] == pytest.approx(pg_loss.item(), rel=1e-5)
    assert stats["moe/aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    assert stats["moe/z_loss"] == pytest.approx(z.item(), rel=1e-5)
    assert stats["moe/expert_load/max_over_mean"] >= 1.0
    ref = dict(model.named_parameters())
    router_grad = 0.0
    for name, p in actor.model.named_parameters():
        scale = float(ref[name].grad.abs().max())
        torch.testing.assert_close(p.grad, ref[name].grad, atol=1e-6 * scale + 1e-9, rtol=1e-4, msg=name)
        if name.endswith("mlp.gate.weight"):
            router_grad += float(p.grad.abs().sum())
    assert router_grad > 0


def test_bad_aux_loss_settings_are_refused(moe_dir, tmp_path):
    dense = str(save_tiny_model(tmp_path / "dense", tokenizer_from=None, vocab_size=128))
    for key in ("aux_loss_coef", "z_loss_coef"):
        with pytest.raises(ValueError, match=f"actor.moe.{key}: the policy .* has no mixture-of-experts router"):
            ActorWorker(dense, shared_prefix=False, moe={key: 0.001}, **grouped(ppo_mini_batch_size=2))
    with pytest.raises(ValueError, match="actor.moe.router_replay: the policy .* has no mixture-of-experts router"):
        ActorWorker(dense, shared_prefix=False, moe={"router_replay": "rollout"}, **grouped(ppo_mini_batch_size=2))
    with pytest.raises(ValueError, match="router_replay: 'off' or 'rollout', got 'engine'"):
        ActorWorker(moe_dir, moe={"router_replay": "engine"})


# Two PPO steps with the aux loss on. The aux loss is per micro-batch, so each comparison keeps the micro-batches'
# samples: micro-batches of 8 / world samples on one rank hold what each of ``world`` ranks holds.
TRAIN_KW = dict(lr=1e-3, ppo_mini_batch_size=8, rollout_n=1, shared_prefix=False, moe={"aux_loss_coef": COEF})
METRICS = ["actor/pg_loss", "actor/grad_norm", "moe/aux_loss", "moe/expert_load/max_over_mean"]


def _train_and_generate(moe_dir: str, micro: int, ep: int = 1, gen_tp: int = 1) -> dict:
    """Two updates, then a greedy rollout through the hybrid engine (the actor's current shards streamed into a
    released native engine), this rank's prompts; ``gen_tp`` > 1: an engine over the generation layout's TP group
    (each rank running its share of the experts), all the prompts."""
    torch.set_num_threads(1)
    batch = rollout_batch(8, temperature=0.9)
    actor = ActorWorker(moe_dir, ep_size=ep, **grouped(ppo_micro_batch_size_per_device=micro, **TRAIN_KW))
    shard = batch.chunk(actor.dp_size)[actor.dp_rank]
    metrics = [actor.update(shard, temperature=0.9) for _ in range(2)]
    width = shard["prompts"].shape[1]
    prompts = Batch({"input_ids": shard["prompts"], "attention_mask": shard["attention_mask"][:, :width]})
    tp_mesh = None
    if gen_tp > 1:
        tp_mesh = generation_mesh(training_mesh(actor.model), gen_tp)["tp"]
        prompts = Batch({"input_ids": batch["prompts"], "attention_mask": batch["attention_mask"][:, :width]})
    engine = NativeEngine(moe_dir, max_batch_size=16, max_seq_len=32, tp_mesh=tp_mesh)
    engine.release()
    gen = generate_with_current_weights(actor.model, engine, prompts, SamplingParams(
        n=1, temperature=0.0, max_tokens=4, ignore_eos=True), optimizer=actor.optimizer)
    split = [m for m in actor.model.modules() if getattr(m, "ep_size", 1) > 1]  # experts run expert-parallel
    local = [m.gate_up_proj.to_local().shape[0] for m in split]
    engine_experts = [m.gate_up_proj.shape[0] for m in engine.model.modules() if hasattr(m, "gate_up_proj")]
    return {"metrics": metrics, "params": full_params(actor.model), "responses": gen["responses"],
            "local_experts": local, "engine_experts": engine_experts}


def _on_ranks(rank: int, world: int, moe_dir: str, out: str, ep: int, gen_tp: int) -> None:
    result = _train_and_generate(moe_dir, 8 // world, ep, gen_tp)
    parts: list = [None] * world
    dist.all_gather_object(parts, result["responses"])
    if gen_tp == world:  # one engine over all ranks: every rank has every response
        assert all(torch.equal(p, parts[0]) for p in parts)
        parts = parts[:1]
    if rank == 0:
        torch.save({**result, "responses": torch.cat(parts)}, out)


@pytest.mark.parametrize("world, ep, gen_tp", [(2, 1, 1), (2, 2, 1), (4, 2, 1), (2, 2, 2)],
                         ids=["fsdp2", "ep2", "fsdp2xep2", "ep2-engine-tp2"])
def test_sharded_training_equals_one_rank_and_the_engine_generates_with_the_trained_experts(moe_dir, tmp_path,
                                                                                            world, ep, gen_tp):
    """FSDP2, expert parallelism (each rank holds 4 of the 8 experts; tokens go to them by all-to-all) and both
    (4 ranks: experts split over 2, each half FSDP-sharded over 2) give one process's metrics, weights after two
    updates and greedy rollouts. ``ep2-engine-tp2``: the trained experts are resharded from the EP layout into a
    TP-2 engine that holds 4 experts per rank."""
    single = _train_and_generate(moe_dir, 8 // world)
    run_ranks(_on_ranks, world, moe_dir, str(tmp_path / "fsdp.pt"), ep, gen_tp, timeout=300)
    fsdp = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    # ep 2: each of the 2 layers' experts module holds 4 experts on this rank (FSDP2 splits them further on 4 ranks)
    assert fsdp["local_experts"] == ([4 // (world // ep)] * 2 if ep > 1 else [])
    assert fsdp["engine_experts"] == [8 // gen_tp] * 2
    for got, want in zip(fsdp["metrics"], single["metrics"]):
        for key in METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for name, want in single["params"].items():
        torch.testing.assert_close(fsdp["params"][name], want, atol=2e-5, rtol=1e-4, msg=name)
    # the experts moved, and generation after training is transformers' greedy on the trained weights
    start = transformers.Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(single["params"][name], start.state_dict()[name])
    start.load_state_dict(single["params"])
    batch = rollout_batch(8, temperature=0.9)
    width = batch["prompts"].shape[1]
    want = start.generate(batch["prompts"], attention_mask=batch["attention_mask"][:, :width], do_sample=False,
                          max_new_tokens=4, min_new_tokens=4, pad_token_id=2)[:, width:]
    assert torch.equal(single["responses"], want) and torch.equal(fsdp["responses"], want)


def test_routing_replay_uses_the_engines_experts_and_narrows_the_bf16_log_prob_gap(tmp_path):
    """A bf16 engine (16 experts, top-4) routes some tokens differently from the float32 actor. With
    ``moe.router_replay: rollout`` the actor routes every fed response token to the engine's experts: its log-probs
    come closer to the engine's than with its own routes. In float32 the two routers agree exactly."""
    moe = str(save_tiny_model(tmp_path / "moe16", family="qwen3_moe", tokenizer_from=None, vocab_size=128,
                              initializer_range=0.2, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4))
    batch = rollout_batch(16, prompt_len=8, seed=5)
    width = batch["prompts"].shape[1]
    prompts = Batch({"input_ids": batch["prompts"], "attention_mask": batch["attention_mask"][:, :width]})
    gaps, agreement = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = NativeEngine(moe, max_batch_size=32, max_seq_len=64, dtype=dtype, record_routes=True)
        gen = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=0))
        gen["position_ids"] = (gen["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        mask = gen["response_mask"].bool()
        for replay in ("off", "rollout"):
            actor, packed = (ActorWorker(moe, moe={"router_replay": replay}, shared_prefix=shared,
                                         **grouped(freeze=True, ppo_micro_batch_size_per_device=8))
                             for shared in (False, True))
            lp = actor.compute_log_prob(gen, temperature=1.0)["old_log_probs"]
            # the shared-prefix layout replays the same routes at its own token positions
            torch.testing.assert_close(packed.compute_log_prob(gen, temperature=1.0)["old_log_probs"][mask], lp[mask],
                                       atol=1e-5, rtol=1e-5)
            gaps[dtype, replay] = float((lp - gen["rollout_log_probs"]).abs()[mask].mean())
            _, _, record = actor._forward(gen[:8], list(range(8)), None, None, 1.0, False)
            agreement[dtype, replay] = record.agreement  # the actor's own choices against the engine's
    assert agreement[torch.float32, "off"] == 1.0 and gaps[torch.float32, "off"] < 1e-4
    flipped = 1.0 - agreement[torch.bfloat16, "off"]
    assert flipped > 0  # bf16 flips some routes (their share is printed for the record)
    assert gaps[torch.bfloat16, "rollout"] < gaps[torch.bfloat16, "off"]
    print(f"bf16 engine vs float32 actor: {flipped:.2%} of token-layer expert choices flipped; mean |log-prob gap| "
          f"{gaps[torch.bfloat16, 'off']:.4f} without replay, {gaps[torch.bfloat16, 'rollout']:.4f} with replay")


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_shared_prefix_aux_loss_equals_the_dense_one_over_micro_batch_splits(moe_dir, micro):
    """8 samples of 3 prompts (groups of 3, 3, 2), micro-batches of 1-3 samples that cut across groups: the
    shared-prefix update (prompts computed once per mini-batch, their router logits shared by the micro-batches)
    gives the dense update's loss, aux loss and gradients."""
    results = {}
    for shared in (False, True):
        batch = rollout_batch(8, temperature=0.8, seed=7, group_size=3)
        actor = ActorWorker(moe_dir, shared_prefix=shared, moe={"aux_loss_coef": COEF},
                            **grouped(ppo_mini_batch_size=8, rollout_n=1, ppo_micro_batch_size_per_device=micro))
        stats = actor._train_mini_batch(batch, {"temperature": 0.8})
        results[shared] = stats, {n: p.grad.clone() for n, p in actor.model.named_parameters()}
    (dense, dense_grads), (packed, packed_grads) = results[False], results[True]
    for key in ("actor/pg_loss", "moe/aux_loss"):
        assert packed[key] == pytest.approx(dense[key], rel=1e-5), key
    for name, g in dense_grads.items():
        scale = float(g.abs().max())
        torch.testing.assert_close(packed_grads[name], g, atol=1e-6 * scale + 1e-9, rtol=1e-4, msg=name)
