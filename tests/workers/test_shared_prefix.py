"""Shared-prefix training (prompt once per mini-batch, packed suffixes, response-only logits) == the dense path.

The dense path (``shared_prefix=False``, one padded row per sample) is itself checked
against a plain HF forward and hand-derived gradients in test_actor.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_helpers import full_params, rollout_batch, run_ranks, grouped  # noqa: E402

from torchrlhf.models import save_tiny_model  # noqa: E402
from torchrlhf.workers.actor import ActorWorker  # noqa: E402
from torchrlhf.workers.critic import CriticWorker  # noqa: E402
from torchrlhf.workers.shared_prefix import SharedPrefixPlan  # noqa: E402

# 3 groups of 4 samples; mini-batch 3 prompts; micro-batches of 1 or 3 split the groups. A small lr:
# Adam moves a weight by ~lr whatever its gradient, so rounding in near-zero gradients shows as ~lr.
TRAIN_KW = dict(lr=1e-4, grad_clip=None, ppo_mini_batch_size=3, rollout_n=4, ppo_epochs=2, use_kl_loss=True,
                entropy_coeff=0.01)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_from=None, vocab_size=128))


def group_batch(n: int = 4, groups: int = 3, **kw):
    return rollout_batch(n * groups, prompt_len=8, response_len=6, group_size=n, seed=3, **kw)


def test_plan_runs_each_prompt_once():
    batch = group_batch(min_response_len=0)
    plan = SharedPrefixPlan(batch)
    p = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    prompt_lens = batch["attention_mask"][:, :p].sum(-1)
    resp_lens = batch["attention_mask"][:, p:].sum(-1)
    assert plan.num_groups == 3
    assert plan.group_of == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    # the prompt minus its last token, once per group; then the last prompt token + response, per sample
    assert plan.prefix_tokens() == int(prompt_lens[::4].sum()) - 3
    assert plan.suffix_tokens() == int(resp_lens.sum()) + 12
    assert plan.prefix_tokens() + plan.suffix_tokens() < int(batch["attention_mask"].sum())


def test_plan_rejects_an_empty_prompt():
    batch = group_batch()
    batch["attention_mask"][0, :8] = 0
    with pytest.raises(ValueError, match="sample 0 has an empty prompt"):
        SharedPrefixPlan(batch)


def _run(model_dir, batch, shared: bool, steps: int = 2, **kw):
    actor = ActorWorker(model_dir, **grouped(shared_prefix=shared, **{**TRAIN_KW, **kw}))
    temperature = batch.meta["temperature"]
    lp = actor.compute_log_prob(batch, temperature=temperature)["old_log_probs"]
    metrics = [actor.update(batch, temperature=temperature) for _ in range(steps)]
    return lp, metrics, {k: v.detach().clone() for k, v in actor.model.state_dict().items()}


@pytest.mark.parametrize("micro_kw", [
    dict(ppo_micro_batch_size_per_device=1),  # every group split over 4 micro-batches
    dict(ppo_micro_batch_size_per_device=3),  # groups straddle micro-batch boundaries
    dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=14),
    dict(ppo_micro_batch_size_per_device=3, activation_checkpointing=True),  # the prefix is recomputed in backward
], ids=["micro1", "micro3", "dynamic", "checkpointing"])
def test_shared_prefix_update_equals_dense(model_dir, micro_kw):
    """Log-probs, loss metrics and parameters after 2 PPO epochs x 2 updates match the dense path (fp32)."""
    batch = group_batch(min_response_len=0)  # includes an empty response
    assert (batch["response_mask"].sum(-1) == 0).any()
    lp_s, m_s, p_s = _run(model_dir, batch, True, **micro_kw)
    lp_d, m_d, p_d = _run(model_dir, batch, False, **micro_kw)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(lp_s[mask], lp_d[mask], atol=1e-5, rtol=1e-5)
    for got, want in zip(m_s, m_d):
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for name, want in p_d.items():
        torch.testing.assert_close(p_s[name], want, atol=2e-5, rtol=1e-4, msg=name)
    start = ActorWorker(model_dir, freeze=True).model.state_dict()
    assert any(not torch.allclose(start[k], p_d[k]) for k in p_d)  # the updates did change the weights


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_offloaded_prefix_activations_give_the_same_update(model_dir, checkpointing, monkeypatch):
    """The prompt pass's saved tensors held in host memory until its backward: the same log-probs, metrics and
    weights, bit for bit (copies are exact), and the prompt pass did hand its activations over."""
    import torchrlhf.workers.base as base

    offloaded = []
    run_prefixes = base.run_prefixes

    def counting(*args, **kwargs):
        plan, prefix, lengths = run_prefixes(*args, **kwargs)
        offloaded.append(prefix.offloaded_bytes)
        return plan, prefix, lengths

    monkeypatch.setattr(base, "run_prefixes", counting)
    batch = group_batch(min_response_len=0)
    kw = dict(ppo_micro_batch_size_per_device=3, activation_checkpointing=checkpointing)
    lp_o, m_o, p_o = _run(model_dir, batch, True, offload_prefix_activations=True, **kw)
    # the no-grad log-prob pass saves nothing; each of 2 updates x 2 epochs moved its prompts' activations
    assert len(offloaded) == 5 and offloaded[0] == 0 and min(offloaded[1:]) > 0, offloaded
    lp_r, m_r, p_r = _run(model_dir, batch, True, **kw)
    assert offloaded[5:] == [0] * 5
    assert torch.equal(lp_o, lp_r)
    for got, want in zip(m_o, m_r):  # the MFU is a timing
        assert {k: v for k, v in got.items() if not k.startswith("perf/")} == \
            {k: v for k, v in want.items() if not k.startswith("perf/")}
    for name, want in p_r.items():
        assert torch.equal(p_o[name], want), name


def test_offloading_needs_shared_prefixes(model_dir):
    with pytest.raises(ValueError, match="offload_prefix_activations needs actor.shared_prefix: true"):
        ActorWorker(model_dir, **grouped(shared_prefix=False, offload_prefix_activations=True, **TRAIN_KW))


def test_shared_prefix_with_one_sample_per_prompt(model_dir):
    """n = 1 (PPO): nothing to share, the packed path must still equal the dense one."""
    batch = rollout_batch(6, prompt_len=8, response_len=6, seed=5)
    kw = dict(ppo_mini_batch_size=2, rollout_n=1, ppo_micro_batch_size_per_device=1)
    lp_s, _, p_s = _run(model_dir, batch, True, steps=1, **kw)
    lp_d, _, p_d = _run(model_dir, batch, False, steps=1, **kw)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(lp_s[mask], lp_d[mask], atol=1e-5, rtol=1e-5)
    for name, want in p_d.items():
        torch.testing.assert_close(p_s[name], want, atol=2e-5, rtol=1e-4, msg=name)


def _shared_on_ranks(rank: int, world: int, model_dir: str, untied_dir: str, out: str) -> None:
    """Groups split over 2 data-parallel ranks (FSDP2; also with an untied head, which the prompts' pass
    leaves without a gradient), then TP = 2, all with shared prefixes."""
    torch.set_num_threads(1)
    batch = group_batch(min_response_len=0)
    results = {}
    for name, path, tp in (("fsdp", model_dir, 1), ("fsdp_untied", untied_dir, 1), ("tp", model_dir, 2)):
        actor = ActorWorker(path, **grouped(shared_prefix=True, tp_size=tp, **TRAIN_KW, ppo_micro_batch_size_per_device=1))
        shard = batch.chunk(actor.dp_size)[actor.dp_rank]
        [actor.update(shard, temperature=shard.meta["temperature"]) for _ in range(2)]
        results[name] = full_params(actor.model)
    if rank == 0:
        torch.save(results, out)


def test_shared_prefix_fsdp_and_tp_equal_dense_single_process(model_dir, tmp_path):
    batch = group_batch(min_response_len=0)
    untied_dir = str(save_tiny_model(tmp_path / "untied", tokenizer_from=None, vocab_size=128,
                                     tie_word_embeddings=False))
    _, _, dense = _run(model_dir, batch, False, ppo_micro_batch_size_per_device=4)
    _, _, dense_untied = _run(untied_dir, batch, False, ppo_micro_batch_size_per_device=4)
    out = tmp_path / "shared.pt"
    run_ranks(_shared_on_ranks, 2, model_dir, untied_dir, str(out), timeout=300)
    results = torch.load(out, weights_only=True)
    for run, want_params in (("fsdp", dense), ("fsdp_untied", dense_untied), ("tp", dense)):
        for name, want in want_params.items():
            torch.testing.assert_close(results[run][name], want, atol=2e-5, rtol=1e-4, msg=f"{run}: {name}")
    head, embedding = "lm_head.weight", "model.embed_tokens.weight"
    assert torch.equal(dense[head], dense[embedding]) and not torch.equal(dense_untied[head], dense_untied[embedding])


@pytest.mark.parametrize("micro", [1, 3])
def test_critic_shared_prefix_equals_dense(model_dir, micro):
    """Values and the critic's parameters after 2 updates match the dense critic (groups split over micro-batches;
    with micro-batches of 3 the shared critic also offloads its prompt pass's activations)."""
    batch = group_batch(min_response_len=0)
    runs = {}
    for shared in (True, False):
        critic = CriticWorker(model_dir, **grouped(lr=1e-4, grad_clip=None, ppo_mini_batch_size=3, rollout_n=4, ppo_epochs=2,
                              ppo_micro_batch_size_per_device=micro, shared_prefix=shared,
                              offload_prefix_activations=shared and micro == 3))
        values = critic.compute_values(batch)["values"]
        metrics = [critic.update(batch) for _ in range(2)]
        runs[shared] = values, metrics, {k: v.detach().clone() for k, v in critic.model.state_dict().items()}
    (v_s, m_s, p_s), (v_d, m_d, p_d) = runs[True], runs[False]
    torch.testing.assert_close(v_s, v_d, atol=1e-5, rtol=1e-5)
    for got, want in zip(m_s, m_d):
        for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    for name, want in p_d.items():
        torch.testing.assert_close(p_s[name], want, atol=2e-5, rtol=1e-4, msg=name)


def test_plan_refuses_sequences_longer_than_a_sliding_window():
    batch = group_batch()
    longest = int(batch["attention_mask"].sum(-1).max())
    SharedPrefixPlan(batch, window=longest)
    with pytest.raises(ValueError, match="sliding attention window .* set shared_prefix: false"):
        SharedPrefixPlan(batch, window=longest - 1)
