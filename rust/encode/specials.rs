//! Special tokens: matched leftmost-longest (so "<|endoftext|><|endoftext|>" wins over
//! "<|endoftext|>" when both are special), found with Aho-Corasick.

use aho_corasick::{AhoCorasick, MatchKind};

#[derive(Default)]
pub(crate) struct Specials {
    tokens: Vec<(String, u32)>,
    matcher: Option<AhoCorasick>,
    max_len: usize,
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
        Specials { tokens, matcher: Some(matcher), max_len }
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

    /// (start, end, id) of each special token in `text`, left to right.
    pub(crate) fn find_iter<'a>(&'a self, text: &'a str) -> impl Iterator<Item = (usize, usize, u32)> + 'a {
        self.matcher
            .iter()
            .flat_map(move |m| m.find_iter(text))
            .map(move |m| (m.start(), m.end(), self.tokens[m.pattern().as_usize()].1))
    }
}
