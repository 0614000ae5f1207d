"""Run by test_parallelize.py under torchrun (gloo, CPU): sharded models against single-process references.

    torchrun --standalone --nproc_per_node=N _dist_parallel.py TP WORKDIR

WORKDIR holds `tied/` and `untied/` tiny HF dirs written by the test. Every check
raises on mismatch; the script prints "OK <rank>" when all passed.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchrlhf.models import (
    build_meta_value_model,
    build_tiny_causal_lm,
    load_causal_lm,
    load_causal_lm_sharded,
    load_value_model,
    load_value_weights,
    parallelize,
)
from torchrlhf.runtime import ParallelDims
from torchrlhf.utils.checkpoint import save_checkpoint

ATOL, RTOL = 2e-5, 1e-4


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def batch(vocab):
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on two rows
    mask[2, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def lm_loss(logits, ids):
    # mean next-token CE over all positions: equal token counts per DP shard, so the DP mean is the global mean
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def check_causal_lm(path, dp_mesh, tp_mesh, dp_rank, dp_size, **kw):
    ref = load_causal_lm(path)
    model = load_causal_lm_sharded(path, dp_mesh=dp_mesh, tp_mesh=tp_mesh, **kw)
    tied = ref.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied, "tying changed by sharded load"
    for (n, p), (n_ref, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        assert n == n_ref, (n, n_ref)
        torch.testing.assert_close(full(p.detach()), p_ref.detach(), rtol=0, atol=0, msg=f"loaded {n}")

    ids, mask, pos = batch(ref.config.vocab_size)
    per = ids.shape[0] // dp_size
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)

    logits = model(input_ids=ids[mine], attention_mask=mask[mine], position_ids=pos[mine]).logits
    logits_ref = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(logits, logits_ref[mine], rtol=RTOL, atol=ATOL, msg="logits")
    lm_loss(logits, ids[mine]).backward()
    lm_loss(logits_ref, ids).backward()
    for (n, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.grad), p_ref.grad, rtol=RTOL, atol=1e-6, msg=f"grad {n}")
    opt.step()
    opt_ref.step()
    for (n, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.detach()), p_ref.detach(), rtol=RTOL, atol=1e-6, msg=f"after step {n}")
    return model


def check_value_model(path, dp_mesh, tp_mesh, dp_rank, dp_size):
    ref = load_value_model(path, init_head_std=0.3, seed=7)
    model = build_meta_value_model(path)
    parallelize(model, dp_mesh=dp_mesh, tp_mesh=tp_mesh)
    load_value_weights(model, path, init_head_std=0.3, seed=7)
    ids, mask, pos = batch(ref.config.vocab_size)
    per = ids.shape[0] // dp_size
    mine = slice(dp_rank * per, (dp_rank + 1) * per)
    torch.testing.assert_close(model(ids[mine], mask[mine], pos[mine]), ref(ids, mask, pos)[mine], rtol=RTOL, atol=ATOL)


def check_errors(dp_mesh, tp_mesh):
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    try:
        parallelize(gpt2, dp_mesh=dp_mesh, tp_mesh=tp_mesh)
    except ValueError as e:
        assert "'gpt2'" in str(e) and "llama" in str(e) and "qwen3" in str(e), e
    else:
        raise AssertionError("TP on GPT-2 did not raise")
    with torch.device("meta"):
        odd = build_tiny_causal_lm(vocab_size=64, hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    try:
        parallelize(odd, dp_mesh=dp_mesh, tp_mesh=tp_mesh)
    except ValueError as e:
        assert "num_attention_heads=3" in str(e) and "num_key_value_heads=1" in str(e), e
    else:
        raise AssertionError("indivisible heads did not raise")


def main():
    tp, workdir = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_mesh, tp_mesh = ParallelDims(world, tp).build_meshes(range(world), "cpu", dist.group.WORLD)
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()

    tied = check_causal_lm(f"{workdir}/tied", dp_mesh, tp_mesh, dp_rank, dp_size)
    # The trained (one step) sharded model, as a DCP checkpoint: test_parallelize merges it to HF.
    save_checkpoint(f"{workdir}/ckpt", model=tied, process_group=dist.group.WORLD)
    check_causal_lm(f"{workdir}/untied", dp_mesh, tp_mesh, dp_rank, dp_size, activation_checkpointing=True,
                    cpu_offload=tp == 1, reshard_after_forward=tp > 1)
    check_value_model(f"{workdir}/tied", dp_mesh, tp_mesh, dp_rank, dp_size)
    if tp > 1:
        for family in ("qwen2", "qwen3"):
            check_causal_lm(f"{workdir}/{family}", dp_mesh, tp_mesh, dp_rank, dp_size)
        check_errors(dp_mesh, tp_mesh)
    dist.barrier()
    print(f"OK {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
