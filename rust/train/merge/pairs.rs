//! The pair table: each adjacent symbol pair's count and the words that hold it,
//! sharded by the pair's hash so that it is built in parallel.

use super::words::Words;
use super::{pack, FxMap};

pub(super) struct PairStats {
    pub(super) count: i64,
    /// Most pairs occur in a few words only: those lists live inline, unallocated.
    pub(super) words: WordList,
}

pub(super) type WordList = smallvec::SmallVec<[u32; 4]>;

/// Pair statistics in shards by a hash of the pair, so that they can be built in
/// parallel without a final merge.
pub(super) struct Pairs {
    pub(super) shards: Vec<FxMap<u64, PairStats>>,
}

impl Pairs {
    #[inline]
    pub(super) fn shard_index(key: u64, n: usize) -> usize {
        // Multiply-shift range reduction of a mixed key.
        let h = key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32;
        ((h * n as u64) >> 32) as usize
    }

    #[inline]
    pub(super) fn shard(&mut self, key: u64) -> &mut FxMap<u64, PairStats> {
        let i = Self::shard_index(key, self.shards.len());
        &mut self.shards[i]
    }

    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<&PairStats> {
        self.shards[Self::shard_index(key, self.shards.len())].get(&key)
    }

    /// Count all adjacent pairs of the words `ids` into `n` shards, in parallel. Each
    /// worker scans every word and keeps the pairs of its shard, except when
    /// `bytes_only` (see `build_dense`).
    pub(super) fn build(words: &Words, ids: &[u32], n: usize, bytes_only: bool) -> Pairs {
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
    pub(super) fn build_dense(words: &Words, ids: &[u32], n: usize) -> Pairs {
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
