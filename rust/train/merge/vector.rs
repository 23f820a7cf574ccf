//! The word rewrite (`rewrite::rewrite_word`) with vector compares: one compare of the word against a and of its
//! next symbols against b finds every occurrence at once, so a stale word costs no scan,
//! and a word with one occurrence (99 % of the rest) is rewritten with no loop at all.
//! Words of up to VECTOR_SYMBOLS symbols; `rec` must hold VECTOR_READ values (the
//! record and what follows it, which is read but left as it is).

use std::arch::x86_64::*;

use super::deltas::Deltas;
use super::rewrite::rewrite_from;
use super::words::HEADER;

/// Words of up to this many symbols (nearly all that a merge visits) are rewritten with
/// vector compares where the CPU has AVX-512F or AVX2.
pub(super) const VECTOR_SYMBOLS: usize = 16;
/// How many values from a record's start the vector rewrite reads (the record and what
/// follows it, which it leaves unchanged).
pub(super) const VECTOR_READ: usize = HEADER + VECTOR_SYMBOLS + 1;

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
