//! The lookup table on the hot path: piece bytes -> ids.
//!
//! Each encoder builds a base table holding every ordinary token (a piece that is a
//! token is that token: "the vocab is the cache"). Each thread encodes with its own
//! copy of it, into which the ids of pieces that needed merges are added, so that any
//! piece seen before costs one lookup, usually one cache line.
//!
//! Slots are 32 bytes: keys of up to 16 bytes and up to 3 ids live inline (no pointer
//! chase); longer keys and longer id lists go to side storage.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use rustc_hash::FxHashMap;

use super::hugebuf::{Zeroable, ZeroedBuf};

/// Pieces longer than this are not cached (they rarely repeat).
pub(crate) const MAX_CACHED_PIECE: usize = 128;
/// A thread's table is reset to the base when it holds this many cached pieces ...
const MAX_CACHED_PIECES: usize = 1 << 20;
/// ... or this many bytes outside its slots (ids of pieces of more than 3 ids, keys of
/// more than 16 bytes) ...
const MAX_SIDE_BYTES: usize = 4 << 20;
/// ... or when its slot array would grow past this many slots (16 MiB), or past the
/// base's size if that is larger.
const MAX_SLOTS: usize = 1 << 19;
/// Bookkeeping bytes counted per long key besides its bytes.
const LONG_ENTRY_BYTES: usize = 48;
/// Encoders whose tables a thread keeps at once.
const TABLES_PER_THREAD: usize = 4;

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

impl Slot {
    /// Whether this slot holds the probed key. A long-key probe has n = u32::MAX, which
    /// no key length equals.
    #[inline(always)]
    fn holds(&self, p: &Probe) -> bool {
        self.meta & 0xFF == p.n && self.lo == p.lo && self.hi == p.hi
    }
}

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

/// A prepared lookup (see [`PieceTable::probe`]).
#[derive(Clone, Copy, Default)]
pub(crate) struct Probe {
    lo: u64,
    hi: u64,
    hash: u64,
    n: u32,
}

/// Piece bytes -> ids. Open addressing, linear probing, load factor at most 3/4.
#[derive(Clone, Default)]
pub(crate) struct PieceTable {
    slots: ZeroedBuf<Slot>,
    mask: usize,
    count: usize,
    overflow: Vec<u32>,
    long: FxHashMap<Box<[u8]>, (u32, u32)>,
    /// Bytes of the keys in `long` (plus LONG_ENTRY_BYTES each).
    long_bytes: usize,
}

impl PieceTable {
    pub(crate) fn with_capacity(n: usize) -> Self {
        let size = (n.max(8) * 2).next_power_of_two();
        PieceTable {
            slots: ZeroedBuf::new(size),
            mask: size - 1,
            count: 0,
            overflow: Vec::new(),
            long: FxHashMap::default(),
            long_bytes: 0,
        }
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

    /// Number of pieces held.
    pub(crate) fn len(&self) -> usize {
        self.count + self.long.len()
    }

    /// Bytes held outside the slots.
    fn side_bytes(&self) -> usize {
        self.overflow.len() * 4 + self.long_bytes
    }

    /// Whether inserting a key of `n` bytes would grow the slot array past `max_slots`.
    fn would_outgrow(&self, n: usize, max_slots: usize) -> bool {
        n <= INLINE_KEY && self.full(self.count + 1) && self.slots.len() * 2 > max_slots
    }

    /// Whether `count` keys exceed the load factor (3/4: the vocab's tokens, looked up most,
    /// are inserted first and so sit at or next to their home slot).
    #[inline]
    fn full(&self, count: usize) -> bool {
        count * 4 > self.slots.len() * load_quarters()
    }

    #[inline(always)]
    fn ids_of<'a>(&'a self, s: &'a Slot) -> &'a [u32] {
        let c = (s.meta >> COUNT_SHIFT) as usize;
        if c <= INLINE_IDS {
            &s.ids[..c]
        } else {
            let o = s.ids[0] as usize;
            &self.overflow[o..o + c]
        }
    }

    /// The hash of `key` and its packed form; [`PieceTable::prefetch`] it, then
    /// [`PieceTable::get_probed`] (a batch of lookups then overlaps its cache misses).
    #[inline(always)]
    pub(crate) fn probe(&self, key: &[u8]) -> Probe {
        let n = key.len();
        if n == 0 || n > INLINE_KEY {
            return Probe { lo: 0, hi: 0, hash: 0, n: u32::MAX };
        }
        let (lo, hi) = pack(key);
        Probe { lo, hi, hash: hash(lo, hi, n), n: n as u32 }
    }

    /// [`PieceTable::probe`] of `text[start..start + len]`, reading 16 bytes at once and
    /// masking (no branches on the length) when the text extends that far.
    #[inline(always)]
    pub(crate) fn probe_at(&self, text: &[u8], start: usize, len: usize) -> Probe {
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
        self.probe(&text[start..start + len])
    }

    #[inline(always)]
    pub(crate) fn prefetch(&self, p: &Probe) {
        #[cfg(target_arch = "x86_64")]
        if p.n != u32::MAX {
            // SAFETY: the index is masked to the table size; prefetch never faults anyway.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                let at = self.home(p.hash);
                _mm_prefetch(self.slots.as_ptr().add(at) as *const i8, _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }

    #[inline(always)]
    pub(crate) fn get_probed(&self, p: &Probe, key: &[u8]) -> Option<&[u32]> {
        if p.n == u32::MAX {
            return self.get_long(key);
        }
        let mut i = self.home(p.hash);
        loop {
            // SAFETY: i is masked to slots.len() - 1.
            let s = unsafe { self.slots.get_unchecked(i) };
            if s.holds(p) {
                return Some(self.ids_of(s));
            }
            if s.meta == 0 {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The slot array's address and mask, to keep in registers over a run of lookups
    /// (valid until the next insert: see [`HomeView`]).
    #[inline(always)]
    pub(crate) fn home_view(&self) -> HomeView {
        HomeView { slots: self.slots.as_ptr(), home_mask: self.mask & !1 }
    }

    #[inline(always)]
    pub(crate) fn get(&self, key: &[u8]) -> Option<&[u32]> {
        let p = self.probe(key);
        self.get_probed(&p, key)
    }

    #[cold]
    #[inline(never)]
    fn get_long(&self, key: &[u8]) -> Option<&[u32]> {
        if key.is_empty() || self.long.is_empty() {
            return None;
        }
        self.long.get(key).map(|&(o, c)| &self.overflow[o as usize..(o + c) as usize])
    }

    /// Insert or replace; `ids` is not empty.
    pub(crate) fn insert(&mut self, key: &[u8], ids: &[u32]) {
        let n = key.len();
        assert!(n > 0 && !ids.is_empty() && ids.len() < (1 << 24), "bad piece table entry");
        if n > INLINE_KEY {
            let o = self.overflow.len() as u32;
            self.overflow.extend_from_slice(ids);
            if self.long.insert(key.into(), (o, ids.len() as u32)).is_none() {
                self.long_bytes += n + LONG_ENTRY_BYTES;
            }
            return;
        }
        if self.full(self.count + 1) {
            self.grow();
        }
        let (lo, hi) = pack(key);
        let mut slot = Slot { lo, hi, meta: n as u32 | ((ids.len() as u32) << COUNT_SHIFT), ids: [0; INLINE_IDS] };
        if ids.len() <= INLINE_IDS {
            slot.ids[..ids.len()].copy_from_slice(ids);
        } else {
            slot.ids[0] = self.overflow.len() as u32;
            slot.ids[1] = ids.len() as u32;
            self.overflow.extend_from_slice(ids);
        }
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

/// A table's slot array for lookups of pieces that sit in their home line (the two
/// slots of [`PieceTable::home`]) with their ids inline: most lookups of real text. A
/// copy of the table's address and mask, so a loop of such lookups keeps them in
/// registers. It must not outlive the table, nor be used after an insert (which may
/// move the slots).
#[derive(Clone, Copy)]
pub(crate) struct HomeView {
    slots: *const Slot,
    /// The table's mask without its lowest bit: hash & home_mask is the home slot.
    home_mask: usize,
}

impl HomeView {
    /// Write the ids of the probed piece at `dst` and return how many (1 to 3), or 0 when
    /// the piece is not in its home line with its ids inline (then use
    /// [`PieceTable::get_probed`]).
    ///
    /// # Safety
    /// The table this view was taken from is alive and unchanged since, and `dst` has
    /// room for 3 ids.
    #[inline(always)]
    pub(crate) unsafe fn emit_home(self, p: &Probe, dst: *mut u32) -> usize {
        let home = p.hash as usize & self.home_mask;
        // SAFETY: home is even and masked, so home + 1 <= mask: both are in the table,
        // and in the same 64-byte line.
        let (s0, s1) = unsafe { (&*self.slots.add(home), &*self.slots.add(home + 1)) };
        let s = if s0.holds(p) {
            s0
        } else if s1.holds(p) {
            s1
        } else {
            return 0;
        };
        let count = (s.meta >> COUNT_SHIFT) as usize;
        // One id is the common case: a branch on it lets the CPU run on to the next piece
        // without waiting for the count.
        if count == 1 {
            unsafe { dst.write(s.ids[0]) };
            return 1;
        }
        if count > INLINE_IDS {
            return 0;
        }
        unsafe { (dst as *mut [u32; INLINE_IDS]).write_unaligned(s.ids) };
        count
    }
}

/// One thread's table for one encoder: the encoder's base table plus cached pieces.
///
/// Its memory is bounded: when the cached pieces reach one of the limits above, the
/// table goes back to the base (frequent pieces are cached again at once). Besides
/// memory, a table that stays small stays in the CPU caches: the vocab's entries are
/// the ones most looked up, and they are spread over the whole slot array.
pub(crate) struct PieceCache {
    owner: u64,
    table: PieceTable,
    base_len: usize,
    base_side: usize,
    max_slots: usize,
    max_side: usize,
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

#[cfg(test)]
thread_local! {
    /// Smaller bounds for this thread's new tables (tests of the resets).
    static TEST_LIMITS: std::cell::Cell<Option<(usize, usize)>> = const { std::cell::Cell::new(None) };
}

/// Make this thread's tables made from now on reset at `max_slots` slots and `max_side`
/// side bytes (tests).
#[cfg(test)]
pub(crate) fn set_test_limits(max_slots: usize, max_side: usize) {
    TEST_LIMITS.with(|l| l.set(Some((max_slots, max_side))));
}

impl PieceCache {
    fn new(owner: u64, base: &PieceTable) -> Self {
        #[allow(unused_mut)]
        let (mut max_slots, mut max_side) = (base.slots.len().max(MAX_SLOTS), MAX_SIDE_BYTES);
        #[cfg(test)]
        if let Some((a, b)) = TEST_LIMITS.with(|l| l.get()) {
            (max_slots, max_side) = (base.slots.len().max(a), b);
        }
        #[cfg(test)]
        if let Some(a) = std::env::var("FERROLM_TEST_SLOTS").ok().and_then(|v| v.parse::<usize>().ok()) {
            max_slots = base.slots.len().max(a);
        }
        PieceCache { owner, table: base.clone(), base_len: base.len(), base_side: base.side_bytes(), max_slots, max_side }
    }

    #[inline(always)]
    pub(crate) fn table(&self) -> &PieceTable {
        &self.table
    }

    /// (slots, bytes outside the slots) now, and the bounds they stay within.
    #[cfg(test)]
    pub(crate) fn usage(&self) -> ((usize, usize), (usize, usize)) {
        ((self.table.slots_len(), self.table.side_bytes() - self.base_side), (self.max_slots, self.max_side))
    }

    /// Remember the ids of a piece that needed merges.
    pub(crate) fn insert(&mut self, base: &PieceTable, piece: &[u8], ids: &[u32]) {
        if piece.len() > MAX_CACHED_PIECE || ids.is_empty() {
            return;
        }
        let side = if piece.len() > INLINE_KEY {
            piece.len() + LONG_ENTRY_BYTES + ids.len() * 4
        } else if ids.len() > INLINE_IDS {
            ids.len() * 4
        } else {
            0
        };
        if self.table.len() - self.base_len >= MAX_CACHED_PIECES
            || self.table.side_bytes() - self.base_side + side > self.max_side
            || self.table.would_outgrow(piece.len(), self.max_slots)
        {
            // The old table goes first, so that both are never held at once.
            self.table = PieceTable::default();
            self.table = base.clone();
        } else if piece.len() <= INLINE_KEY && self.table.full(self.table.count + 1) {
            // The last two doublings in one step: a doubling holds the table and its
            // double at once (1.5x the largest size at the last one; 1.25x this way).
            let slots = self.table.slots.len();
            self.table.grow_to(if slots * 4 >= self.max_slots { self.max_slots } else { slots * 2 });
        }
        self.table.insert(piece, ids);
    }
}

thread_local! {
    /// Most recently used first.
    static CACHES: RefCell<Vec<PieceCache>> = const { RefCell::new(Vec::new()) };
    /// The value of DROPS when this thread last dropped the tables of dead encoders.
    static SEEN_DROPS: Cell<u64> = const { Cell::new(0) };
}

/// The encoders alive (their uids), and how many were dropped so far: a thread drops its
/// tables of dropped encoders the next time it encodes (pool threads would otherwise keep
/// them until they had used TABLES_PER_THREAD newer encoders).
static LIVE: Mutex<Vec<u64>> = Mutex::new(Vec::new());
static DROPS: AtomicU64 = AtomicU64::new(0);

/// Record a new encoder.
pub(crate) fn register(owner: u64) {
    LIVE.lock().unwrap_or_else(|e| e.into_inner()).push(owner);
}

/// The encoders whose tables this thread holds (tests).
#[cfg(test)]
pub(crate) fn owners() -> Vec<u64> {
    CACHES.with(|c| c.borrow().iter().map(|t| t.owner).collect())
}

/// Run `f` with this thread's table for encoder `owner` (made from `base` the first
/// time; a thread keeps the tables of its last few encoders). Re-entrant calls get a
/// temporary table.
pub(crate) fn with_cache<R>(owner: u64, base: &PieceTable, f: impl FnOnce(&mut PieceCache) -> R) -> R {
    let mut f = Some(f);
    let done = CACHES.try_with(|cell| {
        let mut caches = cell.try_borrow_mut().ok()?;
        let drops = DROPS.load(Ordering::Relaxed);
        if SEEN_DROPS.with(|s| s.replace(drops)) != drops && !caches.is_empty() {
            let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
            caches.retain(|c| c.owner == owner || live.contains(&c.owner));
        }
        match caches.iter().position(|c| c.owner == owner) {
            Some(0) => {}
            Some(i) => {
                let c = caches.remove(i);
                caches.insert(0, c);
            }
            None => {
                if caches.len() >= TABLES_PER_THREAD {
                    caches.pop();
                }
                caches.insert(0, PieceCache::new(owner, base));
            }
        }
        Some((f.take().unwrap())(&mut caches[0]))
    });
    match done {
        Ok(Some(r)) => r,
        _ => (f.take().unwrap())(&mut PieceCache::new(owner, base)),
    }
}

/// Encoder `owner` is dropped: forget its tables (this thread's now, other threads' when
/// they next encode).
pub(crate) fn forget(owner: u64) {
    LIVE.lock().unwrap_or_else(|e| e.into_inner()).retain(|&o| o != owner);
    DROPS.fetch_add(1, Ordering::Relaxed);
    let _ = CACHES.try_with(|cell| {
        if let Ok(mut caches) = cell.try_borrow_mut() {
            caches.retain(|c| c.owner != owner);
        }
    });
}
