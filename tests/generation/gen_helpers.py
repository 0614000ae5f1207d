"""Test helpers: tiny random HF models of every family the engine supports, prompts, a toy tokenizer, a counter
of the host's reads from the device."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from torchrlhf.data.batch import Batch

VOCAB = 96
LENGTHS = [5, 9, 3, 7, 6]


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A 2-layer random model; large init std so greedy outputs are not degenerate."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=500.0)),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=None)),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=32)),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                      dict(head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                           norm_topk_prob=True)),
    }
    config_cls, model_cls, extra = classes[family]
    config = config_cls(**{**common, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if family == "qwen2":  # make the qkv biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def left_padded(lengths: list[int], seed: int = 0, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts (tokens 3..VOCAB-1, so no EOS/pad inside) left-padded to the longest."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[i, width - n :] = 1
    return ids, mask


def hf_greedy(model, batch, new_tokens: int) -> torch.Tensor:
    """transformers' greedy `generate` on ``batch``'s left-padded prompts: the new tokens only, EOS ignored."""
    out = model.generate(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    return out[:, batch["input_ids"].shape[1] :]


class CharTokenizer:
    """Token i decodes to one letter; enough for stop-string tests."""

    eos_token_id = 2
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


def prompt_batch(lengths=LENGTHS, seed=0) -> Batch:
    """Left-padded random prompts with non-tensor columns and meta that engines must carry through."""
    ids, mask = left_padded(lengths, seed)
    n = len(lengths)
    return Batch(
        {"input_ids": ids, "attention_mask": mask},
        {"uid": [f"u{i}" for i in range(n)], "raw_prompt": [f"p{i}" for i in range(n)]},
        {"step": 3},
    )


def forward_logits(model, out: Batch) -> torch.Tensor:
    """Training-style forward on the generated sequences: logits predicting each response token."""
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    return logits[:, out["prompts"].shape[1] - 1 : -1].float()


def save_tokenizer(path) -> None:
    """A character tokenizer over the tiny vocab (ids 0-2 are pad/bos/eos): enough for stop strings."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>" if i < 3 else chr(0x3B1 + i): i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<0>", bos_token="<1>", eos_token="<2>")
    tok.save_pretrained(path)


WIDE = dict(hidden_size=128, intermediate_size=192)  # 4 heads of 32: vLLM's CPU attention needs head_dim >= 32


def saved_model_pair(path):
    """(model A saved to ``path`` with a tokenizer, ``path``, model B): same architecture, other weights."""
    model_a = tiny_model("llama", seed=0, **WIDE)
    model_a.save_pretrained(path)
    save_tokenizer(path)
    return model_a, path, tiny_model("llama", seed=1, **WIDE)


class HostReads(TorchFunctionMode):
    """Counts the calls that make the host wait for a tensor's values (a device synchronisation on a GPU)."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))
