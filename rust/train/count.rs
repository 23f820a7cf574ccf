//! Stage 2: pre-tokenize in parallel and count unique pre-tokens (u64 counts).
//!
//! Each worker owns one table for the whole run (no locking, no sharing). Pieces of up
//! to 15 bytes (nearly all of them) are keyed by a 128-bit integer read straight from
//! the chunk; longer ones are looked up as byte slices borrowed from the chunk and
//! copied only the first time a worker sees them. Lookups go through a small count
//! cache and are batched with prefetches, so memory latency overlaps. The tables are
//! sharded by hash and merged once, at the end, shard by shard in parallel.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::pretokenize::PreTokenizer;

use super::{Control, TrainError};
use crate::cut::last_text_cut;

use crate::utf8::Utf8Errors;

/// Pieces of up to this many bytes are keyed by a 128-bit integer (bytes + length).
const SHORT: usize = 15;
/// Pieces counted together (at most): their memory accesses are started before any
/// is used. The pre-tokenizer's batches are smaller.
const BATCH: usize = crate::pretokenize::MAX_BATCH;
const _: () = assert!(BATCH <= 256, "add_batch keeps batch indices in u8");

#[inline]
fn mix(key: u128) -> u64 {
    // Folded multiply of the two halves with odd constants (the mixer of foldhash/ahash).
    let lo = (key as u64) ^ 0x243f_6a88_85a3_08d3;
    let hi = ((key >> 64) as u64) ^ 0x1319_8a2e_0370_7344;
    let p = (lo as u128).wrapping_mul(hi as u128);
    (p as u64) ^ ((p >> 64) as u64)
}

/// The key of a short piece: its bytes little-endian in bits 0..120, its length on top.
#[inline]
fn short_key(piece: &[u8]) -> u128 {
    debug_assert!(piece.len() <= SHORT);
    let mut buf = [0u8; 16];
    buf[..piece.len()].copy_from_slice(piece);
    buf[15] = piece.len() as u8;
    u128::from_le_bytes(buf)
}

/// `KEY_MASKS[n]` keeps the first n bytes of a little-endian 16-byte word (a load is
/// cheaper than a variable 128-bit shift).
const KEY_MASKS: [u128; SHORT + 1] = {
    let mut m = [0u128; SHORT + 1];
    let mut i = 0;
    while i <= SHORT {
        m[i] = (1u128 << (8 * i)) - 1;
        i += 1;
    }
    m
};

/// The key of a short piece of `len` bytes, given the 16 bytes from its start
/// (little-endian).
#[inline(always)]
fn short_key_of(word: u128, len: usize) -> u128 {
    (word & KEY_MASKS[len]) | ((len as u128) << 120)
}

/// The key of the short piece `text[s..e]`, reading 16 bytes at once when the text
/// extends at least that far.
#[inline]
fn short_key_at(text: &[u8], s: usize, e: usize) -> u128 {
    let len = e - s;
    debug_assert!(len <= SHORT && e <= text.len());
    if s + 16 <= text.len() {
        short_key_of(u128::from_le_bytes(text[s..s + 16].try_into().unwrap()), len)
    } else {
        short_key(&text[s..e])
    }
}

fn short_bytes(key: u128) -> ([u8; 16], usize) {
    let b = key.to_le_bytes();
    (b, b[15] as usize)
}

/// Number of shards of a count table (a power of two). Shards are merged and turned
/// into words in parallel.
pub const SHARDS: usize = 16;

#[inline]
fn shard_of(h: u64) -> usize {
    // Bits hashbrown does not use for tables under 2^40 buckets, nor for its tags.
    ((h >> 40) as usize) & (SHARDS - 1)
}

#[inline]
fn long_hash(piece: &[u8]) -> u64 {
    mix(short_key(&piece[..SHORT.min(piece.len())]))
}

/// An entry of a `ShortTable`: a short piece's key and its count.
#[derive(Clone, Copy, Default)]
struct Entry {
    key: [u64; 2],
    count: u64,
}

/// Open addressing with linear probing over keys of short pieces (key[1] is never 0 for
/// a real key: it holds the length). Kept under 70 % full.
#[derive(Default)]
struct ShortTable {
    entries: Vec<Entry>,
    len: usize,
}

impl ShortTable {
    #[inline]
    fn mask(&self) -> usize {
        self.entries.len().wrapping_sub(1)
    }

    /// Hint the slot where the key of hash `h` starts probing into the CPU cache.
    #[inline]
    fn prefetch(&self, h: u64) {
        #[cfg(target_arch = "x86_64")]
        if !self.entries.is_empty() {
            // SAFETY: a prefetch is only a hint; the index is in bounds anyway.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                let p = self.entries.as_ptr().add(h as usize & self.mask());
                _mm_prefetch(p as *const i8, _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = h;
    }

    #[inline]
    fn add(&mut self, h: u64, key: u128, n: u64) {
        if (self.len + 1) * 10 > self.entries.len() * 7 {
            self.grow();
        }
        let k = [key as u64, (key >> 64) as u64];
        let mask = self.mask();
        let mut i = h as usize & mask;
        loop {
            let e = &mut self.entries[i];
            if e.key == k {
                e.count += n;
                return;
            }
            if e.key[1] == 0 {
                *e = Entry { key: k, count: n };
                self.len += 1;
                return;
            }
            i = (i + 1) & mask;
        }
    }

    #[cold]
    fn grow(&mut self) {
        let cap = (self.entries.len() * 2).max(1024);
        let mut entries = Vec::with_capacity(cap);
        super::advise_huge_pages(&entries);
        entries.resize(cap, Entry::default());
        let old = std::mem::replace(&mut self.entries, entries);
        self.len = 0;
        for e in old {
            if e.key[1] != 0 {
                let key = e.key[0] as u128 | (e.key[1] as u128) << 64;
                self.add(mix(key), key, e.count);
            }
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn iter(&self) -> impl Iterator<Item = (u128, u64)> + '_ {
        self.entries.iter().filter(|e| e.key[1] != 0).map(|e| (e.key[0] as u128 | (e.key[1] as u128) << 64, e.count))
    }

    fn reserve(&mut self, more: usize) {
        while (self.len + more) * 10 > self.entries.len() * 7 {
            self.grow();
        }
    }
}

/// One shard of a count table.
#[derive(Default)]
pub struct Shard {
    short: ShortTable,
    long: HashMap<Box<[u8]>, u64, FxBuildHasher>,
}

impl Shard {
    #[inline]
    fn add_short_hashed(&mut self, h: u64, key: u128, n: u64) {
        self.short.add(h, key, n)
    }

    #[inline]
    fn add_long(&mut self, piece: &[u8], n: u64) {
        if let Some(c) = self.long.get_mut(piece) {
            *c += n;
        } else {
            self.long.insert(piece.into(), n);
        }
    }

    pub fn len(&self) -> usize {
        self.short.len() + self.long.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Visit each unique piece and its count.
    pub fn for_each(&self, mut f: impl FnMut(&[u8], u64)) {
        for (k, n) in self.short.iter() {
            let (b, len) = short_bytes(k);
            f(&b[..len], n);
        }
        for (k, &n) in self.long.iter() {
            f(k, n);
        }
    }

    /// Add all of `other`'s counts to `self`.
    fn absorb(&mut self, other: Shard) {
        self.short.reserve(other.short.len() / 2);
        for (k, n) in other.short.iter() {
            self.add_short_hashed(mix(k), k, n);
        }
        for (k, n) in other.long {
            *self.long.entry(k).or_insert(0) += n;
        }
    }
}

/// Unique pre-tokens (their bytes) and how often each occurs, in `SHARDS` shards by hash.
/// Short pieces (the vast majority) are keyed by a 128-bit integer, so a lookup is a
/// multiply, a probe and one integer compare; longer ones by their bytes.
///
/// In front sits a small direct-mapped cache of counts: frequent pieces are counted
/// there without touching the big tables, whose lookups are cache misses once they
/// hold a few hundred thousand pieces. A slot holding a piece seen fewer than
/// `CACHE_KEEP` times gives way to the next piece that maps to it (its count moves to
/// the table). `flush` empties the cache; only then are the shards complete.
pub struct PieceCounts {
    /// A fixed size, so that a slot's index (the top bits of a hash) needs no bounds check.
    cache: Option<Box<[CacheSlot; CACHE_SLOTS]>>,
    pub shards: Vec<Shard>,
}

#[derive(Clone, Copy, Default)]
struct CacheSlot {
    key: [u64; 2],
    count: u64,
}

const CACHE_BITS: u32 = 16;
const CACHE_SLOTS: usize = 1 << CACHE_BITS;
const CACHE_KEEP: u64 = 4;

impl Default for PieceCounts {
    fn default() -> Self {
        PieceCounts { cache: None, shards: (0..SHARDS).map(|_| Shard::default()).collect() }
    }
}

impl PieceCounts {
    /// A table with a count cache, for a counting worker.
    pub fn with_cache() -> Self {
        let slots = vec![CacheSlot::default(); CACHE_SLOTS].into_boxed_slice();
        let Ok(cache) = slots.try_into() else { unreachable!("a cache has CACHE_SLOTS slots") };
        PieceCounts { cache: Some(cache), ..Default::default() }
    }

    /// Hint the cache slot (or, without a cache, the table slot) of hash `h` into the
    /// CPU cache.
    #[inline]
    fn prefetch_slot(&self, h: u64) {
        let Some(cache) = self.cache.as_deref() else {
            return self.shards[shard_of(h)].short.prefetch(h);
        };
        #[cfg(target_arch = "x86_64")]
        {
            let i = (h >> (64 - CACHE_BITS)) as usize;
            // SAFETY: a prefetch is only a hint; the index is in bounds anyway.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch(cache.as_ptr().add(i) as *const i8, _MM_HINT_T0);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = h;
    }

    /// Count one occurrence of a short piece through the cache. Returns false when the
    /// piece must go to the table instead (see `add_short_table`).
    #[inline]
    fn add_short_cached(&mut self, key: u128, h: u64) -> bool {
        let Some(cache) = self.cache.as_deref_mut() else {
            return false;
        };
        let slot = &mut cache[(h >> (64 - CACHE_BITS)) as usize];
        let k = [key as u64, (key >> 64) as u64];
        if slot.key == k {
            slot.count += 1;
        } else if slot.count < CACHE_KEEP {
            let old = *slot;
            *slot = CacheSlot { key: k, count: 1 };
            if old.count > 0 {
                self.add_short(old.key[0] as u128 | (old.key[1] as u128) << 64, old.count);
            }
        } else {
            return false;
        }
        true
    }

    /// Count one occurrence of a short piece in the table.
    #[inline]
    fn add_short_table(&mut self, key: u128, h: u64) {
        self.shards[shard_of(h)].add_short_hashed(h, key, 1);
    }

    #[inline]
    fn prefetch_table(&self, h: u64) {
        self.shards[shard_of(h)].short.prefetch(h);
    }

    /// Count a batch of short pieces (key, hash) whose cache slots were prefetched: first
    /// through the cache, then the rest in the table, whose slots are prefetched between.
    #[inline]
    fn add_batch(&mut self, batch: &[(u128, u64)]) {
        debug_assert!(batch.len() <= BATCH);
        // Indices into `batch` of the pieces the cache did not take (small to set up).
        let mut rest = [0u8; BATCH];
        let mut n = 0;
        for (i, &(k, h)) in batch.iter().enumerate() {
            if !self.add_short_cached(k, h) {
                self.prefetch_table(h);
                rest[n] = i as u8;
                n += 1;
            }
        }
        for &i in &rest[..n] {
            let (k, h) = batch[i as usize];
            self.add_short_table(k, h);
        }
    }

    /// Move the cache's counts into the shards.
    pub fn flush(&mut self) {
        let Some(mut cache) = self.cache.take() else { return };
        for slot in cache.iter_mut() {
            let slot = std::mem::take(slot);
            if slot.count > 0 {
                self.add_short(slot.key[0] as u128 | (slot.key[1] as u128) << 64, slot.count);
            }
        }
        self.cache = Some(cache);
    }

    #[inline]
    fn add_short(&mut self, key: u128, n: u64) {
        let h = mix(key);
        self.shards[shard_of(h)].add_short_hashed(h, key, n)
    }

    #[inline]
    fn add_long(&mut self, piece: &[u8], n: u64) {
        self.shards[shard_of(long_hash(piece))].add_long(piece, n)
    }

    /// Add `n` occurrences of `piece`.
    #[inline]
    pub fn add(&mut self, piece: &[u8], n: u64) {
        if piece.len() <= SHORT {
            self.add_short(short_key(piece), n);
        } else {
            self.add_long(piece, n);
        }
    }

    /// Number of unique pieces (after `flush`).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Visit each unique piece and its count (after `flush`).
    pub fn for_each(&self, mut f: impl FnMut(&[u8], u64)) {
        for s in &self.shards {
            s.for_each(&mut f);
        }
    }

    /// Merge several tables shard by shard, in parallel (on the current rayon pool).
    pub fn merge(tables: Vec<PieceCounts>) -> PieceCounts {
        use rayon::prelude::*;
        let mut tables = tables;
        tables.par_iter_mut().for_each(|t| t.flush());
        let mut columns: Vec<Vec<Shard>> = (0..SHARDS).map(|_| Vec::with_capacity(tables.len())).collect();
        for t in tables {
            for (i, s) in t.shards.into_iter().enumerate() {
                columns[i].push(s);
            }
        }
        let shards = columns
            .into_par_iter()
            .map(|mut col| {
                col.sort_by_key(|s| std::cmp::Reverse(s.len()));
                let mut it = col.into_iter();
                let mut total = it.next().unwrap_or_default();
                for s in it {
                    total.absorb(s);
                }
                total
            })
            .collect();
        PieceCounts { cache: None, shards }
    }
}

/// Pre-tokenize one span of text (no special tokens inside) into `map`.
///
/// The scanner hands the pieces over in batches; short pieces are then keyed, their
/// cache slots prefetched, and counted, so that the memory latencies overlap.
#[inline]
pub fn count_text(pre: &PreTokenizer, text: &str, map: &mut PieceCounts) {
    let bytes = text.as_bytes();
    pre.for_each_piece_batch(text, |bounds| count_bounds(bytes, bounds, map));
}

/// Count the pieces `text[bounds[k]..bounds[k + 1]]` (fewer than BATCH).
#[inline]
fn count_bounds(text: &[u8], bounds: &[usize], map: &mut PieceCounts) {
    // All but the last batch of a text have 16 bytes of text from every piece's start:
    // there each key is one unaligned 16-byte load, with no check per piece.
    if bounds.last().is_some_and(|&end| end + 16 <= text.len()) {
        count_bounds_with::<true>(text, bounds, map)
    } else {
        count_bounds_with::<false>(text, bounds, map)
    }
}

/// `count_bounds`; `WIDE`: `text` holds 16 bytes from the start of every piece.
#[inline(always)]
fn count_bounds_with<const WIDE: bool>(text: &[u8], bounds: &[usize], map: &mut PieceCounts) {
    // Keys and hashes of the short pieces; only the first n are written and read.
    let mut batch = [std::mem::MaybeUninit::<(u128, u64)>::uninit(); BATCH];
    assert!(bounds.len() <= BATCH + 1, "a batch of {} pieces", bounds.len().saturating_sub(1));
    let mut n = 0;
    for w in bounds.windows(2) {
        let (s, e) = (w[0], w[1]);
        if e - s > SHORT {
            map.add_long(&text[s..e], 1);
        } else if e > s {
            // (A custom pattern may match the empty string; that is not a pre-token.)
            let key = if WIDE {
                debug_assert!(s + 16 <= text.len());
                // SAFETY: s <= the batch's end, and `text` extends 16 bytes past that.
                short_key_of(
                    u128::from_le(unsafe { std::ptr::read_unaligned(text.as_ptr().add(s).cast::<u128>()) }),
                    e - s,
                )
            } else {
                short_key_at(text, s, e)
            };
            let h = mix(key);
            map.prefetch_slot(h);
            // SAFETY: n counts pieces of this batch, fewer than bounds.len() <= BATCH + 1.
            unsafe { batch.get_unchecked_mut(n) }.write((key, h));
            n += 1;
        }
    }
    // SAFETY: the first n entries were written above.
    map.add_batch(unsafe { std::slice::from_raw_parts(batch.as_ptr().cast(), n) });
}

/// A span of text free of special tokens, with its offset in its source (for errors).
#[derive(Clone, Copy)]
pub struct Segment<'a> {
    pub offset: u64,
    pub bytes: &'a [u8],
}

/// Split long segments at exact text cuts (built-in patterns only), so a chunk made of
/// one huge document still spreads over the workers.
fn split_long_segments<'a>(segs: &mut Vec<Segment<'a>>, piece: usize) {
    if !segs.iter().any(|s| s.bytes.len() > 2 * piece) {
        return;
    }
    let mut out = Vec::with_capacity(segs.len() + 16);
    for seg in segs.iter() {
        let mut rest = *seg;
        while rest.bytes.len() > 2 * piece {
            // Cut in [piece, 2 * piece] if possible, else leave it long.
            match last_text_cut(rest.bytes, piece, 2 * piece + 1) {
                Some(c) => {
                    out.push(Segment { offset: rest.offset, bytes: &rest.bytes[..c] });
                    rest = Segment { offset: rest.offset + c as u64, bytes: &rest.bytes[c..] };
                }
                None => break,
            }
        }
        out.push(rest);
    }
    *segs = out;
}

/// The parallel counting engine: one table per worker.
pub struct Counter {
    pub tables: Vec<Mutex<PieceCounts>>,
}

impl Counter {
    pub fn new(workers: usize) -> Self {
        Counter { tables: (0..workers.max(1)).map(|_| Mutex::new(PieceCounts::with_cache())).collect() }
    }

    /// Pre-tokenize and count `segs` on the pool's workers.
    /// `source` names the input in error messages.
    #[allow(clippy::too_many_arguments)]
    pub fn count_segments(
        &self,
        pool: &rayon::ThreadPool,
        pre: &PreTokenizer,
        builtin: bool,
        errors: Utf8Errors,
        mut segs: Vec<Segment<'_>>,
        source: &str,
        ctl: &Control,
    ) -> Result<(), TrainError> {
        let workers = self.tables.len();
        let total: usize = segs.iter().map(|s| s.bytes.len()).sum();
        // Enough tasks to balance the load (a worker that ends early waits for the others
        // before the next chunk: half a task on average), big enough that scheduling costs
        // nothing.
        let task_bytes = (total / (workers * 32)).clamp(1 << 16, 4 << 20);
        if builtin {
            split_long_segments(&mut segs, task_bytes);
        }
        // Tasks: contiguous runs of segments of about task_bytes, as (first, end, bytes).
        let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
        let (mut first, mut bytes) = (0, 0);
        for (i, s) in segs.iter().enumerate() {
            bytes += s.bytes.len();
            if bytes >= task_bytes || i + 1 == segs.len() {
                tasks.push((first, i + 1, bytes));
                first = i + 1;
                bytes = 0;
            }
        }
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        // Offset of the first invalid UTF-8 byte any worker found.
        let bad_utf8: Mutex<Option<u64>> = Mutex::new(None);
        let segs = &segs;
        let tasks = &tasks;
        pool.scope(|scope| {
            for table in &self.tables {
                let next = &next;
                let bad_utf8 = &bad_utf8;
                let stop = &stop;
                scope.spawn(move |_| {
                    let mut map = table.lock().unwrap();
                    loop {
                        if ctl.is_cancelled() || stop.load(Ordering::Relaxed) {
                            return;
                        }
                        // Tasks are taken in order, and a task once taken is finished, so
                        // the smallest bad offset found is the first in the source.
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(first, end, bytes)) = tasks.get(i) else { return };
                        crate::fault::check(crate::fault::Site::TrainCount);
                        for seg in &segs[first..end] {
                            match crate::utf8::to_str(seg.bytes) {
                                Ok(text) => count_text(pre, text, &mut map),
                                Err(err) => match errors {
                                    Utf8Errors::Replace => {
                                        count_text(pre, &String::from_utf8_lossy(seg.bytes), &mut map)
                                    }
                                    Utf8Errors::Strict => {
                                        let at = seg.offset + err.valid_up_to() as u64;
                                        let mut bad = bad_utf8.lock().unwrap();
                                        if bad.is_none_or(|b| at < b) {
                                            *bad = Some(at);
                                        }
                                        stop.store(true, Ordering::Relaxed);
                                        return;
                                    }
                                },
                            }
                        }
                        ctl.add_done(bytes as u64);
                    }
                });
            }
        });
        if let Some(offset) = bad_utf8.into_inner().unwrap() {
            return Err(TrainError::InvalidUtf8 { source: source.to_string(), offset });
        }
        if ctl.is_cancelled() {
            return Err(TrainError::Cancelled);
        }
        Ok(())
    }

    /// Merge the workers' tables into one (in parallel on the current rayon pool).
    pub fn into_counts(self) -> PieceCounts {
        PieceCounts::merge(self.tables.into_iter().map(|m| m.into_inner().unwrap()).collect())
    }
}
