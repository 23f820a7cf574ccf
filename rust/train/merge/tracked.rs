//! The pairs the merge loop tracks: their table and heap, and the pruning floor below
//! which pairs are not tracked (see "Pruning" in the module docs).

use hashbrown::hash_map::Entry;

use super::deltas::Deltas;
use super::heap::PairHeap;
use super::pairs::{PairStats, Pairs, WordList};
use super::symbols::Tokens;
use super::words::Words;
use super::{pack, unpack, FxMap};

pub(super) struct Tracked {
    pub(super) pairs: Pairs,
    pub(super) heap: PairHeap,
    /// Every untracked pair counts less than this; tracked counts are exact.
    pub(super) floor: i64,
}

impl Tracked {
    /// Count all pairs of `words` afresh and track those of count `floor` or more, where
    /// `floor` is `want`, lowered to the greatest count if need be (so that the best pair
    /// is always tracked and the merge loop makes progress).
    pub(super) fn recount(words: &Words, ids: &[u32], tokens: &Tokens, want: i64, bytes_only: bool) -> Tracked {
        let pairs = Pairs::build(words, ids, rayon::current_num_threads(), bytes_only);
        let max = pairs.shards.iter().flat_map(|m| m.values().map(|p| p.count)).max().unwrap_or(0);
        let mut t = Tracked { pairs, heap: PairHeap { v: Vec::new() }, floor: 1 };
        t.raise_floor(want.min(max).max(1), tokens);
        t
    }

    /// Forget the pairs whose count is below `floor` and rebuild the heap of the rest.
    pub(super) fn raise_floor(&mut self, floor: i64, tokens: &Tokens) {
        self.floor = floor;
        if floor > 1 {
            for m in self.pairs.shards.iter_mut() {
                m.retain(|_, p| p.count >= floor);
            }
        }
        self.heap =
            PairHeap { v: self.pairs.shards.iter().flat_map(|m| m.iter().map(|(&k, p)| (p.count, k))).collect() };
        self.heap.heapify(tokens);
    }

    /// Pop the best tracked pair: the top entry once it matches the pair's current count.
    /// A top entry whose pair has fewer occurrences now takes that count and sinks; one
    /// whose pair is gone (or has a newer entry with a higher count) is dropped. None
    /// when no pair is tracked.
    pub(super) fn pop_best(&mut self, tokens: &Tokens) -> Option<u64> {
        while let Some((cnt, key)) = self.heap.peek() {
            match self.pairs.get(key) {
                Some(p) if p.count == cnt => {
                    debug_assert!(cnt >= self.floor);
                    self.heap.pop(tokens);
                    return Some(key);
                }
                Some(p) if p.count < cnt => self.heap.lower_top(tokens, p.count),
                _ => {
                    self.heap.pop(tokens);
                }
            }
        }
        None
    }

    /// Apply the count changes of a merge into `x` (`known_bytes`: an earlier merge made
    /// its bytes, so `x` is not new); pairs whose count rose get a fresh heap entry.
    pub(super) fn apply(&mut self, d0: &Deltas, tokens: &Tokens, x: u32, known_bytes: bool) {
        let floor = self.floor;
        for &(key, ref d) in d0.entries.iter() {
            let (ka, kb) = unpack(key);
            if !known_bytes && (ka == x || kb == x) {
                // A pair of a new symbol is new: no lookup needed, and below the floor it
                // is not tracked at all.
                debug_assert!(self.pairs.get(key).is_none());
                if d.count >= floor.max(1) {
                    let mut list = WordList::with_capacity(d.n as usize);
                    list.extend(d0.words(d.head));
                    self.pairs.shard(key).insert(key, PairStats { count: d.count, words: list });
                    self.heap.push(tokens, (d.count, key));
                }
                continue;
            }
            match self.pairs.shard(key).entry(key) {
                Entry::Occupied(mut e) => {
                    let p = e.get_mut();
                    p.count += d.count;
                    debug_assert!(p.count >= 0);
                    if p.count <= 0 || (p.count < floor && d.count <= 0) {
                        e.remove();
                    } else {
                        p.words.reserve(d.n as usize);
                        p.words.extend(d0.words(d.head));
                        if d.count > 0 {
                            self.heap.push(tokens, (p.count, key));
                        }
                    }
                }
                Entry::Vacant(v) => {
                    debug_assert!(d.count >= 0 || floor > 1);
                    if d.count >= floor.max(1) {
                        let mut list = WordList::with_capacity(d.n as usize);
                        list.extend(d0.words(d.head));
                        v.insert(PairStats { count: d.count, words: list });
                        self.heap.push(tokens, (d.count, key));
                    }
                }
            }
        }
    }

    /// After a merge into `x` whose bytes an earlier merge already made: pairs with `x`
    /// may have had untracked occurrences before this merge, which its deltas do not
    /// show. Count every pair with `x` exactly from the words and track those of count
    /// `floor` or more (replacing what is tracked of them). Pairs without `x` only lost
    /// occurrences.
    pub(super) fn rescan_symbol(&mut self, words: &Words, ids: &[u32], x: u32, tokens: &Tokens) {
        let mut found: FxMap<u64, PairStats> = FxMap::default();
        for &w in ids {
            let s = words.symbols(w);
            if !s.contains(&x) {
                continue;
            }
            let c = words.count(w);
            for i in 0..s.len() - 1 {
                if s[i] == x || s[i + 1] == x {
                    let e = found
                        .entry(pack(s[i], s[i + 1]))
                        .or_insert_with(|| PairStats { count: 0, words: WordList::new() });
                    e.count += c;
                    if e.words.last() != Some(&w) {
                        e.words.push(w);
                    }
                }
            }
        }
        for (key, st) in found {
            if st.count >= self.floor {
                self.heap.push(tokens, (st.count, key));
                self.pairs.shard(key).insert(key, st);
            } else {
                self.pairs.shard(key).remove(&key);
            }
        }
    }
}
