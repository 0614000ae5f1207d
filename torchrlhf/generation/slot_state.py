"""What each slot is doing, kept on the device so the decode loop runs without the host.

Every decode step samples a token for each slot, writes it where the slot is live and ends the slot's turn
when the token is a stop id or the turn's budget is spent, all in tensors. The host reads the state only at
a look (`SlotState.read`: one synchronisation), every ``check_every`` steps. Rows of slots that hold no
sample, or whose turn has ended, compute junk that is never written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchrlhf.generation.sampling import SamplingParams, sample_tokens


class SlotState:
    """Per-slot decode state of one `generate` call, pre-allocated for ``slots`` x ``max_tokens``.

    Per slot: ``cur`` the token the next step feeds, ``pos`` the position it goes to, ``step`` the model
    tokens sampled so far (over all turns), ``live`` whether it decodes, ``limit`` the ``step`` its turn
    ends at, ``uni`` its sampling uniforms, ``out_tok`` / ``out_lp`` / ``out_ver`` what it sampled, with
    which log-prob and weight version. ``stopped``: the turn's last token is a stop id; ``nonfinite``: a
    sampled log-prob was NaN or inf.

    Args:
        stop_ids: the token ids that end a turn, on ``device``.
        scratch: the cache position of a slot with nothing to compute (`KVCache.scratch`).
        versions: record each token's weight version (partial rollouts).
        routes: ``(moe_layers, top_k)``: record the experts each fed token was routed to (``out_route``
            [slots, max_tokens, moe_layers, top_k]; index t holds token t's route as the next step's input).
    """

    def __init__(self, slots: int, max_tokens: int, stop_ids: torch.Tensor, scratch: int, device: torch.device,
                 versions: bool = False, routes: tuple[int, int] | None = None) -> None:
        self.stop_ids, self.scratch, self.versions = stop_ids, scratch, versions
        self.cur = torch.zeros(slots, dtype=torch.long, device=device)
        self.pos = torch.full((slots,), scratch, dtype=torch.long, device=device)
        self.step = torch.zeros(slots, dtype=torch.long, device=device)
        self.live = torch.zeros(slots, dtype=torch.long, device=device)
        self.limit = torch.zeros(slots, dtype=torch.long, device=device)
        self.uni = torch.zeros(slots, max_tokens, dtype=torch.float64, device=device)
        self.out_tok = torch.zeros(slots, max_tokens, dtype=torch.long, device=device)
        self.out_lp = torch.zeros(slots, max_tokens, dtype=torch.float32, device=device)
        self.out_ver = torch.zeros(slots, max_tokens, dtype=torch.long, device=device)
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self.nonfinite = torch.zeros(slots, dtype=torch.bool, device=device)
        self.out_route = (torch.zeros(slots, max_tokens, *routes, dtype=torch.int16, device=device)
                          if routes is not None else None)

    def _per_slot(self) -> tuple[torch.Tensor, ...]:
        route = (self.out_route,) if self.out_route is not None else ()
        return (self.cur, self.pos, self.step, self.live, self.limit, self.uni, self.out_tok, self.out_lp,
                self.out_ver, self.stopped, self.nonfinite, *route)

    def start_turn(self, slots: torch.Tensor, logits: torch.Tensor, params: SamplingParams, pos: torch.Tensor,
                   budget: torch.Tensor, version: int | torch.Tensor) -> None:
        """Sample each slot's first token of a turn from ``logits`` [b, V] (its context's last position),
        make the slot live from token index ``step`` (0 for a new sample), with the next token at ``pos``
        and ``budget`` more tokens this turn; then end at once the turns that that token ends."""
        step = self.step[slots]
        tok, lp = sample_tokens(logits, self.uni[slots, step], params, check_finite=False)
        self.out_tok[slots, step] = tok
        self.out_lp[slots, step] = lp
        if self.versions:
            self.out_ver[slots, step] = version
        self.limit[slots] = step + budget
        self.cur[slots] = tok
        self.pos[slots] = pos
        self.step[slots] = step + 1
        self.live[slots] = 1
        self.stopped[slots] = False
        self.end_turns(slots, tok, lp)

    def restore(self, slots: Sequence[int], carried: Sequence) -> None:
        """Slots ``slots`` continue carried samples (`torchrlhf.generation.base.CarriedSample`): they hold the
        tokens, log-probs and versions sampled so far, and their next token is token ``len(tokens)``."""
        for slot, c in zip(slots, carried):
            t = len(c.tokens)
            self.out_tok[slot, :t] = c.tokens.to(self.out_tok.device)
            self.out_lp[slot, :t] = c.log_probs.to(self.out_lp.device, torch.float32)
            self.out_ver[slot, :t] = c.versions.to(self.out_ver.device)
            self.step[slot] = t

    def advance(self, logits: torch.Tensor, params: SamplingParams, version: int,
                routes: torch.Tensor | None = None) -> None:
        """A decode step's sampling over slots ``0 .. span - 1`` (``logits`` [span, V]): each live slot
        takes its next token, writes it and moves on one position; the others keep their token and write
        nothing. ``routes`` [span, moe_layers, top_k]: the experts the step's input tokens went to, kept for
        the live slots at their input token's index."""
        span = logits.shape[0]
        rows = torch.arange(span, device=logits.device)
        step = self.step[:span].clamp(max=self.out_tok.shape[1] - 1)
        live = self.live[:span]
        if routes is not None and self.out_route is not None:
            fed = (self.step[:span] - 1).clamp(min=0)  # the input token was sampled at index step - 1
            kept = torch.where(live.bool()[:, None, None], routes.to(torch.int16), self.out_route[rows, fed])
            self.out_route[rows, fed] = kept
        tok, lp = sample_tokens(logits, self.uni[rows, step], params, check_finite=False)
        keep = live.bool()
        tok = torch.where(keep, tok, self.cur[:span])
        self.out_tok[rows, step] = torch.where(keep, tok, self.out_tok[rows, step])
        self.out_lp[rows, step] = torch.where(keep, lp, self.out_lp[rows, step])
        if self.versions:
            self.out_ver[rows, step] = torch.where(keep, version, self.out_ver[rows, step])
        self.cur[:span] = tok
        self.pos[:span] += live
        self.step[:span] += live
        self.end_turns(rows, tok, lp)

    def end_turns(self, slots: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """End, without a host synchronisation, the turn of each live slot of ``slots`` whose newest token
        ``tok`` is a stop id or reaches its limit: it stops advancing until the host frees it or hands the
        turn on. Slots that are not live are left alone."""
        live = self.live[slots].bool()
        hit = torch.isin(tok, self.stop_ids) & live
        ended = hit | (live & (self.step[slots] >= self.limit[slots]))
        self.stopped[slots] |= hit
        self.nonfinite[slots] |= live & ~torch.isfinite(lp)
        self.live[slots] = (live & ~ended).long()

    def read(self, slots: Sequence[int]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """The host's look, one synchronisation: ``live``, ``stopped``, ``pos``, ``step`` and ``nonfinite``
        of ``slots``, as lists."""
        slot_t = torch.tensor(list(slots), device=self.cur.device)
        state = torch.stack([self.live[slot_t], self.stopped[slot_t].long(), self.pos[slot_t], self.step[slot_t],
                             self.nonfinite[slot_t].long()])
        live, stopped, pos, step, bad = state.tolist()
        return live, stopped, pos, step, bad

    def cut(self, slot: int, step: int, token: int, pos: int) -> None:
        """End ``slot``'s turn after its first ``step`` tokens (a stop string ended at token ``token``); the
        tokens sampled after it are dropped and the next one goes to ``pos``."""
        self.live[slot], self.stopped[slot], self.step[slot], self.cur[slot], self.pos[slot] = 0, True, step, token, pos

    def take(self, slots: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """What ``slots`` sampled, on the host (tokens, log-probs, versions [b, max_tokens], lengths [b], and
        with routes the experts [b, max_tokens, moe_layers, top_k]), and free them."""
        slot_t = torch.tensor(list(slots), device=self.cur.device)
        out = (self.out_tok[slot_t].cpu(), self.out_lp[slot_t].cpu(), self.out_ver[slot_t].cpu(),
               self.step[slot_t].cpu())
        if self.out_route is not None:
            out += (self.out_route[slot_t].cpu(),)
            self.out_route[slot_t] = 0
        self.live[slot_t] = 0
        self.pos[slot_t] = self.scratch
        self.step[slot_t] = 0
        self.stopped[slot_t] = False
        return out

    def move(self, dst: Sequence[int], src: Sequence[int]) -> None:
        """Slots ``src`` move to the free slots ``dst`` (compaction); ``src`` are left free."""
        d = torch.tensor(list(dst), device=self.cur.device)
        s = torch.tensor(list(src), device=self.cur.device)
        for t in self._per_slot():
            t[d] = t[s]
        self.live[s] = 0
        self.pos[s] = self.scratch
        self.step[s] = 0
