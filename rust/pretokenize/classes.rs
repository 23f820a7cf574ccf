//! Character classes: the `regex` classes the three patterns use, from a 128-entry
//! table for ASCII and the generated tables (`unicode_tables.rs`) for the rest, and the
//! scanning primitives built on them (runs of a class, letters, contractions,
//! whitespace runs).

use crate::unicode_tables::{BLOCK_MASK, BLOCK_SHIFT, DIRECT, STAGE1, STAGE2};

pub(super) const OTHER: u8 = 0;
pub(super) const WS: u8 = 1;
pub(super) const NUM: u8 = 2;
pub(super) const MARK: u8 = 3;
pub(super) const UPPER: u8 = 4; // Lu, Lt
pub(super) const LOWER: u8 = 5; // Ll
pub(super) const OLET: u8 = 6; // Lm, Lo
/// Past the end of the text; in no set.
pub(super) const END: u8 = 7;

pub(super) const fn bit(c: u8) -> u8 {
    1 << c
}
/// `\p{L}`
pub(super) const SET_L: u8 = bit(UPPER) | bit(LOWER) | bit(OLET);
/// `\p{N}`
pub(super) const SET_N: u8 = bit(NUM);
/// `\s`
pub(super) const SET_WS: u8 = bit(WS);
/// `[^\s\p{L}\p{N}]`
pub(super) const SET_PUNCT: u8 = bit(OTHER) | bit(MARK);
/// o200k's `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`
pub(super) const SET_U: u8 = bit(UPPER) | bit(OLET) | bit(MARK);
/// o200k's `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`
pub(super) const SET_W: u8 = bit(LOWER) | bit(OLET) | bit(MARK);

#[inline(always)]
pub(super) fn in_set(c: u8, set: u8) -> bool {
    // In u32, whose shift needs no masking of the amount on x86 (c < 8 anyway).
    ((set as u32) >> (c as u32)) & 1 != 0
}

pub(super) const fn ascii_table() -> [u8; 128] {
    let mut t = [OTHER; 128];
    let mut i = 0;
    while i < 128 {
        let b = i as u8;
        t[i] = if b.is_ascii_uppercase() {
            UPPER
        } else if b.is_ascii_lowercase() {
            LOWER
        } else if b.is_ascii_digit() {
            NUM
        } else if matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r') {
            WS
        } else {
            OTHER
        };
        i += 1;
    }
    t
}

pub(super) static ASCII: [u8; 128] = ascii_table();

// The tables cover every code point, and every STAGE1 entry names a whole STAGE2 block
// (the generator writes them so; `class_of_cp` relies on it, `table_shapes` tests it).
const _: () = assert!(STAGE1.len() << BLOCK_SHIFT == 0x110000);
const _: () = {
    // Two-byte UTF-8 (cp < 0x800) looks its class up in STAGE2 directly.
    assert!(DIRECT == 0x800 && STAGE2.len() >= DIRECT as usize);
    let mut k = 0;
    while k < (DIRECT >> BLOCK_SHIFT) as usize {
        assert!(STAGE1[k] as usize == k);
        k += 1;
    }
};

/// The class of a code point (the regex engine's, see `unicode_tables.rs`).
#[inline(always)]
pub(super) fn class_of_cp(cp: u32) -> u8 {
    debug_assert!(cp < 0x110000);
    // SAFETY: cp < 0x110000 (it was decoded from valid UTF-8), so cp >> BLOCK_SHIFT is
    // within STAGE1, whose entries index whole blocks of STAGE2.
    unsafe {
        let block = *STAGE1.get_unchecked((cp >> BLOCK_SHIFT) as usize) as usize;
        *STAGE2.get_unchecked((block << BLOCK_SHIFT) | (cp & BLOCK_MASK) as usize)
    }
}

/// The class of a `char` as the scanners see it (exposed for tests of the tables).
pub fn char_class(c: char) -> u8 {
    // Through the scanners' own decoding path, so that tests of this cover it.
    let mut buf = [0u8; 4];
    let bytes = c.encode_utf8(&mut buf).as_bytes();
    if bytes[0] < 0x80 {
        ASCII[bytes[0] as usize]
    } else {
        decode_class(bytes, 0).0
    }
}

/// Bit flags of a `char`'s memberships in the classes the built-in patterns use:
/// 1 `\p{L}`, 2 `\p{N}`, 4 `\s`, 8 `\p{M}`, 16 `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`,
/// 32 `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`. For exhaustive tests of the tables.
pub fn char_class_flags(c: char) -> u8 {
    let k = char_class(c);
    (in_set(k, SET_L) as u8)
        | (in_set(k, SET_N) as u8) << 1
        | (in_set(k, SET_WS) as u8) << 2
        | ((k == MARK) as u8) << 3
        | (in_set(k, SET_U) as u8) << 4
        | (in_set(k, SET_W) as u8) << 5
}

/// Not a class: a group of code points of several classes.
pub(super) const MIXED: u8 = 0xff;

/// For the code points U+0000..U+FFFF in groups of 64 (`cp >> 6`, i.e. the lead byte's
/// low four bits and the first continuation byte's six bits of a three-byte UTF-8
/// sequence), the class all of them share, or MIXED.
pub(super) static THREE_BYTE_GROUPS: [u8; 1024] = three_byte_groups();

pub(super) const fn three_byte_groups() -> [u8; 1024] {
    let mut t = [MIXED; 1024];
    let mut g = 0;
    while g < 1024 {
        let first = class_of_cp_const((g as u32) << 6);
        let mut same = true;
        let mut k = 1;
        while k < 64 {
            if class_of_cp_const(((g as u32) << 6) | k) != first {
                same = false;
            }
            k += 1;
        }
        if same {
            t[g] = first;
        }
        g += 1;
    }
    t
}

pub(super) const fn class_of_cp_const(cp: u32) -> u8 {
    let block = STAGE1[(cp >> BLOCK_SHIFT) as usize] as usize;
    STAGE2[(block << BLOCK_SHIFT) | (cp & BLOCK_MASK) as usize]
}

/// Decode the non-ASCII UTF-8 sequence at `b[i]` (a lead byte) and classify it.
/// `b` must be valid UTF-8 (it comes from a `&str`).
#[inline(always)]
pub(super) fn decode_class(b: &[u8], i: usize) -> (u8, usize) {
    debug_assert!(b[i] >= 0x80);
    // SAFETY: `b` is valid UTF-8 and b[i] is a lead byte, so its continuation bytes exist.
    unsafe {
        let b0 = *b.get_unchecked(i) as u32;
        let b1 = (*b.get_unchecked(i + 1) & 0x3f) as u32;
        if b0 < 0xe0 {
            // Below DIRECT: STAGE2 holds these classes in code point order.
            (*STAGE2.get_unchecked((((b0 & 0x1f) << 6) | b1) as usize), 2)
        } else if b0 < 0xf0 {
            // Most 64-code-point groups (one lead byte and one continuation byte) are of
            // one class, e.g. all CJK ideographs.
            let prefix = ((b0 & 0x0f) << 6) | b1;
            let c = *THREE_BYTE_GROUPS.get_unchecked(prefix as usize);
            if c != MIXED {
                return (c, 3);
            }
            let b2 = (*b.get_unchecked(i + 2) & 0x3f) as u32;
            (class_of_cp((prefix << 6) | b2), 3)
        } else {
            let b2 = (*b.get_unchecked(i + 2) & 0x3f) as u32;
            let b3 = (*b.get_unchecked(i + 3) & 0x3f) as u32;
            let cp = ((b0 & 0x07) << 18) | (b1 << 12) | (b2 << 6) | b3;
            (class_of_cp(cp), 4)
        }
    }
}

/// Class and byte length of the char at `i`; `(END, 0)` at or past the end.
#[inline(always)]
pub(super) fn class_at(b: &[u8], i: usize) -> (u8, usize) {
    match b.get(i) {
        None => (END, 0),
        Some(&x) if x < 0x80 => (ASCII[x as usize], 1),
        Some(_) => decode_class(b, i),
    }
}

/// End of the run of chars in `set` starting at `j`.
#[inline(always)]
pub(super) fn scan(b: &[u8], mut j: usize, set: u8) -> usize {
    while let Some(&x) = b.get(j) {
        if x < 0x80 {
            if !in_set(ASCII[x as usize], set) {
                break;
            }
            j += 1;
        } else {
            let (c, l) = decode_class(b, j);
            if !in_set(c, set) {
                break;
            }
            j += l;
        }
    }
    j
}

/// Bit k set when byte k of the 16 at `b[j..j + 16]` is not an ASCII letter
/// (`lower_only`: not an ASCII lowercase letter). Requires `j + 16 <= b.len()`.
#[inline(always)]
pub(super) fn non_letter_mask16(b: &[u8], j: usize, lower_only: bool) -> u32 {
    debug_assert!(j + 16 <= b.len());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // SAFETY: SSE2 is part of x86_64; the 16 bytes are in bounds (checked by callers).
        unsafe {
            let v = _mm_loadu_si128(b.as_ptr().add(j) as *const __m128i);
            // Folding case with | 0x20 keeps bytes >= 0x80 negative, i.e. below 'a'.
            let y = if lower_only { v } else { _mm_or_si128(v, _mm_set1_epi8(0x20)) };
            let ge_a = _mm_cmpgt_epi8(y, _mm_set1_epi8(0x60));
            let le_z = _mm_cmpgt_epi8(_mm_set1_epi8(0x7b), y);
            !(_mm_movemask_epi8(_mm_and_si128(ge_a, le_z)) as u32) & 0xffff
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        non_letter_mask16_swar(b, j, lower_only)
    }
}

/// `non_letter_mask16` without SIMD instructions, eight bytes at a time.
#[cfg(any(test, not(target_arch = "x86_64")))]
#[inline(always)]
pub(super) fn non_letter_mask16_swar(b: &[u8], j: usize, lower_only: bool) -> u32 {
    const HI: u64 = 0x8080_8080_8080_8080;
    // Per byte: y = the low 7 bits (lowercased); y + 0x1f has bit 7 iff y >= 'a';
    // y + 0x05 has bit 7 iff y > 'z'. No byte carries into the next.
    let half = |w: u64| {
        let y = if lower_only { w & !HI } else { (w | 0x2020_2020_2020_2020) & !HI };
        let bad = !((y + 0x1f1f_1f1f_1f1f_1f1f) & !(y + 0x0505_0505_0505_0505) & !w) & HI;
        // Gather the eight high bits into the low byte.
        ((bad >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) as u32
    };
    let lo = half(u64::from_le_bytes(b[j..j + 8].try_into().unwrap()));
    let hi = half(u64::from_le_bytes(b[j + 8..j + 16].try_into().unwrap()));
    lo | (hi << 8)
}

/// End of the run of `\p{L}` starting at `j` (the hot loop): sixteen ASCII bytes at a
/// time, non-ASCII chars through the class table.
#[inline(always)]
pub(super) fn scan_letters(b: &[u8], mut j: usize) -> usize {
    let n = b.len();
    loop {
        // ASCII letters, sixteen at a time.
        if j + 16 <= n {
            let m = non_letter_mask16(b, j, false);
            if m == 0 {
                j += 16;
                continue;
            }
            j += m.trailing_zeros() as usize;
        } else {
            while j < n && b[j].is_ascii_alphabetic() {
                j += 1;
            }
            if j == n {
                return j;
            }
        }
        // b[j] is not an ASCII letter: non-ASCII letters one by one, until an ASCII
        // letter (back to the loop above) or a non-letter (the end).
        loop {
            // SAFETY: j < n (the mask had a bit set within the 16 bytes, or checked).
            let x = unsafe { *b.get_unchecked(j) };
            if x < 0x80 {
                if x.is_ascii_alphabetic() {
                    break;
                }
                return j;
            }
            let (c, l) = decode_class(b, j);
            if !in_set(c, SET_L) {
                return j;
            }
            j += l;
            if j == n {
                return j;
            }
        }
    }
}

/// End of the run of ASCII lowercase letters at `j`.
#[inline(always)]
pub(super) fn scan_ascii_lower(b: &[u8], mut j: usize) -> usize {
    let n = b.len();
    while j + 16 <= n {
        let m = non_letter_mask16(b, j, true);
        if m != 0 {
            return j + m.trailing_zeros() as usize;
        }
        j += 16;
    }
    while j < n && b[j].is_ascii_lowercase() {
        j += 1;
    }
    j
}

/// End of the run of bytes in `[\r\n]` (and `/` when `slash`) starting at `j`.
#[inline(always)]
pub(super) fn scan_newlines(b: &[u8], mut j: usize, slash: bool) -> usize {
    while let Some(&x) = b.get(j) {
        if x == b'\r' || x == b'\n' || (slash && x == b'/') {
            j += 1;
        } else {
            break;
        }
    }
    j
}

/// After an apostrophe: the end of `(?:[sdmt]|ll|ve|re)` at `j`, case-sensitive.
#[inline(always)]
pub(super) fn contraction(b: &[u8], j: usize) -> Option<usize> {
    match b.get(j)? {
        b's' | b'd' | b'm' | b't' => Some(j + 1),
        b'l' if b.get(j + 1) == Some(&b'l') => Some(j + 2),
        b'v' | b'r' if b.get(j + 1) == Some(&b'e') => Some(j + 2),
        _ => None,
    }
}

/// After an apostrophe: the end of `(?i:[sdmt]|ll|ve|re)` at `j`. Python `regex` folds
/// case simply, so besides ASCII case only U+017F (LATIN SMALL LETTER LONG S) matches `s`.
#[inline(always)]
pub(super) fn contraction_ci(b: &[u8], j: usize) -> Option<usize> {
    let lower = |k: usize| b.get(k).map(|&x| if x.is_ascii_uppercase() { x | 0x20 } else { x });
    match lower(j)? {
        b's' | b'd' | b'm' | b't' => Some(j + 1),
        b'l' if lower(j + 1) == Some(b'l') => Some(j + 2),
        b'v' | b'r' if lower(j + 1) == Some(b'e') => Some(j + 2),
        0xc5 if b.get(j + 1) == Some(&0xbf) => Some(j + 2),
        _ => None,
    }
}

/// Up to `more` further `\p{N}` chars after `j`.
#[inline(always)]
pub(super) fn scan_numbers_max(b: &[u8], mut j: usize, more: usize) -> usize {
    for _ in 0..more {
        let (c, l) = class_at(b, j);
        if c != NUM {
            break;
        }
        j += l;
    }
    j
}

/// The whitespace run starting at `i` (whose first char is `l` bytes long).
pub(super) struct WsRun {
    /// End of the run.
    pub(super) end: usize,
    /// Start of the run's last char.
    pub(super) last: usize,
    /// End of the last `\r` or `\n` in the run (0 if none).
    pub(super) newline_end: usize,
}

#[inline(always)]
pub(super) fn ws_run(b: &[u8], i: usize, l: usize) -> WsRun {
    let mut last = i;
    let mut j = i + l;
    let mut newline_end = if b[i] == b'\r' || b[i] == b'\n' { i + 1 } else { 0 };
    loop {
        match b.get(j) {
            Some(&x) if x < 0x80 => {
                if ASCII[x as usize] != WS {
                    break;
                }
                last = j;
                j += 1;
                if x == b'\r' || x == b'\n' {
                    newline_end = j;
                }
            }
            Some(_) => {
                let (c, l) = decode_class(b, j);
                if c != WS {
                    break;
                }
                last = j;
                j += l;
            }
            None => break,
        }
    }
    WsRun { end: j, last, newline_end }
}
