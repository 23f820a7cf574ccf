//! ASCII text 64 bytes at a time (x86_64): the piece starts of a window from bit masks.
//!
//! A window starts at a piece start. For its ASCII prefix, where a piece starts follows
//! from the classes of neighbouring bytes, as bit masks (bit k = byte k). For GPT-2
//! (L letter, N digit, W whitespace, P other; cl100k and o200k: see `shared_window`;
//! GPT-2 gives the bytes of a non-ASCII char other than whitespace its char's class, so
//! its prefix runs to the first non-ASCII whitespace):
//!   - a piece starts where the class changes;
//!   - except before a non-space preceded by ' ' (the space opens ` ?\p{L}+` etc.);
//!   - and at the last char of a whitespace run followed by a non-space (`\s+(?!\S)`
//!     gives it back; the text end is never inside a window, except in GPT-2's padded
//!     last window, where the padding spaces extend a final run as the end would);
//!   - an apostrophe at a piece start followed by s, d, m, t, ll, ve or re is a piece of
//!     its own (those are rare; the scalar `contraction` decides each one).
//!
//! So a start at k depends only on bytes k-4..=k+1: the starts before the last ASCII
//! byte but one are certain. The pieces between them are reported and the next window
//! begins at the last certain start; where no piece completes (a non-ASCII char, a
//! very long piece) the scalar scanner takes one piece.

use super::classes::*;
use super::scan::*;
use super::{Simd, MAX_BATCH, PIECE_BATCH};

/// Class masks of the 64 bytes at `b[i..i + 64]`.
#[derive(Default)]
pub(super) struct Window {
    letter: u64,
    upper: u64,
    digit: u64,
    space: u64,
    white: u64,
    apostrophe: u64,
    /// \r \n
    newline: u64,
    slash: u64,
    non_ascii: u64,
}

/// How a window's class masks are computed: SSE2 (every x86_64), AVX2, AVX-512BW.
/// The AVX ones are only used inside functions compiled for those features (see
/// `dispatch`), after the CPU was checked to have them.
pub(super) trait Masks {
    fn masks(b: &[u8], i: usize) -> Window;

    /// Write `i + k` for each bit k of `m` (lowest first) at `bounds[at..]`; up to 7
    /// more values may be written past the last.
    #[inline(always)]
    fn write_starts(bounds: &mut [usize], at: usize, i: usize, m: u64) {
        write_starts(bounds, at, i, m)
    }
}

pub(super) struct Sse2;
pub(super) struct Avx2;
pub(super) struct Avx512;
pub(super) struct Avx512Vbmi2;

impl Masks for Sse2 {
    #[inline(always)]
    fn masks(b: &[u8], i: usize) -> Window {
        window_masks(b, i)
    }
}

impl Masks for Avx2 {
    #[inline(always)]
    fn masks(b: &[u8], i: usize) -> Window {
        // SAFETY: only called from code compiled for AVX2 on a CPU that has it.
        unsafe { window_masks_avx2(b, i) }
    }
}

impl Masks for Avx512 {
    #[inline(always)]
    fn masks(b: &[u8], i: usize) -> Window {
        // SAFETY: only called from code compiled for AVX-512BW on a CPU that has it.
        unsafe { window_masks_avx512(b, i) }
    }
}

impl Masks for Avx512Vbmi2 {
    /// The AVX-512BW masks; only the start writer differs.
    #[inline(always)]
    fn masks(b: &[u8], i: usize) -> Window {
        Avx512::masks(b, i)
    }

    #[inline(always)]
    fn write_starts(bounds: &mut [usize], at: usize, i: usize, m: u64) {
        // SAFETY: only called from code compiled for AVX-512 VBMI2 on a CPU that has it.
        unsafe { write_starts_vbmi2(bounds, at, i, m) }
    }
}

/// `write_starts` without a loop over the bits: one byte compress packs the bit
/// positions of `m`, which are then widened and stored 8 at a time (a window of
/// GPT-2 pieces has 13 starts on average: two stores instead of 13).
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512BW and AVX-512 VBMI2.
#[inline(always)]
pub(super) unsafe fn write_starts_vbmi2(bounds: &mut [usize], at: usize, i: usize, m: u64) {
    use std::arch::x86_64::*;
    const IOTA: [u8; 64] = {
        let mut a = [0u8; 64];
        let mut k = 0;
        while k < 64 {
            a[k] = k as u8;
            k += 1;
        }
        a
    };
    let n = m.count_ones() as usize;
    // The stores below write whole groups of 8.
    assert!(at + n.next_multiple_of(8) <= bounds.len());
    let packed = _mm512_maskz_compress_epi8(m, _mm512_loadu_si512(IOTA.as_ptr().cast()));
    let base = _mm512_set1_epi64(i as i64);
    let dst = bounds.as_mut_ptr().add(at).cast::<__m512i>();
    // Store i + the 8 positions in the low bytes of `x` as group `g`.
    let store = |g: usize, x: __m128i| _mm512_storeu_si512(dst.add(g), _mm512_add_epi64(_mm512_cvtepu8_epi64(x), base));
    let lane = |k: usize| match k {
        0 => _mm512_castsi512_si128(packed),
        1 => _mm512_extracti32x4_epi32::<1>(packed),
        2 => _mm512_extracti32x4_epi32::<2>(packed),
        _ => _mm512_extracti32x4_epi32::<3>(packed),
    };
    let mut g = 0;
    while g * 8 < n {
        let x = lane(g / 2);
        store(g, if g % 2 == 0 { x } else { _mm_srli_si128::<8>(x) });
        g += 1;
    }
}

/// `window_masks` 32 bytes at a time.
///
/// # Safety
/// The CPU must have AVX2.
#[inline(always)]
unsafe fn window_masks_avx2(b: &[u8], i: usize) -> Window {
    use std::arch::x86_64::*;
    assert!(i + 64 <= b.len());
    let mut w = Window::default();
    let set = |x: u8| _mm256_set1_epi8(x as i8);
    for k in 0..2 {
        let v = _mm256_loadu_si256(b.as_ptr().add(i + 32 * k) as *const __m256i);
        let mask = |m: __m256i| (_mm256_movemask_epi8(m) as u32 as u64) << (32 * k);
        let in_range = |x: __m256i, lo: u8, hi: u8| {
            _mm256_and_si256(_mm256_cmpgt_epi8(x, set(lo - 1)), _mm256_cmpgt_epi8(set(hi + 1), x))
        };
        let space = _mm256_cmpeq_epi8(v, set(b' '));
        w.letter |= mask(in_range(_mm256_or_si256(v, set(0x20)), b'a', b'z'));
        w.upper |= mask(in_range(v, b'A', b'Z'));
        w.digit |= mask(in_range(v, b'0', b'9'));
        w.space |= mask(space);
        // \t \n \v \f \r
        w.white |= mask(_mm256_or_si256(space, in_range(v, 0x09, 0x0d)));
        w.apostrophe |= mask(_mm256_cmpeq_epi8(v, set(b'\'')));
        w.newline |= mask(_mm256_or_si256(_mm256_cmpeq_epi8(v, set(b'\n')), _mm256_cmpeq_epi8(v, set(b'\r'))));
        w.slash |= mask(_mm256_cmpeq_epi8(v, set(b'/')));
        w.non_ascii |= mask(v);
    }
    w
}

/// `window_masks` in one 64-byte vector, the compares giving the bit masks directly.
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512BW.
#[inline(always)]
unsafe fn window_masks_avx512(b: &[u8], i: usize) -> Window {
    use std::arch::x86_64::*;
    assert!(i + 64 <= b.len());
    let v = _mm512_loadu_si512(b.as_ptr().add(i) as *const __m512i);
    let set = |x: u8| _mm512_set1_epi8(x as i8);
    // lo <= x <= hi as one unsigned compare of x - lo.
    let in_range = |x: __m512i, lo: u8, hi: u8| _mm512_cmple_epu8_mask(_mm512_sub_epi8(x, set(lo)), set(hi - lo));
    let eq = |c: u8| _mm512_cmpeq_epi8_mask(v, set(c));
    let space = eq(b' ');
    Window {
        letter: in_range(_mm512_or_si512(v, set(0x20)), b'a', b'z'),
        upper: in_range(v, b'A', b'Z'),
        digit: in_range(v, b'0', b'9'),
        space,
        // \t \n \v \f \r
        white: space | in_range(v, 0x09, 0x0d),
        apostrophe: eq(b'\''),
        newline: eq(b'\n') | eq(b'\r'),
        slash: eq(b'/'),
        non_ascii: _mm512_movepi8_mask(v),
    }
}

#[inline(always)]
fn window_masks(b: &[u8], i: usize) -> Window {
    use std::arch::x86_64::*;
    assert!(i + 64 <= b.len());
    let mut w =
        Window { letter: 0, upper: 0, digit: 0, space: 0, white: 0, apostrophe: 0, newline: 0, slash: 0, non_ascii: 0 };
    // SAFETY: SSE2 is part of x86_64; the 64 bytes are in bounds (asserted).
    unsafe {
        let set = |x: u8| _mm_set1_epi8(x as i8);
        for k in 0..4 {
            let v = _mm_loadu_si128(b.as_ptr().add(i + 16 * k) as *const __m128i);
            let mask = |m: __m128i| (_mm_movemask_epi8(m) as u32 as u64) << (16 * k);
            let folded = _mm_or_si128(v, set(0x20));
            let letter = _mm_and_si128(_mm_cmpgt_epi8(folded, set(b'a' - 1)), _mm_cmpgt_epi8(set(b'z' + 1), folded));
            let digit = _mm_and_si128(_mm_cmpgt_epi8(v, set(b'0' - 1)), _mm_cmpgt_epi8(set(b'9' + 1), v));
            let space = _mm_cmpeq_epi8(v, set(b' '));
            // \t \n \v \f \r
            let ctl = _mm_and_si128(_mm_cmpgt_epi8(v, set(0x08)), _mm_cmpgt_epi8(set(0x0e), v));
            w.letter |= mask(letter);
            w.upper |= mask(_mm_and_si128(_mm_cmpgt_epi8(v, set(b'A' - 1)), _mm_cmpgt_epi8(set(b'Z' + 1), v)));
            w.digit |= mask(digit);
            w.space |= mask(space);
            w.white |= mask(_mm_or_si128(space, ctl));
            w.apostrophe |= mask(_mm_cmpeq_epi8(v, set(b'\'')));
            w.newline |= mask(_mm_or_si128(_mm_cmpeq_epi8(v, set(b'\n')), _mm_cmpeq_epi8(v, set(b'\r'))));
            w.slash |= mask(_mm_cmpeq_epi8(v, set(b'/')));
            w.non_ascii |= mask(v);
        }
    }
    w
}

/// Remove the starts inside the piece `[k, k + len)` of a window and start one after it.
#[inline(always)]
fn make_piece(starts: u64, k: usize, len: usize) -> u64 {
    let inside = ((1u64 << len) - 2) << k;
    let after = if k + len < 64 { 1u64 << (k + len) } else { 0 };
    (starts & !inside) | after
}

/// Digit pieces of cl100k and o200k: `\p{N}{1,3}`, i.e. a start at each run of digits
/// and every three digits along it.
#[inline(always)]
fn digit_group_starts(digit: u64) -> u64 {
    let three = digit & (digit << 1) & (digit << 2);
    let mut g = digit & !(digit << 1);
    loop {
        let next = g | ((g << 3) & three);
        if next == g {
            return g;
        }
        g = next;
    }
}

/// A built-in pattern's scanner: the piece starts of a 64-byte window, and the end of
/// the piece at a position (the scalar path). Static calls, so that both are inlined
/// into `drive_windows` (calls through `impl Fn` parameters were not always inlined).
pub(super) trait Scan {
    /// Whether `window` sees the end of the text as it sees a space after it, so
    /// that the last bytes of a text (fewer than 64) can be scanned in a window
    /// padded with spaces (see `tail_starts`).
    const PAD_TAIL: bool;
    fn window<K: Masks>(b: &[u8], i: usize) -> Result<(u64, u64), usize>;
    fn next_end(b: &[u8], i: usize) -> usize;
}

/// `scanner!(Name, window, next_end)`: a `Scan` made of those two functions.
macro_rules! scanner {
    ($name:ident, $window:ident, $next_end:ident, $pad_tail:expr) => {
        pub(super) struct $name;

        impl Scan for $name {
            const PAD_TAIL: bool = $pad_tail;
            #[inline(always)]
            fn window<K: Masks>(b: &[u8], i: usize) -> Result<(u64, u64), usize> {
                $window::<K>(b, i)
            }
            #[inline(always)]
            fn next_end(b: &[u8], i: usize) -> usize {
                $next_end(b, i)
            }
        }
    };
}

// GPT-2's rules look past a piece only for `\s+(?!\S)`, which at the end of the text
// takes the whole whitespace run, as it does before a space. cl100k's `\s++$` and
// o200k's case rules are not checked for that.
scanner!(Gpt2, gpt2_window, gpt2_next, true);
scanner!(Cl100k, cl100k_window, cl100k_next, false);
scanner!(O200k, o200k_window, o200k_next, false);

/// The piece starts of the last `b.len() - i` (fewer than 64) bytes of the text, as
/// bits (k: a piece starts at i + k; not bit 0), from a window of them padded with
/// spaces; None unless every start is certain.
#[inline(always)]
fn tail_starts<S: Scan, K: Masks>(b: &[u8], i: usize) -> Option<u64> {
    let len = b.len() - i;
    debug_assert!(S::PAD_TAIL && len > 0 && len < 64);
    // 64 bytes for the masks and a few more for the contraction check after an
    // apostrophe.
    let mut pad = [b' '; 64 + 8];
    pad[..len].copy_from_slice(&b[i..]);
    let (starts, valid) = S::window::<K>(&pad, 0).ok()?;
    let within = (1u64 << len) - 1;
    (valid & within == within).then_some(starts & within & !1)
}

/// Write `i + k` for each bit k of `m` (lowest first) at `bounds[at..]`, four at a
/// time: up to 3 more are written past the last (trailing_zeros(0) = 64, a harmless
/// value the batch does not include). See also `Masks::write_starts`.
#[inline(always)]
pub(super) fn write_starts(bounds: &mut [usize], mut at: usize, i: usize, mut m: u64) {
    loop {
        bounds[at] = i + m.trailing_zeros() as usize;
        m &= m.wrapping_sub(1);
        bounds[at + 1] = i + m.trailing_zeros() as usize;
        m &= m.wrapping_sub(1);
        bounds[at + 2] = i + m.trailing_zeros() as usize;
        m &= m.wrapping_sub(1);
        bounds[at + 3] = i + m.trailing_zeros() as usize;
        m &= m.wrapping_sub(1);
        at += 4;
        if m == 0 {
            break;
        }
    }
}

/// Drive a scanner over `b`: 64-byte windows where `window(b, i)` gives the piece starts
/// and the certain ones (`Ok((starts, valid))`, or `Err(limit)`: only bytes before
/// `limit` are simple), the scalar `next_end` elsewhere. The pieces are handed over in
/// batches of boundaries (see `PreTokenizer::for_each_piece_batch`).
#[inline(always)]
pub(super) fn drive_windows<S: Scan, K: Masks>(b: &[u8], mut f: impl FnMut(&[usize])) {
    let n = b.len();
    // bounds[0] is where the batch's first piece starts; a window adds at most 63
    // pieces to a batch of fewer than PIECE_BATCH (and `write_starts` may write 7 past
    // the last).
    let mut bounds = [0usize; MAX_BATCH + 8];
    let mut k = 0;
    let mut i = 0;
    let mut retry_at = 0;
    let mut failures = 0u32;
    while i < n {
        if i + 64 <= n && i >= retry_at {
            let limit = match S::window::<K>(b, i) {
                Ok((starts, valid)) => {
                    let m = starts & valid & !1;
                    if m != 0 {
                        // Each piece ends where the next starts; the last start is
                        // where the unfinished piece begins (the next window).
                        let pieces = m.count_ones() as usize;
                        let last = 63 - m.leading_zeros() as usize;
                        K::write_starts(&mut bounds, k + 1, i, m);
                        k += pieces;
                        i += last;
                        failures = 0;
                        if k >= PIECE_BATCH {
                            f(&bounds[..=k]);
                            bounds[0] = bounds[k];
                            k = 0;
                        }
                        continue;
                    }
                    64
                }
                Err(limit) => limit,
            };
            failures += 1;
            retry_at = i + limit + 1 + if failures > 2 { 32 << failures.min(6) } else { 0 };
        }
        if S::PAD_TAIL && i + 64 > n && i >= retry_at {
            if let Some(m) = tail_starts::<S, K>(b, i) {
                // The pieces of the rest of the text, the last one ending at its end.
                if m != 0 {
                    K::write_starts(&mut bounds, k + 1, i, m);
                    k += m.count_ones() as usize;
                }
                k += 1;
                bounds[k] = n;
                break;
            }
            // Not certain (non-ASCII whitespace): the scalar scanner takes the rest,
            // without another padded window per piece.
            retry_at = n;
        }
        let e = S::next_end(b, i);
        debug_assert!(e > i && e <= n);
        k += 1;
        bounds[k] = e;
        i = e;
        if k >= PIECE_BATCH {
            f(&bounds[..=k]);
            bounds[0] = bounds[k];
            k = 0;
        }
    }
    if k > 0 {
        f(&bounds[..=k]);
    }
}

// The driver compiled for AVX2, for AVX-512 and for AVX-512 with VBMI2 (with the
// bit instructions that come with them: popcnt, lzcnt, bmi); `batches` picks one by
// `Simd`.
// Everything inlined into them, the caller's closure included, is compiled for
// that level.

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi2,avx2,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn batches_avx512_vbmi2<S: Scan>(b: &[u8], f: impl FnMut(&[usize])) {
    drive_windows::<S, Avx512Vbmi2>(b, f)
}

#[target_feature(enable = "avx512f,avx512bw,avx2,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn batches_avx512<S: Scan>(b: &[u8], f: impl FnMut(&[usize])) {
    drive_windows::<S, Avx512>(b, f)
}

#[target_feature(enable = "avx2,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn batches_avx2<S: Scan>(b: &[u8], f: impl FnMut(&[usize])) {
    drive_windows::<S, Avx2>(b, f)
}

/// `drive_windows` at the level `simd`.
#[inline(always)]
pub(super) fn batches<S: Scan>(simd: Simd, b: &[u8], f: impl FnMut(&[usize])) {
    match simd {
        // SAFETY: a `Simd` above the baseline is only ever one the CPU has
        // (`Simd::detected` caps it).
        Simd::Avx512Vbmi2 => unsafe { batches_avx512_vbmi2::<S>(b, f) },
        Simd::Avx512 => unsafe { batches_avx512::<S>(b, f) },
        Simd::Avx2 => unsafe { batches_avx2::<S>(b, f) },
        Simd::Baseline => drive_windows::<S, Sse2>(b, f),
    }
}

/// The GPT-2 piece starts of the window at `i` and the certain ones.
#[inline(always)]
pub(super) fn gpt2_window<K: Masks>(b: &[u8], i: usize) -> Result<(u64, u64), usize> {
    let mut w = K::masks(b, i);
    // Bytes 0..limit are classified; starts at k <= limit - 2 are certain.
    let limit = classify_non_ascii(b, i, &mut w);
    if limit < 8 {
        return Err(limit as usize);
    }
    let valid = (1u64 << (limit - 1)) - 1;
    // Non-ASCII punctuation is in none of the three classes.
    let punct = !(w.letter | w.digit | w.white);
    let change =
        (w.letter ^ (w.letter << 1)) | (w.digit ^ (w.digit << 1)) | (w.white ^ (w.white << 1)) | (punct ^ (punct << 1));
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` take a space before them.
    let joined = (w.space << 1) & !w.white;
    // `\s+(?!\S)` leaves the last char of a run before a non-space.
    let ws_last = w.white & !(w.white >> 1);
    let mut starts = (change & !joined) | ws_last;
    let mut apostrophes = w.apostrophe & starts & valid;
    while apostrophes != 0 {
        let k = apostrophes.trailing_zeros() as usize;
        apostrophes &= apostrophes - 1;
        if let Some(e) = contraction(b, i + k + 1) {
            starts = make_piece(starts, k, e - i - k);
        }
    }
    Ok((starts, valid))
}

/// A window classifies its non-ASCII chars (see `classify_non_ascii`) when they take
/// at most this many of its bytes.
const MAX_CLASSIFIED_BYTES: u32 = 12;

/// Give the bytes of each non-ASCII char of the window at `i` the class of the char
/// (letter, digit, or neither: punctuation), as the GPT-2 rules see it, so that a
/// window with a few accented letters, dashes or quotes is still scanned by masks.
/// Every byte of a char then has its class: the rules, which only start pieces where
/// the class changes, never cut inside one. Returns where classification stopped: 64,
/// or the first non-ASCII whitespace char (`\s+(?!\S)` gives back a run's last
/// char, which the masks take to be one byte).
///
/// A window starts at a char boundary (a piece start), so its first non-ASCII byte is
/// a lead byte, and so is the first one after each char.
#[inline(always)]
fn classify_non_ascii(b: &[u8], i: usize, w: &mut Window) -> u32 {
    let mut rest = w.non_ascii;
    if rest.count_ones() > MAX_CLASSIFIED_BYTES {
        // Dense non-ASCII text (Cyrillic, CJK): its pieces are long or its chars many,
        // and the scalar scanner, which classifies each char once, is faster than
        // windows that classify the chars of the pieces they cannot finish again.
        return rest.trailing_zeros();
    }
    while rest != 0 {
        let k = rest.trailing_zeros() as usize;
        let (class, len) = decode_class(b, i + k);
        let bytes = bit_range(k, (k + len).min(64));
        if in_set(class, SET_L) {
            w.letter |= bytes;
        } else if class == NUM {
            w.digit |= bytes;
        } else if class == WS {
            return k as u32;
        }
        rest &= !bytes;
    }
    64
}

/// What cl100k and o200k share on a window of ASCII.
struct SharedStarts {
    w: Window,
    /// Certain starts.
    valid: u64,
    /// Punctuation chars that start a piece.
    punct_start: u64,
    /// Starts of all pieces but for o200k's case rule and the contractions.
    starts: u64,
}

/// Bits `lo..hi` (`lo <= hi <= 64`).
#[inline(always)]
fn bit_range(lo: usize, hi: usize) -> u64 {
    let below = |k: usize| if k >= 64 { u64::MAX } else { (1u64 << k) - 1 };
    below(hi) & !below(lo)
}

/// The starts cl100k and o200k share, on the ASCII prefix of the window at `i`.
/// `tail` is what a punctuation run takes after it: `[\r\n]*` (cl100k) or `[\r\n/]*`
/// (o200k). The whitespace rules of both (for a run not at the end of the text):
/// a run containing a newline gives `\s*[\r\n]` up to its last newline; the rest, or
/// a run without newline, gives back its last char (`\s+(?!\S)`), which opens a
/// letter run after it (`[^\r\n\p{L}\p{N}]?`) or, if a space, a punctuation run.
#[inline(always)]
fn shared_window<K: Masks>(b: &[u8], i: usize, tail_slash: bool) -> Result<SharedStarts, usize> {
    let w = K::masks(b, i);
    // Bytes 0..limit are ASCII; starts at k <= limit - 2 are certain (and, in a
    // whitespace run with a newline, only if the run ends before the limit).
    let limit = w.non_ascii.trailing_zeros() as usize;
    if limit < 8 {
        return Err(limit);
    }
    let mut valid = (1u64 << (limit - 1)) - 1;
    let punct = !(w.letter | w.digit | w.white | w.non_ascii);
    // The tail of each punctuation run: from a newline right after punctuation to the
    // end of that run of tail chars (a '/' before the newline is in the punctuation run).
    let tail = if tail_slash { w.newline | w.slash } else { w.newline };
    let mut seeds = w.newline & (punct << 1);
    let mut absorbed = 0;
    while seeds != 0 {
        let k = seeds.trailing_zeros() as usize;
        let e = (k + (!tail >> k).trailing_zeros() as usize).min(64);
        absorbed |= bit_range(k, e);
        seeds &= !bit_range(k, e);
    }
    let punct = punct & !absorbed;
    let white = w.white & !absorbed;
    // A punctuation run starts a piece unless a space opens it (` ?[^\s\p{L}\p{N}]+`).
    let punct_start = punct & !(punct << 1) & !(w.space << 1);
    // Whitespace other than \r \n, or a punctuation char that starts a piece, opens
    // the letter run after it.
    let joined = w.letter & (((white & !w.newline) << 1) | (punct_start << 1));
    let letter_start = w.letter & !(w.letter << 1) & !joined;
    // Whitespace runs: at their first char, and at their last before a non-space.
    let white_start = (white & !(white << 1)) | (white & !(white >> 1));
    let mut starts = 1 | punct_start | letter_start | white_start | digit_group_starts(w.digit);
    // Whitespace runs with a newline: redo the starts inside.
    let mut newlines = w.newline & white & valid;
    while newlines != 0 {
        let q0 = newlines.trailing_zeros() as usize;
        // The run is [a, e).
        let a = 64 - (!white & bit_range(0, q0)).leading_zeros() as usize;
        let e = q0 + (!white >> q0).trailing_zeros() as usize;
        if e >= limit {
            // Unfinished: only its first start is certain.
            valid &= bit_range(0, a + 1);
            break;
        }
        let q = 63 - (w.newline & bit_range(a, e)).leading_zeros() as usize;
        starts &= !bit_range(a + 1, e);
        if q + 1 < e {
            starts |= (1u64 << (q + 1)) | (1u64 << (e - 1));
        }
        newlines &= !bit_range(a, e);
    }
    Ok(SharedStarts { w, valid, punct_start, starts })
}

/// The cl100k piece starts of the window at `i` and the certain ones.
#[inline(always)]
pub(super) fn cl100k_window<K: Masks>(b: &[u8], i: usize) -> Result<(u64, u64), usize> {
    let sh = shared_window::<K>(b, i, false)?;
    let mut starts = sh.starts;
    // `'(?i:[sdmt]|ll|ve|re)` at an apostrophe that starts a piece.
    let mut apostrophes = sh.w.apostrophe & sh.punct_start & sh.valid;
    while apostrophes != 0 {
        let k = apostrophes.trailing_zeros() as usize;
        apostrophes &= apostrophes - 1;
        if let Some(e) = contraction_ci(b, i + k + 1) {
            starts = make_piece(starts, k, e - i - k);
        }
    }
    Ok((starts, sh.valid))
}

/// The o200k piece starts of the window at `i` and the certain ones.
#[inline(always)]
pub(super) fn o200k_window<K: Masks>(b: &[u8], i: usize) -> Result<(u64, u64), usize> {
    let sh = shared_window::<K>(b, i, true)?;
    let lower = sh.w.letter & !sh.w.upper;
    // `[A-Z]*[a-z]+|[A-Z]+`: an upper-case letter after a lower-case one starts a piece.
    let mut starts = sh.starts | (sh.w.upper & (lower << 1));
    // The contraction suffix `(?i:'s|'t|'re|'ve|'m|'ll|'d)?` of a letter piece: at an
    // apostrophe after a letter, unless that letter ends a suffix itself.
    let mut apostrophes = sh.w.apostrophe & (sh.w.letter << 1) & sh.valid;
    let mut suffix_end = usize::MAX;
    while apostrophes != 0 {
        let k = apostrophes.trailing_zeros() as usize;
        apostrophes &= apostrophes - 1;
        if k == suffix_end {
            continue;
        }
        if let Some(e) = contraction_ci(b, i + k + 1) {
            let len = e - i - k;
            // The apostrophe no longer starts a piece either.
            starts = make_piece(starts, k, len) & !(1u64 << k);
            suffix_end = k + len;
        }
    }
    Ok((starts, sh.valid))
}
