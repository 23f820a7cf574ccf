//! The merge table: (left id, right id) -> (rank << 32 | merged id), open addressing
//! with the key and value side by side in one 16-byte slot (one cache line per lookup).

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
        }
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

    #[inline(always)]
    pub(crate) fn get(&self, left: u32, right: u32) -> u64 {
        let k = key(left, right);
        let mut i = hash(k) & self.mask;
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

    #[inline(always)]
    pub(crate) fn prefetch(&self, left: u32, right: u32) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the index is masked; prefetch never faults.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let i = hash(key(left, right)) & self.mask;
            _mm_prefetch(self.slots.as_ptr().add(i) as *const i8, _MM_HINT_T0);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (left, right);
    }
}
