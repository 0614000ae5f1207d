"""The one engine interface every rollout engine implements, and the output contract they share.

A `RolloutEngine` turns a Batch of left-padded prompts into a Batch of responses. The rollout role
(`torchrlhf.workers.RolloutWorker`) drives any engine the same way, so the native engine and vLLM are
interchangeable behind ``rollout.engine._component_``:

    engine = EngineCls(model_path, tokenizer=tok, device=dev, dtype=dtype, tp_mesh=tp_mesh, **config)
    engine.release()                      # colocated with training: give the memory back until needed
    engine.resume(("weights",))           # weights first (verl's order): room for the incoming tensors
    engine.update_weights(stream)         # (hf_name, tensor) pairs in the layout of `param_shard_dims`
    engine.resume(("kv_cache",))          # then the cache, once the weights have their memory
    out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=64))
    engine.release()

Every engine returns `GENERATION_COLUMNS` built by `assemble_generation` (so the columns, padding and
masks cannot drift apart between engines), plus the non-tensor ``finish_reason`` ("stop" or "length").

What an engine can do beyond single-turn sampling it declares in ``capabilities`` (names of `CAPABILITIES`);
the recipe's config check reads them (`capability_errors`), so a run that needs one fails before it starts.
Adding a capability is one entry in `CAPABILITIES` (its `generate` argument and the config key that asks for
it), plus the engine that implements it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from torchrlhf.data.batch import Batch
from torchrlhf.generation.sampling import SamplingParams, prompt_seed_for, sample_seed
from torchrlhf.generation.session import Session, SessionTrajectory, Turn, run_rounds

GENERATION_COLUMNS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
)
RESUME_TAGS = ("weights", "kv_cache")  # in the order `resume` must restore them


@dataclass(frozen=True)
class Capability:
    """An optional feature of `RolloutEngine.generate`: the keyword argument it adds and the recipe key that
    asks for it (a run with that key set needs an engine that declares the capability)."""

    argument: str
    config_key: str
    what: str  # for the config error: "<config_key> needs a rollout engine that can <what>"


CAPABILITIES: dict[str, Capability] = {
    "partial_rollout": Capability(
        "between_steps", "async_training.partial_rollout",
        "load newer weights between two decode steps (between_steps) and record each token's weight version "
        "(token_weight_versions)"),
    "agent_sessions": Capability(
        "sessions", "rollout.agent",
        "run multi-turn agent sessions (sessions=): natively, or in rounds of single-turn calls with "
        "torchrlhf.generation.base.generate_in_rounds"),
    "repack": Capability(
        "release_below", "async_training.repack.enable",
        "hand back its unfinished samples when its active slots fall below a fraction of them (release_below) "
        "and continue carried samples (the CARRIED_COLUMNS of a prompt batch)"),
}

# A prompt batch whose rows continue samples another call carried out (`release_below`, Laminar's repack): the
# tokens, log-probs and weight versions sampled so far [B, max_tokens], how many [B], and which sample of its
# prompt each row is (its sampling uniforms are that sample's, from where it stopped).
CARRIED_COLUMNS = ("carried_tokens", "carried_log_probs", "carried_versions", "carried_lengths", "sample_index")
CARRIED = "carried"  # the finish_reason of a sample handed back unfinished


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout role needs from an engine (see the module docstring for the call order).

    ``tp_size``/``tp_mesh``: the engine's tensor-parallel group (1 / None without TP). Every rank of a TP
    group calls `generate` with the same prompts and gets the same answer. ``max_seq_len``: the longest
    prompt + response it holds (agents' trajectories and a judge's prompts are capped by it). ``capabilities``:
    the names of the `CAPABILITIES` its `generate` implements (none when an engine does not say).
    """

    tp_size: int
    tp_mesh: object | None
    max_seq_len: int
    capabilities: ClassVar[frozenset[str]]

    def generate(self, prompts: Batch, sampling: SamplingParams | None = None, *,
                 between_steps: Callable[[], int] | None = None, sessions: Sequence[Session] | None = None) -> Batch:
        """``sampling.n`` responses per prompt, samples of one prompt adjacent (see `assemble_generation`).

        A prompt's ``seed`` and ``max_tokens`` columns, when present, replace its seed and cap its response
        (`prompt_seeds`, `prompt_max_tokens`). ``between_steps`` (capability ``partial_rollout``) and
        ``sessions`` (``agent_sessions``): see `CAPABILITIES`; an engine without one leaves its argument out.
        """

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(hf_name, tensor)`` pairs, copying each before taking the next (the producer may free it)."""

    def param_shard_dims(self) -> dict[str, int | None]:
        """HF name -> the dim this rank's TP shard splits (None: the full tensor is expected)."""

    def release(self) -> None:
        """Free the KV cache and, where the engine can, its weights (no-op where the device cannot)."""

    def resume(self, tags: Sequence[str] = RESUME_TAGS) -> None:
        """Re-allocate what `release` freed: ``"weights"`` (then refilled by `update_weights`), ``"kv_cache"``."""

    def load_groups(self) -> list[set[str]]:
        """HF names `update_weights` must receive in one call (fused modules, as vLLM's q/k/v); [] when each
        tensor loads on its own."""

    def shutdown(self) -> None:
        """Stop what the engine runs beside this process's tensors (vLLM's engine core) when its role closes."""


ENGINE_METHODS = tuple(name for name, value in vars(RolloutEngine).items()
                       if inspect.isfunction(value) and not name.startswith("_"))


def engine_capabilities(engine: Any) -> frozenset[str]:
    """The capabilities an engine (class or instance) declares; ValueError on a name `CAPABILITIES` lacks."""
    declared = frozenset(getattr(engine, "capabilities", ()))
    unknown = sorted(declared - CAPABILITIES.keys())
    if unknown:
        raise ValueError(f"{_name(engine)}.capabilities: unknown {unknown}; valid: {sorted(CAPABILITIES)}")
    return declared


def engine_problem(cls: Any) -> str | None:
    """Why ``cls`` is not a `RolloutEngine` class (a missing method, a declared capability whose argument its
    `generate` does not take), or None."""
    missing = [m for m in ENGINE_METHODS if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        return f"is not a rollout engine class (missing {missing}; see torchrlhf.generation.RolloutEngine)"
    try:
        declared = engine_capabilities(cls)
    except ValueError as e:
        return str(e)
    params = inspect.signature(cls.generate).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    lacking = [name for name in sorted(declared) if CAPABILITIES[name].argument not in params and not takes_any]
    if lacking:
        return (f"declares {lacking} but its generate takes no {[CAPABILITIES[n].argument for n in lacking]} "
                "argument (a subclass that overrides generate must pass them on)")
    return None


def capability_errors(engine_cls: Any, asked: Callable[[str], Any]) -> list[str]:
    """One message per capability the config asks for (``asked(config_key)`` is set) that the engine lacks."""
    have = engine_capabilities(engine_cls)
    return [f"{cap.config_key} needs a rollout engine that can {cap.what}; {_name(engine_cls)} does not declare "
            f"{name!r} in its capabilities (the native engine does)"
            for name, cap in CAPABILITIES.items() if asked(cap.config_key) and name not in have]


def _name(engine: Any) -> str:
    return engine.__name__ if isinstance(engine, type) else type(engine).__name__


PROMPT_COLUMNS = ("prompts", "input_ids", "attention_mask", "position_ids")  # left-padded prompt width


def _prompt_width(batch: Batch) -> int:
    """Left-padded prompt width: the "prompts" column of a generation, or "input_ids" of a prompt batch."""
    return batch["prompts" if "prompts" in batch else "input_ids"].shape[1]


def _widened_copy(gen: Batch, part: str, have: int, width: int) -> Batch:
    """A shallow copy of ``gen`` whose tensor dict may take padded columns; ``part`` is only for the error."""
    if width < have:
        raise ValueError(f"cannot pad {part} of width {have} to {width}")
    out = gen.copy()
    out.tensors = dict(gen.tensors)
    return out


def left_pad_prompts(gen: Batch, width: int, pad_id: int) -> Batch:
    """``gen`` (a generation or a prompt batch) with its prompt part left-padded to ``width`` tokens, so
    batches of other widths concatenate."""
    extra = width - _prompt_width(gen)
    if extra == 0:
        return gen
    out = _widened_copy(gen, "prompts", _prompt_width(gen), width)
    for key in PROMPT_COLUMNS:
        if key in gen:
            t = gen[key]
            fill = pad_id if key in ("prompts", "input_ids") else 0
            out.tensors[key] = torch.cat([t.new_full((len(t), extra), fill), t], dim=1)
    return out


SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "position_ids")  # [B, P + R]


def right_pad_responses(gen: Batch, width: int, pad_id: int) -> Batch:
    """A generation with its response part right-padded to ``width`` tokens (agent trajectories of one call
    are as wide as its longest), so generations of other calls concatenate: every per-response-token column
    (``responses``, ``response_mask``, ``rollout_log_probs``, ``token_level_scores``, ...: width R) and the
    response end of the ``[B, P + R]`` columns."""
    r = gen["responses"].shape[1]
    extra = width - r
    if extra == 0:
        return gen
    out = _widened_copy(gen, "responses", r, width)
    for key, t in gen.tensors.items():
        if key in SEQUENCE_COLUMNS or (key != "prompts" and t.dim() >= 2 and t.shape[1] == r):
            fill = pad_id if key in ("responses", "input_ids") else 0
            out.tensors[key] = torch.cat([t, t.new_full((len(t), extra, *t.shape[2:]), fill)], dim=1)
    return out


def concat_generations(parts: list[Batch], pad_id: int = 0) -> Batch:
    """Generations (or prompt batches) of different prompt (and response) widths as one Batch.

    The padding is masked everywhere it matters (``attention_mask``, ``response_mask``), so ``pad_id`` only
    decides which token id fills it: the collect of a data-parallel generate, which has no tokenizer at
    hand, uses the default."""
    width = max(_prompt_width(p) for p in parts)
    parts = [left_pad_prompts(p, width, pad_id) for p in parts]
    if all("responses" in p for p in parts):
        response_width = max(p["responses"].shape[1] for p in parts)
        parts = [right_pad_responses(p, response_width, pad_id) for p in parts]
    return Batch.concat(parts)



def check_resume_tags(tags: Sequence[str]) -> tuple[str, ...]:
    tags = (tags,) if isinstance(tags, str) else tuple(tags)
    bad = [t for t in tags if t not in RESUME_TAGS]
    if bad:
        raise ValueError(f"resume: unknown tags {bad}; valid: {list(RESUME_TAGS)}")
    return tags


def validate_prompts(prompts: Batch, params: SamplingParams, max_seq_len: int) -> list[int]:
    """Prompt lengths; ValueError naming the prompt when one is empty or leaves no room for its ``max_tokens``
    (`prompt_max_tokens`)."""
    input_ids, mask = prompts["input_ids"], prompts["attention_mask"]
    if input_ids.dim() != 2 or input_ids.shape != mask.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [B, P]; got {tuple(input_ids.shape)} and {tuple(mask.shape)}"
        )
    lengths = mask.sum(-1).tolist()
    for i, (length, max_tokens) in enumerate(zip(lengths, prompt_max_tokens(prompts, params))):
        if length == 0:
            raise ValueError(f"prompt {i} is empty (attention_mask has no 1s)")
        if length > max_seq_len - max_tokens:
            raise ValueError(
                f"prompt {i} has {length} tokens; with max_tokens={max_tokens} the limit is "
                f"max_seq_len - max_tokens = {max_seq_len} - {max_tokens} = {max_seq_len - max_tokens}"
            )
    return lengths


def check_sessions(sessions: Sequence[Session], max_seq_len: int) -> None:
    """Agent sessions must start from a prompt that leaves room for a token; ValueError naming the first
    that does not (the session's own budgets keep every later turn within ``max_seq_len``)."""
    for i, session in enumerate(sessions):
        length = len(session.prompt_tokens)
        if length == 0 or length >= max_seq_len:
            raise ValueError(f"agent trajectory {i} starts from {length} prompt tokens; it needs 1 to "
                             f"max_seq_len - 1 = {max_seq_len - 1}")


def prompt_max_tokens(prompts: Batch, params: SamplingParams) -> list[int]:
    """Each prompt's response budget: its ``max_tokens`` column (a per-prompt budget, e.g. a length target)
    capped at ``params.max_tokens``, else ``params.max_tokens``."""
    if "max_tokens" not in prompts:
        return [params.max_tokens] * len(prompts)
    limits = [min(int(m), params.max_tokens) for m in prompts["max_tokens"].tolist()]
    bad = [i for i, m in enumerate(limits) if m < 1]
    if bad:
        raise ValueError(f"prompt {bad[0]} has a max_tokens column of {limits[bad[0]]}; it must be >= 1")
    return limits


def prompt_seeds(prompts: Batch, params: SamplingParams, tp_mesh=None) -> list[int]:
    """One seed per prompt: the Batch's ``seed`` column, else ``params.seed + i``, else a base drawn from
    torch's global RNG (broadcast over ``tp_mesh``, when given, so every TP rank samples identically)."""
    if "seed" in prompts:
        seeds = prompts["seed"]
        return [int(s) for s in (seeds.tolist() if isinstance(seeds, torch.Tensor) else seeds)]
    base = params.seed
    if base is None:
        drawn = torch.randint(0, 2**62, (1,))
        if tp_mesh is not None and tp_mesh.size() > 1:
            group = tp_mesh.get_group()
            dist.broadcast(drawn, src=dist.get_global_rank(group, 0), group=group)
        base = int(drawn.item())
    return [base + i for i in range(len(prompts))]


@dataclass(frozen=True)
class CarriedSample:
    """A sample continued from where another call stopped it: what it sampled so far, and its sample index."""

    tokens: torch.Tensor  # [t] long
    log_probs: torch.Tensor  # [t] float32
    versions: torch.Tensor  # [t] long
    sample: int


def carried_samples(prompts: Batch, params: SamplingParams) -> list[CarriedSample] | None:
    """The samples a prompt batch continues (`CARRIED_COLUMNS`), one per row, or None for fresh prompts.
    ValueError when the columns are partial, ``n`` is not 1, or a sample has no budget left."""
    present = [c for c in CARRIED_COLUMNS if c in prompts]
    if not present:
        return None
    if len(present) != len(CARRIED_COLUMNS):
        raise ValueError(f"carried samples need every column of {list(CARRIED_COLUMNS)}; missing "
                         f"{[c for c in CARRIED_COLUMNS if c not in prompts]}")
    if params.n != 1:
        raise ValueError(f"carried samples continue one sample each: SamplingParams.n must be 1, got {params.n}")
    lengths = prompts["carried_lengths"].tolist()
    out = []
    for i, (t, limit) in enumerate(zip(lengths, prompt_max_tokens(prompts, params))):
        if not 0 < t < limit:
            raise ValueError(f"carried sample {i} has {t} tokens; it needs 1 .. {limit - 1} (its max_tokens is {limit})")
        out.append(CarriedSample(prompts["carried_tokens"][i, :t].cpu(), prompts["carried_log_probs"][i, :t].cpu(),
                                 prompts["carried_versions"][i, :t].cpu(), int(prompts["sample_index"][i])))
    return out


def continuations(prompts: Batch, gen: Batch, n: int) -> tuple[list[int], Batch | None]:
    """The rows of ``gen`` (``prompts``' generation, ``n`` samples each) that came back carried, and a prompt
    batch that continues them (their prompts' columns, seeds included, and the `CARRIED_COLUMNS`; ``n`` 1).
    Versions: the per-token ones when the generation has them, else each sample's ``weight_version``."""
    rows = [r for r, reason in enumerate(gen["finish_reason"]) if reason == CARRIED]
    if not rows:
        return rows, None
    index = torch.tensor(rows)
    source = prompts[index // n]
    width = gen["responses"].shape[1]
    if "token_weight_versions" in gen:
        versions = gen["token_weight_versions"][index]
    elif "weight_version" in gen:
        versions = gen["weight_version"][index][:, None].expand(-1, width).clone()
    else:
        versions = torch.zeros(len(rows), width, dtype=torch.long)
    source["carried_tokens"] = gen["responses"][index]
    source["carried_log_probs"] = gen["rollout_log_probs"][index] if "rollout_log_probs" in gen else \
        torch.zeros(len(rows), width)
    source["carried_versions"] = versions
    source["carried_lengths"] = gen["response_mask"][index].sum(-1)
    source["sample_index"] = prompts["sample_index"][index // n] if "sample_index" in prompts else index % n
    return rows, source


def prompt_token_lists(prompts: Batch) -> list[torch.Tensor]:
    """Each prompt's tokens without its left padding."""
    ids, mask = prompts["input_ids"].cpu(), prompts["attention_mask"].cpu().bool()
    return [ids[i][mask[i]] for i in range(len(ids))]


def assemble_generation(
    prompts: Batch,
    params: SamplingParams,
    tokens: torch.Tensor,
    logps: torch.Tensor,
    resp_len: torch.Tensor,
    reasons: list[str],
    pad_id: int,
) -> Batch:
    """The output Batch of every engine, from per-sample results (sample ``i*n + j``: prompt i, sample j).

    ``tokens``/``logps`` are ``[B*n, max_tokens]`` (anything past ``resp_len`` is ignored). Returns
    ``prompts`` (left-padded prompt ids), ``responses`` (right-padded with ``pad_id``), ``input_ids``,
    ``attention_mask``, ``position_ids``, ``response_mask``, ``rollout_log_probs`` (float32, 0 on
    padding; only with ``params.logprobs``), ``finish_reason``; every other column of ``prompts`` is
    repeated n times. The log-probs' temperature is ``params.logprob_temperature``: the trainer reads it
    from the config, not from the batch.
    """
    n = params.n
    r = params.max_tokens
    response_mask = (torch.arange(r)[None, :] < resp_len[:, None]).long()
    responses = torch.where(response_mask.bool(), tokens, pad_id)
    prompt_ids = prompts["input_ids"].cpu().repeat_interleave(n, dim=0)
    prompt_mask = prompts["attention_mask"].cpu().long().repeat_interleave(n, dim=0)
    return _generation_batch(prompts, params, prompt_ids, prompt_mask, responses, response_mask, response_mask,
                             (logps * response_mask).float(), reasons)


def assemble_trajectories(prompts: Batch, params: SamplingParams, trajectories: Sequence[SessionTrajectory],
                          logps: torch.Tensor,
                          pad_id: int, versions: torch.Tensor | None = None) -> Batch:
    """The output Batch of an agent rollout (`torchrlhf.agents`), from finished trajectories, one per sample.

    The same columns as `assemble_generation`, where a response is the model's turns *and* the rendered
    observations between them: ``response_mask`` (the loss mask) is 1 on the model's tokens and 0 on
    observation tokens, while ``attention_mask`` covers both. ``logps`` [N, max_tokens] holds each
    trajectory's model-token log-probs in order (all turns), as ``versions`` their weight versions;
    ``prompts`` are the trajectories' own first contexts (an environment may have written them).
    """
    count = len(trajectories)
    width = max(len(t.prompt_tokens) for t in trajectories)
    r = max(1, max(len(t.response_tokens) for t in trajectories))
    prompt_ids = torch.full((count, width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros(count, width, dtype=torch.long)
    responses = torch.full((count, r), pad_id, dtype=torch.long)
    valid = torch.zeros(count, r, dtype=torch.long)
    loss_mask = torch.zeros(count, r, dtype=torch.long)
    rollout_lp = torch.zeros(count, r, dtype=torch.float32)
    token_versions = torch.zeros(count, r, dtype=torch.long)
    for i, t in enumerate(trajectories):
        p, k = len(t.prompt_tokens), len(t.response_tokens)
        prompt_ids[i, width - p:] = torch.tensor(t.prompt_tokens, dtype=torch.long)
        prompt_mask[i, width - p:] = 1
        if k:
            responses[i, :k] = torch.tensor(t.response_tokens, dtype=torch.long)
            valid[i, :k] = 1
            model = torch.tensor(t.loss_mask, dtype=torch.bool)
            loss_mask[i, :k] = model.long()
            m = int(model.sum())
            rollout_lp[i, :k][model] = logps[i, :m].float()
            if versions is not None:
                token_versions[i, :k][model] = versions[i, :m]
    extra = {"token_weight_versions": token_versions} if versions is not None else {}
    return _generation_batch(prompts, params, prompt_ids, prompt_mask, responses, valid, loss_mask, rollout_lp,
                             [t.finish_reason for t in trajectories], extra)


def sample_single_turns(generate: Callable[[Batch, SamplingParams], Batch], params: SamplingParams, pad_id: int,
                        contexts: Sequence[Sequence[int]], budgets: Sequence[int], seeds: Sequence[int]) -> list[Turn]:
    """One batched single-turn ``generate`` call that continues each token ``context``: left-padded, with its own
    ``max_tokens`` (``budgets``) and seed (a sample seed, mapped through `prompt_seed_for`, so the engine samples
    from exactly it). Returns (tokens, their log-probs (zeros without ``params.logprobs``), finish reason) per
    context: the agent round driver's and the OpenAI-endpoint harness's sampler of turns."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for r, c in enumerate(contexts):
        ids[r, width - len(c):], mask[r, width - len(c):] = torch.tensor(c, dtype=torch.long), 1
    batch = Batch({"input_ids": ids, "attention_mask": mask, "max_tokens": torch.tensor(list(budgets)),
                   "seed": torch.tensor([prompt_seed_for(s) for s in seeds], dtype=torch.long)})
    out = generate(batch, dataclasses.replace(params, n=1, max_tokens=max(budgets)))
    lengths = out["response_mask"].sum(-1).tolist()
    return [(out["responses"][r, :m].tolist(),
             out["rollout_log_probs"][r, :m].tolist() if "rollout_log_probs" in out else [0.0] * m,
             out["finish_reason"][r]) for r, m in enumerate(lengths)]


def sample_sessions(generate: Callable[..., Batch], params: SamplingParams, sessions: Sequence[Session],
                    seeds: Sequence[int]) -> list[list[float]]:
    """One ``generate(..., sessions=sessions)`` call (``n=1``), each agent session sampled from its own sample
    seed (mapped through `prompt_seed_for`, as `sample_single_turns` does); returns each session's model-token
    log-probs, in order (zeros without ``params.logprobs``): the OpenAI-endpoint harness's driver of its calls."""
    ones = torch.ones(len(sessions), 1, dtype=torch.long)
    batch = Batch({"input_ids": ones, "attention_mask": ones,
                   "seed": torch.tensor([prompt_seed_for(s) for s in seeds], dtype=torch.long)})
    out = generate(batch, dataclasses.replace(params, n=1), sessions=list(sessions))
    model = out["response_mask"].bool()
    if "rollout_log_probs" not in out:
        return [[0.0] * int(row.sum()) for row in model]
    return [out["rollout_log_probs"][r][model[r]].tolist() for r in range(len(sessions))]


def generate_in_rounds(generate: Callable[[Batch, SamplingParams], Batch], prompts: Batch, params: SamplingParams,
                       sessions: Sequence[Session], pad_id: int, tp_mesh: Any = None) -> Batch:
    """``generate(prompts, params, sessions=sessions)`` for an engine whose ``generate`` samples single turns.

    The rounds of `torchrlhf.generation.session.run_rounds`: each round is one ``generate`` call with every
    live trajectory's whole token sequence as a prompt (``n=1``; an engine with a prefix cache computes only
    the new tokens), its turn budget as the ``max_tokens`` column and its own seed: turn t of sample j of
    prompt i samples from ``sample_seed(seed_i, j) + t``. Returns `assemble_trajectories`' columns.
    """
    seeds = prompt_seeds(prompts, params, tp_mesh)

    def sample_turns(live: list[int], turn: int) -> list[Turn]:
        return sample_single_turns(generate, params, pad_id, [sessions[k].tokens for k in live],
                                   [sessions[k].turn_budget() for k in live],
                                   [sample_seed(seeds[k // params.n], k % params.n) + turn for k in live])

    logps = run_rounds(sessions, sample_turns)
    table = torch.zeros(len(sessions), max(1, params.max_tokens), dtype=torch.float32)
    for k, values in enumerate(logps):
        table[k, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return assemble_trajectories(prompts, params, [s.result() for s in sessions], table, pad_id)


def _generation_batch(prompts: Batch, params: SamplingParams, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      responses: torch.Tensor, valid: torch.Tensor, response_mask: torch.Tensor,
                      rollout_log_probs: torch.Tensor, reasons: list[str],
                      extra: dict[str, torch.Tensor] | None = None) -> Batch:
    """The Batch both assemblers return: prompts left-padded, responses right-padded (``valid``: the
    tokens present, ``response_mask``: those the loss sees), ``extra`` columns, and every other column of
    ``prompts`` repeated ``params.n`` times, on the prompts' device."""
    attention_mask = torch.cat([prompt_mask, valid], dim=1)
    columns = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
    }
    if params.logprobs:
        columns["rollout_log_probs"] = rollout_log_probs
    columns.update(extra or {})
    out_device = prompts["input_ids"].device
    columns = {k: v.to(out_device) for k, v in columns.items()}
    reserved = {*GENERATION_COLUMNS, "finish_reason"}
    rest = prompts.select(*[k for k in prompts.keys() if k not in reserved]).repeat(params.n) if len(prompts) else None
    return Batch(
        {**(rest.tensors if rest else {}), **columns},
        {**(rest.non_tensors if rest else {}), "finish_reason": reasons},
        dict(prompts.meta),
    )
