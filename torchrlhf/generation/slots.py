"""Which KV-cache slots a `generate` call may use, and what a free slot still holds: the prefix cache.

A finished sample's slot keeps its keys/values until the slot is needed again; `SlotPool.place` computes a
later prompt from the longest cached prefix it starts with. The pool only does the bookkeeping (slot
numbers and token lists); the engine moves the keys/values it decides on.
"""

from __future__ import annotations

# The shortest cached prefix a prompt is computed from (vLLM's KV block size): below it the saved compute
# does not pay for a forward call of its own.
MIN_CACHED_PREFIX = 16


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    """How many first tokens ``a`` and ``b`` share (a binary search over list-slice compares, done in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class SlotPool:
    """The free slots of one `generate` call, and the prefix cache it carries over from the last call.

    Args:
        size: the engine's slots (all free when a call starts).
        cached: free slot -> the tokens whose keys/values it holds (the engine's ``cached_prefixes``); a slot
            taken for another sample loses its entry.
    """

    def __init__(self, size: int, cached: dict[int, list[int]]) -> None:
        self.free = set(range(size))
        self.cached = cached

    def take(self) -> int:
        """The lowest free slot that holds no cached prefix, else the lowest free one (its prefix dropped)."""
        plain = [s for s in self.free if s not in self.cached]
        slot = min(plain) if plain else min(self.free)
        self.free.discard(slot)
        self.cached.pop(slot, None)
        return slot

    def place(self, tokens: list[int]) -> tuple[int, int, int | None]:
        """A slot for computing the prompt ``tokens``: ``(slot, held, source)``, where the slot will hold the
        first ``held`` tokens before the rest is computed, copied from slot ``source`` (None: no copy).

        It is the slot of the longest cached prefix the prompt continues whole, or a fresh slot with the
        longest shared prefix copied in, when that prefix is worth a forward call of its own (at least half
        the prompt and `MIN_CACHED_PREFIX` tokens; the source stays cached); else a fresh slot and 0. The
        prompt's last token is always computed: it gives the logits of the first sampled token.
        """
        best, length = -1, 0
        for slot, cached in self.cached.items():
            shared = min(shared_prefix_len(cached, tokens), len(tokens) - 1)
            if shared > length:
                best, length = slot, shared
        if length < MIN_CACHED_PREFIX or 2 * length < len(tokens):
            return self.take(), 0, None
        if length == len(self.cached[best]):  # the prompt continues all the slot holds: compute it there
            self.free.discard(best)
            del self.cached[best]
            return best, length, None
        slot = self.take()
        return slot, length, (None if slot == best else best)

    def give_back(self, slot: int, holds: list[int] | None = None) -> None:
        """Free ``slot``; ``holds``: the tokens whose keys/values it keeps for later prompts (None: nothing)."""
        if holds is not None:
            self.cached[slot] = holds
        self.free.add(slot)

    def move(self, dst: int, src: int) -> None:
        """A sample moves from ``src`` to the free slot ``dst`` (compaction): ``dst``'s cached prefix is
        overwritten, and ``src`` is free, holding nothing recorded."""
        self.free.discard(dst)
        self.cached.pop(dst, None)
        self.free.add(src)
