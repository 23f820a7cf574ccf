//! The one rule for where a text may be cut, used by training (chunks, parts, tasks),
//! the shard writer (chunks, parts) and the parallel encoder (tasks): each side of an
//! exact cut, pre-tokenized or encoded on its own, gives the pieces and ids of the whole.
//!
//! A position `c` is an exact cut when both hold:
//! 1. no special-token match straddles `c` (starts before it, ends after it). The
//!    leftmost-longest matches of the part before `c` are then the whole text's matches
//!    that end by `c`, and a search of the part after it starts where the whole text's
//!    search would go on (see [`SpecialMatcher`]);
//! 2. a piece ends at `c` and the next begins there whatever surrounds the cut: `c` is
//!    the start or end of a special-token match (special tokens are hard boundaries), or,
//!    for the built-in patterns only (GPT-2, cl100k, o200k), a text cut ([`is_text_cut`]).
//!
//! Text cuts are just before a space that follows a printable ASCII character (`x| `),
//! and just after a newline between two (`x\n|y`). Why they are exact: in each built-in
//! pattern a piece that holds a printable, non-space ASCII character ends before the next
//! space or newline (letters, digits, punctuation and contractions stop there), except a
//! punctuation run that takes the newlines after it in cl100k and o200k (`.\n`), which ends
//! at the newline when a non-space follows. A newline between two non-spaces is a
//! whitespace run of its own: `\s+(?!\S)` fails before `y` and `\s+` / `\s*[\r\n]+` take
//! `"\n"`, which is what `\s+(?!\S)` / `\s++$` take at the end of the part; no piece goes
//! on from a newline into `y` (the letter prefix excludes `\r\n` in cl100k and o200k and
//! is a space in GPT-2). So the part before `c` ends with the piece that ends at `c` in
//! the whole text, and since the patterns never look behind, the part after `c` is
//! matched from `c` as the whole text is. A special-token match can straddle a text cut
//! only if the token holds a space or a newline ([`SpecialMatcher::straddles`] checks).
//!
//! Callers choose among exact cuts (the last one in a buffer, the first one after a
//! nominal part boundary, a special token before a text cut) but never decide what is
//! exact. The one inexact fallback, [`hold_back_cut`], is for custom patterns only.

use crate::pretokenize::PreTokenizer;
use crate::specials::SpecialMatcher;

/// A printable, non-space ASCII character.
#[inline]
fn graphic(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

/// Whether `c` is a text cut of `bytes` (`x| ` or `x\n|y`, see the module docs); the
/// start and the end of `bytes` are not.
#[inline]
pub fn is_text_cut(bytes: &[u8], c: usize) -> bool {
    if c == 0 || c >= bytes.len() {
        return false;
    }
    if bytes[c] == b' ' {
        return graphic(bytes[c - 1]);
    }
    c >= 2 && bytes[c - 1] == b'\n' && graphic(bytes[c]) && graphic(bytes[c - 2])
}

/// The text cut that a space or newline at `p` may give: before a space, after a newline.
#[inline]
fn candidate(bytes: &[u8], p: usize) -> usize {
    if bytes[p] == b' ' {
        p
    } else {
        p + 1
    }
}

/// The last text cut `c` with `lo <= c < hi`.
pub fn last_text_cut(bytes: &[u8], lo: usize, hi: usize) -> Option<usize> {
    let lo = lo.max(1);
    let hi = hi.min(bytes.len());
    if hi <= lo {
        return None;
    }
    // A cut c in [lo, hi) has its space at c or its newline at c - 1.
    memchr::memrchr2_iter(b' ', b'\n', &bytes[lo - 1..hi])
        .map(|p| candidate(bytes, p + lo - 1))
        .find(|&c| c >= lo && c < hi && is_text_cut(bytes, c))
}

/// The first text cut `c` with `lo <= c < hi` for which `ok(c)` holds.
pub fn first_text_cut(bytes: &[u8], lo: usize, hi: usize, ok: impl Fn(usize) -> bool) -> Option<usize> {
    let lo = lo.max(1);
    let hi = hi.min(bytes.len());
    if hi <= lo {
        return None;
    }
    memchr::memchr2_iter(b' ', b'\n', &bytes[lo - 1..hi])
        .map(|p| candidate(bytes, p + lo - 1))
        .find(|&c| c >= lo && c < hi && is_text_cut(bytes, c) && ok(c))
}

/// The first exact cut `c >= lo` that ends a special-token match, in a window `bytes`
/// of a longer text that starts at least `specials.max_len()` bytes before `lo` (or at
/// the text's start). `at_end`: the window ends where the text does. The window's own
/// search may pair matches differently from the whole text's when occurrences overlap,
/// so a match `[s, c)` counts only when no occurrence straddles `s` or `c`: then the
/// whole text's search reaches `s` and takes that match (a longer one would straddle `c`).
pub fn first_special_cut(bytes: &[u8], lo: usize, specials: &SpecialMatcher, at_end: bool) -> Option<usize> {
    let max_len = specials.max_len();
    specials
        .find_iter(bytes)
        .map(|(s, e, _)| (s, e))
        .find(|&(s, e)| {
            e >= lo
                && (at_end || s + max_len <= bytes.len())
                && !specials.straddles(bytes, s)
                && !specials.straddles(bytes, e)
        })
        .map(|(_, e)| e)
}

/// The bytes at the end of a buffer that [`last_cut_at`] searches first.
const TAIL: usize = 64 << 10;

/// A late exact cut `> 0` of a buffer whose text goes on after it (the last one in the
/// buffer's last `TAIL` bytes, else in a tail four times as long, and so on), or None.
/// For callers that need the position only: unlike [`last_cut`] it does not search the
/// whole buffer for special tokens.
pub fn last_cut_at(buf: &[u8], specials: &SpecialMatcher, text_cuts: bool) -> Option<usize> {
    last_cut_in_tails(buf, specials, text_cuts, TAIL)
}

fn last_cut_in_tails(buf: &[u8], specials: &SpecialMatcher, text_cuts: bool, mut tail: usize) -> Option<usize> {
    loop {
        let lo = buf.len().saturating_sub(tail);
        if let Some(c) = last_cut_from(buf, lo, specials, text_cuts) {
            return Some(c);
        }
        if lo == 0 {
            return None;
        }
        tail = tail.saturating_mul(4).max(1);
    }
}

/// The last exact cut `c >= lo` of `buf` (whose text goes on after it), judged from the
/// bytes around each candidate, as in [`first_special_cut`]: a match `[s, e)` counts when
/// no occurrence straddles `s` or `e` and no longer token starting at `s` could end past
/// the buffer; a text cut when no occurrence straddles it, all of which would lie within
/// the buffer.
fn last_cut_from(buf: &[u8], lo: usize, specials: &SpecialMatcher, text_cuts: bool) -> Option<usize> {
    let max_len = specials.max_len();
    let len = buf.len();
    // Room before `lo` for the occurrences that could straddle a match's start.
    let from = lo.saturating_sub(2 * max_len);
    let mut best = None;
    for (s, e, _) in specials.find_iter(&buf[from..]) {
        let (s, e) = (from + s, from + e);
        if (s >= lo || from == 0) && s + max_len <= len && !specials.straddles(buf, s) && !specials.straddles(buf, e) {
            best = Some(e);
        }
    }
    if text_cuts {
        let floor = best.map_or(lo, |b| b + 1);
        let mut hi = len.saturating_sub(max_len);
        while let Some(c) = last_text_cut(buf, floor, hi) {
            if !specials.straddles(buf, c) {
                return Some(c);
            }
            hi = c;
        }
    }
    best
}

/// Where a buffer of text is cut, and the spans free of special tokens before the cut
/// (found by the same search, so that the text is searched for special tokens once).
#[derive(Debug, PartialEq, Eq)]
pub struct Cut {
    pub at: usize,
    pub segments: Vec<(usize, usize)>,
}

impl Cut {
    /// The cut at the end of `buf` (the end of the input).
    pub fn whole(buf: &[u8], specials: &SpecialMatcher) -> Cut {
        let mut segments = Vec::new();
        specials.segments(buf, 0, &mut segments);
        Cut { at: buf.len(), segments }
    }

    /// The cut at `at`, given the special-token occurrences `matches` of the buffer, in
    /// order, none of which may straddle `at`: those that end by it are then the ones a
    /// search of the part before it finds.
    fn from_matches(matches: &[(usize, usize)], at: usize) -> Cut {
        let mut segments = Vec::with_capacity(matches.len() + 1);
        let mut pos = 0;
        for &(s, e) in matches.iter().take_while(|m| m.1 <= at) {
            if s > pos {
                segments.push((pos, s));
            }
            pos = e;
        }
        if at > pos {
            segments.push((pos, at));
        }
        Cut { at, segments }
    }
}

/// The last exact cut `> 0` of a buffer whose text goes on after it, or None.
/// `text_cuts`: the pattern is a built-in one. Special-token matches are trusted only
/// when they start at least `max_len` bytes before the end of the buffer: then no longer
/// special token, and no earlier one, could be hiding behind the end of the buffer.
pub fn last_cut(buf: &[u8], specials: &SpecialMatcher, text_cuts: bool) -> Option<Cut> {
    let max_len = specials.max_len();
    let limit = buf.len().saturating_sub(max_len);
    let mut last_safe_end: Option<usize> = None;
    let mut last_end = 0usize;
    let mut matches: Vec<(usize, usize)> = Vec::new();
    specials.for_each_match(buf, |s, e| {
        if s <= limit && s + max_len <= buf.len() {
            last_safe_end = Some(e);
        }
        last_end = e;
        matches.push((s, e));
    });
    let fallback = if text_cuts {
        // No special token covers any position in [last_end, limit]: a match covering
        // c >= last_end would start at or after last_end (matches do not overlap) and
        // before limit, so it would have been found.
        last_text_cut(buf, last_end.max(1), limit.min(buf.len().saturating_sub(1)) + 1)
    } else {
        None
    };
    let at = match (last_safe_end, fallback) {
        (Some(a), Some(b)) => a.max(b),
        (Some(a), None) if a > 0 => a,
        (None, Some(b)) => b,
        _ => return None,
    };
    // No match straddles the cut: it is a match's end, or lies past the last match.
    Some(Cut::from_matches(&matches, at))
}

/// The fallback cut when no exact one exists in a long buffer: hold back the last two
/// pre-tokens of the text after the last special token (and any possible start of a
/// special token at the end), as `ferrolm.reference` does when streaming. Exact for the
/// built-in patterns; for a custom pattern it assumes no match depends on text more
/// than two pre-tokens ahead.
pub fn hold_back_cut(buf: &[u8], specials: &SpecialMatcher, pre: &PreTokenizer) -> Option<Cut> {
    let max_len = specials.max_len();
    let limit = buf.len().saturating_sub(max_len.saturating_sub(1));
    let mut start = 0;
    let mut end = limit;
    let mut matches: Vec<(usize, usize)> = Vec::new();
    specials.for_each_match(buf, |s, e| {
        if s + max_len <= buf.len() {
            start = e; // complete: no longer special token can start here
        } else {
            end = end.min(s);
        }
        matches.push((s, e));
    });
    if end <= start {
        return None;
    }
    let region = &buf[start..end];
    let text = match crate::utf8::to_str(region) {
        Ok(t) => t,
        Err(e) => std::str::from_utf8(&region[..e.valid_up_to()]).unwrap_or_default(),
    };
    let mut starts = [usize::MAX; 2];
    pre.for_each_piece_range(text, |s, _| {
        starts = [starts[1], s];
    });
    // The cut lies in [start, end): after every complete match, before any partial one.
    (starts[0] != usize::MAX && start + starts[0] > 0).then(|| Cut::from_matches(&matches, start + starts[0]))
}

#[cfg(test)]
mod tests;
