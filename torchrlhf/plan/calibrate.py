"""Measure a hardware profile on this machine: short probes of every rate the simulator uses.

    python recipes/ppo.py --calibrate [--hardware-out FILE] [--threads N] [--device cuda]

- **matmul peak** per dtype (`torchrlhf.utils.flops.matmul_peak`, kept in the calibration file);
- **training and forward passes** of the run's architecture (SmolLM2's by default; random weights) at two
  micro-batch sizes: the time model
  ``call_s + FLOPs / (peak · efficiency)`` through both points gives the efficiency and the cost per call;
- **sampling**: the engine's sampler over 32 rows of the vocabulary, in ns per logit;
- **decode**: the native engine at two batch sizes (EOS ignored), less its sampling, fitted as ``step_s + bound /
  efficiency``, once with weights of its own (a rollout apart) and once on the training model's (colocated);
- **memory bandwidth**: a large copy;
- **a colocated engine's resume**: its weights and KV cache taken back after training, as at each rollout;
- **concurrency** (CPU): a GEMM loop in every compute unit at once against one alone (SMT siblings and a shared
  memory bus slow each rank down when all compute);
- **collectives**: two processes on this node, all-reduce of 4 KiB and 32 MiB (gloo on CPU, NCCL on GPU): latency
  and bandwidth. Across nodes is not probed: the profile copies the node's link, and says so in ``source``;
- **FSDP2 in a step**: the same passes sharded over two processes against one: the latency and bandwidth of FSDP2's
  traffic as a training step sees it, and how much slower the passes compute beside it (`probe_fsdp`);
- **TP in a step**: the same passes split by tensor parallelism over two processes against half of them in one: the
  latency and bandwidth of TP's all-reduces as a step sees them (`probe_tp`).

On a CPU each rank is ``--threads`` threads (torchrun's ranks run 1), and the probes run at that many.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchrlhf.plan.hardware import (GIB, DecodeCost, HardwareProfile, Link, PassCost, decode_bound_s, sampling_s,
                                     share)
from torchrlhf.utils import calibration
from torchrlhf.utils.flops import TransformerFlops, causal_keys, peak_flops

# SmolLM2-135M's architecture (random weights): the default probe model
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, num_hidden_layers=30, vocab_size=49152, max_position_embeddings=2048)
SEQ = 64  # prompt 32 + response 32
# the two micro-batch sizes the passes are timed at: 64 and 1 024 tokens, the range of a CPU run's micro-batches (the
# line through 1 and 4 rows of SmolLM2's shape missed 16 rows by -14 %, and FSDP2's extra time, which grows with
# the rows, could not be told from noise over so short a span)
ROWS = (1, 16)


def _best(fn: Callable[[], None], repeats: int = 3, min_seconds: float = 0.5) -> float:
    """The fastest of at least ``repeats`` runs after a warm-up, repeated until ``min_seconds`` have been spent: a
    pass of a small model takes milliseconds, and the best of 3 of those moved a fitted ``call_s`` 2x between two
    calibrations of one 2-core host, where the best of half a second's runs holds."""
    fn()  # warm-up
    best, spent, runs = float("inf"), 0.0, 0
    while runs < repeats or spent < min_seconds:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return best


def _fit(x1: float, t1: float, x2: float, t2: float) -> tuple[float, float]:
    """(intercept, slope) of the line through (x1, t1) and (x2, t2); where that line's intercept or slope is
    negative, the line through the origin whose errors at the two points cancel (not one through the larger point,
    which missed the smaller by a factor of two or more in the decode fit of a tiny model)."""
    slope = (t2 - t1) / (x2 - x1)
    if slope > 0 and t1 - slope * x1 >= 0:
        return t1 - slope * x1, slope
    return 0.0, max((t1 + t2) / (x1 + x2), 1e-18)


def probe_model(config_dir: str | None, dtype: torch.dtype, device: torch.device, tp: int = 1) -> torch.nn.Module:
    """The architecture of ``config_dir``'s config.json (no weights read), else SmolLM2's, with random weights;
    ``tp``: with attention and KV heads rounded down to multiples of ``tp`` where they are not (SmolLM2's 9 and 3
    become 8 and 2 at TP 2), head size unchanged, so that the TP probe can split them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchrlhf.models.loading import build_tiny_causal_lm

    if config_dir is None:
        return build_tiny_causal_lm({**SMOLLM2_SHAPE, **_heads_for_tp(SMOLLM2_SHAPE, tp)}, dtype=dtype).to(device)
    config = AutoConfig.from_pretrained(config_dir)
    for key, value in _heads_for_tp(config.to_dict(), tp).items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)


def _heads_for_tp(config: dict, tp: int) -> dict:
    """Config changes that make ``tp`` divide the attention and KV heads (none where it does)."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    if heads % tp == 0 and kv % tp == 0:
        return {}
    kv = max(tp, kv - kv % tp)
    return {"num_attention_heads": max(kv, heads - heads % kv), "num_key_value_heads": kv,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads}


def time_passes(model: torch.nn.Module, device: torch.device, min_seconds: float = 0.5
                ) -> dict[tuple[bool, int], float]:
    """Seconds of a training (forward + loss + backward) and a forward pass of ``model`` at `ROWS` rows of `SEQ`
    tokens (`_best`): ``{(train, rows): seconds}``. Ranks of one process group pass ``min_seconds=0``: each must
    run as many passes as the others, or their collectives pair up wrongly and hang."""
    from torchrlhf.trainer.memory import actor_loss

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for train in (True, False):
        for rows in ROWS:
            ids = torch.randint(3, 1000, (rows, SEQ), generator=torch.Generator().manual_seed(rows)).to(device)
            mask, pos = torch.ones_like(ids), torch.arange(SEQ, device=device).expand(rows, SEQ)

            def step() -> None:
                with torch.set_grad_enabled(train):
                    loss = actor_loss(model, ids, mask, pos, SEQ // 2, False)
                if train:
                    loss.backward()
                    model.zero_grad(set_to_none=True)
                sync()

            out[train, rows] = _best(step, repeats=3, min_seconds=min_seconds)
    return out


def probe_passes(model: torch.nn.Module, device: torch.device, dtype: torch.dtype
                 ) -> tuple[PassCost, PassCost, dict[tuple[bool, int], float]]:
    """Training (forward + loss + backward; the optimizer step is timed by the bandwidth) and forward passes at
    `ROWS` rows of `SEQ` tokens, and the times they were fitted through."""
    from torchrlhf.models.lm_head import LogProbHead

    LogProbHead.install(model)
    counts = TransformerFlops.from_model(model)
    peak = peak_flops(dtype, device)
    times = time_passes(model, device)
    costs = []
    for train in (True, False):
        count = counts.train if train else counts.forward
        points = [(count(rows * SEQ, rows * causal_keys(SEQ), rows * SEQ // 2), times[train, rows]) for rows in ROWS]
        call_s, per_flop = _fit(*points[0], *points[1])
        costs.append(PassCost(efficiency=min(1.0, 1 / (per_flop * peak)), call_s=call_s))
    return costs[0], costs[1], times


def probe_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 256 MiB copy (read + write)."""
    src = torch.empty(64 << 20, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = _best(lambda: (dst.copy_(src), sync()), repeats=5)
    return 2 * src.numel() * 4 / seconds


def probe_sampling(device: torch.device, vocab: int) -> float:
    """Nanoseconds per vocabulary logit of the engine's sampler (`generation.sampling.sample_tokens`, temperature 1)
    drawing a token for each of 32 rows: per-slot work of a decode step that its roofline bound does not count."""
    from torchrlhf.generation.sampling import SamplingParams, sample_tokens

    logits = torch.randn(32, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    uniforms = torch.rand(32, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    seconds = _best(lambda: (sample_tokens(logits, uniforms, params, check_finite=False), sync()), repeats=5,
                    min_seconds=0.2)
    return seconds / logits.numel() * 1e9


def probe_decode(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, bandwidth: float,
                 sample_ns: float = 0.0) -> tuple[DecodeCost, DecodeCost]:
    """The native engine's decode at batch 4 and 32 (32 sampled tokens, EOS ignored), less its sampling
    (``sample_ns`` per logit, `probe_sampling`), against its roofline bound, fitted as ``step_s + bound /
    efficiency``: an engine that owns its weights (a rollout on ranks of its own; on a CPU its projections
    prepacked), and one decoding ``model``'s own (a colocated rollout)."""
    from torchrlhf.generation import NativeEngine

    def fit(engine: NativeEngine) -> DecodeCost:
        points = []
        for batch in (4, 32):
            prompts, sampling = _decode_batch(batch, device)
            seconds = _best(lambda: engine.generate(prompts, sampling), repeats=1)
            sampled = sampling_s(batch, model.config.vocab_size, sample_ns)
            points.append((_decode_bound(model, batch, dtype, device, bandwidth), seconds / 32 - sampled))
        step_s, per_bound = _fit(*points[0], *points[1])
        return DecodeCost(efficiency=min(1.0, 1 / per_bound), step_s=step_s)

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        owned = fit(NativeEngine(d, max_batch_size=32, max_seq_len=SEQ + 32, device=device, dtype=dtype))
    shared = fit(NativeEngine(model, max_batch_size=32, max_seq_len=SEQ + 32, device=device, dtype=dtype))
    return owned, shared


def _collective_worker(rank: int, init: str, backend: str, threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
    result = []
    for nbytes in (4 << 10, 32 << 20):
        t = torch.ones(nbytes // 4, device=device)
        seconds = _best(lambda: (dist.all_reduce(t), sync()), repeats=20, min_seconds=0.0)  # as many on each rank
        result.append((2 * nbytes / 2, seconds))  # a ring all-reduce moves 2 (n-1)/n of the bytes per rank
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _gemm_worker(rank: int, threads: int, start_file: str, out: str) -> None:
    torch.set_num_threads(threads)
    a = torch.randn(512, 512)
    while not os.path.exists(start_file):  # every process starts timing together
        time.sleep(0.001)
    # as many runs in every process, so that they overlap to the end: with runs for half a second each, a process
    # whose others had stopped would time uncontended runs. Runs of 20 products (a few ms) read 1.0 and 1.43 in two
    # calibrations of one host; of 200, long enough that a scheduling hiccup does not decide the figure
    rate = 2 * 512**3 / _best(lambda: [a @ a for _ in range(200)], repeats=5, min_seconds=0.0) * 200
    Path(f"{out}.{rank}").write_text(json.dumps(rate))


def probe_concurrency(units: int, threads: int) -> float:
    """How much slower a rank computes when every compute unit of the node computes at once (SMT siblings, a shared
    memory bus): a GEMM loop in ``units`` processes together against the same loop alone (CPU only)."""
    if units < 2:
        return 1.0
    rates = []
    for procs in (1, units):
        with tempfile.TemporaryDirectory() as d:
            start, out = os.path.join(d, "go"), os.path.join(d, "rate")
            ctx = mp.get_context("spawn")
            workers = [ctx.Process(target=_gemm_worker, args=(r, threads, start, out)) for r in range(procs)]
            for w in workers:
                w.start()
            time.sleep(2.0)  # let them import
            Path(start).touch()
            for w in workers:
                w.join()
            rates.append(sum(json.loads(Path(f"{out}.{r}").read_text()) for r in range(procs)) / procs)
    return max(1.0, rates[0] / rates[1])


def _decode_batch(batch: int, device: torch.device):
    """``batch`` prompts of 32 random tokens, and sampling of 32 tokens ignoring EOS: what the decode probes run."""
    from torchrlhf.data.batch import Batch
    from torchrlhf.generation import SamplingParams

    ids = torch.randint(3, 1000, (batch, 32), generator=torch.Generator().manual_seed(0)).to(device)
    prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return prompts, SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, seed=0)


def _kv_bytes_per_token(config, width: int) -> int:
    """Keys and values of one token over all layers of a HF ``config``, at ``width`` bytes per element."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * width


def probe_engine_resume(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> float:
    """GB/s at which a colocated engine takes back its weights and KV cache at each rollout: a `NativeEngine`
    released as at the end of one, then `hybrid.generation_mode` handing it ``model``'s weights (the engine's weight
    storage and KV cache allocated again and filled) and releasing them as the rollout's end does. On a CPU the
    fresh pages fault in: SmolLM2's 0.54 GB of weights took 0.5 s where the copy probe moves 12 GB/s."""
    from torchrlhf.generation import NativeEngine
    from torchrlhf.hybrid import generation_mode

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    slots, seq = 32, SEQ + 32

    def resume() -> None:
        with generation_mode(model, engine):
            sync()
        sync()

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        engine = NativeEngine(d, max_batch_size=slots, max_seq_len=seq, device=device, dtype=dtype)
        engine.release()
        seconds = _best(resume, repeats=3)
    width = torch.empty((), dtype=dtype).element_size()
    nbytes = sum(p.numel() for p in model.parameters()) * width + slots * seq * _kv_bytes_per_token(model.config, width)
    return nbytes / seconds / 1e9


def _decode_bound(model: torch.nn.Module, batch: int, dtype: torch.dtype, device: torch.device, bandwidth: float,
                  tp: int = 1) -> float:
    """The roofline bound of a decode step of `_decode_batch(batch)` (its mean context, 32 + 16 keys) on one rank
    of a ``tp``-way engine, as `plan.simulate.generate_s` counts it: the blocks' weights, KV and FLOPs split over
    ``tp``, the LM head whole."""
    config = model.config
    width = torch.empty((), dtype=dtype).element_size()
    head = config.hidden_size * config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    context = 32 + 16
    kv = batch * context * _kv_bytes_per_token(config, width)
    read = ((params - head) * width + kv) / tp + head * width
    counts = TransformerFlops.from_model(model)
    flops = counts.forward(batch, batch * context, 0) / tp + counts.forward(0, 0, batch)
    return decode_bound_s(read, flops, bandwidth, peak_flops(dtype, device), device.type)


def _two_rank_passes_worker(rank: int, init: str, backend: str, threads: int, model_dir: str | None, dtype: str,
                            layout: str, out: str) -> None:
    """On one of two ranks: `time_passes`, the model sharded by FSDP2 (``layout`` "fsdp") or split by TP ("tp"); or
    ("engine") the seconds of one `generate` of `_decode_batch(4)` by a native engine split by TP."""
    from torchrlhf.generation import NativeEngine
    from torchrlhf.models.lm_head import LogProbHead
    from torchrlhf.models.parallelize import apply_tp, parallelize
    from torchrlhf.runtime.mesh import build_mesh

    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        if layout == "engine":  # saved before the process group starts: transformers saves on its rank 0 only
            probe_model(model_dir, getattr(torch, dtype), device, tp=2).save_pretrained(d, safe_serialization=True)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=300))
        mesh = build_mesh(torch.tensor([0, 1]), ("dp" if layout == "fsdp" else "tp",), device.type)
        if layout == "engine":
            engine = NativeEngine(d, max_batch_size=4, max_seq_len=SEQ + 32, device=device, dtype=getattr(torch, dtype),
                                  tp_mesh=mesh)
            prompts, sampling = _decode_batch(4, device)
            result = _best(lambda: engine.generate(prompts, sampling), repeats=3, min_seconds=0.0)  # as many per rank
        else:
            if layout == "tp":
                model = probe_model(model_dir, getattr(torch, dtype), device, tp=2)
                apply_tp(model, mesh)
            else:
                model = probe_model(model_dir, getattr(torch, dtype), device)
                LogProbHead.install(model)
                parallelize(model, dp_mesh=mesh)
            times = time_passes(model, device, min_seconds=0.0)
            result = [[train, rows, t] for (train, rows), t in times.items()]
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _two_rank_run(layout: str, device: torch.device, threads: int, model_dir: str | None, dtype: torch.dtype):
    backend = "nccl" if device.type == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, layout)
        mp.spawn(_two_rank_passes_worker, args=(f"file://{d}/store", backend, threads, model_dir,
                                                str(dtype).split(".")[-1], layout, out), nprocs=2, join=True)
        return json.loads(Path(out).read_text())


def _two_rank_passes(layout: str, device: torch.device, threads: int, model_dir: str | None, dtype: torch.dtype
                     ) -> dict[tuple[bool, int], float]:
    return {(bool(train), int(rows)): t for train, rows, t in _two_rank_run(layout, device, threads, model_dir, dtype)}


def probe_fsdp(device: torch.device, threads: int, model_dir: str | None, dtype: torch.dtype, params: int,
               layers: int, alone: dict[tuple[bool, int], float], contention: float = 1.0) -> tuple[Link, float]:
    """FSDP2 as a training step runs it: the passes of `time_passes` sharded over 2 processes, against the same rows
    in one process (``alone``); `fit_fsdp` of the two."""
    sharded = _two_rank_passes("fsdp", device, threads, model_dir, dtype)
    return fit_fsdp(alone, sharded, params, layers, torch.empty((), dtype=dtype).element_size(), contention)


def fit_fsdp(alone: dict[tuple[bool, int], float], sharded: dict[tuple[bool, int], float], params: int, layers: int,
             width: int, contention: float = 1.0) -> tuple[Link, float]:
    """FSDP2's traffic as a step sees it (a `Link`) and how much slower the passes compute beside it (the profile's
    ``fsdp_slowdown``), from the seconds of passes at `ROWS` rows ``{(train, rows): s}`` in one process (``alone``)
    and on each of 2 ranks (``sharded``), whose compute alone would be ``contention`` times slower for computing
    together (the simulator's `plan.simulate.share` of 2 ranks; 1 on GPUs). A sharded pass takes ``contention ·
    slowdown · alone + calls · latency + bytes / bandwidth``: its growth with the rows, over both passes, gives the
    slowdown (whatever takes the cores from the compute: on a CPU gloo's threads, while FSDP2 prefetches the next
    block's gather); what is left, the same at both sizes, gives the latency and the bandwidth from the training
    pass (2 gathers of ``width``-byte parameters and a float32 reduce-scatter per layer) and the forward (a gather
    per layer). Where the two are not separable, all of it is bandwidth."""
    small, large = ROWS
    growth = {train: sharded[train, large] - sharded[train, small] for train in (True, False)}
    alone_growth = {train: alone[train, large] - alone[train, small] for train in (True, False)}
    slowdown = max(1.0, sum(growth.values()) / sum(alone_growth.values()) / contention)
    fixed = {train: sum(max(0.0, sharded[train, r] - contention * slowdown * alone[train, r]) for r in ROWS)
             / len(ROWS) for train in (True, False)}
    # per pass, half the parameters cross: train 2 gathers of `width` + a float32 reduce-scatter, forward 1 gather
    nbytes = {True: params / 2 * (2 * width + 4), False: params / 2 * width}
    calls = {True: 3 * layers, False: layers}
    # fixed = calls * latency + nbytes / bandwidth, for both passes
    det = calls[True] * nbytes[False] - calls[False] * nbytes[True]
    per_byte = (calls[True] * fixed[False] - calls[False] * fixed[True]) / det if det else 0.0
    latency = (fixed[True] - nbytes[True] * per_byte) / calls[True] if per_byte > 0 else 0.0
    if per_byte <= 0 or latency < 0:  # not separable: all of it as bandwidth
        per_byte, latency = fixed[True] / nbytes[True], 0.0
    return Link(bandwidth_gbps=1 / max(per_byte, 1e-15) / 1e9, latency_us=latency * 1e6), slowdown


def probe_tp(device: torch.device, threads: int, model_dir: str | None, dtype: torch.dtype, link: Link
             ) -> Link | None:
    """Tensor parallelism's all-reduces as a training step runs them: the passes of `time_passes` split over 2
    processes (`models.parallelize.apply_tp`) against half of the same passes in one. The extra time of a training
    pass (4 all-reduces per layer of the rows' activations), less their bytes at the bare ``link``'s bandwidth, is a
    latency per all-reduce, the mean over `ROWS`: whatever else each one costs, which on a CPU is more than the
    bytes (DTensor's dispatch, the wait for the other rank). One figure from two points: a bandwidth fitted through
    them as well swung from 0.02 GB/s to infinite between two calibrations. None for an architecture without a TP
    plan."""
    from torchrlhf.models.lm_head import LogProbHead
    from torchrlhf.models.parallelize import TP_SUPPORTED_MODEL_TYPES

    model = probe_model(model_dir, dtype, device, tp=2)
    if model.config.model_type not in TP_SUPPORTED_MODEL_TYPES:
        return None
    LogProbHead.install(model)
    alone = time_passes(model, device)
    split = _two_rank_passes("tp", device, threads, model_dir, dtype)
    config = model.config
    width = torch.empty((), dtype=dtype).element_size()
    calls = 4 * config.num_hidden_layers
    latencies = []
    for rows in ROWS:  # per all-reduce: the rows' activations, half of them crossing at TP 2
        nbytes = rows * SEQ * config.hidden_size * width * 2 * (2 - 1) / 2
        extra = split[True, rows] - alone[True, rows] / 2
        latencies.append(max(0.0, extra / calls - nbytes / (link.bandwidth_gbps * 1e9)))
    return Link(bandwidth_gbps=link.bandwidth_gbps, latency_us=sum(latencies) / len(latencies) * 1e6)


def probe_tp_engine(device: torch.device, threads: int, model_dir: str | None, dtype: torch.dtype, link: Link,
                    bandwidth: float, decode: DecodeCost, sample_ns: float = 0.0) -> Link | None:
    """The native engine's TP all-reduces (plain tensors, `models.parallelize.split_blocks_over_tp`) as its decode
    step sees them: a TP-2 engine's `generate` of `_decode_batch(4)` on 2 processes, against what the simulator
    (`plan.simulate.generate_s`) gives that step without its all-reduces, from ``decode`` (the one-rank engine's
    fit and the sampler's ``sample_ns`` per logit): the blocks' reads and FLOPs halved, the LM head whole. The
    rest, less the bytes at the bare ``link``'s bandwidth, is a latency per all-reduce (2 per layer and step). None
    for an architecture without a TP plan."""
    from torchrlhf.models.parallelize import TP_SUPPORTED_MODEL_TYPES

    model = probe_model(model_dir, dtype, device, tp=2)
    config = model.config
    if config.model_type not in TP_SUPPORTED_MODEL_TYPES:
        return None
    seconds = _two_rank_run("engine", device, threads, model_dir, dtype)
    step = (decode.step_s + _decode_bound(model, 4, dtype, device, bandwidth, tp=2) / decode.efficiency
            + sampling_s(4, config.vocab_size, sample_ns))
    width = torch.empty((), dtype=dtype).element_size()
    calls = 2 * config.num_hidden_layers
    nbytes = 4 * config.hidden_size * width * 2 * (2 - 1) / 2
    latency = max(0.0, (seconds / 32 - step) / calls - nbytes / (link.bandwidth_gbps * 1e9))
    return Link(bandwidth_gbps=link.bandwidth_gbps, latency_us=latency * 1e6)


def probe_link(device: torch.device, threads: int) -> Link:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise RuntimeError("the collective probe needs 2 GPUs on this node")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "link")
        mp.spawn(_collective_worker, args=(f"file://{d}/store", backend, threads, out), nprocs=2, join=True)
        (b1, t1), (b2, t2) = json.loads(Path(out).read_text())
    latency, per_byte = _fit(b1, t1, b2, t2)
    return Link(bandwidth_gbps=1 / per_byte / 1e9, latency_us=latency * 1e6)


def calibrate(device: str = "cpu", threads: int = 1, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
              name: str | None = None, model_dir: str | None = None) -> HardwareProfile:
    """Run every probe (6 to 7 minutes on a 2-core CPU) and return the profile (`save_hardware` writes it).
    ``model_dir``: time the passes and decode on that architecture (its config.json; random weights), else
    SmolLM2's."""
    dev = torch.device(device)
    torch.set_num_threads(threads)
    label = calibration.device_name(dev)
    peaks = {d: peak_flops(getattr(torch, d), dev) / 1e12 for d in dtypes}
    compute = dtypes[0]
    model = probe_model(model_dir, getattr(torch, compute), dev)
    bandwidth = probe_bandwidth(dev)
    sample_ns = probe_sampling(dev, model.config.vocab_size)
    decode, decode_shared = probe_decode(model, dev, getattr(torch, compute), bandwidth, sample_ns)
    engine_resume = probe_engine_resume(model, dev, getattr(torch, compute))
    train, forward, alone = probe_passes(model, dev, getattr(torch, compute))
    link = probe_link(dev, threads)
    if dev.type == "cuda":
        memory_gib, units, slowdown = torch.cuda.get_device_properties(dev).total_memory / GIB, None, 1.0
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        units = max(1, (os.cpu_count() or 1) // threads)
        memory_gib = total / GIB / units
        slowdown = probe_concurrency(units, threads)
    fsdp, fsdp_slowdown = probe_fsdp(dev, threads, model_dir, getattr(torch, compute),
                                     sum(p.numel() for p in model.parameters()), model.config.num_hidden_layers, alone,
                                     contention=share(2, units, slowdown))
    two = dev.type == "cpu" or torch.cuda.device_count() > 1
    tp = probe_tp(dev, threads, model_dir, getattr(torch, compute), link) if two else None
    tp_engine = probe_tp_engine(dev, threads, model_dir, getattr(torch, compute), link, bandwidth, decode,
                                sample_ns) if two else None
    stamp = datetime.date.today().isoformat()
    return HardwareProfile(
        name=name or (f"{label} ({threads} thread(s) per rank)" if dev.type == "cpu" else label),
        source=(f"measured by `recipes/ppo.py --calibrate` on {label}, {stamp}, torch {torch.__version__}, "
                f"{threads} thread(s) per rank; pass costs in {compute}; inter_node copies the node's link "
                "(not probed)"),
        memory_gib=round(memory_gib, 2), matmul_tflops=peaks, memory_bandwidth_gbps=bandwidth / 1e9,
        train=train, forward=forward, decode=decode, decode_shared=decode_shared, intra_node=link, inter_node=link,
        fsdp=fsdp, tp=tp, tp_engine=tp_engine, engine_resume_gbps=engine_resume, sample_ns_per_logit=sample_ns,
        compute_units_per_node=units, concurrent_slowdown=round(slowdown, 3), fsdp_slowdown=round(fsdp_slowdown, 3))


__all__ = ["calibrate", "fit_fsdp", "probe_bandwidth", "probe_decode", "probe_engine_resume", "probe_link",
           "probe_passes", "probe_sampling", "probe_tp", "probe_tp_engine"]
