//! Stages 3 and 4: build words and pair counts, then merge.
//!
//! * Words are the unique pre-tokens as symbol sequences in one flat array; a merge
//!   rewrites a word in place (it only gets shorter), in one left-to-right pass; where
//!   the CPU has AVX-512F or AVX2 (`Simd::detected`), a word of up to 16 symbols (nearly
//!   all) is searched with vector compares and, with one occurrence, rewritten by masked
//!   stores (`vector`).
//! * `pairs` maps each adjacent symbol pair to its weighted count and the list of
//!   words that contain it. Lists are append-only and may hold stale or repeated
//!   word ids (deduplicated lazily); every word that contains the pair is in it.
//! * A max-heap orders pairs by (count, bytes of left, bytes of right), so among
//!   equal counts the lexicographically greatest pair wins. Entries are invalidated
//!   lazily: a popped entry whose count is no longer current is re-pushed or dropped.
//! * Symbols are identified by their bytes: if a merge produces bytes that some
//!   earlier merge already produced, both merges yield the same symbol, as in a
//!   trainer that keeps pre-tokens as tuples of bytes.
//! * Pruning. A pair's count never rises after the merge that creates it: the pairs a
//!   merge gains all contain its new symbol, and every other pair only loses
//!   occurrences. So a pair created with a count below `floor` stays below it, and
//!   while the best tracked pair has a count of at least `floor`, untracked pairs can
//!   neither win nor tie: they need no entry, no heap slot and no word list.
//!   Invariant: every untracked pair counts less than `floor`; tracked counts are
//!   exact. After the first merges, `floor` is set from the counts seen so far,
//!   extrapolated to the last merge with a safety margin. When no tracked pair is
//!   left, all pairs are recounted from the words (exactly) and the floor is lowered to
//!   at most the greatest count. The one exception to "never rises", a merge whose
//!   bytes an earlier merge already made (its symbol is not new, so pairs with it may
//!   have had untracked occurrences), is followed by an exact rescan of that symbol's
//!   pairs. Most pairs a merge creates are rare, so this keeps the pair table and the
//!   heap small. The merges are the same as without pruning.

use hashbrown::hash_map::Entry;
use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use super::count::PieceCounts;
use super::{Control, TrainError};

type FxMap<K, V> = HashMap<K, V, FxBuildHasher>;

/// How many words ahead of the one being rewritten to prefetch.
const PREFETCH: usize = 8;

#[inline]
fn pack(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

#[inline]
fn unpack(p: u64) -> (u32, u32) {
    ((p >> 32) as u32, p as u32)
}

/// The unique pre-tokens of a corpus as symbol sequences, with their counts.
/// Pre-tokens of a single byte have no pair and are not stored.
///
/// One flat array of records `[len, count_lo, count_hi, sym_0, .., sym_len-1, (spare)]`;
/// a word's id is the offset of its record, so visiting a word touches one place in
/// memory. A merge shrinks `len` and leaves the spare slots at the end.
#[derive(Default)]
pub struct Words {
    data: Vec<u32>,
    /// The ids of the words, in order (taken by the merge loop).
    ids: Vec<u32>,
}

const HEADER: usize = 3;

/// Whether a pre-token becomes a word (one of a single byte has no pair).
#[inline]
fn is_word(bytes: &[u8], count: u64) -> bool {
    bytes.len() >= 2 && count > 0
}

impl Words {
    /// Add a pre-token. Fails only when the table outgrows 32-bit word ids (16 GiB).
    pub fn push(&mut self, bytes: &[u8], count: u64) -> Result<(), TrainError> {
        if !is_word(bytes, count) {
            return Ok(());
        }
        if self.data.len() + HEADER + bytes.len() > u32::MAX as usize {
            return Err(TrainError::InvalidInput(
                "too many distinct pre-tokens for one training run (over 4 G symbols)".into(),
            ));
        }
        self.ids.push(self.data.len() as u32);
        self.data.push(bytes.len() as u32);
        self.data.push(count as u32);
        self.data.push((count >> 32) as u32);
        self.data.extend(bytes.iter().map(|&b| b as u32));
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Words from a table of pre-token counts, built shard by shard in parallel (on the
    /// current rayon pool) straight into one array. Frees the table as it goes.
    pub fn from_counts(counts: PieceCounts) -> Result<Words, TrainError> {
        use rayon::prelude::*;
        use std::mem::MaybeUninit;
        // Each shard's share of the array, so that the shards can write in parallel.
        let sizes: Vec<usize> = counts
            .shards
            .par_iter()
            .map(|shard| {
                let mut len = 0;
                shard.for_each(|piece, n| {
                    if is_word(piece, n) {
                        len += HEADER + piece.len();
                    }
                });
                len
            })
            .collect();
        let total: usize = sizes.iter().sum();
        if total > u32::MAX as usize {
            return Err(TrainError::InvalidInput(
                "too many distinct pre-tokens for one training run (over 4 G symbols)".into(),
            ));
        }
        let mut data: Vec<u32> = Vec::with_capacity(total);
        super::advise_huge_pages(&data);
        let mut shares: Vec<(usize, &mut [MaybeUninit<u32>])> = Vec::with_capacity(sizes.len());
        let mut rest = &mut data.spare_capacity_mut()[..total];
        let mut start = 0;
        for &len in &sizes {
            let (share, tail) = rest.split_at_mut(len);
            shares.push((start, share));
            rest = tail;
            start += len;
        }
        let ids: Vec<Vec<u32>> = counts
            .shards
            .into_par_iter()
            .zip(shares)
            .map(|(shard, (start, share))| {
                let mut ids = Vec::with_capacity(shard.len());
                let mut at = 0;
                shard.for_each(|piece, n| {
                    if is_word(piece, n) {
                        let rec = &mut share[at..at + HEADER + piece.len()];
                        rec[0].write(piece.len() as u32);
                        rec[1].write(n as u32);
                        rec[2].write((n >> 32) as u32);
                        for (slot, &b) in rec[HEADER..].iter_mut().zip(piece) {
                            slot.write(b as u32);
                        }
                        ids.push((start + at) as u32);
                        at += rec.len();
                    }
                });
                // The same pieces as counted for `sizes`: the share is written whole.
                assert_eq!(at, share.len(), "a count table changed while words were built from it");
                ids
            })
            .collect();
        // SAFETY: the shares cover data[..total] and each was written whole (asserted).
        unsafe { data.set_len(total) };
        Ok(Words { data, ids: ids.concat() })
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The most merges these words allow: each merge joins at least one pair of symbols
    /// in some word, which leaves it one symbol shorter, and a word stops at one.
    pub fn max_merges(&self) -> usize {
        self.ids.iter().map(|&w| self.data[w as usize] as usize - 1).sum()
    }

    /// Ids of all words, in order (taken: the merge loop keeps them).
    fn take_ids(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.ids)
    }

    #[inline]
    fn count(&self, w: u32) -> i64 {
        let w = w as usize;
        (self.data[w + 1] as u64 | (self.data[w + 2] as u64) << 32) as i64
    }

    /// Symbols of word `w`.
    #[inline]
    fn symbols(&self, w: u32) -> &[u32] {
        let w = w as usize;
        &self.data[w + HEADER..w + HEADER + self.data[w] as usize]
    }
}

struct PairStats {
    count: i64,
    /// Most pairs occur in a few words only: those lists live inline, unallocated.
    words: WordList,
}

type WordList = smallvec::SmallVec<[u32; 4]>;

/// Pair statistics in shards by a hash of the pair, so that they can be built in
/// parallel without a final merge.
struct Pairs {
    shards: Vec<FxMap<u64, PairStats>>,
}

impl Pairs {
    #[inline]
    fn shard_index(key: u64, n: usize) -> usize {
        // Multiply-shift range reduction of a mixed key.
        let h = key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
        ((h * n as u64) >> 32) as usize
    }

    #[inline]
    fn shard(&mut self, key: u64) -> &mut FxMap<u64, PairStats> {
        let i = Self::shard_index(key, self.shards.len());
        &mut self.shards[i]
    }

    #[inline]
    fn get(&self, key: u64) -> Option<&PairStats> {
        self.shards[Self::shard_index(key, self.shards.len())].get(&key)
    }

    /// Count all adjacent pairs of the words `ids` into `n` shards, in parallel. Each
    /// worker scans every word and keeps the pairs of its shard, except when
    /// `bytes_only` (see `build_dense`).
    fn build(words: &Words, ids: &[u32], n: usize, bytes_only: bool) -> Pairs {
        use rayon::prelude::*;
        let n = n.max(1);
        if bytes_only {
            return Self::build_dense(words, ids, n);
        }
        let shards = (0..n)
            .into_par_iter()
            .map(|shard| {
                let mut m: FxMap<u64, PairStats> = FxMap::default();
                for &w in ids {
                    let c = words.count(w);
                    let s = words.symbols(w);
                    for i in 0..s.len().saturating_sub(1) {
                        let key = pack(s[i], s[i + 1]);
                        if Self::shard_index(key, n) != shard {
                            continue;
                        }
                        let e = m.entry(key).or_insert_with(|| PairStats { count: 0, words: WordList::new() });
                        e.count += c;
                        if e.words.last() != Some(&w) {
                            e.words.push(w);
                        }
                    }
                }
                m
            })
            .collect();
        Pairs { shards }
    }

    /// `build` when every symbol is still a byte (no merge yet). Each worker tallies its
    /// own contiguous share of the words into a dense table of the 65,536 byte pairs (no
    /// hashing, and no unpredictable branch on whose pair an occurrence is); then each
    /// shard gathers its pairs from all the tables, their word lists joined in word order.
    fn build_dense(words: &Words, ids: &[u32], n: usize) -> Pairs {
        use rayon::prelude::*;
        let share = ids.len().div_ceil(n).max(1);
        let tables: Vec<Vec<PairStats>> = ids
            .par_chunks(share)
            .map(|part| {
                let mut table: Vec<PairStats> =
                    (0..1usize << 16).map(|_| PairStats { count: 0, words: WordList::new() }).collect();
                for &w in part {
                    let c = words.count(w);
                    let s = words.symbols(w);
                    for p in s.windows(2) {
                        debug_assert!(p[0] < 256 && p[1] < 256);
                        let e = &mut table[((p[0] as usize) << 8 | p[1] as usize) & 0xffff];
                        e.count += c;
                        if e.words.last() != Some(&w) {
                            e.words.push(w);
                        }
                    }
                }
                table
            })
            .collect();
        let shards = (0..n)
            .into_par_iter()
            .map(|shard| {
                let mut m: FxMap<u64, PairStats> = FxMap::default();
                for k in 0..1usize << 16 {
                    let key = pack((k >> 8) as u32, k as u32 & 255);
                    let count: i64 = tables.iter().map(|t| t[k].count).sum();
                    if count == 0 || Self::shard_index(key, n) != shard {
                        continue;
                    }
                    let mut list = WordList::with_capacity(tables.iter().map(|t| t[k].words.len()).sum());
                    for t in &tables {
                        list.extend_from_slice(&t[k].words);
                    }
                    m.insert(key, PairStats { count, words: list });
                }
                m
            })
            .collect();
        crate::threads::drop_in_background(tables);
        Pairs { shards }
    }
}

/// The bytes of symbols `0..len()`, back to back in one array.
#[derive(Debug, Default)]
struct SymbolBytes {
    arena: Vec<u8>,
    /// Where each symbol's bytes end in `arena` (they start where the previous ends).
    ends: Vec<usize>,
}

impl SymbolBytes {
    fn len(&self) -> usize {
        self.ends.len()
    }

    #[inline]
    fn range(&self, t: u32) -> std::ops::Range<usize> {
        let t = t as usize;
        (if t == 0 { 0 } else { self.ends[t - 1] })..self.ends[t]
    }

    #[inline]
    fn get(&self, t: u32) -> &[u8] {
        &self.arena[self.range(t)]
    }

    /// The bytes after the last symbol's in `arena`, not yet a symbol.
    fn pending(&self) -> &[u8] {
        &self.arena[self.ends.last().copied().unwrap_or(0)..]
    }
}

/// Learned merges, in order: each as the two symbols it joins and the symbol it makes,
/// with the bytes of every symbol. Symbols 0-255 are the bytes; a merge whose bytes no
/// earlier merge made adds the next symbol (one that did makes the same symbol again).
#[derive(Debug)]
pub struct Merges {
    symbols: SymbolBytes,
    pairs: Vec<(u32, u32)>,
    made: Vec<u32>,
}

impl Merges {
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// The number of symbols (256 bytes and the distinct merge results).
    pub fn num_symbols(&self) -> usize {
        self.symbols.len()
    }

    /// The bytes of symbol `s` (< `num_symbols()`).
    pub fn symbol_bytes(&self, s: u32) -> &[u8] {
        self.symbols.get(s)
    }

    /// Merge `i`: the symbols it joins and the symbol it makes.
    pub fn merge(&self, i: usize) -> ((u32, u32), u32) {
        (self.pairs[i], self.made[i])
    }

    /// The merges as byte strings.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.pairs.iter().map(|&(a, b)| (self.symbol_bytes(a), self.symbol_bytes(b)))
    }

    /// The merges as owned byte strings.
    pub fn to_vecs(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.iter().map(|(a, b)| (a.to_vec(), b.to_vec())).collect()
    }
}

/// The symbols of a training run: their bytes, an 8-byte big-endian prefix of each for
/// fast comparison, and an index of the symbols by their bytes. A merge adds at most
/// one symbol and allocates nothing (amortized).
struct Tokens {
    bytes: SymbolBytes,
    prefix: Vec<u64>,
    /// Symbol ids, found by their bytes.
    by_bytes: hashbrown::HashTable<u32>,
}

fn bytes_hash(b: &[u8]) -> u64 {
    use std::hash::BuildHasher;
    FxBuildHasher.hash_one(b)
}

impl Tokens {
    fn new() -> Self {
        let mut t = Tokens { bytes: SymbolBytes::default(), prefix: Vec::new(), by_bytes: hashbrown::HashTable::new() };
        for b in 0..=255u8 {
            t.bytes.arena.push(b);
            t.add_pending();
        }
        t
    }

    /// Make the pending bytes (see `SymbolBytes::pending`) a new symbol.
    fn add_pending(&mut self) -> u32 {
        let new = self.bytes.pending();
        let mut p = [0u8; 8];
        let n = new.len().min(8);
        p[..n].copy_from_slice(&new[..n]);
        self.prefix.push(u64::from_be_bytes(p));
        let h = bytes_hash(new);
        let id = self.bytes.len() as u32;
        self.bytes.ends.push(self.bytes.arena.len());
        let bytes = &self.bytes;
        self.by_bytes.insert_unique(h, id, |&t| bytes_hash(bytes.get(t)));
        id
    }

    /// The symbol whose bytes are those of `a` then those of `b`, made if there is none
    /// yet, and whether it was there before.
    fn join(&mut self, a: u32, b: u32) -> (u32, bool) {
        let start = self.bytes.arena.len();
        for t in [a, b] {
            let r = self.bytes.range(t);
            self.bytes.arena.extend_from_within(r);
        }
        let bytes = &self.bytes;
        let joined = bytes.pending();
        if let Some(&x) = self.by_bytes.find(bytes_hash(joined), |&t| bytes.get(t) == joined) {
            self.bytes.arena.truncate(start);
            return (x, true);
        }
        (self.add_pending(), false)
    }

    #[inline]
    fn get(&self, t: u32) -> &[u8] {
        self.bytes.get(t)
    }

    /// Compare two symbols by their bytes. Differing prefixes order the byte strings the
    /// same way (zero padding only ties a string with its extension by zero bytes).
    #[inline]
    fn cmp(&self, x: u32, y: u32) -> std::cmp::Ordering {
        if x == y {
            return std::cmp::Ordering::Equal;
        }
        match self.prefix[x as usize].cmp(&self.prefix[y as usize]) {
            std::cmp::Ordering::Equal => self.get(x).cmp(self.get(y)),
            o => o,
        }
    }
}

/// A binary max-heap of (count, pair) whose order breaks count ties by the pairs' bytes.
struct PairHeap {
    v: Vec<(i64, u64)>,
}

impl PairHeap {
    #[inline]
    fn greater(tokens: &Tokens, x: (i64, u64), y: (i64, u64)) -> bool {
        if x.0 != y.0 {
            return x.0 > y.0;
        }
        let (xa, xb) = unpack(x.1);
        let (ya, yb) = unpack(y.1);
        tokens.cmp(xa, ya).then_with(|| tokens.cmp(xb, yb)) == std::cmp::Ordering::Greater
    }

    fn heapify(&mut self, tokens: &Tokens) {
        for i in (0..self.v.len() / 2).rev() {
            self.sift_down(tokens, i);
        }
    }

    fn push(&mut self, tokens: &Tokens, e: (i64, u64)) {
        self.v.push(e);
        let mut i = self.v.len() - 1;
        while i > 0 {
            let parent = (i - 1) / 2;
            if Self::greater(tokens, self.v[i], self.v[parent]) {
                self.v.swap(i, parent);
                i = parent;
            } else {
                break;
            }
        }
    }

    /// The greatest entry, left in place.
    fn peek(&self) -> Option<(i64, u64)> {
        self.v.first().copied()
    }

    /// Lower the count of the greatest entry to `count` (one sift, where a pop and a
    /// push would take two).
    fn lower_top(&mut self, tokens: &Tokens, count: i64) {
        debug_assert!(count <= self.v[0].0);
        self.v[0].0 = count;
        self.sift_down(tokens, 0);
    }

    fn pop(&mut self, tokens: &Tokens) -> Option<(i64, u64)> {
        if self.v.is_empty() {
            return None;
        }
        let top = self.v.swap_remove(0);
        if !self.v.is_empty() {
            self.sift_down(tokens, 0);
        }
        Some(top)
    }

    fn sift_down(&mut self, tokens: &Tokens, mut i: usize) {
        let n = self.v.len();
        loop {
            let l = 2 * i + 1;
            if l >= n {
                break;
            }
            let r = l + 1;
            // The greater child, without a branch on which it is unless counts tie (a
            // coin flip the CPU would mispredict half the time).
            let c = if r < n {
                let (vr, vl) = (self.v[r], self.v[l]);
                let right = if vr.0 == vl.0 { Self::greater(tokens, vr, vl) } else { vr.0 > vl.0 };
                l + right as usize
            } else {
                l
            };
            if Self::greater(tokens, self.v[c], self.v[i]) {
                self.v.swap(c, i);
                i = c;
            } else {
                break;
            }
        }
    }
}

const NONE: u32 = u32::MAX;

/// Count changes of one pair during one merge, and the words that gained it (a chain
/// through `Deltas::adds`).
#[derive(Clone, Copy)]
struct DeltaEntry {
    count: i64,
    head: u32,
    tail: u32,
    n: u32,
    /// The last word chained (NONE before the first), to skip repeats without reading
    /// `adds` (it fits in the entry's padding).
    last: u32,
}

impl DeltaEntry {
    const EMPTY: DeltaEntry = DeltaEntry { count: 0, head: NONE, tail: NONE, n: 0, last: NONE };
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
struct Deltas {
    merge: (u32, u32, u32),
    /// 1 + index into `entries` (0: no entry yet) of the group of neighbour s on the
    /// left (of (s, a) then (s, x)) and on the right (of (b, s) then (x, s)), at index s;
    /// `OF_MERGE` at a, b and x. As long as the symbol count.
    left_groups: Vec<u32>,
    right_groups: Vec<u32>,
    /// 1 + index into `entries` (0: none) of each pair of two symbols of the merge, at
    /// `3 * role(p) + role(q)`.
    merge_pairs: [u32; 9],
    entries: Vec<(u64, DeltaEntry)>,
    /// (word, index of the next entry of the same pair's chain).
    adds: Vec<(u32, u32)>,
}

/// The mark of a symbol of the merge in the group arrays of `Deltas`.
const OF_MERGE: u32 = u32::MAX;

impl Deltas {
    /// Start recording the changes of merging (a, b) into x, with `symbols` symbols in
    /// all (x included). The deltas must be empty.
    fn begin(&mut self, a: u32, b: u32, x: u32, symbols: usize) {
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
    fn mark_merge(&mut self, mark: u32) {
        let (a, b, x) = self.merge;
        for s in [a, b, x] {
            self.left_groups[s as usize] = mark;
            self.right_groups[s as usize] = mark;
        }
    }

    /// The group slot of neighbour `s` on one side (see `left_groups`).
    #[inline(always)]
    fn group_slot(&self, s: u32, left: bool) -> u32 {
        if left {
            self.left_groups[s as usize]
        } else {
            self.right_groups[s as usize]
        }
    }

    /// Whether `s` is a symbol of the merge (a, b or the new x).
    #[inline(always)]
    fn of_merge(&self, s: u32) -> bool {
        let (a, b, x) = self.merge;
        s == a || s == b || s == x
    }

    /// 0, 1, 2 for a, b, x (0 for b when a == b).
    #[inline]
    fn role(&self, s: u32) -> usize {
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
    fn shift(&mut self, s: u32, left: bool, c: i64, w: u32) {
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
    fn group(&mut self, s: u32, left: bool) -> usize {
        let slot = self.group_slot(s, left);
        debug_assert!(slot != OF_MERGE);
        if slot != 0 {
            return (slot - 1) as usize;
        }
        self.new_group(s, left)
    }

    /// Make the (empty) group of neighbour `s` on one side.
    #[inline]
    fn new_group(&mut self, s: u32, left: bool) -> usize {
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
    fn entry(&mut self, key: u64) -> usize {
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
    fn add(&mut self, key: u64, d: i64, w: u32) {
        let k = self.entry(key);
        self.add_at(k, d, w);
    }

    /// Add `d` to entry `k`'s count and chain word `w` (unless NONE) to it.
    #[inline(always)]
    fn add_at(&mut self, k: usize, d: i64, w: u32) {
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
    fn words(&self, head: u32) -> impl Iterator<Item = u32> + '_ {
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
    fn absorb(&mut self, other: &mut Deltas) {
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

    fn clear(&mut self) {
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

/// Rewrite word `w` (the record at `rec`) merging each (a, b) into x, left to right,
/// and record the count changes of the neighbouring pairs (not of (a, b) itself).
#[inline]
fn rewrite_word(rec: &mut [u32], w: u32, a: u32, b: u32, x: u32, deltas: &mut Deltas) {
    let n = rec[0] as usize;
    // Find the first occurrence; a stale entry (the word lost the pair) costs just this scan.
    let Some(first) = rec[HEADER..HEADER + n].windows(2).position(|p| p[0] == a && p[1] == b) else { return };
    rewrite_from(rec, first, w, a, b, x, deltas);
}

/// `rewrite_word` for a word whose first occurrence of (a, b) is at symbol `first`.
#[inline]
fn rewrite_from(rec: &mut [u32], first: usize, w: u32, a: u32, b: u32, x: u32, deltas: &mut Deltas) {
    let n = rec[0] as usize;
    let c = (rec[1] as u64 | (rec[2] as u64) << 32) as i64;
    let s = &mut rec[HEADER..HEADER + n];
    let mut i = first;
    let mut j = first;
    while i < n {
        if i + 1 < n && s[i] == a && s[i + 1] == b {
            if j > 0 {
                deltas.shift(s[j - 1], true, c, w);
            }
            if i + 2 < n {
                deltas.shift(s[i + 2], false, c, w);
            }
            s[j] = x;
            j += 1;
            i += 2;
        } else {
            s[j] = s[i];
            j += 1;
            i += 1;
        }
    }
    rec[0] = j as u32;
}

/// Words of up to this many symbols (nearly all that a merge visits) are rewritten with
/// vector compares where the CPU has AVX-512F or AVX2.
const VECTOR_SYMBOLS: usize = 16;
/// How many values from a record's start the vector rewrite reads (the record and what
/// follows it, which it leaves unchanged).
const VECTOR_READ: usize = HEADER + VECTOR_SYMBOLS + 1;

/// `rewrite_word` with vector compares: one compare of the word against a and of its
/// next symbols against b finds every occurrence at once, so a stale word costs no scan,
/// and a word with one occurrence (99 % of the rest) is rewritten with no loop at all.
/// Words of up to VECTOR_SYMBOLS symbols; `rec` must hold VECTOR_READ values (the
/// record and what follows it, which is read but left as it is).
#[cfg(target_arch = "x86_64")]
mod vector {
    use super::{rewrite_from, Deltas, HEADER, VECTOR_READ, VECTOR_SYMBOLS};
    use std::arch::x86_64::*;

    /// With AVX2 (two 8-lane halves).
    ///
    /// # Safety
    /// The CPU must have AVX2 and BMI1.
    #[target_feature(enable = "avx2,bmi1")]
    #[inline]
    pub(super) unsafe fn rewrite_word_avx2(rec: &mut [u32], w: u32, a: u32, b: u32, x: u32, deltas: &mut Deltas) {
        let (n, s) = word_of(rec);
        let load = |k: usize| _mm256_loadu_si256(s.add(k) as *const __m256i);
        let (va, vb) = (_mm256_set1_epi32(a as i32), _mm256_set1_epi32(b as i32));
        // Lane k of `here` holds symbol k, of `next` symbol k + 1.
        let (here0, here1, next0, next1) = (load(0), load(8), load(1), load(9));
        let hit0 = _mm256_and_si256(_mm256_cmpeq_epi32(here0, va), _mm256_cmpeq_epi32(next0, vb));
        let hit1 = _mm256_and_si256(_mm256_cmpeq_epi32(here1, va), _mm256_cmpeq_epi32(next1, vb));
        let pairs = (1u32 << (n - 1)) - 1;
        let found = (_mm256_movemask_ps(_mm256_castsi256_ps(hit0)) as u32
            | (_mm256_movemask_ps(_mm256_castsi256_ps(hit1)) as u32) << 8)
            & pairs;
        let Some(i) = record_occurrence(rec, found, w, a, b, x, deltas) else { return };
        let s = word_of(rec).1; // (`rec` was borrowed again since)
                                // Symbols i+1 .. n-2 take the one after them (b drops out); symbol i becomes x.
        let moved = _mm256_set1_epi32((pairs & (u32::MAX << (i + 1))) as i32);
        let lane0 = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        let lane1 = _mm256_slli_epi32::<8>(lane0);
        let mask0 = _mm256_cmpeq_epi32(_mm256_and_si256(moved, lane0), lane0);
        let mask1 = _mm256_cmpeq_epi32(_mm256_and_si256(moved, lane1), lane1);
        _mm256_maskstore_epi32(s as *mut i32, mask0, next0);
        _mm256_maskstore_epi32(s.add(8) as *mut i32, mask1, next1);
        *s.add(i) = x;
        rec[0] = (n - 1) as u32;
    }

    /// With AVX-512 (one 16-lane register, compares straight into a mask).
    ///
    /// # Safety
    /// The CPU must have AVX-512F, AVX2 and BMI1.
    #[target_feature(enable = "avx512f,avx2,bmi1")]
    #[inline]
    pub(super) unsafe fn rewrite_word_avx512(rec: &mut [u32], w: u32, a: u32, b: u32, x: u32, deltas: &mut Deltas) {
        let (n, s) = word_of(rec);
        let here = _mm512_loadu_si512(s as *const __m512i);
        let next = _mm512_loadu_si512(s.add(1) as *const __m512i);
        let pairs = ((1u32 << (n - 1)) - 1) as __mmask16;
        let at_a = _mm512_mask_cmpeq_epi32_mask(pairs, here, _mm512_set1_epi32(a as i32));
        let found = _mm512_mask_cmpeq_epi32_mask(at_a, next, _mm512_set1_epi32(b as i32)) as u32;
        let Some(i) = record_occurrence(rec, found, w, a, b, x, deltas) else { return };
        let s = word_of(rec).1; // (`rec` was borrowed again since)
                                // Symbols i+1 .. n-2 take the one after them (b drops out); symbol i becomes x.
        _mm512_mask_storeu_epi32(s as *mut i32, pairs & (u32::MAX << (i + 1)) as __mmask16, next);
        *s.add(i) = x;
        rec[0] = (n - 1) as u32;
    }

    /// The symbol count of the word at `rec` and a pointer to its first symbol; `rec`
    /// must hold the VECTOR_READ values the vector rewrites read.
    #[inline(always)]
    fn word_of(rec: &mut [u32]) -> (usize, *mut u32) {
        assert!(rec.len() >= VECTOR_READ);
        let n = rec[0] as usize;
        debug_assert!((1..=VECTOR_SYMBOLS).contains(&n));
        (n, rec[HEADER..].as_mut_ptr())
    }

    /// Given the mask of the occurrences in a word, record the changes of a single
    /// occurrence and return its place (the caller rewrites the word); no occurrence
    /// leaves all as it is, and several are rewritten by the scalar code. Both return None.
    #[inline(always)]
    fn record_occurrence(
        rec: &mut [u32],
        found: u32,
        w: u32,
        a: u32,
        b: u32,
        x: u32,
        deltas: &mut Deltas,
    ) -> Option<usize> {
        if found == 0 {
            return None;
        }
        let i = found.trailing_zeros() as usize;
        if found & (found - 1) != 0 {
            // Two or more occurrences (rare; with a == b they may overlap).
            rewrite_from(rec, i, w, a, b, x, deltas);
            return None;
        }
        let n = rec[0] as usize;
        let c = (rec[1] as u64 | (rec[2] as u64) << 32) as i64;
        if i > 0 {
            deltas.shift(rec[HEADER + i - 1], true, c, w);
        }
        if i + 2 < n {
            deltas.shift(rec[HEADER + i + 2], false, c, w);
        }
        Some(i)
    }
}

/// The words array shared by the workers of one merge; each touches only its own words.
#[derive(Clone, Copy)]
struct SharedWords {
    ptr: *mut u32,
    len: usize,
}

// SAFETY: workers only form slices over disjoint word records (see `rewrite_share`).
unsafe impl Send for SharedWords {}
unsafe impl Sync for SharedWords {}

/// Rewrite the words of `list` whose ids are in `lo..hi`.
///
/// # Safety
/// Meanwhile no other thread may access the records of the words with ids in `lo..hi`,
/// nor the array between the first of them and `hi` (the vector rewrite reads past a
/// record's end, up to `hi`); every id in `list` must be the offset of a record of
/// `words`.
#[allow(clippy::too_many_arguments)] // the merge's symbols, passed in registers
unsafe fn rewrite_share(
    words: SharedWords,
    list: &[u32],
    lo: u32,
    hi: u32,
    a: u32,
    b: u32,
    x: u32,
    deltas: &mut Deltas,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::pretokenize::Simd;
        match Simd::detected() {
            Simd::Avx512 | Simd::Avx512Vbmi2 => return rewrite_share_avx512(words, list, lo, hi, a, b, x, deltas),
            Simd::Avx2 => return rewrite_share_avx2(words, list, lo, hi, a, b, x, deltas),
            Simd::Baseline => {}
        }
    }
    for_each_word(words, list, lo, hi, |w, n| {
        rewrite_word(std::slice::from_raw_parts_mut(words.ptr.add(w as usize), HEADER + n), w, a, b, x, deltas)
    });
}

/// `rewrite_share` with `vector::rewrite_word_avx2` for the words it can take.
///
/// # Safety
/// As `rewrite_share`, and the CPU must have AVX2 and BMI1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,bmi1")]
#[allow(clippy::too_many_arguments)] // the merge's symbols, passed in registers
unsafe fn rewrite_share_avx2(
    words: SharedWords,
    list: &[u32],
    lo: u32,
    hi: u32,
    a: u32,
    b: u32,
    x: u32,
    deltas: &mut Deltas,
) {
    rewrite_share_vector(words, list, lo, hi, a, b, x, deltas, |rec, w, d| {
        vector::rewrite_word_avx2(rec, w, a, b, x, d)
    });
}

/// `rewrite_share` with `vector::rewrite_word_avx512` for the words it can take.
///
/// # Safety
/// As `rewrite_share`, and the CPU must have AVX-512F, AVX2 and BMI1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,bmi1")]
#[allow(clippy::too_many_arguments)] // the merge's symbols, passed in registers
unsafe fn rewrite_share_avx512(
    words: SharedWords,
    list: &[u32],
    lo: u32,
    hi: u32,
    a: u32,
    b: u32,
    x: u32,
    deltas: &mut Deltas,
) {
    rewrite_share_vector(words, list, lo, hi, a, b, x, deltas, |rec, w, d| {
        vector::rewrite_word_avx512(rec, w, a, b, x, d)
    });
}

/// `rewrite_share` with `vector_word(record, word, deltas)` (a `vector` rewrite) for the
/// words of up to VECTOR_SYMBOLS symbols whose vector reads stay below `hi` and inside
/// the array (what lies there is this thread's alone); it gets VECTOR_READ values from
/// the record's start.
///
/// # Safety
/// As `rewrite_share`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rewrite_share_vector(
    words: SharedWords,
    list: &[u32],
    lo: u32,
    hi: u32,
    a: u32,
    b: u32,
    x: u32,
    deltas: &mut Deltas,
    vector_word: impl Fn(&mut [u32], u32, &mut Deltas),
) {
    let end = (hi as usize).min(words.len);
    for_each_word(words, list, lo, hi, |w, n| {
        let w_at = w as usize;
        if n <= VECTOR_SYMBOLS && w_at + VECTOR_READ <= end {
            vector_word(std::slice::from_raw_parts_mut(words.ptr.add(w_at), VECTOR_READ), w, deltas)
        } else {
            rewrite_word(std::slice::from_raw_parts_mut(words.ptr.add(w_at), HEADER + n), w, a, b, x, deltas)
        }
    });
}

/// Call `visit(w, symbols)` for each word of `list` with an id in `lo..hi` (once for a
/// run of repeats), prefetching the records of the words ahead.
///
/// # Safety
/// Every id in `list` must be the offset of a record of `words`.
#[inline(always)]
unsafe fn for_each_word(words: SharedWords, list: &[u32], lo: u32, hi: u32, mut visit: impl FnMut(u32, usize)) {
    let mut last = NONE;
    for (k, &w) in list.iter().enumerate() {
        if let Some(&ahead) = list.get(k + PREFETCH) {
            if (lo..hi).contains(&ahead) {
                // A record (header and symbols) often crosses into the next cache line:
                // fetch that line too.
                let rec = words.ptr.wrapping_add(ahead as usize);
                prefetch(rec);
                prefetch(rec.wrapping_add(12));
            }
        }
        if w == last || !(lo..hi).contains(&w) {
            continue;
        }
        last = w;
        debug_assert!(w as usize + HEADER <= words.len);
        visit(w, *words.ptr.add(w as usize) as usize);
    }
}

#[inline]
fn prefetch(p: *const u32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch(p as *const i8, _MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Lists at least this long are rewritten by all workers, each on its range of word ids.
const PARALLEL_LIST: usize = 4096;

/// Timings of the merge stages, in seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct MergeTimes {
    pub build_s: f64,
    pub merge_s: f64,
    /// The pruning floor first chosen (1: no pruning), and how many exact recounts
    /// were needed.
    pub floor: i64,
    pub recounts: u32,
    /// Merges whose bytes an earlier merge already made, under a floor (each rescans
    /// the words for the pairs of the merged symbol).
    pub rescans: u32,
}

/// When and how much to prune (see the module docs).
#[derive(Clone, Copy, Debug)]
struct Pruning {
    /// Merges done before the first estimate (no pruning for shorter runs).
    after: usize,
    /// The floor is the predicted count of the last merge divided by this.
    margin: f64,
    /// Rescan the pairs of every merged symbol under a floor, not only of those whose
    /// bytes were made before (for tests: such merges are rare, and a rescan must
    /// change nothing).
    rescan_all: bool,
}

/// The floor is estimated early: until then every rare pair a merge makes gets a word
/// list and a heap entry (estimating after 1,000 merges, those first merges took half
/// of the merge time on the 74 MB webtext; after 100, the merge stage is 10-15 % faster
/// there and up to 40 % on Chinese). An estimate from fewer merges is rougher, so a run
/// now and then needs one exact recount; the merges are the same either way.
const PRUNING: Pruning = Pruning { after: 100, margin: 4.0, rescan_all: false };

/// Predicted count of merge `total` from the counts of the merges so far (a power law
/// fitted to the last three quarters of them).
fn predict_last_count(history: &[i64], total: usize) -> f64 {
    let k = history.len();
    let (c_lo, c_hi) = (history[k / 4] as f64, history[k - 1] as f64);
    let alpha = (c_lo / c_hi).ln() / ((k as f64) / (k / 4 + 1) as f64).ln();
    c_hi * (total as f64 / k as f64).powf(-alpha.max(0.0))
}

/// Count all pairs of `words` afresh and track those of count `floor` or more, where
/// `floor` is `want`, lowered to the greatest count if need be (so that the best pair is
/// always tracked and the merge loop makes progress). Returns the floor used.
fn recount(words: &Words, ids: &[u32], tokens: &Tokens, want: i64, bytes_only: bool) -> (Pairs, PairHeap, i64) {
    let mut pairs = Pairs::build(words, ids, rayon::current_num_threads(), bytes_only);
    let max = pairs.shards.iter().flat_map(|m| m.values().map(|p| p.count)).max().unwrap_or(0);
    let floor = want.min(max).max(1);
    prune(&mut pairs, floor);
    let heap = rebuild_heap(&pairs, tokens);
    (pairs, heap, floor)
}

/// After a merge into `x` whose bytes an earlier merge already made: pairs with `x` may
/// have had untracked occurrences before this merge, which its deltas do not show. Count
/// every pair with `x` exactly from the words and track those of count `floor` or more
/// (replacing what is tracked of them). Pairs without `x` only lost occurrences.
fn rescan_symbol(
    words: &Words,
    ids: &[u32],
    x: u32,
    floor: i64,
    pairs: &mut Pairs,
    heap: &mut PairHeap,
    tokens: &Tokens,
) {
    let mut found: FxMap<u64, PairStats> = FxMap::default();
    for &w in ids {
        let s = words.symbols(w);
        if !s.contains(&x) {
            continue;
        }
        let c = words.count(w);
        for i in 0..s.len() - 1 {
            if s[i] == x || s[i + 1] == x {
                let e =
                    found.entry(pack(s[i], s[i + 1])).or_insert_with(|| PairStats { count: 0, words: WordList::new() });
                e.count += c;
                if e.words.last() != Some(&w) {
                    e.words.push(w);
                }
            }
        }
    }
    for (key, st) in found {
        if st.count >= floor {
            heap.push(tokens, (st.count, key));
            pairs.shard(key).insert(key, st);
        } else {
            pairs.shard(key).remove(&key);
        }
    }
}

/// Forget the pairs whose count is below `floor`.
fn prune(pairs: &mut Pairs, floor: i64) {
    if floor > 1 {
        for m in pairs.shards.iter_mut() {
            m.retain(|_, p| p.count >= floor);
        }
    }
}

fn rebuild_heap(pairs: &Pairs, tokens: &Tokens) -> PairHeap {
    let mut heap = PairHeap { v: pairs.shards.iter().flat_map(|m| m.iter().map(|(&k, p)| (p.count, k))).collect() };
    heap.heapify(tokens);
    heap
}

/// Learn up to `num_merges` merges from `words`. Returns the merges as byte pairs, in order.
/// Stops early when no pair is left. Memory is sized by the merges the words allow
/// (`Words::max_merges`), not by the request, which may be any number.
pub fn learn_merges(
    words: Words,
    num_merges: usize,
    ctl: &Control,
    times: &mut MergeTimes,
) -> Result<Merges, TrainError> {
    crate::fault::check(crate::fault::Site::TrainMerge);
    let num_merges = num_merges.min(words.max_merges());
    ctl.set_total(num_merges as u64);
    learn_merges_with(words, num_merges, ctl, times, PARALLEL_LIST, PRUNING)
}

/// `learn_merges`, rewriting the words of lists of at least `parallel_list` entries on all
/// the workers of the current rayon pool.
fn learn_merges_with(
    mut words: Words,
    num_merges: usize,
    ctl: &Control,
    times: &mut MergeTimes,
    parallel_list: usize,
    pruning: Pruning,
) -> Result<Merges, TrainError> {
    let t0 = std::time::Instant::now();
    let mut tokens = Tokens::new();
    if num_merges == 0 || words.is_empty() {
        return Ok(Merges { symbols: tokens.bytes, pairs: Vec::new(), made: Vec::new() });
    }
    // The merges as symbol pairs, and the symbol each makes.
    let mut merged: Vec<(u32, u32)> = Vec::with_capacity(num_merges);
    let mut made: Vec<u32> = Vec::with_capacity(num_merges);

    // Pair counts and the pair -> words index.
    let ids = words.take_ids();
    // Pairs of a smaller count are not tracked (see "Pruning" above).
    let (mut pairs, mut heap, mut floor) = recount(&words, &ids, &tokens, 1, true);
    times.floor = floor;
    let mut history: Vec<i64> = Vec::with_capacity(num_merges);
    times.build_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();

    let workers = rayon::current_num_threads().max(1);
    let mut deltas: Vec<Deltas> = (0..workers).map(|_| Deltas::default()).collect();
    // Word-id ranges of the workers: equal shares of the words array.
    let total = words.data.len() as u64;
    let bounds: Vec<u32> = (0..=workers).map(|t| (total * t as u64 / workers as u64) as u32).collect();
    while merged.len() < num_merges {
        if ctl.is_cancelled() {
            return Err(TrainError::Cancelled);
        }
        // The best pair: the top entry once it matches the pair's current count. A top
        // entry whose pair has fewer occurrences now takes that count and sinks; one whose
        // pair is gone (or has a newer entry with a higher count) is dropped.
        let best = loop {
            match heap.peek() {
                Some((cnt, key)) => match pairs.get(key) {
                    Some(p) if p.count == cnt => {
                        debug_assert!(cnt >= floor);
                        heap.pop(&tokens);
                        break Some(key);
                    }
                    Some(p) if p.count < cnt => heap.lower_top(&tokens, p.count),
                    _ => {
                        heap.pop(&tokens);
                    }
                },
                None if floor > 1 => {
                    // No tracked pair is left, but untracked ones may be: recount them all
                    // under a lower floor (the last stretch of merges under none).
                    let want = if num_merges - merged.len() < pruning.after {
                        1
                    } else {
                        (*history.last().unwrap_or(&0) as f64 / (2.0 * pruning.margin)) as i64
                    };
                    (pairs, heap, floor) = recount(&words, &ids, &tokens, want, false);
                    times.recounts += 1;
                }
                None => break None,
            }
        };
        let Some(best) = best else { break };
        let (a, b) = unpack(best);
        let stats = pairs.shard(best).remove(&best).expect("popped pair is present");
        history.push(stats.count);

        merged.push((a, b));
        let (x, known_bytes) = tokens.join(a, b);
        made.push(x);

        // Rewrite each affected word in one pass, recording count changes.
        for d in deltas.iter_mut() {
            d.begin(a, b, x, tokens.bytes.len());
        }
        let shared = SharedWords { ptr: words.data.as_mut_ptr(), len: words.data.len() };
        let list = &stats.words;
        if workers > 1 && list.len() >= parallel_list {
            let bounds = &bounds;
            rayon::scope(|scope| {
                for (t, d) in deltas.iter_mut().enumerate() {
                    scope.spawn(move |_| {
                        // SAFETY: the word-id ranges of the workers are disjoint, and a
                        // worker's first record starts after the last record of the one
                        // before ends.
                        unsafe { rewrite_share(shared, list, bounds[t], bounds[t + 1], a, b, x, d) };
                    });
                }
            });
            let (first, rest) = deltas.split_at_mut(1);
            for d in rest {
                first[0].absorb(d);
            }
        } else {
            // SAFETY: this thread alone touches the words.
            unsafe { rewrite_share(shared, list, 0, NONE, a, b, x, &mut deltas[0]) };
        }
        drop(stats);

        // Apply the changes; pairs whose count rose get a fresh heap entry.
        let d0 = &mut deltas[0];
        for &(key, ref d) in d0.entries.iter() {
            let (ka, kb) = unpack(key);
            if !known_bytes && (ka == x || kb == x) {
                // A pair of a new symbol is new: no lookup needed, and below the floor it
                // is not tracked at all.
                debug_assert!(pairs.get(key).is_none());
                if d.count >= floor.max(1) {
                    let mut list = WordList::with_capacity(d.n as usize);
                    list.extend(d0.words(d.head));
                    pairs.shard(key).insert(key, PairStats { count: d.count, words: list });
                    heap.push(&tokens, (d.count, key));
                }
                continue;
            }
            match pairs.shard(key).entry(key) {
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
                            heap.push(&tokens, (p.count, key));
                        }
                    }
                }
                Entry::Vacant(v) => {
                    debug_assert!(d.count >= 0 || floor > 1);
                    if d.count >= floor.max(1) {
                        let mut list = WordList::with_capacity(d.n as usize);
                        list.extend(d0.words(d.head));
                        v.insert(PairStats { count: d.count, words: list });
                        heap.push(&tokens, (d.count, key));
                    }
                }
            }
        }
        d0.clear();
        if (known_bytes || pruning.rescan_all) && floor > 1 {
            // An untracked pair with `x` may have gained occurrences: count them exactly.
            rescan_symbol(&words, &ids, x, floor, &mut pairs, &mut heap, &tokens);
            times.rescans += 1;
        }
        if merged.len() == pruning.after && num_merges >= 4 * pruning.after {
            floor = ((predict_last_count(&history, num_merges) / pruning.margin) as i64).max(1);
            prune(&mut pairs, floor);
            heap = rebuild_heap(&pairs, &tokens);
            times.floor = floor;
        }
        ctl.set_done(merged.len() as u64);
    }
    times.merge_s = t1.elapsed().as_secs_f64();
    // Freeing the pair index (a list per pair) and the words takes ~10 ms for 74 MB of
    // text, more for larger corpora: the caller need not wait for it.
    crate::threads::drop_in_background((words, pairs, heap, tokens.by_bytes));
    Ok(Merges { symbols: tokens.bytes, pairs: merged, made })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn train(corpus: &[(&str, u64)], n: usize) -> Vec<(String, String)> {
        let mut words = Words::default();
        for (w, c) in corpus {
            words.push(w.as_bytes(), *c).unwrap();
        }
        let ctl = Control::default();
        let mut t = MergeTimes::default();
        learn_merges(words, n, &ctl, &mut t)
            .unwrap()
            .to_vecs()
            .into_iter()
            .map(|(a, b)| (String::from_utf8(a).unwrap(), String::from_utf8(b).unwrap()))
            .collect()
    }

    fn m(a: &str, b: &str) -> (String, String) {
        (a.to_string(), b.to_string())
    }

    #[test]
    fn ties_go_to_the_lexicographically_greatest_pair() {
        // "ab", "cd", "ba" all count 3: ("c","d") > ("b","a") > ("a","b").
        let got = train(&[("ab", 3), ("cd", 3), ("ba", 3)], 3);
        assert_eq!(got, vec![m("c", "d"), m("b", "a"), m("a", "b")]);
    }

    #[test]
    fn ties_compare_left_bytes_first_then_right() {
        // ("a","z") vs ("b","a"): left bytes decide; ("b","a") wins though "z" > "a".
        let got = train(&[("az", 2), ("ba", 2)], 1);
        assert_eq!(got, vec![m("b", "a")]);
        // Equal left bytes: the right bytes decide.
        let got = train(&[("ac", 2), ("ab", 2)], 1);
        assert_eq!(got, vec![m("a", "c")]);
        // A longer left token beats its own prefix: ("ab","x") > ("a","z").
        let got = train(&[("ab", 10), ("abx", 2), ("az", 2)], 3);
        assert_eq!(got, vec![m("a", "b"), m("ab", "x"), m("a", "z")]);
    }

    #[test]
    fn cs336_example() {
        // The worked example of the CS336 assignment (pre-tokens, whitespace split).
        let corpus = [("low", 5), ("lower", 2), ("widest", 3), ("newest", 6)];
        let got = train(&corpus, 6);
        let want = vec![m("s", "t"), m("e", "st"), m("o", "w"), m("l", "ow"), m("w", "est"), m("n", "e")];
        assert_eq!(got, want);
    }

    #[test]
    fn repeated_symbols_merge_left_to_right() {
        // "aaaa" -> "aa aa" -> "aaaa"; "aaa" -> "aa a".
        let got = train(&[("aaaa", 1), ("aaa", 1)], 3);
        assert_eq!(got[0], m("a", "a"));
        assert_eq!(got[1], m("aa", "aa"));
        // After the two merges: "aaaa" is one symbol, "aaa" is ("aa","a") count 1.
        assert_eq!(got[2], m("aa", "a"));
    }

    #[test]
    fn rewrite_deltas_match_a_recount() {
        // Random words over few symbols (x among them, as when a merge's bytes were made
        // before, and a == b sometimes), so that pairs fitting two of the four shapes
        // occur: the recorded change of each pair must be its change in a recount. Half
        // the rounds record the words in two halves and absorb one into the other, as the
        // workers of a parallel merge do.
        let mut rng: u64 = 3;
        let mut next = |n: u64| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((rng >> 33) % n) as u32
        };
        let mut deltas = Deltas::default();
        let mut other = Deltas::default();
        for round in 0..2000 {
            let (a, b, x) = if round % 3 == 0 { (1, 1, 4) } else { (1, 2, 4) };
            let pair_counts = |s: &[u32]| {
                let mut m: FxMap<u64, i64> = FxMap::default();
                for p in s.windows(2) {
                    *m.entry(pack(p[0], p[1])).or_default() += 1;
                }
                m
            };
            let mut want: FxMap<u64, i64> = FxMap::default();
            let mut gained: FxMap<u64, Vec<u32>> = FxMap::default();
            deltas.begin(a, b, x, 5);
            other.begin(a, b, x, 5);
            let split = round % 2 == 1;
            let mut data = Vec::new();
            for w in 0..1 + next(4) {
                let len = 2 + next(8) as usize;
                let s: Vec<u32> = (0..len).map(|_| next(5)).collect();
                let c = 1 + next(3) as u64;
                let mut rec = vec![len as u32, c as u32, (c >> 32) as u32];
                rec.extend(&s);
                rewrite_word(&mut rec, w, a, b, x, if split && w % 2 == 1 { &mut other } else { &mut deltas });
                let (before, after) = (pair_counts(&s), pair_counts(&rec[HEADER..HEADER + rec[0] as usize]));
                for (&k, &n) in after.iter() {
                    if n > before.get(&k).copied().unwrap_or(0) {
                        gained.entry(k).or_default().push(w);
                    }
                }
                let keys: std::collections::BTreeSet<u64> = before.keys().chain(after.keys()).copied().collect();
                for k in keys {
                    let d = after.get(&k).copied().unwrap_or(0) - before.get(&k).copied().unwrap_or(0);
                    *want.entry(k).or_default() += d * c as i64;
                }
                data.push(rec);
            }
            want.remove(&pack(a, b));
            deltas.absorb(&mut other);
            let mut got: FxMap<u64, i64> = FxMap::default();
            for &(k, ref e) in &deltas.entries {
                assert!(got.insert(k, e.count).is_none(), "two entries for one pair");
                let words: Vec<u32> = deltas.words(e.head).collect();
                for w in gained.get(&k).into_iter().flatten() {
                    assert!(words.contains(w), "word {w} gained pair {:?} unrecorded", unpack(k));
                }
            }
            want.retain(|_, d| *d != 0);
            got.retain(|_, d| *d != 0);
            assert_eq!(got, want, "round {round}: {data:?}");
            deltas.clear();
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_rewrites_match_the_scalar_one() {
        use crate::pretokenize::Simd;
        type Rewrite = unsafe fn(&mut [u32], u32, u32, u32, u32, &mut Deltas);
        let level = Simd::detected();
        let mut rewrites: Vec<(&str, Rewrite)> = Vec::new();
        if level >= Simd::Avx2 {
            rewrites.push(("avx2", vector::rewrite_word_avx2));
        }
        if level >= Simd::Avx512 {
            rewrites.push(("avx512", vector::rewrite_word_avx512));
        }
        if rewrites.len() < 2 {
            eprintln!(
                "{} of the two vector rewrites skipped: this CPU lacks AVX2 / AVX-512 (or FERROLM_SIMD caps it)",
                2 - rewrites.len()
            );
        }
        // Random words of 1..=16 symbols over few symbols (x among them), so that
        // occurrences are frequent, often repeated and, with a == b, overlapping; each
        // record is followed by random values that must stay as they are.
        let mut rng: u64 = 11;
        let mut next = |n: u64| {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((rng >> 33) % n) as u32
        };
        let changes = |d: &Deltas| -> Vec<(u64, i64, Vec<u32>)> {
            d.entries.iter().map(|&(k, e)| (k, e.count, d.words(e.head).collect())).collect()
        };
        let (mut scalar, mut vectored) = (Deltas::default(), Deltas::default());
        let mut rewritten = 0;
        for round in 0..20_000u32 {
            let (a, b, x) = [(1, 1, 4), (1, 2, 4), (2, 1, 4)][round as usize % 3];
            let len = 1 + next(VECTOR_SYMBOLS as u64) as usize;
            let c = 1 + next(1000) as u64;
            let mut rec = vec![len as u32, c as u32, (c >> 32) as u32];
            rec.extend((HEADER..VECTOR_READ).map(|_| next(5)));
            let before = rec.clone();
            let w = round * 7;
            scalar.begin(a, b, x, 5);
            rewrite_word(&mut rec[..HEADER + len], w, a, b, x, &mut scalar);
            rewritten += (rec[0] as usize != len) as u32;
            for &(name, rewrite) in &rewrites {
                let mut rec_v = before.clone();
                vectored.begin(a, b, x, 5);
                // SAFETY: the CPU has the features of each rewrite in the list (checked above).
                unsafe { rewrite(&mut rec_v, w, a, b, x, &mut vectored) };
                assert_eq!(rec_v, rec, "{name}, round {round}: (a, b) = ({a}, {b}), {before:?}");
                assert_eq!(changes(&vectored), changes(&scalar), "{name}, round {round}: {before:?}");
                vectored.clear();
            }
            scalar.clear();
        }
        assert!(rewritten > 3_000, "{rewritten}");
    }

    #[test]
    fn any_number_of_merges_asked_learns_what_the_words_allow() {
        // "abcd" x 3 and "ab": at most 3 + 1 merges; memory sized by the request would
        // not be there for usize::MAX.
        let corpus = |words: &mut Words| {
            words.push(b"abcd", 3).unwrap();
            words.push(b"ab", 1).unwrap();
        };
        let mut words = Words::default();
        corpus(&mut words);
        assert_eq!(words.max_merges(), 4);
        let ctl = Control::default();
        let got = learn_merges(words, usize::MAX, &ctl, &mut MergeTimes::default()).unwrap().to_vecs();
        assert_eq!(got.len(), 3, "{got:?}"); // "ab", "cd", then "abcd": the words are whole
        assert_eq!(ctl.progress().1, 4, "the progress total is what the words allow");
        let mut words = Words::default();
        corpus(&mut words);
        assert_eq!(learn_merges(words, 2, &ctl, &mut MergeTimes::default()).unwrap().len(), 2);
    }

    #[test]
    fn parallel_rewriting_changes_nothing() {
        // A corpus with many words per pair, so lists are long and rewritten in parallel.
        let mut text = Vec::new();
        let mut x: u64 = 1;
        for _ in 0..20_000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let len = 2 + (x >> 60) as usize;
            let w: String = (0..len).map(|k| (b'a' + (x.rotate_right((4 * k) as u32) % 6) as u8) as char).collect();
            text.push((w, 1 + (x >> 40) % 5));
        }
        let run = |threads: usize, parallel_list: usize| {
            let mut words = Words::default();
            for (w, c) in &text {
                words.push(w.as_bytes(), *c).unwrap();
            }
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let ctl = Control::default();
            let mut t = MergeTimes::default();
            pool.install(|| learn_merges_with(words, 300, &ctl, &mut t, parallel_list, PRUNING)).unwrap().to_vecs()
        };
        let serial = run(1, usize::MAX);
        assert!(serial.len() > 200);
        assert_eq!(run(3, 1), serial);
        assert_eq!(run(2, 64), serial);
    }

    #[test]
    fn pruning_changes_nothing() {
        // Zipf-like counts over random words, long enough for many merges.
        let mut text = Vec::new();
        let mut x: u64 = 7;
        for i in 0..30_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let len = 2 + (x >> 61) as usize;
            let w: String = (0..len).map(|k| (b'a' + ((x >> (5 * k + 3)) % 11) as u8) as char).collect();
            text.push((w, 1 + 5000 / (i + 1)));
        }
        let run = |pruning: Pruning| {
            let mut words = Words::default();
            for (w, c) in &text {
                words.push(w.as_bytes(), *c).unwrap();
            }
            let ctl = Control::default();
            let mut t = MergeTimes::default();
            let m = learn_merges_with(words, 1500, &ctl, &mut t, usize::MAX, pruning).unwrap().to_vecs();
            (m, t)
        };
        let (plain, _) = run(Pruning { after: usize::MAX / 8, margin: 1.0, rescan_all: false });
        assert!(plain.len() == 1500);
        // A sensible floor, a floor far too high (recounts), and an early, tight one.
        for pruning in [
            Pruning { after: 100, margin: 4.0, rescan_all: false },
            Pruning { after: 50, margin: 0.05, rescan_all: false },
            Pruning { after: 10, margin: 1.0, rescan_all: false },
        ] {
            let (pruned, t) = run(pruning);
            assert!(t.floor > 1, "{pruning:?} did not prune");
            assert_eq!(pruned, plain, "{pruning:?}");
            if pruning.margin < 0.1 {
                assert!(t.recounts > 0);
            }
        }
    }

    fn train_with(corpus: &[(String, u64)], n: usize, pruning: Pruning) -> (Vec<(String, String)>, MergeTimes) {
        let mut words = Words::default();
        for (w, c) in corpus {
            words.push(w.as_bytes(), *c).unwrap();
        }
        let ctl = Control::default();
        let mut t = MergeTimes::default();
        let got = learn_merges_with(words, n, &ctl, &mut t, usize::MAX, pruning)
            .unwrap()
            .to_vecs()
            .into_iter()
            .map(|(a, b)| (String::from_utf8(a).unwrap(), String::from_utf8(b).unwrap()))
            .collect();
        (got, t)
    }

    #[test]
    fn pruning_recounts_after_a_sharp_drop() {
        // One long word of count 1000 sets a floor near 1000; once it is merged whole,
        // every pair left counts a few at most: the recount must lower the floor below
        // them (a floor derived from the last merge's count alone would stay too high).
        let long: String = (b'A'..=b'Z').chain(b'a'..=b'z').map(|c| c as char).collect();
        let mut corpus = vec![(long, 1000u64)];
        let mut x: u64 = 3;
        for _ in 0..300 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let len = 2 + (x >> 61) as usize;
            let w: String = (0..len).map(|k| (b'0' + ((x >> (5 * k + 3)) % 7) as u8) as char).collect();
            corpus.push((w, 1 + (x >> 20) % 3));
        }
        let (got, t) = train_with(&corpus, 120, Pruning { after: 10, margin: 1.0, rescan_all: false });
        assert!(t.floor >= 500 && t.recounts > 0, "{t:?}");
        let want: Vec<(String, String)> = naive(&corpus.iter().map(|(w, c)| (w.as_str(), *c)).collect::<Vec<_>>(), 120);
        assert_eq!(got, want);
    }

    #[test]
    fn pruning_with_rescans_and_recounts() {
        // A merge whose bytes an earlier merge already made needs an exact rescan of the
        // pairs of its symbol under a floor. Such merges are rare, so the rescan is forced
        // after every merge here (it must change nothing); floors from tight to far too
        // high (many recounts), checked against the naive trainer.
        let mut rescans = 0;
        let mut recounts = 0;
        for seed in 0..40u64 {
            let mut x = seed * 7919 + 1;
            let mut corpus: Vec<(String, u64)> = Vec::new();
            for i in 0..120u64 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let len = 2 + ((x >> 33) % 11) as usize;
                let w: String = (0..len).map(|k| (b'a' + ((x >> (2 * k + 3)) % 3) as u8) as char).collect();
                corpus.push((w, 1 + 40 / (i + 1) + (x >> 60)));
            }
            let want = naive(&corpus.iter().map(|(w, c)| (w.as_str(), *c)).collect::<Vec<_>>(), 80);
            for pruning in [
                Pruning { after: 3, margin: 4.0, rescan_all: true },
                Pruning { after: 5, margin: 1.0, rescan_all: false },
                Pruning { after: 4, margin: 0.25, rescan_all: true },
            ] {
                let (got, t) = train_with(&corpus, 80, pruning);
                assert_eq!(got, want, "seed {seed}, {pruning:?}");
                rescans += t.rescans;
                recounts += t.recounts;
            }
        }
        assert!(rescans > 0 && recounts > 0, "rescans {rescans}, recounts {recounts}");
    }

    #[test]
    fn stops_when_no_pair_is_left() {
        // No merge at all still names the 256 byte symbols.
        let none = learn_merges(Words::default(), 10, &Control::default(), &mut MergeTimes::default()).unwrap();
        assert!(none.is_empty() && none.num_symbols() == 256 && none.symbol_bytes(255) == [255]);
        let got = train(&[("ab", 1)], 10);
        assert_eq!(got, vec![m("a", "b")]);
    }

    #[test]
    fn same_bytes_from_two_merges_are_one_symbol() {
        // Brute-force check against a naive bytes-keyed trainer on small corpora.
        let corpora: Vec<Vec<(&str, u64)>> = vec![
            vec![("abc", 2), ("bcx", 3), ("abx", 2), ("xabc", 1), ("abcabc", 1)],
            vec![("abab", 3), ("baba", 2), ("aabb", 1), ("bbaa", 2), ("ab", 1)],
            vec![("hello", 4), ("yellow", 2), ("mellow", 3), ("low", 5), ("lowest", 1)],
        ];
        for corpus in corpora {
            let got = train(&corpus, 50);
            assert_eq!(got, naive(&corpus, 50));
        }
    }

    /// The obvious quadratic trainer: words as lists of byte strings.
    fn naive(corpus: &[(&str, u64)], n: usize) -> Vec<(String, String)> {
        let mut words: Vec<(Vec<String>, u64)> =
            corpus.iter().map(|(w, c)| (w.chars().map(|ch| ch.to_string()).collect(), *c)).collect();
        let mut out = vec![];
        for _ in 0..n {
            let mut counts: std::collections::BTreeMap<(String, String), u64> = Default::default();
            for (w, c) in &words {
                for p in w.windows(2) {
                    *counts.entry((p[0].clone(), p[1].clone())).or_default() += c;
                }
            }
            let Some(best) = counts.iter().max_by(|x, y| x.1.cmp(y.1).then(x.0.cmp(y.0))).map(|x| x.0.clone()) else {
                break;
            };
            for (w, _) in words.iter_mut() {
                let mut o = vec![];
                let mut i = 0;
                while i < w.len() {
                    if i + 1 < w.len() && w[i] == best.0 && w[i + 1] == best.1 {
                        o.push(format!("{}{}", best.0, best.1));
                        i += 2;
                    } else {
                        o.push(w[i].clone());
                        i += 1;
                    }
                }
                *w = o;
            }
            out.push(best);
        }
        out
    }
}
