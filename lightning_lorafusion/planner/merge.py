"""Cross-batch merge: pull samples of later microbatches into underfilled earlier ones.

Walking the plan front to back, each microbatch with free capacity takes samples from the
next ``lookahead`` microbatches: first whole microbatches (a full move, which deletes the
emptied one), then single samples, longest first (a partial move). A sample of adapter b's
batch r may move to position i only if i is at least S microbatches after batch r-1's step
point; moving a sample earlier never hurts anyone else (it can only pull its own batch's
step point earlier). Deleting an emptied microbatch shortens every gap that spans it, so a
deletion happens only when every such gap stays >= S; otherwise the last sample stays put.
"""

from __future__ import annotations

from .plan import SampleRef, padded_length


class _DeletedCounter:
    """Fenwick tree over microbatch positions: how many deleted positions lie before i."""

    def __init__(self, n: int):
        self.tree = [0] * (n + 1)

    def mark(self, i: int) -> None:
        i += 1
        while i < len(self.tree):
            self.tree[i] += 1
            i += i & -i

    def before(self, i: int) -> int:
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total


class _MergeState:
    """Microbatches (deleted ones stay as empty, marked slots so indices never shift), with
    per-adapter token sums and the positions of every (adapter, batch)."""

    def __init__(self, bins: list[list[SampleRef]], capacity: int, pad_multiple: int, num_stages: int):
        self.bins = [list(b) for b in bins]
        self.capacity, self.pad, self.stages = capacity, pad_multiple, num_stages
        self.deleted = [False] * len(self.bins)
        self.counter = _DeletedCounter(len(self.bins))
        self.tokens: list[dict[int, int]] = []
        self.where: dict[tuple[int, int], dict[int, int]] = {}
        for i, content in enumerate(self.bins):
            per: dict[int, int] = {}
            for s in content:
                per[s.adapter] = per.get(s.adapter, 0) + s.length
                pos = self.where.setdefault((s.adapter, s.batch), {})
                pos[i] = pos.get(i, 0) + 1
            self.tokens.append(per)
        self.batches: dict[int, list[int]] = {}
        for a, r in sorted(self.where):
            self.batches.setdefault(a, []).append(r)

    def rank(self, i: int) -> int:
        """Position of microbatch i once deleted slots are dropped."""
        return i - self.counter.before(i)

    def load(self, i: int) -> int:
        return sum(padded_length(t, self.pad) for t in self.tokens[i].values())

    def grow(self, i: int, adapter: int, length: int) -> int:
        old = self.tokens[i].get(adapter, 0)
        return padded_length(old + length, self.pad) - padded_length(old, self.pad)

    def step(self, key: tuple[int, int]) -> int | None:
        pos = self.where.get(key)
        return max(pos) if pos else None

    def first(self, key: tuple[int, int]) -> int | None:
        pos = self.where.get(key)
        return min(pos) if pos else None

    def may_hold(self, i: int, s: SampleRef) -> bool:
        """Bubble lemma for putting s at position i (its previous batch's step is fixed)."""
        prev = self.step((s.adapter, s.batch - 1))
        return prev is None or self.rank(i) - self.rank(prev) >= self.stages

    def move(self, s: SampleRef, src: int, dst: int) -> None:
        self.bins[src].remove(s)
        self.bins[dst].append(s)
        for i, sign in ((src, -1), (dst, 1)):
            t = self.tokens[i].get(s.adapter, 0) + sign * s.length
            if t:
                self.tokens[i][s.adapter] = t
            else:
                self.tokens[i].pop(s.adapter, None)
            pos = self.where[(s.adapter, s.batch)]
            pos[i] = pos.get(i, 0) + sign
            if pos[i] == 0:
                del pos[i]

    def may_delete(self, j: int) -> bool:
        """True if removing (empty) microbatch j keeps every adapter's batches >= S apart."""
        for a, rounds in self.batches.items():
            # The one batch r of adapter a (if any) with step(r-1) < j < first(r): batches of
            # one adapter are ordered, so first(r) grows with r and bisection finds it.
            lo, hi = 0, len(rounds)
            while lo < hi:
                mid = (lo + hi) // 2
                if self.first((a, rounds[mid])) > j:
                    hi = mid
                else:
                    lo = mid + 1
            if lo == len(rounds):
                continue
            r = rounds[lo]
            prev = self.step((a, r - 1))
            if prev is not None and prev < j:
                first = self.first((a, r))
                if self.rank(first) - self.rank(prev) - 1 < self.stages:
                    return False
        return True

    def delete(self, j: int) -> None:
        assert not self.bins[j] and not self.deleted[j]
        self.deleted[j] = True
        self.counter.mark(j)

    def following(self, i: int, lookahead: int) -> list[int]:
        """The next ``lookahead`` live microbatches after i."""
        out = []
        j = i + 1
        while j < len(self.bins) and len(out) < lookahead:
            if not self.deleted[j]:
                out.append(j)
            j += 1
        return out


def merge_across_batches(
    bins: list[list[SampleRef]],
    *,
    capacity: int,
    pad_multiple: int,
    num_stages: int,
    lookahead: int = 32,
) -> list[list[SampleRef]]:
    """Merged microbatches (same samples, same or fewer microbatches, lemma kept if it held)."""
    st = _MergeState(bins, capacity, pad_multiple, num_stages)
    for i in range(len(st.bins)):
        if st.deleted[i]:
            continue
        # Full moves: absorb a whole later microbatch and delete it.
        for j in st.following(i, lookahead):
            content = st.bins[j]
            merged = dict(st.tokens[i])
            for s in content:
                merged[s.adapter] = merged.get(s.adapter, 0) + s.length
            fits = sum(padded_length(t, pad_multiple) for t in merged.values()) <= capacity
            if content and fits and all(st.may_hold(i, s) for s in content):
                moved = list(content)
                for s in moved:
                    st.move(s, j, i)
                if st.may_delete(j):
                    st.delete(j)
                    continue
                for s in moved:
                    st.move(s, i, j)
        # Partial moves: longest samples that fit, never emptying a microbatch we may not delete.
        for j in st.following(i, lookahead):
            if st.load(i) >= capacity:
                break
            for s in sorted(st.bins[j], key=lambda s: (-s.length, s.adapter, s.batch, s.index)):
                if st.load(i) + st.grow(i, s.adapter, s.length) > capacity or not st.may_hold(i, s):
                    continue
                st.move(s, j, i)
                if not st.bins[j]:
                    if st.may_delete(j):
                        st.delete(j)
                    else:
                        st.move(s, i, j)
                    break
    return [sorted(b) for b, gone in zip(st.bins, st.deleted) if not gone]
