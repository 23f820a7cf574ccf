//! The scalar scanners: `*_next(bytes, start)` gives the end of the piece at `start`,
//! through a fast path for the most common pieces of ASCII text (an ASCII word, with or
//! without a leading space); everything else goes to the general `*_end` scanners.

use super::classes::*;

/// gpt2 and cl100k: `( ?|[^\r\n\p{L}\p{N}]?)\p{L}+` for a word starting with an ASCII letter.
#[inline(always)]
pub(super) fn ascii_word_end(b: &[u8], i: usize) -> Option<usize> {
    // One branch for both "word" and " word".
    let s = i + (b[i] == b' ') as usize;
    match b.get(s) {
        Some(y) if y.is_ascii_alphabetic() => Some(scan_letters(b, s + 1)),
        _ => None,
    }
}

#[inline(always)]
pub(super) fn gpt2_next(b: &[u8], i: usize) -> usize {
    match ascii_word_end(b, i) {
        Some(e) => e,
        None => gpt2_end(b, i),
    }
}

#[inline(always)]
pub(super) fn cl100k_next(b: &[u8], i: usize) -> usize {
    // A contraction starts with an apostrophe, never with a space or a letter.
    match ascii_word_end(b, i) {
        Some(e) => e,
        None => cl100k_end(b, i),
    }
}

#[inline(always)]
pub(super) fn o200k_next(b: &[u8], i: usize) -> usize {
    let n = b.len();
    let s = i + (b[i] == b' ') as usize;
    if !b.get(s).is_some_and(u8::is_ascii_alphabetic) {
        return o200k_end(b, i);
    }
    // `[A-Z]*[a-z]+` (alternative 1) or else `[A-Z]+` (alternative 2), as long as the
    // runs end at an ASCII char; otherwise the general scanner decides.
    let mut j = s;
    while j < n && b[j].is_ascii_uppercase() {
        j += 1;
    }
    let j = scan_ascii_lower(b, j);
    if j < n && b[j] >= 0x80 {
        return o200k_end(b, i);
    }
    o200k_suffix(b, j)
}

// ---------------------------------------------------------------------------------
// GPT-2: '(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

/// End of the GPT-2 piece starting at `i` (< len).
#[inline(always)]
pub(super) fn gpt2_end(b: &[u8], i: usize) -> usize {
    let x = b[i];
    let (c, l) = if x < 0x80 { (ASCII[x as usize], 1) } else { decode_class(b, i) };
    if in_set(c, SET_L) {
        return scan_letters(b, i + l);
    }
    match c {
        NUM => scan(b, i + l, SET_N),
        WS => {
            if x == b' ' {
                // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+` with the space.
                let (c1, l1) = class_at(b, i + 1);
                if in_set(c1, SET_L) {
                    return scan_letters(b, i + 1 + l1);
                }
                match c1 {
                    NUM => return scan(b, i + 1 + l1, SET_N),
                    OTHER | MARK => return scan(b, i + 1 + l1, SET_PUNCT),
                    _ => {}
                }
            }
            // `\s+(?!\S)`: a run followed by \S gives back its last char; `\s+` for a
            // single char followed by \S.
            let run = ws_run(b, i, l);
            if run.end == b.len() || run.last == i {
                run.end
            } else {
                run.last
            }
        }
        _ => {
            // OTHER or MARK
            if x == b'\'' {
                if let Some(e) = contraction(b, i + 1) {
                    return e;
                }
            }
            scan(b, i + l, SET_PUNCT)
        }
    }
}

// ---------------------------------------------------------------------------------
// cl100k: '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+
//         | ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s

/// End of the cl100k piece starting at `i` (< len).
#[inline(always)]
pub(super) fn cl100k_end(b: &[u8], i: usize) -> usize {
    let x = b[i];
    let (c, l) = if x < 0x80 { (ASCII[x as usize], 1) } else { decode_class(b, i) };
    if in_set(c, SET_L) {
        return scan_letters(b, i + l);
    }
    if c == NUM {
        return scan_numbers_max(b, i + l, 2);
    }
    // c is OTHER, MARK or WS.
    if x == b'\'' {
        if let Some(e) = contraction_ci(b, i + 1) {
            return e;
        }
    }
    let (c1, l1) = class_at(b, i + l);
    // `[^\r\n\p{L}\p{N}]?+\p{L}++` with the optional char.
    if in_set(c1, SET_L) && x != b'\r' && x != b'\n' {
        return scan_letters(b, i + l + l1);
    }
    if c != WS {
        // ` ?[^\s\p{L}\p{N}]++[\r\n]*+` without the space.
        let e = scan(b, i + l, SET_PUNCT);
        return scan_newlines(b, e, false);
    }
    if x == b' ' && in_set(c1, SET_PUNCT) {
        let e = scan(b, i + 1 + l1, SET_PUNCT);
        return scan_newlines(b, e, false);
    }
    let run = ws_run(b, i, l);
    if run.end == b.len() {
        // `\s++$` (the possessive run ends before a non-space, so `$` can only hold at
        // the very end)
        run.end
    } else if run.newline_end != 0 {
        // `\s*[\r\n]`
        run.newline_end
    } else if run.last != i {
        // `\s+(?!\S)`
        run.last
    } else {
        // `\s`
        run.end
    }
}

// ---------------------------------------------------------------------------------
// o200k:  [^\r\n\p{L}\p{N}]?U*W+C? | [^\r\n\p{L}\p{N}]?U+W*C? | \p{N}{1,3}
//         | ?[^\s\p{L}\p{N}]+[\r\n/]* | \s*[\r\n]+ | \s+(?!\S) | \s+
// with U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}], W = [\p{Ll}\p{Lm}\p{Lo}\p{M}],
// C = (?i:'s|'t|'re|'ve|'m|'ll|'d).

/// `U*W+` at `s` with `regex`'s backtracking: `Ok(end)` on a match, else `Err(e)` where
/// `[s, e)` is the (then all Lu/Lt) run `U+` would take.
///
/// U* takes the run of U chars up to the first Ll (or non-letter). If that is an Ll,
/// W+ takes the W run from there. Otherwise U* gives back chars until W+ can start:
/// at the last Lm/Lo/M of the run, which W+ takes alone (the chars after it are Lu/Lt).
#[inline(always)]
pub(super) fn o200k_upper_lower(b: &[u8], s: usize) -> Result<usize, usize> {
    let mut j = s;
    let mut last_b_end = 0;
    loop {
        let (c, l) = class_at(b, j);
        match c {
            OLET | MARK => {
                j += l;
                last_b_end = j;
            }
            UPPER => j += l,
            LOWER => return Ok(scan(b, j + l, SET_W)),
            _ => return if last_b_end != 0 { Ok(last_b_end) } else { Err(j) },
        }
    }
}

/// Add the optional contraction suffix `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at `e`.
#[inline(always)]
pub(super) fn o200k_suffix(b: &[u8], e: usize) -> usize {
    if b.get(e) == Some(&b'\'') {
        if let Some(end) = contraction_ci(b, e + 1) {
            return end;
        }
    }
    e
}

/// End of the o200k piece starting at `i` (< len).
#[inline(always)]
pub(super) fn o200k_end(b: &[u8], i: usize) -> usize {
    let x = b[i];
    let (c, l) = if x < 0x80 { (ASCII[x as usize], 1) } else { decode_class(b, i) };
    if in_set(c, SET_L) {
        // No prefix char (a letter is not in [^\r\n\p{L}\p{N}]); alternative 1, else 2
        // (which then takes exactly the Lu/Lt run).
        let e = match o200k_upper_lower(b, i) {
            Ok(e) | Err(e) => e,
        };
        return o200k_suffix(b, e);
    }
    if c == NUM {
        return scan_numbers_max(b, i + l, 2);
    }
    // c is OTHER, MARK or WS.
    if x != b'\r' && x != b'\n' {
        // The prefix char taken: alternative 1.
        match o200k_upper_lower(b, i + l) {
            Ok(e) => return o200k_suffix(b, e),
            Err(e) => {
                // Alternative 1 without the prefix: succeeds (with just this char) only
                // for a mark, which is in both U and W.
                if c == MARK {
                    return o200k_suffix(b, i + l);
                }
                // Alternative 2 with the prefix char.
                if e > i + l {
                    return o200k_suffix(b, e);
                }
                // Alternative 2 without it needs c in U: not the case here.
            }
        }
    }
    if c != WS {
        // ` ?[^\s\p{L}\p{N}]+[\r\n/]*` without the space.
        let e = scan(b, i + l, SET_PUNCT);
        return scan_newlines(b, e, true);
    }
    if x == b' ' {
        let (c1, l1) = class_at(b, i + 1);
        if in_set(c1, SET_PUNCT) {
            let e = scan(b, i + 1 + l1, SET_PUNCT);
            return scan_newlines(b, e, true);
        }
    }
    let run = ws_run(b, i, l);
    if run.newline_end != 0 {
        // `\s*[\r\n]+`
        run.newline_end
    } else if run.end == b.len() || run.last == i {
        // `\s+(?!\S)` at the end, or `\s+` for a single char before \S
        run.end
    } else {
        // `\s+(?!\S)`
        run.last
    }
}
