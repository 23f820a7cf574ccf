//! The lookup tables on the hot path: piece bytes -> ids.
//!
//! Each encoder builds a base table holding every ordinary token (a piece that is a
//! token is that token: "the vocab is the cache"). All threads that encode with it look
//! pieces up in one shared table made from the base, into which the ids of pieces that
//! needed merges are added, so that any piece seen before, by any thread, costs one
//! lookup, usually one cache line. One table for all threads: a piece is merged once,
//! not once per thread, and the CPU caches hold one table, not one per core.
//!
//! Slots are 32 bytes: keys of up to 16 bytes and up to 3 ids live inline (no pointer
//! chase); longer keys and longer id lists go to side storage.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rustc_hash::FxHashMap;

use super::hugebuf::{Zeroable, ZeroedBuf};

/// Pieces longer than this are not cached (they rarely repeat).
pub(crate) const MAX_CACHED_PIECE: usize = 128;
/// The shared table goes back to the base when its side storage (ids of pieces of more
/// than 3 ids; keys of more than 16 bytes) would pass this many bytes ...
const MAX_SIDE_BYTES: usize = 4 << 20;
/// ... or when its slot array would grow past this many slots (16 MiB), or past the
/// base's size if that is larger.
const MAX_SLOTS: usize = 1 << 19;
/// Bookkeeping bytes counted per long key besides its bytes.
const LONG_ENTRY_BYTES: usize = 48;

const INLINE_KEY: usize = 16;
const INLINE_IDS: usize = 3;
const COUNT_SHIFT: u32 = 8;

#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
struct Slot {
    /// Key bytes 0..8, little-endian, zero padded.
    lo: u64,
    /// Key bytes 8..16.
    hi: u64,
    /// Key length (low 8 bits; 0 = empty slot) | number of ids << 8.
    meta: u32,
    /// The ids when there are at most 3, else (offset, count) in `overflow`.
    ids: [u32; INLINE_IDS],
}

/// Masks keeping the first `len` bytes of a 16-byte little-endian load.
const MASK_LO: [u64; 17] = {
    let mut m = [0u64; 17];
    let mut i = 0;
    while i <= 16 {
        m[i] = if i >= 8 { u64::MAX } else { (1u64 << (8 * i)) - 1 };
        i += 1;
    }
    m
};
const MASK_HI: [u64; 17] = {
    let mut m = [0u64; 17];
    let mut i = 0;
    while i <= 16 {
        m[i] = if i <= 8 {
            0
        } else if i == 16 {
            u64::MAX
        } else {
            (1u64 << (8 * (i - 8))) - 1
        };
        i += 1;
    }
    m
};

// SAFETY: plain integers; all zeros is the empty slot.
unsafe impl Zeroable for Slot {}

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;

/// The bytes of a key of at most 16 bytes as two little-endian words, zero padded.
#[inline(always)]
fn pack(key: &[u8]) -> (u64, u64) {
    let n = key.len();
    debug_assert!(n <= INLINE_KEY);
    let rd8 = |i: usize| u64::from_le_bytes(key[i..i + 8].try_into().unwrap());
    let rd4 = |i: usize| u32::from_le_bytes(key[i..i + 4].try_into().unwrap()) as u64;
    if n >= 8 {
        let hi = if n == 8 { 0 } else { rd8(n - 8) >> (8 * (16 - n)) };
        (rd8(0), hi)
    } else if n >= 4 {
        (rd4(0) | (rd4(n - 4) << (8 * (n - 4))), 0)
    } else if n > 0 {
        let (a, b, c) = (key[0] as u64, key[n / 2] as u64, key[n - 1] as u64);
        (a | (b << (8 * (n / 2))) | (c << (8 * (n - 1))), 0)
    } else {
        (0, 0)
    }
}

#[inline(always)]
fn hash(lo: u64, hi: u64, len: usize) -> u64 {
    // A folded 64 x 64 -> 128-bit multiply: every input bit reaches the low bits used
    // as the slot index.
    let p = ((lo ^ K1) as u128).wrapping_mul((hi ^ K2 ^ ((len as u64) << 56)) as u128);
    (p as u64) ^ ((p >> 64) as u64)
}

/// A prepared lookup (see [`Probe::of`]).
#[derive(Clone, Copy, Default)]
pub(crate) struct Probe {
    lo: u64,
    hi: u64,
    hash: u64,
    n: u32,
}

impl Probe {
    /// The hash of `key` and its packed form; [`HomeView::prefetch`] it, then
    /// [`SharedTable::emit`] (a batch of lookups then overlaps its cache misses).
    #[inline(always)]
    pub(crate) fn of(key: &[u8]) -> Probe {
        let n = key.len();
        if n == 0 || n > INLINE_KEY {
            return Probe { lo: 0, hi: 0, hash: 0, n: u32::MAX };
        }
        let (lo, hi) = pack(key);
        Probe { lo, hi, hash: hash(lo, hi, n), n: n as u32 }
    }

    /// [`Probe::of`] `text[start..start + len]`, reading 16 bytes at once and
    /// masking (no branches on the length) when the text extends that far.
    #[inline(always)]
    pub(crate) fn at(text: &[u8], start: usize, len: usize) -> Probe {
        if len <= INLINE_KEY && len > 0 && start + 16 <= text.len() {
            // SAFETY: start + 16 <= text.len(), so both 8-byte reads are inside `text`.
            let (lo, hi) = unsafe {
                let p = text.as_ptr().add(start);
                (
                    std::ptr::read_unaligned(p as *const u64).to_le() & MASK_LO[len],
                    std::ptr::read_unaligned(p.add(8) as *const u64).to_le() & MASK_HI[len],
                )
            };
            return Probe { lo, hi, hash: hash(lo, hi, len), n: len as u32 };
        }
        Probe::of(&text[start..start + len])
    }
}

/// The base: each ordinary token's bytes -> its id, in the slot layout and hash of a
/// [`SharedTable`], which copies it (the table is only built, never looked up itself).
/// Open addressing, linear probing, load factor at most 3/4.
#[derive(Default)]
pub(crate) struct PieceTable {
    slots: ZeroedBuf<Slot>,
    mask: usize,
    count: usize,
    /// Keys of more than 16 bytes (shared as they are with the tables made from this one).
    long: Arc<LongMap>,
}

impl PieceTable {
    pub(crate) fn with_capacity(n: usize) -> Self {
        let size = (n.max(8) * 2).next_power_of_two();
        PieceTable { slots: ZeroedBuf::new(size), mask: size - 1, count: 0, long: Arc::default() }
    }

    /// Number of slots (for tests of the memory bound).
    #[cfg(test)]
    pub(crate) fn slots_len(&self) -> usize {
        self.slots.len()
    }

    /// The first slot probed for a key of hash `h`: the first of the two slots of a
    /// 64-byte line, so that a key one slot from home is in the same (prefetched) line.
    #[inline(always)]
    fn home(&self, h: u64) -> usize {
        h as usize & self.mask & !1
    }

    /// Whether `count` keys exceed the load factor (3/4: the vocab's tokens, looked up most,
    /// are inserted first and so sit at or next to their home slot).
    #[inline]
    fn full(&self, count: usize) -> bool {
        count * 4 > self.slots.len() * load_quarters()
    }

    /// Insert or replace the token `key` (not empty).
    pub(crate) fn insert(&mut self, key: &[u8], id: u32) {
        let n = key.len();
        assert!(n > 0, "the empty string is not a token");
        if n > INLINE_KEY {
            Arc::make_mut(&mut self.long).insert(key.into(), Box::new([id]));
            return;
        }
        if self.full(self.count + 1) {
            self.grow();
        }
        let (lo, hi) = pack(key);
        let slot = Slot { lo, hi, meta: n as u32 | (1 << COUNT_SHIFT), ids: [id, 0, 0] };
        let mut i = self.home(hash(lo, hi, n));
        loop {
            let s = &mut self.slots[i];
            if s.meta == 0 {
                *s = slot;
                self.count += 1;
                return;
            }
            if s.meta & 0xFF == n as u32 && s.lo == lo && s.hi == hi {
                *s = slot;
                return;
            }
            i = (i + 1) & self.mask;
        }
    }

    fn grow(&mut self) {
        self.grow_to((self.slots.len() * 2).max(16));
    }

    /// Rehash into `size` slots (a power of two, larger than now).
    fn grow_to(&mut self, size: usize) {
        debug_assert!(size.is_power_of_two() && size > self.slots.len());
        let old = std::mem::replace(&mut self.slots, ZeroedBuf::new(size));
        self.mask = size - 1;
        for &s in old.iter() {
            if s.meta == 0 {
                continue;
            }
            let mut i = self.home(hash(s.lo, s.hi, (s.meta & 0xFF) as usize));
            while self.slots[i].meta != 0 {
                i = (i + 1) & self.mask;
            }
            self.slots[i] = s;
        }
    }
}

/// A slot of a [`SharedTable`]: the layout of [`Slot`], every field atomic, since
/// threads read and write the table at once.
#[derive(Default)]
#[repr(C, align(32))]
struct SharedSlot {
    lo: AtomicU64,
    hi: AtomicU64,
    meta: AtomicU32,
    ids: [AtomicU32; INLINE_IDS],
}

const _: () = assert!(std::mem::size_of::<SharedSlot>() == std::mem::size_of::<Slot>());

// SAFETY: atomics of integers; all zeros is the empty slot.
unsafe impl Zeroable for SharedSlot {}

/// The `meta` of a slot being written: its key length byte matches no probe, and it is
/// not empty, so lookups pass over it.
const BUSY: u32 = 0xFF;

impl SharedSlot {
    /// The inline ids of a slot whose `meta` was read (acquire) as published: they were
    /// written before that and are never written again, so a plain read is no race, and
    /// one copy of 12 bytes is cheaper than three atomic loads.
    #[inline(always)]
    fn published_ids(&self) -> [u32; INLINE_IDS] {
        // SAFETY: AtomicU32 has the layout of u32; no write to these ids can happen
        // after the slot's publication (see above).
        unsafe { std::ptr::read(self.ids.as_ptr() as *const [u32; INLINE_IDS]) }
    }

    /// Whether this slot, whose `meta` was read (acquire) as `m`, holds the probed key:
    /// a slot's key and ids are written before its `meta` is published, so the key is
    /// read after it. BUSY and empty slots match no probe.
    #[inline(always)]
    fn holds(&self, m: u32, p: &Probe) -> bool {
        m & 0xFF == p.n && self.lo.load(Ordering::Relaxed) == p.lo && self.hi.load(Ordering::Relaxed) == p.hi
    }

    /// The slot's `meta` if it holds the probed key.
    #[inline(always)]
    fn matches(&self, p: &Probe) -> Option<u32> {
        let m = self.meta.load(Ordering::Acquire);
        self.holds(m, p).then_some(m)
    }
}

/// A [`SharedTable`]'s slot array for lookups of pieces that sit in their home line (the
/// two slots of [`SharedTable::home`]) with their ids inline: most lookups of real text.
/// A copy of the table's address and mask, so a loop of such lookups keeps them in
/// registers. It must not outlive the table.
#[derive(Clone, Copy)]
pub(crate) struct HomeView {
    slots: *const SharedSlot,
    /// The table's mask without its lowest bit: hash & home_mask is the home slot.
    home_mask: usize,
}

impl HomeView {
    /// Hint the home line of the probed piece into the CPU cache.
    #[inline(always)]
    pub(crate) fn prefetch(self, p: &Probe) {
        #[cfg(target_arch = "x86_64")]
        if p.n != u32::MAX {
            // SAFETY: the index is masked to the table size; prefetch never faults anyway.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch(self.slots.add(p.hash as usize & self.home_mask) as *const i8, _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    /// Write the ids of the probed piece at `dst` and return how many (1 to 3), or 0 when
    /// the piece is not in its home line with its ids inline (then use
    /// [`SharedTable::emit`]).
    ///
    /// # Safety
    /// The table this view was taken from is alive, and `dst` has room for 3 ids.
    #[inline(always)]
    pub(crate) unsafe fn emit_home(self, p: &Probe, dst: *mut u32) -> usize {
        let home = p.hash as usize & self.home_mask;
        // SAFETY: home is even and masked, so home + 1 <= mask: both are in the table,
        // and in the same 64-byte line.
        let (s0, s1) = unsafe { (&*self.slots.add(home), &*self.slots.add(home + 1)) };
        let (s, m) = if let Some(m) = s0.matches(p) {
            (s0, m)
        } else if let Some(m) = s1.matches(p) {
            (s1, m)
        } else {
            return 0;
        };
        let count = (m >> COUNT_SHIFT) as usize;
        // One id is the common case: a branch on it lets the CPU run on to the next piece
        // without waiting for the count.
        if count == 1 {
            unsafe { dst.write(s.ids[0].load(Ordering::Relaxed)) };
            return 1;
        }
        if count > INLINE_IDS {
            return 0;
        }
        for (k, id) in s.ids.iter().enumerate() {
            unsafe { dst.add(k).write(id.load(Ordering::Relaxed)) };
        }
        count
    }
}

/// How large an encoder's [`SharedTable`] may get before it goes back to the base.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TableLimits {
    /// Slots (a power of two; at least the base's).
    pub(crate) max_slots: usize,
    /// Bytes outside the slots: ids of pieces of more than 3 ids (this many bytes of
    /// them), and keys of more than 16 bytes with their ids (as many again).
    pub(crate) max_side: usize,
}

impl TableLimits {
    pub(crate) fn for_base(base: &PieceTable) -> Self {
        TableLimits { max_slots: base.slots.len().max(MAX_SLOTS), max_side: MAX_SIDE_BYTES }
    }
}

/// What a table needs after an insert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outgrown {
    /// Its slots are 3/4 taken: a larger table with the same pieces (or the base again,
    /// at the largest size).
    Slots,
    /// Its side storage is full: the base again.
    Side,
}

/// Credits to take slots, reserved from a table's count this many at a time: threads
/// do not write one shared counter per insert.
const CREDIT_BLOCK: usize = 32;

thread_local! {
    /// (table id, slots this thread may still take in that table).
    static CREDITS: Cell<(u64, usize)> = const { Cell::new((0, 0)) };
}

static NEXT_TABLE_ID: AtomicU64 = AtomicU64::new(1);

/// Keys of more than 16 bytes -> their ids.
type LongMap = FxHashMap<Box<[u8]>, Box<[u32]>>;

/// Keys of more than 16 bytes, with their ids.
#[derive(Default, Clone)]
struct LongPieces {
    map: LongMap,
    /// Bytes of the pieces added since the table was made (plus LONG_ENTRY_BYTES each).
    added: usize,
}

/// The table an encoder's threads all look pieces up in and add merged pieces to: the
/// base (every ordinary token) plus every piece merged since, so that each piece is
/// merged once per table, not once per thread, and the CPU caches hold one table.
///
/// Lookups take no lock. A piece is added by claiming an empty slot (compare and swap
/// of its `meta` to BUSY), writing its key and ids, then publishing its `meta`; two
/// threads that add the same piece at once may both store it (the first is found).
/// The slot array never grows in place: a full table is replaced (see
/// [`Outgrown`]) and threads move to the new one between batches of pieces.
pub(crate) struct SharedTable {
    slots: ZeroedBuf<SharedSlot>,
    mask: usize,
    /// Slots that may be taken in all (7/8 of them: a probe always ends at an empty
    /// slot), and the count past which the table asks to be replaced (3/4).
    hard_cap: usize,
    soft_cap: usize,
    /// Ids of pieces of more than 3 ids (slot: offset, count), fixed capacity.
    overflow: ZeroedBuf<AtomicU32>,
    /// The base's keys of more than 16 bytes (read without a lock), and those added.
    base_long: Arc<LongMap>,
    long: Mutex<LongPieces>,
    limits: TableLimits,
    id: u64,
    /// Written by inserts and replacement: kept off the line the lookups read.
    counts: Counters,
}

#[derive(Default)]
#[repr(align(64))]
struct Counters {
    /// Slots reserved (in CREDIT_BLOCKs) or taken by the copy this table was made from.
    reserved: AtomicUsize,
    overflow_len: AtomicUsize,
    /// A thread is building this table's replacement.
    replacing: std::sync::atomic::AtomicBool,
    /// The replacement is in place: threads holding this table should load the new one.
    retired: std::sync::atomic::AtomicBool,
    /// Whether `long` holds anything (lookups of long pieces skip its lock until then).
    any_long: std::sync::atomic::AtomicBool,
}

impl SharedTable {
    /// A table of the base's pieces, with room for `limits`.
    pub(crate) fn from_base(base: &PieceTable, limits: TableLimits) -> Self {
        // The table has the base's size and hash: its slots are copied as they are.
        let t = Self::empty(base.slots.len(), limits, base.long.clone());
        for (d, s) in t.slots.iter().zip(base.slots.iter()).filter(|(_, s)| s.meta != 0) {
            d.lo.store(s.lo, Ordering::Relaxed);
            d.hi.store(s.hi, Ordering::Relaxed);
            for (a, &id) in d.ids.iter().zip(&s.ids) {
                a.store(id, Ordering::Relaxed);
            }
            d.meta.store(s.meta, Ordering::Relaxed);
        }
        t.counts.reserved.store(base.count, Ordering::Relaxed);
        t
    }

    /// A table of `slots` slots holding what `old` holds now.
    fn grown(old: &SharedTable, slots: usize) -> Self {
        let t = Self::empty(slots, old.limits, old.base_long.clone());
        let mut ids = Vec::new();
        for s in old.slots.iter() {
            let m = s.meta.load(Ordering::Acquire);
            if m == 0 || m == BUSY {
                continue;
            }
            ids.clear();
            old.push_ids(s, m, &mut ids);
            if !t.put(s.lo.load(Ordering::Relaxed), s.hi.load(Ordering::Relaxed), m & 0xFF, &ids) {
                break;
            }
        }
        // The long pieces too, unless another thread holds them (they are merged again).
        if let Some(long) = old.try_long().map(|l| l.clone()) {
            t.counts.any_long.store(!long.map.is_empty(), Ordering::Relaxed);
            *t.long.lock().unwrap_or_else(|e| e.into_inner()) = long;
        }
        t
    }

    fn empty(slots: usize, limits: TableLimits, base_long: Arc<LongMap>) -> Self {
        debug_assert!(slots.is_power_of_two() && slots >= 16);
        SharedTable {
            slots: ZeroedBuf::new(slots),
            mask: slots - 1,
            hard_cap: slots - slots / 8,
            soft_cap: slots * load_quarters() / 4,
            overflow: ZeroedBuf::new((limits.max_side / 4).max(1)),
            base_long,
            long: Mutex::new(LongPieces::default()),
            limits,
            id: NEXT_TABLE_ID.fetch_add(1, Ordering::Relaxed),
            counts: Counters::default(),
        }
    }

    /// Store a piece while the table is private to its builder; false when full.
    fn put(&self, lo: u64, hi: u64, n: u32, ids: &[u32]) -> bool {
        if self.counts.reserved.load(Ordering::Relaxed) >= self.hard_cap {
            return false;
        }
        self.counts.reserved.fetch_add(1, Ordering::Relaxed);
        self.store(&Probe { lo, hi, hash: hash(lo, hi, n as usize), n }, ids).is_ok()
    }

    /// ((slots, bytes outside the slots added since the table was made), their bounds)
    /// (tests of the memory bound).
    #[cfg(test)]
    pub(crate) fn usage(&self) -> ((usize, usize), (usize, usize)) {
        let side = self.counts.overflow_len.load(Ordering::Relaxed).min(self.overflow.len()) * 4
            + self.long.lock().unwrap_or_else(|e| e.into_inner()).added;
        ((self.slots.len(), side), (self.limits.max_slots, 2 * self.limits.max_side))
    }

    #[inline(always)]
    fn home(&self, h: u64) -> usize {
        h as usize & self.mask & !1
    }

    #[inline(always)]
    pub(crate) fn home_view(&self) -> HomeView {
        HomeView { slots: self.slots.as_ptr(), home_mask: self.mask & !1 }
    }

    /// Whether a replacement is in place (threads holding this table load the new one).
    #[inline(always)]
    pub(crate) fn retired(&self) -> bool {
        self.counts.retired.load(Ordering::Relaxed)
    }

    /// The ids of slot `s`, whose `meta` was read (acquire) as `m`, published, appended
    /// to `out`.
    #[inline(always)]
    fn push_ids(&self, s: &SharedSlot, m: u32, out: &mut Vec<u32>) {
        let c = (m >> COUNT_SHIFT) as usize;
        if c <= INLINE_IDS {
            out.extend_from_slice(&s.published_ids()[..c]);
        } else {
            let o = s.ids[0].load(Ordering::Relaxed) as usize;
            out.extend(self.overflow[o..o + c].iter().map(|a| a.load(Ordering::Relaxed)));
        }
    }

    /// Append the ids of the probed piece `key` to `out`; false when it is not held.
    #[inline(always)]
    pub(crate) fn emit(&self, p: &Probe, key: &[u8], out: &mut Vec<u32>) -> bool {
        if p.n == u32::MAX {
            return self.emit_long(key, out);
        }
        let mut i = self.home(p.hash);
        loop {
            // SAFETY: i is masked to slots.len() - 1.
            let s = unsafe { self.slots.get_unchecked(i) };
            let m = s.meta.load(Ordering::Acquire);
            if s.holds(m, p) {
                self.push_ids(s, m, out);
                return true;
            }
            if m == 0 {
                return false;
            }
            i = (i + 1) & self.mask;
        }
    }

    #[cold]
    #[inline(never)]
    fn emit_long(&self, key: &[u8], out: &mut Vec<u32>) -> bool {
        if let Some(ids) = self.base_long.get(key) {
            out.extend_from_slice(ids);
            return true;
        }
        if key.is_empty() || !self.counts.any_long.load(Ordering::Acquire) {
            return false;
        }
        // Merged pieces only: when another thread holds the lock, merging the piece again
        // gives its ids without waiting (and no lock is ever waited for, even in a
        // child forked while another thread held it).
        let Some(long) = self.try_long() else {
            return false;
        };
        match long.map.get(key) {
            Some(ids) => {
                out.extend_from_slice(ids);
                true
            }
            None => false,
        }
    }

    /// The added long pieces, unless another thread holds them.
    fn try_long(&self) -> Option<std::sync::MutexGuard<'_, LongPieces>> {
        match self.long.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Add a merged piece (`ids` not empty). Returns what the table needs, if anything:
    /// the piece may not have been stored then (it will be merged again when next seen).
    pub(crate) fn insert(&self, key: &[u8], ids: &[u32]) -> Option<Outgrown> {
        if key.len() > MAX_CACHED_PIECE || ids.is_empty() || self.counts.replacing.load(Ordering::Relaxed) {
            return None;
        }
        if key.len() > INLINE_KEY {
            let mut long = self.try_long()?;
            let add = key.len() + LONG_ENTRY_BYTES + ids.len() * 4;
            if long.added + add > self.limits.max_side {
                return Some(Outgrown::Side);
            }
            if long.map.insert(key.into(), ids.into()).is_none() {
                long.added += add;
            }
            self.counts.any_long.store(true, Ordering::Release);
            return None;
        }
        let mut outgrown = None;
        // Take a slot credit, reserving a block when this thread has none for this table.
        let (tid, credits) = CREDITS.with(|c| c.get());
        let credits = if tid == self.id && credits > 0 {
            credits
        } else {
            let before = self.counts.reserved.fetch_add(CREDIT_BLOCK, Ordering::Relaxed);
            if before + CREDIT_BLOCK > self.soft_cap {
                outgrown = Some(Outgrown::Slots);
            }
            if before + CREDIT_BLOCK > self.hard_cap {
                return outgrown;
            }
            CREDIT_BLOCK
        };
        CREDITS.with(|c| c.set((self.id, credits - 1)));
        if self.store(&Probe::of(key), ids).is_err() {
            return Some(Outgrown::Side);
        }
        outgrown
    }

    /// Claim a slot for the probed key and publish it with `ids`, unless the key is
    /// there already. The caller holds a slot credit. Err when the side storage is full.
    fn store(&self, p: &Probe, ids: &[u32]) -> Result<(), ()> {
        let c = ids.len();
        let mut inline = [0u32; INLINE_IDS];
        if c <= INLINE_IDS {
            inline[..c].copy_from_slice(ids);
        } else {
            let o = self.counts.overflow_len.fetch_add(c, Ordering::Relaxed);
            if o + c > self.overflow.len() {
                return Err(());
            }
            // The range is this thread's alone until the slot is published.
            for (a, &id) in self.overflow[o..o + c].iter().zip(ids) {
                a.store(id, Ordering::Relaxed);
            }
            inline = [o as u32, c as u32, 0];
        }
        let meta = p.n | ((c as u32) << COUNT_SHIFT);
        let mut i = self.home(p.hash);
        loop {
            // SAFETY: i is masked to slots.len() - 1.
            let s = unsafe { self.slots.get_unchecked(i) };
            let m = s.meta.load(Ordering::Acquire);
            if m == 0 {
                if s.meta.compare_exchange(0, BUSY, Ordering::Acquire, Ordering::Relaxed).is_err() {
                    continue; // taken meanwhile: look at it again
                }
                s.lo.store(p.lo, Ordering::Relaxed);
                s.hi.store(p.hi, Ordering::Relaxed);
                for (a, &id) in s.ids.iter().zip(&inline) {
                    a.store(id, Ordering::Relaxed);
                }
                s.meta.store(meta, Ordering::Release);
                return Ok(());
            }
            if s.holds(m, p) {
                return Ok(());
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Start replacing this table, unless another thread has: true for the one thread
    /// that should build the replacement.
    pub(crate) fn claim_replacement(&self) -> bool {
        !self.counts.replacing.swap(true, Ordering::AcqRel)
    }

    /// The replacement for `why`: the same pieces in more slots, or the base again.
    pub(crate) fn replacement(&self, why: Outgrown, base: &PieceTable) -> SharedTable {
        let slots = self.slots.len();
        if why == Outgrown::Slots && slots < self.limits.max_slots {
            // The last two doublings in one step: a doubling holds the table and its
            // double at once (1.5x the largest size at the last one; 1.25x this way).
            let to = if slots * 4 >= self.limits.max_slots { self.limits.max_slots } else { slots * 2 };
            SharedTable::grown(self, to)
        } else {
            SharedTable::from_base(base, self.limits)
        }
    }

    /// Mark the replacement in place.
    pub(crate) fn retire(&self) {
        self.counts.retired.store(true, Ordering::Release);
    }
}

/// The load factor in quarters (3; tests may set FERROLM_TEST_LOAD).
#[inline(always)]
fn load_quarters() -> usize {
    #[cfg(test)]
    {
        static L: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *L.get_or_init(|| std::env::var("FERROLM_TEST_LOAD").ok().and_then(|v| v.parse().ok()).unwrap_or(3))
    }
    #[cfg(not(test))]
    3
}
