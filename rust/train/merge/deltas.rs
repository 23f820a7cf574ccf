//! The count changes of one merge, recorded while its words are rewritten and applied
//! to the pair table afterwards.

use super::{pack, unpack, NONE};

/// Count changes of one pair during one merge, and the words that gained it (a chain
/// through `Deltas::adds`).
#[derive(Clone, Copy)]
pub(super) struct DeltaEntry {
    pub(super) count: i64,
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) n: u32,
    /// The last word chained (NONE before the first), to skip repeats without reading
    /// `adds` (it fits in the entry's padding).
    pub(super) last: u32,
}

impl DeltaEntry {
    pub(super) const EMPTY: DeltaEntry = DeltaEntry { count: 0, head: NONE, tail: NONE, n: 0, last: NONE };
}

/// The count changes of one merge (or of one worker's share of it). The words that
/// gained a pair are kept in one flat array, chained per pair, so recording them
/// allocates nothing.
///
/// Every pair a merge of (a, b) into x changes has one of four shapes: (s, a), (b, s),
/// (s, x) or (x, s), where s is the neighbouring symbol. A neighbour s other than a, b
/// and x (nearly every one) has its two pairs on a side in one group of adjacent
/// entries: (s, a) and (s, x) on the left, (b, s) and (x, s) on the right; the first
/// loses what the second gains. The group is found by s in an array indexed by symbol,
/// one per side: no hashing and no probing, where this sits inside the innermost loop
/// of training. In those arrays a, b and x are marked `OF_MERGE`, so the one load that
/// finds a group also tells a neighbour of the merge apart; the pairs of two symbols of
/// the merge (at most nine) have slots of their own. `begin` sets the merge; `clear`
/// empties the slots used.
#[derive(Default)]
pub(super) struct Deltas {
    pub(super) merge: (u32, u32, u32),
    /// 1 + index into `entries` (0: no entry yet) of the group of neighbour s on the
    /// left (of (s, a) then (s, x)) and on the right (of (b, s) then (x, s)), at index s;
    /// `OF_MERGE` at a, b and x. As long as the symbol count.
    pub(super) left_groups: Vec<u32>,
    pub(super) right_groups: Vec<u32>,
    /// 1 + index into `entries` (0: none) of each pair of two symbols of the merge, at
    /// `3 * role(p) + role(q)`.
    pub(super) merge_pairs: [u32; 9],
    pub(super) entries: Vec<(u64, DeltaEntry)>,
    /// (word, index of the next entry of the same pair's chain).
    pub(super) adds: Vec<(u32, u32)>,
}

/// The mark of a symbol of the merge in the group arrays of `Deltas`.
pub(super) const OF_MERGE: u32 = u32::MAX;

impl Deltas {
    /// Start recording the changes of merging (a, b) into x, with `symbols` symbols in
    /// all (x included). The deltas must be empty.
    pub(super) fn begin(&mut self, a: u32, b: u32, x: u32, symbols: usize) {
        debug_assert!(self.entries.is_empty());
        if self.left_groups.len() < symbols {
            // Grown in steps, so that the growth is rare.
            let len = symbols.next_power_of_two().max(1 << 10);
            self.left_groups.resize(len, 0);
            self.right_groups.resize(len, 0);
        }
        // The marks of the merge before (if any) go, whether or not it was recorded here.
        self.mark_merge(0);
        self.merge = (a, b, x);
        self.mark_merge(OF_MERGE);
    }

    /// Set the group slots of a, b and x (the arrays, which only grow, cover every merge's).
    pub(super) fn mark_merge(&mut self, mark: u32) {
        let (a, b, x) = self.merge;
        for s in [a, b, x] {
            self.left_groups[s as usize] = mark;
            self.right_groups[s as usize] = mark;
        }
    }

    /// The group slot of neighbour `s` on one side (see `left_groups`).
    #[inline(always)]
    pub(super) fn group_slot(&self, s: u32, left: bool) -> u32 {
        if left {
            self.left_groups[s as usize]
        } else {
            self.right_groups[s as usize]
        }
    }

    /// Whether `s` is a symbol of the merge (a, b or the new x).
    #[inline(always)]
    pub(super) fn of_merge(&self, s: u32) -> bool {
        let (a, b, x) = self.merge;
        s == a || s == b || s == x
    }

    /// 0, 1, 2 for a, b, x (0 for b when a == b).
    #[inline]
    pub(super) fn role(&self, s: u32) -> usize {
        let (a, b, x) = self.merge;
        debug_assert!(self.of_merge(s));
        if s == a {
            0
        } else if s == b {
            1
        } else {
            debug_assert_eq!(s, x);
            2
        }
    }

    /// Record one occurrence merged next to neighbour `s` (on its left or right side), in
    /// a word of count `c`: the pair of s with a (or b) loses c, its pair with x gains c,
    /// and word `w` gains that pair.
    #[inline(always)]
    pub(super) fn shift(&mut self, s: u32, left: bool, c: i64, w: u32) {
        let slot = self.group_slot(s, left);
        let k = if slot.wrapping_sub(1) < OF_MERGE - 1 {
            (slot - 1) as usize
        } else if slot == 0 {
            self.new_group(s, left)
        } else {
            // A symbol of the merge: its pairs are in no group.
            let (a, b, x) = self.merge;
            let (lost, gained) = if left { (pack(s, a), pack(s, x)) } else { (pack(b, s), pack(x, s)) };
            // The merged pair itself is not recorded (it is gone); a pair with x never is it.
            if lost != pack(a, b) {
                self.add(lost, -c, NONE);
            }
            self.add(gained, c, w);
            return;
        };
        self.add_at(k, -c, NONE);
        self.add_at(k + 1, c, w);
    }

    /// The group of neighbour `s` (not a symbol of the merge) on one side: the entries of
    /// its lost and its gained pair, at the returned index and the next.
    #[inline(always)]
    pub(super) fn group(&mut self, s: u32, left: bool) -> usize {
        let slot = self.group_slot(s, left);
        debug_assert!(slot != OF_MERGE);
        if slot != 0 {
            return (slot - 1) as usize;
        }
        self.new_group(s, left)
    }

    /// Make the (empty) group of neighbour `s` on one side.
    #[inline]
    pub(super) fn new_group(&mut self, s: u32, left: bool) -> usize {
        let k = self.entries.len();
        let (a, b, x) = self.merge;
        let keys = if left {
            self.left_groups[s as usize] = k as u32 + 1;
            [pack(s, a), pack(s, x)]
        } else {
            self.right_groups[s as usize] = k as u32 + 1;
            [pack(b, s), pack(x, s)]
        };
        for key in keys {
            self.entries.push((key, DeltaEntry::EMPTY));
        }
        k
    }

    /// The index of `key`'s entry, created (zero) if needed. `key` must have one of the
    /// four shapes; no pair is in two entries.
    #[inline(always)]
    pub(super) fn entry(&mut self, key: u64) -> usize {
        let (p, q) = unpack(key);
        let x = self.merge.2;
        if !self.of_merge(p) {
            debug_assert!(q == self.merge.0 || q == x, "not a pair of this merge");
            return self.group(p, true) + (q == x) as usize;
        }
        if !self.of_merge(q) {
            debug_assert!(p == self.merge.1 || p == x, "not a pair of this merge");
            return self.group(q, false) + (p == x) as usize;
        }
        let i = 3 * self.role(p) + self.role(q);
        if self.merge_pairs[i] == 0 {
            self.entries.push((key, DeltaEntry::EMPTY));
            self.merge_pairs[i] = self.entries.len() as u32;
        }
        (self.merge_pairs[i] - 1) as usize
    }

    #[inline(always)]
    pub(super) fn add(&mut self, key: u64, d: i64, w: u32) {
        let k = self.entry(key);
        self.add_at(k, d, w);
    }

    /// Add `d` to entry `k`'s count and chain word `w` (unless NONE) to it.
    #[inline(always)]
    pub(super) fn add_at(&mut self, k: usize, d: i64, w: u32) {
        let e = &mut self.entries[k].1;
        e.count += d;
        if w != NONE && e.last != w {
            e.last = w;
            let i = self.adds.len() as u32;
            self.adds.push((w, NONE));
            if e.tail == NONE {
                e.head = i;
            } else {
                self.adds[e.tail as usize].1 = i;
            }
            e.tail = i;
            e.n += 1;
        }
    }

    /// The words chained from `head`.
    pub(super) fn words(&self, head: u32) -> impl Iterator<Item = u32> + '_ {
        let mut i = head;
        std::iter::from_fn(move || {
            if i == NONE {
                return None;
            }
            let (w, next) = self.adds[i as usize];
            i = next;
            Some(w)
        })
    }

    /// Add another worker's changes to these.
    pub(super) fn absorb(&mut self, other: &mut Deltas) {
        for &(key, e) in other.entries.iter() {
            self.add(key, e.count, NONE);
            let mut i = e.head;
            while i != NONE {
                let (w, next) = other.adds[i as usize];
                self.add(key, 0, w);
                i = next;
            }
        }
        other.clear();
    }

    pub(super) fn clear(&mut self) {
        // A pair (p, q) with p outside the merge is in p's left group, else, with q
        // outside, in q's right group; the slot of a symbol of the merge keeps its mark.
        // So both slots are reset, but for marks (no branch on the shape).
        let unless_marked = |slot: &mut u32| *slot = 0u32.wrapping_sub((*slot == OF_MERGE) as u32);
        for &(key, _) in &self.entries {
            let (p, q) = unpack(key);
            unless_marked(&mut self.left_groups[p as usize]);
            unless_marked(&mut self.right_groups[q as usize]);
        }
        self.merge_pairs = [0; 9];
        self.entries.clear();
        self.adds.clear();
    }
}
