//! The merge table: (left id, right id) -> (rank << 32 | merged id), open addressing
//! with the key and value side by side in one 16-byte slot (one cache line per lookup).
//!
//! Merging a piece not seen before is a chain of dependent lookups here (each merge
//! makes the next pairs to look up), and the full table (2 MiB for GPT-2) is mostly not
//! in the CPU's L2. Two small structures in front of it answer most lookups from L2:
//! a bit filter of all merge pairs (a clear bit: no merge, about a quarter of the lookups
//! of merging), and an 8-byte-slot copy of the first HOT_RANKS merges (most of the rest)
//! when ids fit in 16 bits. A piece's first lookups, pairs of single bytes, read a dense
//! 256 x 256 table instead (one load each, no hashing).

use super::hugebuf::{Zeroable, ZeroedBuf};

/// Keys are stored complemented, so that the all-zero slot is empty (no real key is
/// u64::MAX: ids are below 2^32 - 1).
const EMPTY: u64 = 0;
/// No merge for this pair.
pub(crate) const NO_MERGE: u64 = u64::MAX;

#[derive(Clone, Copy)]
#[repr(C, align(16))]
struct Slot {
    key: u64,
    val: u64,
}

// SAFETY: plain integers; all zeros is the empty slot.
unsafe impl Zeroable for Slot {}

pub(crate) struct PairTable {
    slots: ZeroedBuf<Slot>,
    mask: usize,
    count: usize,
    /// The bit of every merge pair's hash is set (see `filter_bit`).
    filter: ZeroedBuf<u64>,
    /// The merges of rank < HOT_RANKS whose ids are < 2^16: key !(left << 16 | right),
    /// value rank << 16 | merged id; 0 is empty.
    hot: ZeroedBuf<HotSlot>,
    /// The value of every pair of single bytes, at `a << 8 | b` (see `index_bytes`):
    /// a piece's first lookups, one load each.
    byte_pairs: Box<[u64; 1 << 16]>,
}

#[derive(Clone, Copy)]
#[repr(C, align(8))]
struct HotSlot {
    key: u32,
    val: u32,
}

// SAFETY: plain integers; all zeros is the empty slot.
unsafe impl Zeroable for HotSlot {}

/// Merges kept in the hot table (their slots: twice as many, 8 bytes each: 256 KiB).
const HOT_RANKS: u64 = 1 << 14;
const HOT_SLOTS: usize = 2 * HOT_RANKS as usize;
/// Bits of the filter (128 KiB).
const FILTER_BITS: usize = 1 << 20;

#[inline(always)]
fn hot_key(left: u32, right: u32) -> Option<u32> {
    if (left | right) >> 16 != 0 {
        return None;
    }
    let k = !((left << 16) | right);
    (k != 0).then_some(k)
}

/// The filter word and bit of hash `h`.
#[inline(always)]
fn filter_bit(h: usize) -> (usize, u64) {
    ((h % FILTER_BITS) / 64, 1 << (h % 64))
}

#[inline(always)]
fn hot_index(h: usize) -> usize {
    (h >> 20) & (HOT_SLOTS - 1)
}

#[inline(always)]
fn key(left: u32, right: u32) -> u64 {
    !(((left as u64) << 32) | right as u64)
}

#[inline(always)]
fn hash(k: u64) -> usize {
    let h = k.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (h ^ (h >> 32)) as usize
}

impl PairTable {
    pub(crate) fn with_capacity(n: usize) -> Self {
        let size = (n.max(8) * 2).next_power_of_two();
        PairTable {
            slots: ZeroedBuf::new(size),
            mask: size - 1,
            count: 0,
            filter: ZeroedBuf::new(FILTER_BITS / 64),
            hot: ZeroedBuf::new(HOT_SLOTS),
            // Built on the heap: 512 KiB would not fit every thread's stack.
            byte_pairs: vec![NO_MERGE; 1 << 16].into_boxed_slice().try_into().expect("65,536 entries"),
        }
    }

    /// Fill the table of byte pairs, `byte_ids[b]` being the id of byte `b` (after the
    /// last insert: later inserts do not reach it).
    pub(crate) fn index_bytes(&mut self, byte_ids: &[u32; 256]) {
        for (a, &left) in byte_ids.iter().enumerate() {
            for (b, &right) in byte_ids.iter().enumerate() {
                self.byte_pairs[a << 8 | b] = self.get(left, right);
            }
        }
    }

    /// [`PairTable::get`] of the ids of bytes `a` and `b` (after `index_bytes`).
    #[inline(always)]
    pub(crate) fn get_bytes(&self, a: u8, b: u8) -> u64 {
        self.byte_pairs[(a as usize) << 8 | b as usize]
    }

    /// Insert unless present; returns whether it was inserted.
    pub(crate) fn insert_new(&mut self, left: u32, right: u32, val: u64) -> bool {
        let k = key(left, right);
        debug_assert!(k != EMPTY);
        if (self.count + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mut i = hash(k) & self.mask;
        loop {
            let s = &mut self.slots[i];
            if s.key == EMPTY {
                *s = Slot { key: k, val };
                self.count += 1;
                self.add_front(left, right, val);
                return true;
            }
            if s.key == k {
                return false;
            }
            i = (i + 1) & self.mask;
        }
    }

    fn grow(&mut self) {
        let size = self.slots.len() * 2;
        let old = std::mem::replace(&mut self.slots, ZeroedBuf::new(size));
        self.mask = size - 1;
        for &s in old.iter() {
            if s.key != EMPTY {
                let mut i = hash(s.key) & self.mask;
                while self.slots[i].key != EMPTY {
                    i = (i + 1) & self.mask;
                }
                self.slots[i] = s;
            }
        }
    }

    /// Record a new merge in the filter and, if it qualifies, the hot table.
    fn add_front(&mut self, left: u32, right: u32, val: u64) {
        let h = hash(key(left, right));
        let (w, bit) = filter_bit(h);
        self.filter[w] |= bit;
        let (rank, merged) = (val >> 32, val as u32);
        let Some(k) = hot_key(left, right) else {
            return;
        };
        if rank >= HOT_RANKS || merged >> 16 != 0 {
            return;
        }
        let mut i = hot_index(h);
        while self.hot[i].key != 0 {
            i = (i + 1) & (HOT_SLOTS - 1);
        }
        self.hot[i] = HotSlot { key: k, val: ((rank as u32) << 16) | merged };
    }

    #[inline(always)]
    pub(crate) fn get(&self, left: u32, right: u32) -> u64 {
        let k = key(left, right);
        let h = hash(k);
        let (w, bit) = filter_bit(h);
        // SAFETY: w < FILTER_BITS / 64, the filter's length.
        if unsafe { *self.filter.get_unchecked(w) } & bit == 0 {
            return NO_MERGE;
        }
        if let Some(hk) = hot_key(left, right) {
            let mut i = hot_index(h);
            loop {
                // SAFETY: i is masked to HOT_SLOTS - 1.
                let s = unsafe { self.hot.get_unchecked(i) };
                if s.key == hk {
                    return ((s.val >> 16) as u64) << 32 | (s.val & 0xFFFF) as u64;
                }
                if s.key == 0 {
                    break;
                }
                i = (i + 1) & (HOT_SLOTS - 1);
            }
        }
        let mut i = h & self.mask;
        loop {
            // SAFETY: i is masked to slots.len() - 1.
            let s = unsafe { self.slots.get_unchecked(i) };
            if s.key == k {
                return s.val;
            }
            if s.key == EMPTY {
                return NO_MERGE;
            }
            i = (i + 1) & self.mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustc_hash::FxHashMap;

    /// The filter and the hot table change no answer: ids below and above 2^16, ranks
    /// below and above HOT_RANKS, repeated pairs (the first rank wins), absent pairs.
    #[test]
    fn front_tables_answer_like_the_full_table() {
        let mut t = PairTable::with_capacity(16);
        let mut want: FxHashMap<(u32, u32), u64> = FxHashMap::default();
        let mut x = 12345u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m) as u32
        };
        for rank in 0..40_000u64 {
            let (l, r) = if rank % 3 == 0 { (next(300), next(300)) } else { (next(200_000), next(70_000)) };
            let merged = if rank % 5 == 0 { 70_000 + rank as u32 } else { 256 + rank as u32 };
            let val = (rank << 32) | merged as u64;
            let first = !want.contains_key(&(l, r));
            assert_eq!(t.insert_new(l, r, val), first);
            want.entry((l, r)).or_insert(val);
        }
        t.insert_new(0xFFFF, 0xFFFF, (7 << 32) | 9); // the one pair the hot table cannot key
        want.entry((0xFFFF, 0xFFFF)).or_insert((7 << 32) | 9);
        for (&(l, r), &v) in &want {
            assert_eq!(t.get(l, r), v, "pair ({l}, {r})");
        }
        for _ in 0..100_000 {
            let (l, r) = (next(200_000), next(200_000));
            assert_eq!(t.get(l, r), want.get(&(l, r)).copied().unwrap_or(NO_MERGE));
        }
        // The byte-pair table, for bytes whose ids are not the byte values.
        let byte_ids: [u32; 256] = std::array::from_fn(|b| (b as u32 * 7) % 300);
        t.index_bytes(&byte_ids);
        for a in 0..256 {
            for b in 0..256 {
                let v = want.get(&(byte_ids[a], byte_ids[b])).copied().unwrap_or(NO_MERGE);
                assert_eq!(t.get_bytes(a as u8, b as u8), v, "bytes ({a}, {b})");
            }
        }
    }
}
