"""Workers build their models on the meta device and each rank reads only its shards from safetensors.

A random 346M-parameter Llama saved in bf16 (as HF checkpoints are; 0.69 GB) loads as an fp32
`ActorWorker` on 4 gloo ranks (FSDP2). Bound on each rank's peak increase of private (anonymous) memory
during construction, derived from the layout: its quarter of the fp32 parameters (FSDP2 shards dim 0,
and the rank reads only those rows), plus the largest single tensor (a full read where a placement is
not a row split), plus 25 % and 150 MB for allocator slack, the process group and transformers' own
buffers. Its resident set may also hold the file rows it read (page cache mapped in). Loading the whole
model first, as workers did before, takes the full fp32 model (1.3 GB) on every rank. The loaded model's
log-probs equal a single-process HF load's.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks, grouped

from torchrlhf.workers import ActorWorker

CONFIG = dict(vocab_size=8192, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
              num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256, tie_word_embeddings=False)
WORLD = 4


def _rss_bytes() -> tuple[int, int]:
    """(resident set size, its anonymous part) of this process: the rest is file pages mapped in, here the
    safetensors rows this rank read (page cache, shared between ranks and reclaimable)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "RssAnon:")):
                key, value, _ = line.split()
                fields[key] = int(value) * 1024
    return fields["VmRSS:"], fields["RssAnon:"]


class PeakRSS:
    """The highest resident set size seen while the block runs, sampled every 2 ms (``ru_maxrss`` would not
    do: a spawned process starts with its parent's high-water mark)."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = _rss_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self.peak = tuple(map(max, self.peak, _rss_bytes()))

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = tuple(map(max, self.peak, _rss_bytes()))


def _ids() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))


def _load_on_ranks(rank: int, world: int, model_dir: str, out: str, whole: bool) -> None:
    torch.set_num_threads(1)
    if whole:  # the old path, for the README figure: every rank reads the whole model, then shards it
        ActorWorker.loads_sharded = lambda *args: False
    with PeakRSS() as rss:
        actor = ActorWorker(model_dir, **grouped(ppo_mini_batch_size=1, rollout_n=1, ppo_micro_batch_size_per_device=1,
                            freeze=True))
    grown = [rss.peak[0] - rss.start[0], rss.peak[1] - rss.start[1]]
    with torch.no_grad():
        logits = actor.model(input_ids=_ids()).logits
    peaks = [None] * world
    dist.all_gather_object(peaks, grown)
    if rank == 0:
        torch.save({"peaks": peaks, "log_probs": torch.log_softmax(logits.float(), -1)}, out)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    from torchrlhf.models import save_tiny_model

    import transformers

    d = tmp_path_factory.mktemp("big_bf16")
    save_tiny_model(d, config_overrides=CONFIG, tokenizer_from=None)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    model.save_pretrained(d, safe_serialization=True)  # bf16 on disk, as HF checkpoints are
    return str(d)


def test_each_rank_reads_only_its_shards(big_model, tmp_path):
    import transformers

    out = tmp_path / "load.pt"
    run_ranks(_load_on_ranks, WORLD, big_model, str(out), False, timeout=600)
    result = torch.load(out, weights_only=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(big_model, dtype=torch.float32)
    params = sum(p.numel() for p in reference.parameters())
    largest = max(p.numel() for p in reference.parameters())
    model_bytes = 4 * params
    bound = 1.25 * (model_bytes / WORLD + 4 * largest) + 150e6  # private memory (fp32 shards)
    total_bound = bound + 2 * params / WORLD  # plus the bf16 file rows it read, mapped in
    print(f"peak RSS increase per rank (total, anonymous) {[[round(x / 2**20) for x in p] for p in result['peaks']]} "
          f"MiB; bounds {total_bound / 2**20:.0f}, {bound / 2**20:.0f} MiB; model {model_bytes / 2**20:.0f} MiB "
          f"({params / 1e6:.0f} M parameters)")
    for total, anon in result["peaks"]:
        assert model_bytes / WORLD / 2 < anon < bound, (result["peaks"], bound)
        assert total < total_bound, (result["peaks"], total_bound)
    with torch.no_grad():
        want = torch.log_softmax(reference(input_ids=_ids()).logits.float(), -1)
    torch.testing.assert_close(result["log_probs"], want, atol=1e-4, rtol=1e-4)
