"""Value, reward and cost models: a causal LM backbone with a one-output linear head.

Parameter names follow HF's `*ForSequenceClassification`/`*ForTokenClassification`
(`model.*` backbone, `score.weight`), so a HF reward-model checkpoint loads
as is, and a plain causal-LM checkpoint supplies the backbone (its `lm_head`
is ignored) while the head is initialised fresh.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig

from torchrlhf.models.loading import _existing, _is_gguf, load_causal_lm, quiet_weight_loading
from torchrlhf.models.packed_attention import ATTN_IMPLEMENTATION, PackedAttention
from torchrlhf.models.sharded import SafetensorsReader, load_weights
from torchrlhf.models.moe import install_routers

HEAD_KEYS = ("score.weight", "score.bias")


class ValueModel(nn.Module):
    """Backbone + `score` Linear(hidden, 1): a scalar per token (critic values, reward/cost scores)."""

    def __init__(self, config: PretrainedConfig, backbone: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.model = backbone if backbone is not None else AutoModel.from_config(config)
        install_routers(self.model)
        self.score = nn.Linear(config.hidden_size, 1, bias=True)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> None:
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: torch.Tensor | None = None,
        attention_plan: PackedAttention | None = None,
    ) -> torch.Tensor:
        """Per-token scalars [B, T] (the head's dtype), or [B, N] at positions ``logits_to_keep`` [N].

        ``attention_plan`` is the shared-prefix attention plan (`models.packed_attention`), as for the causal LM.
        """
        kwargs = {} if attention_plan is None else {"attention_plan": attention_plan}
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        ).last_hidden_state
        if logits_to_keep is not None:
            hidden = hidden[:, logits_to_keep]
        # A new tensor, not a view: FSDP2 hooks its backward on the root module's output and warns on views
        # (an in-place op on a view would lose the hook); the copy is [B, T] scalars.
        return self.score(hidden).squeeze(-1).clone()


def score_at_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """values[b, t_last(b)] where t_last is the last position with attention_mask == 1 (left or right padding).

    Rows with no valid token raise: a reward for an empty sequence is a bug upstream.
    """
    if values.shape != attention_mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    mask = attention_mask.bool()
    if not mask.any(dim=-1).all():
        raise ValueError("score_at_last_token: a row of attention_mask has no valid token")
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=-1)
    return values.gather(-1, last.unsqueeze(-1)).squeeze(-1)


def init_value_head(shape: tuple[int, int], std: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fresh head, N(0, std) weight and zero bias, identical on every rank for a given seed."""
    g = torch.Generator().manual_seed(seed)
    return {"score.weight": torch.randn(shape, generator=g) * std, "score.bias": torch.zeros(shape[0])}


def _head_from_checkpoint(path, hidden_size: int) -> dict[str, torch.Tensor]:
    reader = SafetensorsReader(path)
    try:
        found = {k: reader.get(k) for k in HEAD_KEYS if k in reader}
    finally:
        reader.close()
    if "score.weight" in found and tuple(found["score.weight"].shape) != (1, hidden_size):
        raise ValueError(
            f"{path}: score.weight has shape {tuple(found['score.weight'].shape)}; a value/reward head needs "
            f"(1, {hidden_size}) (num_labels=1)"
        )
    if "score.weight" in found:
        found.setdefault("score.bias", torch.zeros(1))
    return found


def load_value_model(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    init_head_std: float | None = None,
    seed: int = 0,
) -> ValueModel:
    """A `ValueModel` from a HF dir (causal LM or sequence/token-classification checkpoint) or a .gguf.

    The head comes from the checkpoint's `score.weight` (+ `score.bias` if any) when present,
    else N(0, init_head_std) with zero bias; `init_head_std` defaults to the config's initializer_range.
    """
    p = _existing(path)
    if _is_gguf(p):
        lm = load_causal_lm(p, dtype=torch.float32)
        config, backbone, head = lm.config, lm.model, {}
    else:
        config = AutoConfig.from_pretrained(str(p))
        with quiet_weight_loading():
            backbone = AutoModel.from_pretrained(str(p), dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION)
        head = _head_from_checkpoint(p, config.hidden_size)
    model = ValueModel(config, backbone=backbone)
    if not head:
        std = init_head_std if init_head_std is not None else getattr(config, "initializer_range", 0.02)
        head = init_value_head((1, config.hidden_size), std, seed)
    with torch.no_grad():
        model.score.weight.copy_(head["score.weight"])
        model.score.bias.copy_(head["score.bias"])
    return model.to(device=device, dtype=dtype)


def build_meta_value_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> ValueModel:
    """The `ValueModel` for the HF dir at `path` with every tensor on meta (for `parallelize` + `load_value_weights`)."""
    config = AutoConfig.from_pretrained(str(_existing(path)))
    config._attn_implementation = ATTN_IMPLEMENTATION
    with torch.device("meta"):
        model = ValueModel(config, backbone=AutoModel.from_config(config, dtype=dtype))
        model.score.to(dtype)
    return model


def load_value_weights(
    model: ValueModel,
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    init_head_std: float | None = None,
    seed: int = 0,
    cpu_offload: bool = False,
) -> None:
    """Sharded counterpart of `load_value_model`: fill a meta-built, parallelized `ValueModel` shard by shard."""
    head = _head_from_checkpoint(path, model.config.hidden_size)
    if not head:
        std = init_head_std if init_head_std is not None else getattr(model.config, "initializer_range", 0.02)
        head = init_value_head((1, model.config.hidden_size), std, seed)
    load_weights(model, path, device=device, extra=head, cpu_offload=cpu_offload)
