"""Advantage estimators: token-level rewards [B, T] -> (advantages, returns) [B, T].

Each estimator is registered with its traits (`Estimator`): the config checks, the rollout pipeline and the
trainer read them, so a new estimator is one decorated function::

    @ADV_ESTIMATORS.register("my_estimator", group=True)
    def my_advantage(token_level_rewards, response_mask, *, index, **_): ...

An estimator takes the inputs its traits name (``index``, ``values``, ``reward_baselines``) and the
algorithm's hyper-parameters (``gamma``, ``lam``, ``norm_adv_by_std``, ``epsilon``, ``whiten``) as keyword
arguments; ``**_`` takes those it ignores.

Outputs are zero outside ``response_mask``. Group estimators take ``index`` (one uid per sample) and a
sequence score = sum of ``token_level_rewards`` over the response, and broadcast the scalar advantage over
the response tokens. A group of one sample has no baseline to compare against, so its advantage is 0 in every
group estimator (verl instead uses mean 0 / std 1 for such groups, i.e. the raw score).
Maths is done in float32; results are cast back to the dtype of ``token_level_rewards``.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torchrlhf.algorithms.masked import masked_whiten
from torchrlhf.algorithms.registry import Registry


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and what it needs from the run.

    group: compares the responses of one prompt, so it needs ``rollout.n`` >= 2 (DAPO's group filter works
        with it); it takes ``index``, each sample's group uid.
    values: learns against a critic's ``values``, so the run needs a critic.
    greedy_baseline: subtracts the reward of a greedy response to the same prompt (ReMax): the rollout
        generates and scores that response, one sampled response per prompt (``rollout.n`` = 1); it takes
        ``reward_baselines``.
    """

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    group: bool = False
    values: bool = False
    greedy_baseline: bool = False

    @property
    def inputs(self) -> dict[str, str]:
        """The batch inputs the traits name: keyword argument -> the batch column it is read from."""
        named = {"index": ("uid", self.group), "values": ("values", self.values),
                 "reward_baselines": ("reward_baselines", self.greedy_baseline)}
        return {keyword: column for keyword, (column, wanted) in named.items() if wanted}


class EstimatorRegistry(Registry):
    """Name -> `Estimator`; ``register`` takes the traits beside the names."""

    def register(self, *names: str, group: bool = False, values: bool = False,
                 greedy_baseline: bool = False) -> Callable[[Callable], Callable]:
        if group and greedy_baseline:
            raise ValueError(f"advantage estimator {names}: group (rollout.n >= 2) and greedy_baseline "
                             "(rollout.n = 1) exclude each other")

        def deco(fn: Callable) -> Callable:
            Registry.register(self, *names)(Estimator(fn, group=group, values=values, greedy_baseline=greedy_baseline))
            return fn

        return deco

    def having(self, trait: str) -> list[str]:
        """The names of the estimators with ``trait`` (for error messages)."""
        return sorted(name for name, estimator in self.items() if getattr(estimator, trait))


ADV_ESTIMATORS = EstimatorRegistry("advantage estimator")

Index = Sequence | torch.Tensor


def group_ids(index: Index, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Map uids (any hashables, or a tensor) to dense group ids [B] in order of first appearance."""
    if index is None:
        raise ValueError("this advantage estimator needs `index` (the uid of each sample's group)")
    keys = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if len(keys) != batch_size:
        raise ValueError(f"index has {len(keys)} entries but the batch has {batch_size} samples")
    ids: dict = {}
    return torch.tensor([ids.setdefault(k, len(ids)) for k in keys], dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, gid: torch.Tensor):
    """Per-sample group (count, mean, unbiased std) gathered back to [B]."""
    zeros = scores.new_zeros(int(gid.max()) + 1 if gid.numel() else 0)
    count = zeros.index_add(0, gid, torch.ones_like(scores))
    mean = zeros.index_add(0, gid, scores) / count
    sq = zeros.index_add(0, gid, (scores - mean[gid]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    return count[gid], mean[gid], std[gid]


def _scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (token_level_rewards.float() * mask).sum(-1)


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go over valid tokens; masked tokens inside a response are skipped (return carried, no discount)."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running
    return returns * mask


@ADV_ESTIMATORS.register("gae", values=True)
def gae_advantage(token_level_rewards, response_mask, *, values, gamma=1.0, lam=1.0, whiten=True, **_):
    """GAE over valid tokens; the recursion jumps over masked tokens (tool/observation tokens inside a
    response carry the next value and advantage). returns = advantages + values (before whitening)."""
    if values is None:
        raise ValueError("gae needs `values` [B, T]")
    rewards, values, mask = token_level_rewards.float(), values.float(), response_mask.float()
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    last_gae = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        last_gae = m * gae_t + (1 - m) * last_gae
        next_value = m * values[:, t] + (1 - m) * next_value
        adv[:, t] = gae_t
    adv = adv * mask
    returns = (adv + values) * mask
    if whiten:
        adv = masked_whiten(adv, mask) * mask
    return adv, returns


@ADV_ESTIMATORS.register("grpo", group=True)
def grpo_advantage(token_level_rewards, response_mask, *, index, norm_adv_by_std=True, epsilon=1e-6, **_):
    """(r - group mean) / (group std + eps), std unbiased (torch.std); without std normalisation it is Dr.GRPO."""
    mask = response_mask.float()
    scores = _scores(token_level_rewards, mask)
    count, mean, std = _group_stats(scores, group_ids(index, len(scores), scores.device))
    adv = scores - mean
    if norm_adv_by_std:  # all-equal groups give 0/0 when epsilon is 0: define their advantage as 0
        adv = torch.where(std + epsilon > 0, adv / (std + epsilon), torch.zeros_like(adv))
    adv = torch.where(count > 1, adv, torch.zeros_like(adv)).unsqueeze(-1) * mask
    return adv, adv


@ADV_ESTIMATORS.register("dr_grpo", group=True)
def dr_grpo_advantage(token_level_rewards, response_mask, *, index, epsilon=1e-6, **_):
    """Dr.GRPO: r - group mean (no std normalisation)."""
    return grpo_advantage(token_level_rewards, response_mask, index=index, norm_adv_by_std=False, epsilon=epsilon)


@ADV_ESTIMATORS.register("rloo", group=True)
def rloo_advantage(token_level_rewards, response_mask, *, index, **_):
    """Leave-one-out: r_i - mean_{j != i} r_j = (r_i - mean) * n / (n - 1)."""
    mask = response_mask.float()
    scores = _scores(token_level_rewards, mask)
    count, mean, _ = _group_stats(scores, group_ids(index, len(scores), scores.device))
    adv = (scores - mean) * count / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv)).unsqueeze(-1) * mask
    return adv, adv


@ADV_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantage(token_level_rewards, response_mask, *, gamma=1.0, **_):
    """REINFORCE++: discounted return-to-go, whitened over all valid tokens of the batch."""
    mask = response_mask.float()
    returns = _discounted_returns(token_level_rewards.float(), mask, gamma)
    return masked_whiten(returns, mask) * mask, returns


@ADV_ESTIMATORS.register("reinforce_pp_baseline", group=True)
def reinforce_pp_baseline_advantage(token_level_rewards, response_mask, *, index, **_):
    """REINFORCE++ with baseline: score minus group mean, broadcast over tokens, then whitened over the batch."""
    mask = response_mask.float()
    scores = _scores(token_level_rewards, mask)
    count, mean, _ = _group_stats(scores, group_ids(index, len(scores), scores.device))
    centred = torch.where(count > 1, scores - mean, torch.zeros_like(scores)).unsqueeze(-1) * mask
    return masked_whiten(centred, mask) * mask, centred


@ADV_ESTIMATORS.register("remax", greedy_baseline=True)
def remax_advantage(token_level_rewards, response_mask, *, reward_baselines, gamma=1.0, **_):
    """ReMax: return-to-go minus the greedy rollout's reward ``reward_baselines`` [B]."""
    if reward_baselines is None:
        raise ValueError("remax needs `reward_baselines` [B] (the greedy rollout's reward)")
    mask = response_mask.float()
    returns = _discounted_returns(token_level_rewards.float(), mask, gamma)
    adv = (returns - reward_baselines.float().unsqueeze(-1)) * mask
    return adv, returns


@ADV_ESTIMATORS.register("opo", group=True)
def opo_advantage(token_level_rewards, response_mask, *, index, **_):
    """OPO: r_i - sum_j(len_j * r_j) / sum_j(len_j) over the group (length-weighted baseline)."""
    mask = response_mask.float()
    scores = _scores(token_level_rewards, mask)
    lengths = mask.sum(-1)
    gid = group_ids(index, len(scores), scores.device)
    zeros = scores.new_zeros(int(gid.max()) + 1)
    weighted = zeros.index_add(0, gid, lengths * scores)
    total_len = zeros.index_add(0, gid, lengths)
    count = zeros.index_add(0, gid, torch.ones_like(scores))[gid]
    baseline = weighted[gid] / total_len[gid].clamp(min=1)
    adv = torch.where(count > 1, scores - baseline, torch.zeros_like(scores)).unsqueeze(-1) * mask
    return adv, adv


@ADV_ESTIMATORS.register("grpo_passk", group=True)
def grpo_passk_advantage(token_level_rewards, response_mask, *, index, norm_adv_by_std=True, epsilon=1e-6, **_):
    """Pass@k GRPO (verl's definition): only the best sample of each group gets credit, r_max - r_second_max
    (divided by group std + eps when ``norm_adv_by_std``); all others get 0. Ties go to the first best sample."""
    mask = response_mask.float()
    scores = _scores(token_level_rewards, mask)
    gid = group_ids(index, len(scores), scores.device)
    _, _, std = _group_stats(scores, gid)
    adv = torch.zeros_like(scores)
    for g in range(int(gid.max()) + 1):
        members = (gid == g).nonzero().squeeze(-1)
        if len(members) < 2:
            continue
        top = torch.topk(scores[members], 2)
        best = members[torch.argmax(scores[members])]
        credit = top.values[0] - top.values[1]
        if norm_adv_by_std:
            credit = credit / (std[best] + epsilon) if std[best] + epsilon > 0 else torch.zeros_like(credit)
        adv[best] = credit
    adv = adv.unsqueeze(-1) * mask
    return adv, adv


@torch.no_grad()
def compute_advantage(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    index: Index | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator ``name`` (see ``ADV_ESTIMATORS``) without autograd; ``whiten`` only applies to gae.
    ``index`` holds one uid per sample (list, array or tensor), needed by the group estimators."""
    fn = ADV_ESTIMATORS[name].fn
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(
            f"compute_advantage({name!r}): token_level_rewards {tuple(token_level_rewards.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must both be [B, T]"
        )
    adv, ret = fn(
        token_level_rewards, response_mask, values=values, index=index, reward_baselines=reward_baselines,
        gamma=gamma, lam=lam, norm_adv_by_std=norm_adv_by_std, epsilon=epsilon, whiten=whiten,
    )
    return adv.to(token_level_rewards.dtype), ret.to(token_level_rewards.dtype)
