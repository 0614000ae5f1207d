"""ActorWorker numerics: HF-forward log-probs, hand-derived PPO gradients, micro-batching / FSDP / TP invariance."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from dist_helpers import full_params, rollout_batch, run_ranks, grouped  # noqa: E402

from torchrlhf.data import Batch  # noqa: E402
from torchrlhf.generation import NativeEngine, SamplingParams  # noqa: E402
from torchrlhf.hybrid import generate_with_current_weights  # noqa: E402
from torchrlhf.models import save_tiny_model  # noqa: E402
from torchrlhf.workers.actor import ActorWorker  # noqa: E402
from torchrlhf.workers.microbatch import validate_batch_sizes  # noqa: E402

# 4 prompts x 2 responses; mini-batch of 2 prompts -> 2 mini-batches per step, 2 PPO epochs.
TRAIN_KW = dict(lr=1e-3, warmup_steps=2, grad_clip=0.5, ppo_mini_batch_size=2, rollout_n=2, ppo_epochs=2,
                use_kl_loss=True, kl_loss_type="k3", entropy_coeff=0.01)
METRICS = ["actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm",
           "actor/lr"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_from=None, vocab_size=128))


def hf_log_probs(model_dir: str, batch, temperature: float):
    """log_softmax(logits / T) of each response token from a plain full-sequence HF forward, and the entropy."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    r = batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, -r - 1 : -1] / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, batch["responses"][..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return model, lp, ent


@pytest.mark.parametrize("dynamic", [False, True])
def test_compute_log_prob_matches_hf_forward(model_dir, dynamic):
    batch = rollout_batch(7, temperature=0.7)
    actor = ActorWorker(model_dir, **grouped(freeze=True, ppo_micro_batch_size_per_device=3, use_dynamic_bsz=dynamic,
                        max_tokens_per_micro_batch=16))
    out = actor.compute_log_prob(batch, temperature=0.7, entropy=True)
    _, lp, ent = hf_log_probs(model_dir, batch, 0.7)
    mask = batch["response_mask"].bool()
    assert out["old_log_probs"].shape == batch["responses"].shape
    torch.testing.assert_close(out["old_log_probs"][mask], lp[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["entropys"][mask], ent[mask], atol=1e-5, rtol=1e-5)
    ref = actor.compute_ref_log_prob(batch, temperature=0.7)["ref_log_prob"]
    torch.testing.assert_close(ref[mask], lp[mask], atol=1e-5, rtol=1e-5)
    teacher = actor.compute_teacher_log_prob(batch, temperature=0.7)
    torch.testing.assert_close(teacher["teacher_log_prob"][mask], lp[mask], atol=1e-5, rtol=1e-5)
    assert "perf/mfu/teacher" in teacher.meta


@pytest.mark.parametrize("method", ["compute_ref_log_prob", "compute_teacher_log_prob"])
def test_frozen_log_probs_need_frozen_worker(model_dir, method):
    actor = ActorWorker(model_dir)
    with pytest.raises(RuntimeError, match="freeze=True"):
        getattr(actor, method)(rollout_batch(2), temperature=1.0)


@pytest.mark.parametrize("micro_kw", [dict(ppo_micro_batch_size_per_device=1), dict(ppo_micro_batch_size_per_device=3),
                                      dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=15)])
def test_gradient_matches_hand_derived_ppo_loss(model_dir, micro_kw):
    """One mini-batch: accumulated micro-batch gradients == gradient of the token-mean PPO loss over the whole batch."""
    batch = rollout_batch(6, temperature=0.8, seed=3)
    model, lp, _ = hf_log_probs(model_dir, batch, 0.8)
    mask = batch["response_mask"].float()
    noise = 0.2 * torch.rand(lp.shape, generator=torch.Generator().manual_seed(1)) - 0.1
    batch["old_log_probs"] = (lp.detach() + noise) * mask  # ratios within the clip range: no clipping
    ratio = torch.exp(lp - batch["old_log_probs"])
    loss = -(batch["advantages"] * ratio * mask).sum() / mask.sum()
    loss.backward()

    actor = ActorWorker(model_dir, **grouped(ppo_mini_batch_size=6, rollout_n=1, **micro_kw))
    stats = actor._train_mini_batch(batch, {"temperature": 0.8})
    assert stats["actor/pg_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert stats["actor/pg_clipfrac"] == 0.0
    ref_grads = dict(model.named_parameters())
    for name, p in actor.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def test_on_policy_update_without_old_log_probs_is_the_policy_gradient(model_dir):
    """No old log-probs (one optimizer step per rollout): ratio 1, gradient of -mean(A * log pi) by hand."""
    batch = rollout_batch(6, temperature=0.8, seed=4)
    batch.pop("old_log_probs")
    model, lp, _ = hf_log_probs(model_dir, batch, 0.8)
    mask = batch["response_mask"].float()
    (-(batch["advantages"] * lp * mask).sum() / mask.sum()).backward()

    actor = ActorWorker(model_dir, **grouped(ppo_mini_batch_size=6, rollout_n=1, ppo_micro_batch_size_per_device=3))
    stats = actor._train_mini_batch(batch, {"temperature": 0.8})
    assert stats["actor/ppo_kl"] == 0.0 and stats["actor/pg_clipfrac"] == 0.0
    ref_grads = dict(model.named_parameters())
    for name, p in actor.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)
    # Two mini-batches (or epochs) see a moved policy: then old log-probs are required.
    with pytest.raises(KeyError, match="old_log_probs"):
        ActorWorker(model_dir, **grouped(ppo_mini_batch_size=3, rollout_n=1)).update(batch, temperature=1.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_the_policy_gradient_by_bounded_ratios(model_dir, level):
    """Gradient of -mean(A * min(pi_old / pi_rollout, C) * log pi) by hand, token or sequence ratios."""
    batch = rollout_batch(6, temperature=0.8, seed=5)
    batch.pop("old_log_probs")
    model, lp, _ = hf_log_probs(model_dir, batch, 0.8)
    mask = batch["response_mask"].float()
    # A rollout engine off by up to x2.7 either way per token: some ratios pass the threshold, some do not.
    log_gap = 2.0 * torch.rand(lp.shape, generator=torch.Generator().manual_seed(2)) - 1.0
    batch["rollout_log_probs"] = (lp.detach() - log_gap) * mask
    log_rho = log_gap * mask if level == "token" else (log_gap * mask).sum(-1, keepdim=True).expand_as(mask)
    w = torch.exp(log_rho).clamp(max=1.5) * mask
    (-(batch["advantages"] * w * lp * mask).sum() / mask.sum()).backward()

    actor = ActorWorker(model_dir, **grouped(ppo_mini_batch_size=6, rollout_n=1, ppo_micro_batch_size_per_device=3,
                        rollout_is=level, rollout_is_threshold=1.5))
    stats = actor._train_mini_batch(batch, {"temperature": 0.8})
    ref_grads = dict(model.named_parameters())
    for name, p in actor.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)
    assert stats["actor/rollout_is_mean"] == pytest.approx(float(w.sum() / mask.sum()), rel=1e-4)
    raw = torch.exp(log_rho) * mask
    assert stats["actor/rollout_is_clipped_frac"] == pytest.approx(float(((raw > 1.5) * mask).sum() / mask.sum()))
    assert stats["actor/rollout_is_max"] == pytest.approx(float(raw.max()), rel=1e-4)
    assert 0 < stats["actor/rollout_is_clipped_frac"] < 1
    with pytest.raises(ValueError, match="rollout_is: must be one of"):
        ActorWorker(model_dir, loss={"rollout_is": "tok"})


def _train(actor: ActorWorker, batch, steps: int = 2) -> list[dict[str, float]]:
    shard = batch.chunk(actor.dp_size)[actor.dp_rank]
    return [actor.update(shard, temperature=shard.meta["temperature"]) for _ in range(steps)]


GREEDY = dict(n=1, temperature=0.0, max_tokens=4, ignore_eos=True)


def prompt_batch(batch) -> Batch:
    """The (left-padded) prompts of a rollout batch, asking for greedy rollouts."""
    width = batch["prompts"].shape[1]
    return Batch({"input_ids": batch["prompts"], "attention_mask": batch["attention_mask"][:, :width]})


def hf_greedy(model_dir: str, params: dict[str, torch.Tensor], prompts: Batch) -> torch.Tensor:
    """4 greedy tokens per prompt from HF ``generate`` on a model holding ``params`` (independent of our engine)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(params)
    out = model.generate(prompts["input_ids"], attention_mask=prompts["attention_mask"], do_sample=False,
                         max_new_tokens=4, min_new_tokens=4, pad_token_id=2)
    return out[:, prompts["input_ids"].shape[1]:]


def _rollout(actor: ActorWorker, model_dir: str, prompts: Batch) -> Batch:
    """What a colocated `RolloutWorker` does: the actor's current shards streamed into a released engine."""
    engine = NativeEngine(model_dir, max_batch_size=64, max_seq_len=64)
    engine.release()
    return generate_with_current_weights(actor.model, engine, prompts, SamplingParams(**GREEDY),
                                         optimizer=actor.optimizer)


def _train_on_ranks(rank: int, world: int, model_dir: str, out: str, tp_size: int) -> None:
    torch.set_num_threads(1)
    batch = rollout_batch(8, temperature=0.9)
    variants = {"fixed": dict(ppo_micro_batch_size_per_device=1)}
    if tp_size == 1:
        variants["dynamic"] = dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=20)
    results = {}
    for name, kw in variants.items():
        actor = ActorWorker(model_dir, **grouped(tp_size=tp_size, **TRAIN_KW, **kw))
        metrics = _train(actor, batch)
        results[name] = {"metrics": metrics, "params": full_params(actor.model)}
        # Rollouts after training use the trained weights, resharded into the engine (the hybrid engine).
        gen = _rollout(actor, model_dir, prompt_batch(batch).chunk(actor.dp_size)[actor.dp_rank])
        parts: list = [None] * world
        dist.all_gather_object(parts, gen["responses"])
        results[name]["responses"] = torch.cat(parts[::tp_size])
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def single_process_run(model_dir):
    actor = ActorWorker(model_dir, **grouped(ppo_micro_batch_size_per_device=4, **TRAIN_KW))
    metrics = _train(actor, rollout_batch(8, temperature=0.9))
    return metrics, {k: v.detach().clone() for k, v in actor.model.state_dict().items()}


def _assert_same_run(run, reference, model_dir):
    metrics, params = run["metrics"], run["params"]
    ref_metrics, ref_params = reference
    for got, want in zip(metrics, ref_metrics):
        assert got["actor/skipped_steps"] == 0
        for key in METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, atol=2e-5, rtol=1e-4, msg=name)
    want = hf_greedy(model_dir, ref_params, prompt_batch(rollout_batch(8, temperature=0.9)))
    assert torch.equal(run["responses"], want)


def test_compiled_blocks_train_as_eager_blocks(model_dir, single_process_run):
    """``compile=True`` (each block's forward through torch.compile, the packed shared-prefix attention eager
    inside it, and the head's tile arithmetic): two PPO steps give the eager run's metrics and weights, within
    float rounding."""
    actor = ActorWorker(model_dir, **grouped(ppo_micro_batch_size_per_device=4, compile=True, **TRAIN_KW))
    assert actor.lm_head.compile
    metrics = _train(actor, rollout_batch(8, temperature=0.9))
    ref_metrics, ref_params = single_process_run
    for got, want in zip(metrics, ref_metrics):
        for key in METRICS:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    params = actor.model.state_dict()
    assert params.keys() == ref_params.keys()  # the blocks are not wrapped: checkpoints look the same
    for name, want in ref_params.items():
        torch.testing.assert_close(params[name], want, atol=2e-5, rtol=1e-4, msg=name)


def test_fsdp_two_ranks_match_single_process(model_dir, single_process_run, tmp_path):
    """2-rank FSDP2 (fixed micro-batches of 1, and token-balanced dynamic) == 1 process with 4-sample micro-batches."""
    out = tmp_path / "fsdp.pt"
    run_ranks(_train_on_ranks, 2, model_dir, str(out), 1)
    results = torch.load(out, weights_only=True)
    assert single_process_run[0][0]["actor/lr"] == pytest.approx(5e-4)  # warmup: step 1 of 2
    _assert_same_run(results["fixed"], single_process_run, model_dir)
    _assert_same_run(results["dynamic"], single_process_run, model_dir)


def test_fsdp_tp_2x2_matches_single_process(model_dir, single_process_run, tmp_path):
    out = tmp_path / "tp.pt"
    run_ranks(_train_on_ranks, 4, model_dir, str(out), 2, timeout=300)
    _assert_same_run(torch.load(out, weights_only=True)["fixed"], single_process_run, model_dir)


def test_nan_loss_skips_step_and_keeps_params(model_dir):
    actor = ActorWorker(model_dir, **grouped(lr=1e-2, ppo_mini_batch_size=4, rollout_n=1, ppo_micro_batch_size_per_device=2))
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    batch = rollout_batch(4)
    batch["advantages"][1, 0] = float("nan")  # a valid response token (every response has >= 1)
    metrics = actor.update(batch, temperature=1.0)
    assert metrics["actor/grad_norm_nonfinite"] == 1.0 and metrics["actor/skipped_steps"] == 1.0
    assert "actor/grad_norm" not in metrics
    for k, v in actor.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    metrics = actor.update(rollout_batch(4), temperature=1.0)  # a clean batch trains normally afterwards
    assert metrics["actor/skipped_steps"] == 0.0 and math.isfinite(metrics["actor/grad_norm"])
    assert any(not torch.equal(v, before[k]) for k, v in actor.model.state_dict().items())


def test_bad_batch_sizes_raise_before_work(model_dir):
    with pytest.raises(ValueError, match=r"train_batch_size=6 .*ppo_mini_batch_size=4"):
        validate_batch_sizes(train_batch_size=6, ppo_mini_batch_size=4, rollout_n=2, dp_size=1,
                             ppo_micro_batch_size_per_device=1)
    with pytest.raises(ValueError, match=r"3 prompts x rollout.n=1 = 3 responses .* 2 data-parallel"):
        validate_batch_sizes(ppo_mini_batch_size=3, rollout_n=1, dp_size=2, ppo_micro_batch_size_per_device=1)
    with pytest.raises(ValueError, match=r"= 4 per rank, not divisible by ppo_micro_batch_size_per_device=3"):
        validate_batch_sizes(ppo_mini_batch_size=4, rollout_n=2, dp_size=2, ppo_micro_batch_size_per_device=3)
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=10 .* 12 tokens"):
        validate_batch_sizes(ppo_mini_batch_size=4, rollout_n=1, dp_size=1, use_dynamic_bsz=True,
                             max_tokens_per_micro_batch=10, max_seq_len=12)
    with pytest.raises(ValueError, match="ppo_micro_batch_size_per_device=3"):
        ActorWorker(model_dir, **grouped(ppo_mini_batch_size=2, rollout_n=2, ppo_micro_batch_size_per_device=3))
    actor = ActorWorker(model_dir, **grouped(ppo_mini_batch_size=2, rollout_n=2, ppo_micro_batch_size_per_device=2))
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"got 6 samples .* 2 prompts x 2 responses / 1 ranks = 4"):
        actor.update(rollout_batch(6), temperature=1.0)
    assert all(torch.equal(v, before[k]) for k, v in actor.model.state_dict().items())


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_seq_mean_modes_do_not_depend_on_micro_batching(model_dir, mode):
    """Sequence-level aggregation over trimmed, token-balanced micro-batches == one whole-batch micro-batch."""
    batch = rollout_batch(6, seed=5)
    grads, losses = [], []
    for kw in (dict(ppo_micro_batch_size_per_device=6), dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=13)):
        actor = ActorWorker(model_dir, **grouped(ppo_mini_batch_size=6, rollout_n=1, loss_agg_mode=mode, entropy_coeff=0.1, **kw))
        losses.append(actor._train_mini_batch(batch, {"temperature": 1.0})["actor/pg_loss"])
        grads.append({n: p.grad.clone() for n, p in actor.model.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-4, msg=name)


def _bf16_on_one_rank(rank: int, world: int, model_dir: str, out: str) -> None:
    """Two bf16 PPO steps on a one-rank group, with the compute copies and (forced) with FSDP2's mixed precision;
    then each worker's log-probs, and a checkpoint of the copies' worker restored into a fresh one."""
    torch.set_num_threads(1)
    batch = rollout_batch(8, temperature=0.9)
    results = {}
    for layout in ("copies", "fsdp"):
        if layout == "fsdp":
            ActorWorker._layout = lambda self, *args: "fsdp"
        actor = ActorWorker(model_dir, **grouped(ppo_micro_batch_size_per_device=2, dtype="bfloat16", **TRAIN_KW))
        holds_copies = actor.compute_copies is not None
        metrics = _train(actor, batch)
        params = {k: v.detach().clone() for k, v in full_params(actor.model).items()}
        lp = actor.compute_log_prob(batch, temperature=0.9)["old_log_probs"]
        results[layout] = {"metrics": metrics, "params": params, "log_probs": lp, "copies": holds_copies,
                           "dtypes": sorted({str(p.dtype) for p in params.values()})}
        if layout == "copies":
            actor.save_checkpoint(str(Path(out).parent / "ckpt"))
            fresh = ActorWorker(model_dir, **grouped(ppo_micro_batch_size_per_device=2, dtype="bfloat16", **TRAIN_KW))
            fresh.load_checkpoint(str(Path(out).parent / "ckpt"))
            results["restored"] = {"log_probs": fresh.compute_log_prob(batch, temperature=0.9)["old_log_probs"],
                                   "metrics": _train(fresh, batch, steps=1), "next": _train(actor, batch, steps=1)}
    torch.save(results, out)


def test_bf16_compute_copies_train_as_fsdp2_mixed_precision(model_dir, tmp_path):
    """On one rank a bf16 actor keeps float32 weights and bf16 compute copies (`ComputeCopies`) instead of
    FSDP2; FSDP2's own mixed precision (bf16 params, float32 gradient reduction) is the reference: two PPO steps
    (2 mini-batches x 2 epochs, 2 micro-batches each) give its metrics, weights and log-probs. The copies follow
    the optimizer's steps (fused AdamW does not bump a tensor's version, so they are cast anew on every use) and a
    checkpoint load (the restored worker scores and steps as the original)."""
    out = tmp_path / "bf16.pt"
    # a hang guard, not a speed bound: bf16 on a CPU without AVX512-BF16 (the 2-core AMD EPYC host) runs 3-5x
    # slower than float32, and this ran past 180 s there
    run_ranks(_bf16_on_one_rank, 1, model_dir, str(out), timeout=1200)
    results = torch.load(out, weights_only=True)
    copies, fsdp, restored = results["copies"], results["fsdp"], results["restored"]
    assert copies["copies"] and not fsdp["copies"]
    assert copies["dtypes"] == ["torch.float32"]  # the weights the optimizer steps and checkpoints save
    for got, want in zip(copies["metrics"], fsdp["metrics"]):
        for key in METRICS:
            assert got[key] == want[key], key  # the same casts and float32 sums: bit for bit
    for name, want in fsdp["params"].items():
        torch.testing.assert_close(copies["params"][name], want, atol=0, rtol=0, msg=name)
    torch.testing.assert_close(copies["log_probs"], fsdp["log_probs"], atol=1e-6, rtol=0)
    torch.testing.assert_close(restored["log_probs"], copies["log_probs"], atol=0, rtol=0)
    for key in METRICS:
        assert restored["metrics"][0][key] == pytest.approx(restored["next"][0][key], rel=1e-6, abs=1e-7), key
