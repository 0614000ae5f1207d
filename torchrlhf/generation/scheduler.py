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
from typing import Any

import torch

from torchrlhf.generation.kv_cache import KVCache
from torchrlhf.generation.model import CachedDecoder
from torchrlhf.generation.sampling import SamplingParams, request_uniforms
from torchrlhf.generation.slot_state import SlotState
from torchrlhf.generation.slots import SlotPool
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
                params: SamplingParams, version: int) -> None:
    """One decode step over slots ``0 .. span - 1``: feed each slot's current token, sample its next one
    (`SlotState.advance`). Attention reads positions below ``kv_len``."""
    logits = decode(state.cur[:span], state.pos[:span], span, kv_len, cache.k, cache.v)
    state.advance(logits, params, version)


class SingleTurn:
    """Each sample is one response to its prompt (``n`` samples per prompt): when its turn ends, it is done.

    ``prompts``: the distinct first contexts; ``prompt_of``: sample -> its context; ``budgets``: sample ->
    its first turn's token budget. ``records``: a finished slot holds exactly its prompt and response, so the
    prefix cache may keep it.
    """

    records = True

    def __init__(self, prompt_tokens: Sequence[torch.Tensor], limits: Sequence[int], n: int) -> None:
        self.prompts = [t.tolist() for t in prompt_tokens]
        total = len(self.prompts) * n
        self.prompt_of = [sid // n for sid in range(total)]
        self.budgets = [limits[sid // n] for sid in range(total)]
        self.parked: dict[int, Future] = {}  # never any: a single turn waits on nothing

    def turns_ended(self, run: Scheduler, ended: list[tuple[int, bool, int]]) -> None:
        run.finish([s for s, _, _ in ended], ["stop" if stopped else "length" for _, stopped, _ in ended])

    def resume(self, run: Scheduler, block: bool, can_ride: bool) -> bool:
        return False

    def riding(self) -> list[tuple[int, list[int]]]:
        return []

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

    def __init__(self, sessions: Sequence[Session]) -> None:
        self.sessions = sessions
        unique: dict[tuple[int, ...], int] = {}
        self.prompt_of = [unique.setdefault(tuple(s.prompt_tokens), len(unique)) for s in sessions]
        self.prompts = [list(t) for t in unique]
        self.budgets = [s.turn_budget() for s in sessions]  # 0: done already (its environment failed to reset)
        self.parked: dict[int, Future] = {}  # slot -> the future of its session's turn result
        self.ready: dict[int, list[int]] = {}  # parked slots whose observation rides in the next decode step

    def turns_ended(self, run: Scheduler, ended: list[tuple[int, bool, int]]) -> None:
        rows = run.state.out_tok[torch.tensor([s for s, _, _ in ended], device=run.device)].tolist()
        for (s, stopped, step), row in zip(ended, rows):
            turn = row[run.slot_turn[s] : step]
            run.slot_turn[s] = step  # the next turn's first model token (a parked slot samples none)
            self.parked[s] = self.sessions[run.slot_sample[s]].end_turn(turn, "stop" if stopped else "length")

    def resume(self, run: Scheduler, block: bool, can_ride: bool) -> bool:
        """Finish the parked trajectories that are done, and continue those whose observation is ready: in the
        next decode step's forward when ``can_ride``, else now. With ``block``, first wait for one (nothing
        else can run). Returns whether any slot changed."""
        waiting = {s: f for s, f in self.parked.items() if s not in self.ready}
        if not waiting:
            return False
        if block:
            wait(list(waiting.values()), return_when=FIRST_COMPLETED)
        done = [(s, f.result()) for s, f in waiting.items() if f.done()]
        if not done:
            return False
        finished = [s for s, r in done if r.done]
        for s in finished:
            del self.parked[s]
        if finished:
            run.finish(finished, [""] * len(finished))  # the session holds the reason
        going = [(s, r.observation_tokens) for s, r in done if not r.done]
        if going and can_ride:
            self.ready.update(going)  # they stay parked until that step
        elif going:
            for s, _ in going:
                del self.parked[s]
            run.observe(going, run.extend(going))
        return True

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


class Scheduler:
    """The scheduling state of one `generate` call.

    Sample ``sid`` starts from context ``policy.prompt_of[sid]``; samples that start from the same one share
    its prefill (the first sample computes it, the others copy its keys/values). The model-token counter of a
    slot (``SlotState.step``) runs over all turns of its sample, so the sampling uniforms and the log-probs of
    one trajectory are one sequence.

    Slots that hold no sample take the scratch position in decode steps (a free row's keys/values are
    written somewhere): never a position of a cached prefix, which holds at most ``max_seq_len - 1`` tokens.
    """

    def __init__(self, decoder: CachedDecoder, decode: Callable[..., torch.Tensor], cache: KVCache,
                 params: SamplingParams, policy: SingleTurn | AgentTurns, seeds: Sequence[int], *,
                 stop_ids: Sequence[int], check_every: int, min_span: int = 1, tokenizer: Any = None,
                 use_prefix_cache: bool = True, between_steps: Callable[[], int] | None = None,
                 repack: Callable[[], None] | None = None) -> None:
        """``decode``: the decode step to run (``decoder.decode``, compiled or graphed); ``min_span``: the
        fewest slots it steps; ``repack``: what makes weights written between steps take effect."""
        self.decoder, self.decode, self.cache = decoder, decode, cache
        self.p, self.policy, self.seeds, self.tokenizer = params, policy, seeds, tokenizer
        self.between_steps, self.version, self.repack = between_steps, 0, repack  # version: the next step's weights
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
                               versions=between_steps is not None)
        self.check_every = 1 if params.stop else check_every  # stop strings: the host reads every token
        self.since_look = 0
        # Results, by sample id (prompt i, sample j -> i * n + j): the model's tokens (all turns).
        total, steps = len(policy.prompt_of), params.max_tokens
        self.res_tok = torch.zeros(total, steps, dtype=torch.long)
        self.res_lp = torch.zeros(total, steps, dtype=torch.float32)
        self.res_ver = torch.zeros(total, steps, dtype=torch.long)
        self.res_len = torch.zeros(total, dtype=torch.long)
        self.reasons: list[str] = [""] * total
        # Host-side bookkeeping. A sample with no budget (an agent whose environment failed) takes no slot.
        self.waiting = deque(sid for sid in range(total) if policy.budgets[sid] > 0)
        self.slot_sample = [-1] * slots
        self.slot_pos = [0] * slots  # position the slot's next token goes to (an upper bound between looks)
        self.slot_turn = [0] * slots  # the model-token index the slot's current (parked: next) turn starts at
        self.prompt_slots: dict[int, set[int]] = {}  # context -> the slots of its samples now running
        self.prompt_logits: dict[int, torch.Tensor] = {}  # context -> its last position's logits, while needed
        self.prompt_version: dict[int, int] = {}  # the weights each context's logits came from
        self.to_admit = {p: 0 for p in set(policy.prompt_of)}
        for sid in self.waiting:
            self.to_admit[policy.prompt_of[sid]] += 1
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
            running = self.prompt_slots.get(p)
            if running or p in computed:
                slot = self.slots.take()
                shares.append((slot, next(iter(running)) if running else computed[p], p))
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
                self.prompt_logits[p] = logits[row]
                self.prompt_version[p] = self.version
        if shares:
            self.cache.copy([d for d, _, _ in shares], [s for _, s, _ in shares],
                            max(len(prompts[p]) for _, _, p in shares))

        contexts = [self.policy.prompt_of[sid] for sid, _ in taken]
        slots = [slot for _, slot in taken]
        slot_t = torch.tensor(slots, device=dev)
        self.state.uni[slot_t] = torch.stack(
            [request_uniforms(self.seeds[sid // n], sid % n, self.p.max_tokens) for sid, _ in taken]
        ).to(dev)
        self.state.step[slot_t] = 0
        lens = [len(prompts[p]) for p in contexts]
        self.state.start_turn(
            slot_t, torch.stack([self.prompt_logits[p] for p in contexts]), self.p,
            pos=torch.tensor(lens, device=dev),
            budget=torch.tensor([self.policy.budgets[sid] for sid, _ in taken], device=dev),
            version=torch.tensor([self.prompt_version[p] for p in contexts], device=dev) if self.state.versions else 0)
        for (sid, slot), p, length in zip(taken, contexts, lens):
            self.slot_sample[slot] = sid
            self.slot_pos[slot] = length
            self.slot_turn[slot] = 0
            self.prompt_slots.setdefault(p, set()).add(slot)
            self.to_admit[p] -= 1
            if self.to_admit[p] == 0:
                del self.prompt_logits[p]
        # A sample that ends at its first token (a budget of one token, or a stop token where the host looks
        # every step) is freed now, not after a decode step that would compute nothing for it.
        if self.check_every == 1 or any(self.policy.budgets[sid] == 1 for sid, _ in taken):
            self.look()

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
            self.policy.turns_ended(self, ended)

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

    def finish(self, slots: list[int], reasons: list[str]) -> None:
        """The samples in ``slots`` are done: keep their results and free the slots (recorded in the prefix
        cache where the slot holds exactly its prompt and response)."""
        sids = [self.slot_sample[s] for s in slots]
        sid_t = torch.tensor(sids)
        self.res_tok[sid_t], self.res_lp[sid_t], self.res_ver[sid_t], self.res_len[sid_t] = self.state.take(slots)
        for s, sid, reason in zip(slots, sids, reasons):
            self.reasons[sid] = reason
            p = self.policy.prompt_of[sid]
            self.prompt_slots[p].discard(s)
            holds = None
            if self.record:  # the slot holds the prompt and every sampled token but the last (never fed)
                holds = self.policy.prompts[p] + self.res_tok[sid, : int(self.res_len[sid]) - 1].tolist()
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
    def _compact(self, live: list[int]) -> None:
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
            running = self.prompt_slots[self.policy.prompt_of[sid]]
            running.discard(s)
            running.add(d)
            if s in self.gen_text:
                self.gen_text[d] = self.gen_text.pop(s)
            self.policy.move(d, s)

    def step(self) -> None:
        """One decode step over the span of occupied slots (compacted first when it is mostly free)."""
        live = [s for s, sid in enumerate(self.slot_sample) if sid >= 0]
        span = live[-1] + 1
        if not self.waiting and span >= 8 and len(live) <= span // 2:
            self._compact(live)
            live = list(range(len(live)))
            span = len(live)
        span = max(span, self.min_span)
        kv_len = max(self.slot_pos[s] for s in live) + 1
        advancing = [s for s in live if s not in self.policy.parked]
        riding = self.policy.riding()  # parked until now: their observation goes in this step's forward
        if riding:
            state, cache = self.state, self.cache
            logits, riding_logits = self.decoder.decode_and_extend(
                state.cur[:span], state.pos[:span], span, kv_len, *self.extension(riding), cache.k, cache.v)
            state.advance(logits, self.p, self.version)
        else:
            decode_step(self.decode, self.state, self.cache, span, kv_len, self.p, self.version)
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
        if version != self.version and self.repack is not None:
            self.repack()  # e.g. repack what `update_weights` wrote
        self.version = version

    def run(self) -> None:
        """Run every sample to its end; the results are in ``res_tok``, ``res_lp``, ``res_ver``, ``res_len``
        and ``reasons``."""
        parked = self.policy.parked
        while self.waiting or any(sid >= 0 for sid in self.slot_sample):
            self._refresh()
            decoding = any(sid >= 0 and s not in parked for s, sid in enumerate(self.slot_sample))
            if self.policy.resume(self, block=not decoding and not (self.waiting and self.slots.free),
                                  can_ride=decoding):
                continue
            if self.waiting and self.slots.free:
                self.admit()
                continue
            if decoding:
                self.step()
        self.cache.prefixes = self.slots.cached
