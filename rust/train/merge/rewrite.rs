//! The rewrite of the words that hold a merged pair: scalar, or with vector compares
//! (AVX2, AVX-512) for short words, on one thread or on all for long word lists.

use super::deltas::Deltas;
#[cfg(target_arch = "x86_64")]
use super::vector::{self, VECTOR_READ, VECTOR_SYMBOLS};
use super::words::{Words, HEADER};
use super::NONE;

/// How many words ahead of the one being rewritten to prefetch.
const PREFETCH: usize = 8;

/// Rewrite word `w` (the record at `rec`) merging each (a, b) into x, left to right,
/// and record the count changes of the neighbouring pairs (not of (a, b) itself).
#[inline]
pub(super) fn rewrite_word(rec: &mut [u32], w: u32, a: u32, b: u32, x: u32, deltas: &mut Deltas) {
    let n = rec[0] as usize;
    // Find the first occurrence; a stale entry (the word lost the pair) costs just this scan.
    let Some(first) = rec[HEADER..HEADER + n].windows(2).position(|p| p[0] == a && p[1] == b) else { return };
    rewrite_from(rec, first, w, a, b, x, deltas);
}

/// `rewrite_word` for a word whose first occurrence of (a, b) is at symbol `first`.
#[inline]
pub(super) fn rewrite_from(rec: &mut [u32], first: usize, w: u32, a: u32, b: u32, x: u32, deltas: &mut Deltas) {
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

/// The words array shared by the workers of one merge; each touches only its own words.
#[derive(Clone, Copy)]
pub(super) struct SharedWords {
    pub(super) ptr: *mut u32,
    pub(super) len: usize,
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
pub(super) unsafe fn rewrite_share(
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
pub(super) unsafe fn rewrite_share_avx2(
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
pub(super) unsafe fn rewrite_share_avx512(
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
pub(super) unsafe fn rewrite_share_vector(
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
pub(super) unsafe fn for_each_word(
    words: SharedWords,
    list: &[u32],
    lo: u32,
    hi: u32,
    mut visit: impl FnMut(u32, usize),
) {
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
pub(super) fn prefetch(p: *const u32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch(p as *const i8, _MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Rewrites the words of each merge, on this thread or, for word lists of at least
/// `parallel_list` entries, on all the workers of the current rayon pool, each on an
/// equal share of the words array.
pub(super) struct Rewriter {
    /// One per worker; the first holds a merge's changes once `rewrite` returns.
    deltas: Vec<Deltas>,
    /// Word-id ranges of the workers: worker t has the ids in `bounds[t]..bounds[t + 1]`.
    bounds: Vec<u32>,
    parallel_list: usize,
}

impl Rewriter {
    pub(super) fn new(words: &Words, parallel_list: usize) -> Rewriter {
        let workers = rayon::current_num_threads().max(1);
        let total = words.data.len() as u64;
        let bounds = (0..=workers).map(|t| (total * t as u64 / workers as u64) as u32).collect();
        Rewriter { deltas: (0..workers).map(|_| Deltas::default()).collect(), bounds, parallel_list }
    }

    /// Rewrite the words of `list` merging (a, b) into x (with `symbols` symbols in all),
    /// and return the count changes of the other pairs (cleared by the next call).
    #[allow(clippy::too_many_arguments)] // the merge's symbols, passed in registers
    pub(super) fn rewrite(
        &mut self,
        words: &mut Words,
        list: &[u32],
        a: u32,
        b: u32,
        x: u32,
        symbols: usize,
    ) -> &Deltas {
        // The other workers' deltas were emptied by `absorb`.
        self.deltas[0].clear();
        for d in self.deltas.iter_mut() {
            d.begin(a, b, x, symbols);
        }
        let shared = SharedWords { ptr: words.data.as_mut_ptr(), len: words.data.len() };
        if self.deltas.len() > 1 && list.len() >= self.parallel_list {
            let bounds = &self.bounds;
            rayon::scope(|scope| {
                for (t, d) in self.deltas.iter_mut().enumerate() {
                    scope.spawn(move |_| {
                        // SAFETY: the word-id ranges of the workers are disjoint, and a
                        // worker's first record starts after the last record of the one
                        // before ends.
                        unsafe { rewrite_share(shared, list, bounds[t], bounds[t + 1], a, b, x, d) };
                    });
                }
            });
            let (first, rest) = self.deltas.split_at_mut(1);
            for d in rest {
                first[0].absorb(d);
            }
        } else {
            // SAFETY: this thread alone touches the words.
            unsafe { rewrite_share(shared, list, 0, NONE, a, b, x, &mut self.deltas[0]) };
        }
        &self.deltas[0]
    }
}
