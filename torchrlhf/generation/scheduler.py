"""Continuous batching for the native engine: which sample runs in which slot, step by step.

One `Scheduler` runs one `generate` call. Its loop is the dataflow, top to bottom:

    while samples wait or slots hold one:
        resume the turns whose observation is ready        (agents)
        admit waiting samples into free slots: `prefill`   (samples of one prompt share it)
        or decode every live slot one token: `decode_step`
        every ``check_every`` steps, look: free the slots whose turn ended

What a sample does when its turn ends is its *turn policy*: `SingleTurn` finishes it, `AgentTurns` hands
the turn to its agent session and parks the slot until the observation comes back. The device-side state of
the slots is `SlotState`, their keys/values `KVCache`, the prefix cache's bookkeeping `SlotPool`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from torchrlhf.generation.base import CARRIED, CarriedSample
from torchrlhf.generation.kv_cache import KVCache
from torchrlhf.generation.model import CachedDecoder
from torchrlhf.generation.sampling import SamplingParams, request_uniforms
from torchrlhf.generation.slot_state import SlotState
from torchrlhf.generation.slots import SlotPool
from torchrlhf.models.moe import record_routing
from torchrlhf.generation.session import Session


def right_padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one right-padded [b, T] tensor and their lengths [b], on ``device``."""
    lens = [len(r) for r in rows]
    toks = torch.zeros(len(rows), max(lens), dtype=torch.long)
    for i, r in enumerate(rows):
        toks[i, : lens[i]] = torch.tensor(r, dtype=torch.long)
    return toks.to(device), torch.tensor(lens, device=device)


def prefill(decoder: CachedDecoder, cache: KVCache, prompts: list[list[int]], slots: list[int],
            held: list[int]) -> torch.Tensor:
    """Compute each prompt into its slot, after the first ``held`` tokens the slot already holds. Returns
    the logits [b, V] at each prompt's last token, in order. Prompts held from nothing run as one prefill
    forward, the others as one extend forward over their new tokens only."""
    dev = cache.k.device
    logits: list[torch.Tensor | None] = [None] * len(prompts)
    whole = [i for i, h in enumerate(held) if h == 0]
    rest = [i for i, h in enumerate(held) if h > 0]
    if whole:
        toks, lens = right_padded([prompts[i] for i in whole], dev)
        out = decoder.prefill(toks, lens, torch.tensor([slots[i] for i in whole], device=dev), cache.k, cache.v)
        for row, i in enumerate(whole):
            logits[i] = out[row]
    if rest:
        toks, lens = right_padded([prompts[i][held[i]:] for i in rest], dev)
        out = decoder.extend(toks, torch.tensor([held[i] for i in rest], device=dev), lens,
                             torch.tensor([slots[i] for i in rest], device=dev),
                             max(len(prompts[i]) for i in rest), cache.k, cache.v)
        for row, i in enumerate(rest):
            logits[i] = out[row]
    return torch.stack(logits)


def decode_step(decode: Callable[..., torch.Tensor], state: SlotState, cache: KVCache, span: int, kv_len: int,
                params: SamplingParams, version: int, route_model: torch.nn.Module | None = None) -> None:
    """One decode step over slots ``0 .. span - 1``: feed each slot's current token, sample its next one
    (`SlotState.advance`). Attention reads positions below ``kv_len``. With ``route_model`` (an MoE model),
    the experts its routers chose for the fed tokens are kept too."""
    if route_model is None:
        state.advance(decode(state.cur[:span], state.pos[:span], span, kv_len, cache.k, cache.v), params, version)
        return
    with record_routing(route_model) as record:
        logits = decode(state.cur[:span], state.pos[:span], span, kv_len, cache.k, cache.v)
    state.advance(logits, params, version, torch.stack(record.experts, 1))


class EndedTurn(NamedTuple):
    """A turn the device ended (a stop token, its budget): its slot, its sample, whether it stopped, and its
    model tokens (read from the device only for a policy that ``reads_turns``)."""

    slot: int
    sample: int
    stopped: bool
    tokens: list[int] | None


class Resumed(NamedTuple):
    """What a policy's `resume` changed: the slots whose samples are done, and the slots whose observation is
    prefilled now, in a forward of its own."""

    finished: list[int]
    going: list[tuple[int, list[int]]]


class SingleTurn:
    """Each sample is one response to its prompt (``n`` samples per prompt): when its turn ends, it is done.

    ``prompts``: the distinct first contexts; ``prompt_of``: sample -> its context; ``budgets``: sample ->
    its first turn's token budget. ``records``: a finished slot holds exactly its prompt and response, so the
    prefix cache may keep it.
    """

    records = True
    reads_turns = False

    def __init__(self, prompt_tokens: Sequence[torch.Tensor], limits: Sequence[int], n: int) -> None:
        self.prompts = [t.tolist() for t in prompt_tokens]
        total = len(self.prompts) * n
        self.prompt_of = [sid // n for sid in range(total)]
        self.budgets = [limits[sid // n] for sid in range(total)]
        self.parked: dict[int, Future] = {}  # never any: a single turn waits on nothing

    def turns_ended(self, ended: list[EndedTurn]) -> list[tuple[int, str]]:
        """The slots to finish now, with their finish reasons: every one."""
        return [(t.slot, "stop" if t.stopped else "length") for t in ended]

    def resume(self, block: bool, can_ride: bool) -> Resumed | None:
        return None

    def riding(self) -> list[tuple[int, list[int]]]:
        return []

    def budget(self, sid: int) -> int:
        raise AssertionError("a single turn has no next turn")

    def move(self, dst: int, src: int) -> None:
        pass


class AgentTurns:
    """Each sample is a multi-turn trajectory driven by its agent session (`torchrlhf.agents.AgentSession`).

    When the model ends a turn, the slot is *parked*: it keeps its keys/values and skips decode steps while
    its session runs the tools or the environment. When the observation is ready, only it is prefilled into
    the slot, in the next decode step's forward (`CachedDecoder.decode_and_extend`, eager even where the plain
    decode step is compiled or graphed: one eager forward instead of an eager extend and a decode step), or in
    an extend of its own when no slot is decoding. Then the next turn decodes. Trajectories that start from
    equal contexts share one prefill.
    """

    records = False  # a slot also holds observations
    reads_turns = True

    def __init__(self, sessions: Sequence[Session]) -> None:
        self.sessions = sessions
        unique: dict[tuple[int, ...], int] = {}
        self.prompt_of = [unique.setdefault(tuple(s.prompt_tokens), len(unique)) for s in sessions]
        self.prompts = [list(t) for t in unique]
        self.budgets = [s.turn_budget() for s in sessions]  # 0: done already (its environment failed to reset)
        self.parked: dict[int, Future] = {}  # slot -> the future of its session's turn result
        self.ready: dict[int, list[int]] = {}  # parked slots whose observation rides in the next decode step

    def turns_ended(self, ended: list[EndedTurn]) -> list[tuple[int, str]]:
        """Hand each ended turn to its session and park its slot; none is finished here."""
        for t in ended:
            self.parked[t.slot] = self.sessions[t.sample].end_turn(t.tokens, "stop" if t.stopped else "length")
        return []

    def resume(self, block: bool, can_ride: bool) -> Resumed | None:
        """The parked trajectories that are done, and those whose observation is ready: kept for the next
        decode step's forward when ``can_ride``, else returned to prefill now. With ``block``, first wait for
        one (nothing else can run). None when no slot changed."""
        waiting = {s: f for s, f in self.parked.items() if s not in self.ready}
        if not waiting:
            return None
        if block:
            wait(list(waiting.values()), return_when=FIRST_COMPLETED)
        done = [(s, f.result()) for s, f in waiting.items() if f.done()]
        if not done:
            return None
        finished = [s for s, r in done if r.done]  # the session holds the reason
        for s in finished:
            del self.parked[s]
        going = [(s, r.observation_tokens) for s, r in done if not r.done]
        if going and can_ride:
            self.ready.update(going)  # they stay parked until that step
            going = []
        for s, _ in going:
            del self.parked[s]
        return Resumed(finished, going)

    def riding(self) -> list[tuple[int, list[int]]]:
        """The observations to prefill in this decode step's forward; their slots are no longer parked."""
        going, self.ready = list(self.ready.items()), {}
        for s, _ in going:
            del self.parked[s]
        return going

    def budget(self, sid: int) -> int:
        return self.sessions[sid].turn_budget()

    def move(self, dst: int, src: int) -> None:
        for per_slot in (self.parked, self.ready):
            if src in per_slot:
                per_slot[dst] = per_slot.pop(src)


class Results:
    """A `generate` call's results by sample id (prompt i, sample j -> i * n + j): the model's tokens over all
    turns, their log-probs and weight versions, how many, and why each sample ended."""

    def __init__(self, total: int, steps: int, routes: tuple[int, int] | None = None) -> None:
        self.tokens = torch.zeros(total, steps, dtype=torch.long)
        self.log_probs = torch.zeros(total, steps, dtype=torch.float32)
        self.versions = torch.zeros(total, steps, dtype=torch.long)
        self.lengths = torch.zeros(total, dtype=torch.long)
        self.routes = torch.zeros(total, steps, *routes, dtype=torch.int16) if routes is not None else None
        self.reasons: list[str] = [""] * total

    def grow(self, count: int) -> None:
        """Room for ``count`` more samples (carried samples joining a running call)."""
        def more(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t.new_zeros(count, *t.shape[1:])])

        self.tokens, self.log_probs, self.versions, self.lengths = map(
            more, (self.tokens, self.log_probs, self.versions, self.lengths))
        self.reasons += [""] * count

    def keep(self, sids: list[int], taken: tuple[torch.Tensor, ...], reasons: list[str]) -> None:
        """Store what `SlotState.take` returned for samples ``sids``."""
        sid_t = torch.tensor(sids)
        self.tokens[sid_t], self.log_probs[sid_t], self.versions[sid_t], self.lengths[sid_t] = taken[:4]
        if self.routes is not None:
            self.routes[sid_t] = taken[4]
        for sid, reason in zip(sids, reasons):
            self.reasons[sid] = reason

    def held(self, sid: int) -> list[int]:
        """The tokens a finished sample's slot holds after its prompt: every sampled one but the last (never fed)."""
        return self.tokens[sid, : int(self.lengths[sid]) - 1].tolist()


class SharedContexts:
    """Samples that start from one context share its prefill: the first computes it into its slot, the others
    copy that slot's keys/values (or, admitted in the same round, the slot it is computed into). The context's
    last logits are kept until its last sample is admitted."""

    def __init__(self, prompt_of: Sequence[int], waiting: Sequence[int]) -> None:
        self.prompt_of = prompt_of
        self.slots: dict[int, set[int]] = {}  # context -> the slots of its samples now running
        self.logits: dict[int, torch.Tensor] = {}  # context -> its last position's logits, while needed
        self.version: dict[int, int] = {}  # the weights each context's logits came from
        self.to_admit = {p: 0 for p in set(prompt_of)}
        for sid in waiting:
            self.to_admit[prompt_of[sid]] += 1

    def running_slot(self, p: int) -> int | None:
        """A slot that holds context ``p`` now, if any."""
        return next(iter(self.slots[p])) if self.slots.get(p) else None

    def computed(self, p: int, logits: torch.Tensor, version: int) -> None:
        self.logits[p], self.version[p] = logits, version

    def admitted(self, sid: int, slot: int) -> None:
        p = self.prompt_of[sid]
        self.slots.setdefault(p, set()).add(slot)
        self.to_admit[p] -= 1
        if self.to_admit[p] == 0:
            del self.logits[p]

    def released(self, sid: int, slot: int) -> None:
        self.slots[self.prompt_of[sid]].discard(slot)

    def moved(self, sid: int, dst: int, src: int) -> None:
        running = self.slots[self.prompt_of[sid]]
        running.discard(src)
        running.add(dst)


# More carried samples arriving while a call runs: (contexts, budgets, prompt seeds, carried), or None.
MoreCarried = Callable[[bool], tuple[list[list[int]], list[int], list[int], list[CarriedSample]] | None]


@dataclass(frozen=True)
class Repack:
    """A call's part in Laminar's repack (`rollouts.repack`): the samples it continues, when it hands its own
    back, and where more continued samples come from while it runs. The default is a plain call.

    ``carried`` (single turn, one per sample): each sample continues one that another call stopped; its
    context already holds the tokens it sampled, which it keeps (tokens, log-probs, versions), and it samples
    on from where it stopped with its own uniforms. ``release_below`` (decoding slots): once no sample waits
    and the decoding slots, having reached that many, fall below it, stop and hand the unfinished samples back
    as they are (finish reason `CARRIED`). ``more`` (a call of carried samples): more carried samples that
    arrive while it runs, asked whenever a slot is free and, with ``True``, once more before the call ends
    (after which none may arrive); they join the call as its next sample ids.
    """

    carried: Sequence[CarriedSample] | None = None
    release_below: float = 0.0
    more: MoreCarried | None = None


class Scheduler:
    """The scheduling state of one `generate` call.

    Sample ``sid`` starts from context ``policy.prompt_of[sid]``; samples that start from the same one share
    its prefill (`SharedContexts`). The policy (`SingleTurn`, `AgentTurns`) decides what an ended turn means
    and never sees the scheduler: it is told the ended turns and answers what to finish or resume. The model-token counter of a
    slot (``SlotState.step``) runs over all turns of its sample, so the sampling uniforms and the log-probs of
    one trajectory are one sequence.

    Slots that hold no sample take the scratch position in decode steps (a free row's keys/values are
    written somewhere): never a position of a cached prefix, which holds at most ``max_seq_len - 1`` tokens.
    """

    def __init__(self, decoder: CachedDecoder, decode: Callable[..., torch.Tensor], cache: KVCache,
                 params: SamplingParams, policy: SingleTurn | AgentTurns, seeds: Sequence[int], *,
                 stop_ids: Sequence[int], check_every: int, min_span: int = 1, tokenizer: Any = None,
                 use_prefix_cache: bool = True, between_steps: Callable[[], int] | None = None,
                 refresh_packed: Callable[[], None] | None = None, routes: tuple[int, int] | None = None,
                 repack: Repack = Repack()) -> None:
        """``decode``: the decode step to run (``decoder.decode``, compiled or graphed); ``min_span``: the
        fewest slots it steps; ``refresh_packed``: what makes weights written between steps take effect;
        ``routes`` ``(moe_layers, top_k)``: keep the experts of every fed token (eager ``decode`` only);
        ``repack``: the samples this call continues and when it hands its own back (`Repack`)."""
        self.decoder, self.decode, self.cache = decoder, decode, cache
        self.carried = list(repack.carried) if repack.carried is not None else None
        self.release_below, self.peak_live, self.more = repack.release_below, 0, repack.more
        self.decode_steps = self.slot_steps = 0  # occupancy: decode steps, and the slots they advanced
        self.riding_steps = self.extends = 0  # agents: steps that prefilled observations (eager), extends of their own
        self.p, self.policy, self.seeds, self.tokenizer = params, policy, list(seeds), tokenizer
        self.between_steps, self.refresh_packed = between_steps, refresh_packed
        self.version = 0  # the next step's weights
        self.min_span = min_span
        self.device, slots = cache.k.device, cache.k.shape[1]
        # The prefix cache, taken from the KV cache and given back by `run`; with weights that may change
        # between steps it is neither used nor filled.
        use_cache = use_prefix_cache and between_steps is None
        self.slots = SlotPool(slots, cache.prefixes if use_cache else {})
        cache.prefixes = {}
        self.record = use_cache and policy.records
        stop_t = torch.tensor(list(stop_ids), dtype=torch.long, device=self.device)
        self.state = SlotState(slots, params.max_tokens, stop_t, cache.scratch, self.device,
                               versions=between_steps is not None, routes=routes)
        self.route_model = decoder.model if routes is not None else None
        self.check_every = 1 if params.stop else check_every  # stop strings: the host reads every token
        self.since_look = 0
        total = len(policy.prompt_of)
        self.results = Results(total, params.max_tokens, routes)
        # Host-side bookkeeping. A sample with no budget (an agent whose environment failed) takes no slot.
        self.waiting = deque(sid for sid in range(total) if policy.budgets[sid] > 0)
        self.slot_sample = [-1] * slots
        self.slot_pos = [0] * slots  # position the slot's next token goes to (an upper bound between looks)
        self.slot_turn = [0] * slots  # the model-token index the slot's current (parked: next) turn starts at
        self.contexts = SharedContexts(policy.prompt_of, self.waiting)
        self.gen_text: dict[int, list[int]] = {}  # stop strings: the slot's turn's tokens the host has read
        self.stop_window = max((len(s) for s in params.stop), default=0) + 4

    # ---------------------------------------------------------------- admission
    def admit(self) -> None:
        """Give free slots to waiting samples: compute each new context once (from a cached prefix where one
        is held), copy it into the slots of its other samples, and sample every admitted slot's first token."""
        dev, n, prompts = self.device, self.p.n, self.policy.prompts
        taken: list[tuple[int, int]] = []  # (sample, slot)
        computed: dict[int, int] = {}  # context -> the slot it is computed into now
        held: dict[int, int] = {}  # context -> the tokens its slot holds already
        reuse: list[tuple[int, int, int]] = []  # (dst, src, length) cached-prefix copies
        shares: list[tuple[int, int, int]] = []  # (dst, src, context): a context computed in another slot
        while self.waiting and self.slots.free:
            sid = self.waiting.popleft()
            p = self.policy.prompt_of[sid]
            running = self.contexts.running_slot(p)
            if running is not None or p in computed:
                slot = self.slots.take()
                shares.append((slot, running if running is not None else computed[p], p))
            else:
                slot, held[p], source = self.slots.place(prompts[p])
                if source is not None:
                    reuse.append((slot, source, held[p]))
                computed[p] = slot
            taken.append((sid, slot))
        if reuse:  # before anything is written: a source may be taken by a later context of this admission
            self.cache.copy([d for d, _, _ in reuse], [s for _, s, _ in reuse], max(n for _, _, n in reuse))
        if computed:
            order = list(computed)
            logits = prefill(self.decoder, self.cache, [prompts[p] for p in order], [computed[p] for p in order],
                             [held[p] for p in order])
            for row, p in enumerate(order):
                self.contexts.computed(p, logits[row], self.version)
        if shares:
            self.cache.copy([d for d, _, _ in shares], [s for _, s, _ in shares],
                            max(len(prompts[p]) for _, _, p in shares))

        contexts = [self.policy.prompt_of[sid] for sid, _ in taken]
        slots = [slot for _, slot in taken]
        slot_t = torch.tensor(slots, device=dev)
        self.state.uni[slot_t] = torch.stack(
            [request_uniforms(self.seeds[sid // n], self._sample_index(sid), self.p.max_tokens) for sid, _ in taken]
        ).to(dev)
        self.state.step[slot_t] = 0
        if self.carried is not None:
            self.state.restore(slots, [self.carried[sid] for sid, _ in taken])
        lens = [len(prompts[p]) for p in contexts]
        self.state.start_turn(
            slot_t, torch.stack([self.contexts.logits[p] for p in contexts]), self.p,
            pos=torch.tensor(lens, device=dev),
            budget=torch.tensor([self.policy.budgets[sid] for sid, _ in taken], device=dev),
            version=torch.tensor([self.contexts.version[p] for p in contexts], device=dev) if self.state.versions else 0)
        for (sid, slot), length in zip(taken, lens):
            self.slot_sample[slot] = sid
            self.slot_pos[slot] = length
            self.slot_turn[slot] = 0
            self.contexts.admitted(sid, slot)
        # A sample that ends at its first token (a budget of one token, or a stop token where the host looks
        # every step) is freed now, not after a decode step that would compute nothing for it.
        if self.check_every == 1 or any(self.policy.budgets[sid] == 1 for sid, _ in taken):
            self.look()

    def _sample_index(self, sid: int) -> int:
        """Which sample of its prompt ``sid`` is: its sampling uniforms are that sample's."""
        return self.carried[sid].sample if self.carried is not None else sid % self.p.n

    # ---------------------------------------------------------------- the host's look
    def look(self) -> None:
        """The host's look at the decoding slots, one synchronisation: free those whose turn ended on the
        device (the policy decides what that means), catch up ``slot_pos``, check stop strings."""
        self.since_look = 0
        slots = [s for s, sid in enumerate(self.slot_sample) if sid >= 0 and s not in self.policy.parked]
        if not slots:
            return
        live, stopped, pos, step, bad = self.state.read(slots)
        if any(bad):
            sids = [self.slot_sample[s] for s, b in zip(slots, bad) if b]
            raise FloatingPointError(
                f"generate: the next-token distribution of samples {sids[:8]} is not finite (NaN or inf logits): "
                "the model's weights or activations are not finite (a corrupt checkpoint, or an overflow in "
                "float16/bfloat16)"
            )
        for s, p in zip(slots, pos):
            self.slot_pos[s] = p
        if self.p.stop:
            self._check_stop_strings(slots, live, stopped, step)
        ended = [(s, bool(st), n) for s, lv, st, n in zip(slots, live, stopped, step) if not lv]
        for s, _, _ in ended:
            self.gen_text.pop(s, None)
        if ended:
            self._turns_ended(ended)
        if self.release_below > 0:
            self._release_tail()

    def _release_tail(self) -> None:
        """Repack: hand the unfinished samples back once nothing waits and the decoding slots, having been at
        least ``release_below``, are fewer now (the host has just looked, so every live slot is still going)."""
        live = [s for s, sid in enumerate(self.slot_sample) if sid >= 0]
        self.peak_live = max(self.peak_live, len(live))
        if live and not self.waiting and self.peak_live >= self.release_below > len(live):
            for s in live:
                self.gen_text.pop(s, None)
            self.finish(live, [CARRIED] * len(live), record=False)

    def _turns_ended(self, ended: list[tuple[int, bool, int]]) -> None:
        """Hand the ended turns (slot, stopped, model-token count) to the policy; finish what it says is done.
        The slot's next turn starts where this one ended (a parked slot samples no token)."""
        rows: list[list[int] | None] = [None] * len(ended)
        if self.policy.reads_turns:
            rows = self.state.out_tok[torch.tensor([s for s, _, _ in ended], device=self.device)].tolist()
        turns = []
        for (s, stopped, step), row in zip(ended, rows):
            turns.append(EndedTurn(s, self.slot_sample[s], stopped, None if row is None else row[self.slot_turn[s] : step]))
            self.slot_turn[s] = step
        done = self.policy.turns_ended(turns)
        if done:
            self.finish([s for s, _ in done], [reason for _, reason in done])

    def _check_stop_strings(self, slots: list[int], live: list[int], stopped: list[int], step: list[int]) -> None:
        """End each live slot whose text now holds a stop string, at the token that completed it (``live``,
        ``stopped`` and ``step`` are updated in place, and on the device)."""
        rows = self.state.out_tok[torch.tensor(slots, device=self.device)].tolist()
        tokenizer = self.tokenizer
        for i, s in enumerate(slots):
            if not live[i]:
                continue
            text_ids = self.gen_text.setdefault(s, [])
            start = self.slot_turn[s] + len(text_ids)
            for j in range(start, step[i]):
                text_ids.append(rows[i][j])
                tail = tokenizer.decode(text_ids[-self.stop_window :], skip_special_tokens=False)
                if any(stop in tail for stop in self.p.stop):  # tokens after j were sampled past the end
                    self.slot_pos[s] -= step[i] - (j + 1)
                    live[i], stopped[i], step[i] = 0, 1, j + 1
                    self.state.cut(s, j + 1, rows[i][j], self.slot_pos[s])
                    break

    def finish(self, slots: list[int], reasons: list[str], record: bool = True) -> None:
        """The samples in ``slots`` are done: keep their results and free the slots (recorded in the prefix
        cache where the slot holds exactly its prompt and response)."""
        sids = [self.slot_sample[s] for s in slots]
        self.results.keep(sids, self.state.take(slots), reasons)
        for s, sid in zip(slots, sids):
            self.contexts.released(sid, s)
            keep = record and self.record and self.carried is None  # a carried context already holds its tokens
            holds = self.policy.prompts[self.policy.prompt_of[sid]] + self.results.held(sid) if keep else None
            self.slots.give_back(s, holds)
            self.slot_sample[s] = -1
            self.slot_pos[s] = 0
            self.slot_turn[s] = 0

    # ---------------------------------------------------------------- agent turns
    def extension(self, going: list[tuple[int, list[int]]]) -> tuple[Any, ...]:
        """The `CachedDecoder.extend` inputs that append ``[last sampled token] + observation`` to each slot:
        right-padded tokens, start positions, lengths, slots, and the longest slot after it."""
        dev = self.device
        slots = torch.tensor([s for s, _ in going], device=dev)
        toks, lens = right_padded([[0, *obs] for _, obs in going], dev)
        toks[:, 0] = self.state.cur[slots]  # on the device: the host never reads the sampled tokens here
        return (toks, torch.tensor([self.slot_pos[s] for s, _ in going], device=dev), lens, slots,
                max(self.slot_pos[s] + 1 + len(obs) for s, obs in going))

    def extend(self, going: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Prefill each slot's ``[last sampled token] + observation`` in a forward of its own; the logits [b, V]
        at each last token."""
        self.extends += 1
        return self.decoder.extend(*self.extension(going), self.cache.k, self.cache.v)

    def observe(self, going: list[tuple[int, list[int]]], logits: torch.Tensor) -> None:
        """Each slot's observation has been prefilled (``logits`` at its last token): start the next turn."""
        slots = [s for s, _ in going]
        slot_t = torch.tensor(slots, device=self.device)
        lens = [1 + len(obs) for _, obs in going]
        self.state.start_turn(
            slot_t, logits, self.p,
            pos=torch.tensor([self.slot_pos[s] + n for s, n in zip(slots, lens)], device=self.device),
            budget=torch.tensor([self.policy.budget(self.slot_sample[s]) for s in slots], device=self.device),
            version=self.version)
        for s, length in zip(slots, lens):
            self.slot_pos[s] += length

    # ---------------------------------------------------------------- decode
    def compact(self, live: list[int]) -> None:
        """Move live samples into the lowest slots so decode runs over a short span."""
        targets = [s for s in range(len(live)) if self.slot_sample[s] < 0]
        movers = [s for s in live if s >= len(live)]
        if not movers:
            return
        self.cache.copy(targets, movers, max(self.slot_pos[s] for s in movers) + 1)
        self.state.move(targets, movers)
        for d, s in zip(targets, movers):
            self.slots.move(d, s)
            sid = self.slot_sample[s]
            self.slot_sample[d], self.slot_sample[s] = sid, -1
            self.slot_pos[d], self.slot_pos[s] = self.slot_pos[s], 0
            self.slot_turn[d], self.slot_turn[s] = self.slot_turn[s], 0
            self.contexts.moved(sid, d, s)
            if s in self.gen_text:
                self.gen_text[d] = self.gen_text.pop(s)
            self.policy.move(d, s)

    def step(self) -> None:
        """One decode step over the span of occupied slots (compacted first when it is mostly free)."""
        live = [s for s, sid in enumerate(self.slot_sample) if sid >= 0]
        span = live[-1] + 1
        if not self.waiting and span >= 8 and len(live) <= span // 2:
            self.compact(live)
            live = list(range(len(live)))
            span = len(live)
        span = max(span, self.min_span)
        kv_len = max(self.slot_pos[s] for s in live) + 1
        advancing = [s for s in live if s not in self.policy.parked]
        riding = self.policy.riding()  # parked until now: their observation goes in this step's forward
        if riding:
            self.riding_steps += 1
            state, cache = self.state, self.cache
            logits, riding_logits = self.decoder.decode_and_extend(
                state.cur[:span], state.pos[:span], span, kv_len, *self.extension(riding), cache.k, cache.v)
            state.advance(logits, self.p, self.version)
        else:
            decode_step(self.decode, self.state, self.cache, span, kv_len, self.p, self.version, self.route_model)
        self.decode_steps += 1
        self.slot_steps += len(advancing)
        for s in advancing:
            self.slot_pos[s] += 1  # an upper bound until the next look: a slot may have ended since
        if riding:
            self.observe(riding, riding_logits)
        self.since_look += 1
        if self.since_look >= self.check_every:
            self.look()

    def _refresh(self) -> None:
        """Partial rollouts: let the caller swap weights in between two steps."""
        if self.between_steps is None:
            return
        version = int(self.between_steps())
        if version != self.version and self.refresh_packed is not None:
            self.refresh_packed()  # e.g. pack again what `update_weights` wrote
        self.version = version

    def _join(self, final: bool) -> bool:
        """Carried samples that arrived since the last look join the call (``more``); whether any did."""
        arrived = self.more(final) if self.more is not None else None
        if not arrived:
            return False
        contexts, budgets, seeds, carried = arrived
        first = len(self.policy.prompt_of)
        for k, (context, budget) in enumerate(zip(contexts, budgets)):
            p = len(self.policy.prompts)
            self.policy.prompts.append(list(context))
            self.policy.prompt_of.append(p)
            self.policy.budgets.append(budget)
            self.contexts.to_admit[p] = 1
            self.waiting.append(first + k)
        self.seeds.extend(seeds)
        self.carried.extend(carried)
        self.results.grow(len(contexts))
        return True

    def run(self) -> None:
        """Run every sample to its end; the results are in ``results``."""
        while True:
            self._run()
            if not self._join(final=True):
                break
        self.cache.prefixes = self.slots.cached

    def _run(self) -> None:
        parked = self.policy.parked
        while self.waiting or any(sid >= 0 for sid in self.slot_sample):
            if self.more is not None and self.slots.free:
                self._join(final=False)
            self._refresh()
            decoding = any(sid >= 0 and s not in parked for s, sid in enumerate(self.slot_sample))
            resumed = self.policy.resume(block=not decoding and not (self.waiting and self.slots.free),
                                         can_ride=decoding)
            if resumed is not None:
                if resumed.finished:
                    self.finish(resumed.finished, [""] * len(resumed.finished))  # the session holds the reason
                if resumed.going:
                    self.observe(resumed.going, self.extend(resumed.going))
                continue
            if self.waiting and self.slots.free:
                self.admit()
                continue
            if decoding:
                self.step()
