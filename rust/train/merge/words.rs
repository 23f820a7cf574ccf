//! The words: the unique pre-tokens of the corpus as symbol sequences, with their
//! counts, in one flat array that the merges rewrite in place.

use crate::train::count::PieceCounts;
use crate::train::TrainError;

/// The unique pre-tokens of a corpus as symbol sequences, with their counts.
/// Pre-tokens of a single byte have no pair and are not stored.
///
/// One flat array of records `[len, count_lo, count_hi, sym_0, .., sym_len-1, (spare)]`;
/// a word's id is the offset of its record, so visiting a word touches one place in
/// memory. A merge shrinks `len` and leaves the spare slots at the end.
#[derive(Default)]
pub struct Words {
    pub(super) data: Vec<u32>,
    /// The ids of the words, in order (taken by the merge loop).
    pub(super) ids: Vec<u32>,
}

pub(super) const HEADER: usize = 3;

/// Whether a pre-token becomes a word (one of a single byte has no pair).
#[inline]
pub(super) fn is_word(bytes: &[u8], count: u64) -> bool {
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
        crate::train::advise_huge_pages(&data);
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
    pub(super) fn take_ids(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.ids)
    }

    #[inline]
    pub(super) fn count(&self, w: u32) -> i64 {
        let w = w as usize;
        (self.data[w + 1] as u64 | (self.data[w + 2] as u64) << 32) as i64
    }

    /// Symbols of word `w`.
    #[inline]
    pub(super) fn symbols(&self, w: u32) -> &[u32] {
        let w = w as usize;
        &self.data[w + HEADER..w + HEADER + self.data[w] as usize]
    }
}
