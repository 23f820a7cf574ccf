//! The special-token matcher, shared by training, encoding and the shard writer.
//!
//! Matches are leftmost-longest (so "<|endoftext|><|endoftext|>" wins over "<|endoftext|>"
//! when both are special), found with Aho-Corasick over bytes.

use aho_corasick::{AhoCorasick, MatchKind};

/// Special tokens with their ids; the empty set matches nothing.
#[derive(Default)]
pub struct SpecialMatcher {
    tokens: Vec<(String, u32)>,
    matcher: Option<AhoCorasick>,
    max_len: usize,
    /// The distinct first bytes of the tokens, when there are at most 3 (see `find_iter`).
    first_bytes: Vec<u8>,
}

impl SpecialMatcher {
    /// `tokens`: non-empty strings and their ids (empty strings are dropped).
    pub fn new(tokens: Vec<(String, u32)>) -> Self {
        let tokens: Vec<(String, u32)> = tokens.into_iter().filter(|(s, _)| !s.is_empty()).collect();
        if tokens.is_empty() {
            return SpecialMatcher::default();
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(s, _)| s.as_bytes()))
            .expect("special tokens are short literal strings");
        let max_len = tokens.iter().map(|(s, _)| s.len()).max().unwrap_or(0);
        let mut first_bytes: Vec<u8> = tokens.iter().map(|(s, _)| s.as_bytes()[0]).collect();
        first_bytes.sort_unstable();
        first_bytes.dedup();
        if first_bytes.len() > 3 {
            first_bytes.clear();
        }
        SpecialMatcher { tokens, matcher: Some(matcher), max_len, first_bytes }
    }

    /// The tokens numbered in order (for callers that need no ids).
    pub fn from_strings(tokens: &[String]) -> Self {
        SpecialMatcher::new(tokens.iter().enumerate().map(|(i, s)| (s.clone(), i as u32)).collect())
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn tokens(&self) -> &[(String, u32)] {
        &self.tokens
    }

    /// The length in bytes of the longest special token (0 when there are none).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Whether `text` may hold a special token: false when none of their first bytes
    /// occurs. Most texts hold none, and a memchr over a text is cheaper than starting
    /// the automaton's search on it (per document, that start is most of the cost).
    fn may_occur(&self, text: &[u8]) -> bool {
        match *self.first_bytes.as_slice() {
            [a] => memchr::memchr(a, text).is_some(),
            [a, b] => memchr::memchr2(a, b, text).is_some(),
            [a, b, c] => memchr::memchr3(a, b, c, text).is_some(),
            _ => true,
        }
    }

    /// (start, end, id) of each special token in `text`, left to right.
    pub fn find_iter<'a>(&'a self, text: &'a [u8]) -> impl Iterator<Item = (usize, usize, u32)> + 'a {
        self.matcher
            .iter()
            .filter(move |_| self.may_occur(text))
            .flat_map(move |m| m.find_iter(text))
            .map(move |m| (m.start(), m.end(), self.tokens[m.pattern().as_usize()].1))
    }

    /// Calls `f(start, end)` for each special-token occurrence in `hay`, in order.
    pub fn for_each_match(&self, hay: &[u8], mut f: impl FnMut(usize, usize)) {
        for (s, e, _) in self.find_iter(hay) {
            f(s, e);
        }
    }

    /// The non-special spans of `hay` (empty ones are dropped), appended to `out` with
    /// `base` added to each offset.
    pub fn segments(&self, hay: &[u8], base: usize, out: &mut Vec<(usize, usize)>) {
        let mut pos = 0;
        self.for_each_match(hay, |s, e| {
            if s > pos {
                out.push((base + pos, base + s));
            }
            pos = e;
        });
        if hay.len() > pos {
            out.push((base + pos, base + hay.len()));
        }
    }

    /// Whether an occurrence of some token (any occurrence, overlapping ones included)
    /// starts before `q` and ends after it. Looks only at the bytes near `q`.
    pub fn straddles(&self, bytes: &[u8], q: usize) -> bool {
        self.tokens.iter().any(|(tok, _)| {
            let n = tok.len();
            if n < 2 || q == 0 || q >= bytes.len() {
                return false;
            }
            let lo = q.saturating_sub(n - 1);
            let hi = (q + n - 1).min(bytes.len());
            memchr::memmem::find_iter(&bytes[lo..hi], tok.as_bytes()).any(|o| lo + o < q && q < lo + o + n)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every (start, end, id) found equals a plain search's, for sets of special tokens with
    /// 1, 2, 3 and 4 distinct first bytes (4: no memchr filter), in texts that hold them,
    /// hold only their first bytes, or hold neither.
    #[test]
    fn found_with_and_without_the_first_byte_filter() {
        let sets: [&[&str]; 4] = [
            &["<|endoftext|>", "<|endoftext|><|endoftext|>"],
            &["<|a|>", "[SEP]"],
            &["<s>", "[x]", "{y}"],
            &["<s>", "[x]", "{y}", "#z"],
        ];
        let texts = [
            "",
            "plain text",
            "a < b [ c { d # e",
            "x<s>y[x]z{y}#z<|a|>[SEP]<|endoftext|><|endoftext|><|endoftext|>",
            "<<s>[[x]",
            // One kind each: a filter that looked for one first byte only would miss them.
            "just [SEP] here",
            "just [x] here",
            "just {y} and #z",
        ];
        for (k, set) in sets.iter().enumerate() {
            let sp = SpecialMatcher::new(set.iter().enumerate().map(|(i, s)| (s.to_string(), i as u32)).collect());
            assert_eq!(sp.first_bytes.is_empty(), k == 3);
            for text in texts {
                let got: Vec<(usize, usize, u32)> = sp.find_iter(text.as_bytes()).collect();
                // Leftmost-longest by hand.
                let mut want = Vec::new();
                let mut i = 0;
                while i < text.len() {
                    let best =
                        set.iter().enumerate().filter(|(_, s)| text[i..].starts_with(**s)).max_by_key(|(_, s)| s.len());
                    match best {
                        Some((id, s)) => {
                            want.push((i, i + s.len(), id as u32));
                            i += s.len();
                        }
                        None => i += 1,
                    }
                }
                assert_eq!(got, want, "{set:?} in {text:?}");
            }
        }
    }
}
