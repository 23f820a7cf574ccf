//! Special tokens: matched leftmost-longest (so "<|endoftext|><|endoftext|>" wins over
//! "<|endoftext|>" when both are special), found with Aho-Corasick.

use aho_corasick::{AhoCorasick, MatchKind};

#[derive(Default)]
pub(crate) struct Specials {
    tokens: Vec<(String, u32)>,
    matcher: Option<AhoCorasick>,
    max_len: usize,
    /// The distinct first bytes of the tokens, when there are at most 3 (see `find_iter`).
    first_bytes: Vec<u8>,
}

impl Specials {
    pub(crate) fn new(tokens: Vec<(String, u32)>) -> Self {
        if tokens.is_empty() {
            return Specials::default();
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(s, _)| s.as_bytes()))
            .expect("special tokens are non-empty strings");
        let max_len = tokens.iter().map(|(s, _)| s.len()).max().unwrap_or(0);
        let mut first_bytes: Vec<u8> = tokens.iter().map(|(s, _)| s.as_bytes()[0]).collect();
        first_bytes.sort_unstable();
        first_bytes.dedup();
        if first_bytes.len() > 3 {
            first_bytes.clear();
        }
        Specials { tokens, matcher: Some(matcher), max_len, first_bytes }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub(crate) fn tokens(&self) -> &[(String, u32)] {
        &self.tokens
    }

    /// The length in bytes of the longest special token.
    pub(crate) fn max_len(&self) -> usize {
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
    pub(crate) fn find_iter<'a>(&'a self, text: &'a str) -> impl Iterator<Item = (usize, usize, u32)> + 'a {
        self.matcher
            .iter()
            .filter(move |_| self.may_occur(text.as_bytes()))
            .flat_map(move |m| m.find_iter(text))
            .map(move |m| (m.start(), m.end(), self.tokens[m.pattern().as_usize()].1))
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
            let sp = Specials::new(set.iter().enumerate().map(|(i, s)| (s.to_string(), i as u32)).collect());
            assert_eq!(sp.first_bytes.is_empty(), k == 3);
            for text in texts {
                let got: Vec<(usize, usize, u32)> = sp.find_iter(text).collect();
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
