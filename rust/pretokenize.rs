//! Pre-tokenization: cut text into the pieces BPE merges never cross.
//!
//! Semantics are those of Python's `regex` module applied with `finditer`:
//! leftmost-first alternation, pieces are the successive matches.
//! Built-in patterns are selected by name ("gpt2", "cl100k", "o200k");
//! any other string is compiled as a custom regex.

use std::fmt;

/// GPT-2's pattern (also r50k/p50k).
pub const GPT2_PATTERN: &str =
    r"'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// cl100k_base's pattern, as tiktoken ships it.
pub const CL100K_PATTERN: &str = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s";

/// o200k_base's pattern, as tiktoken ships it.
pub const O200K_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+"
);

/// Resolve a pattern name to its regex source; other strings are returned as given.
pub fn resolve_pattern(name_or_regex: &str) -> &str {
    match name_or_regex {
        "gpt2" | "r50k" | "p50k" => GPT2_PATTERN,
        "cl100k" | "cl100k_base" => CL100K_PATTERN,
        "o200k" | "o200k_base" => O200K_PATTERN,
        other => other,
    }
}

#[derive(Debug, Clone)]
pub struct PatternError(pub String);

impl fmt::Display for PatternError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid pre-tokenization pattern: {}", self.0)
    }
}

impl std::error::Error for PatternError {}

/// A compiled pre-tokenizer. Cheap to share between threads (`Sync`).
pub struct PreTokenizer {
    source: String,
    regex: fancy_regex::Regex,
}

impl PreTokenizer {
    /// `pattern` is "gpt2", "cl100k", "o200k" or a regex in Python `regex` syntax.
    pub fn new(pattern: &str) -> Result<Self, PatternError> {
        let source = resolve_pattern(pattern).to_string();
        let regex = fancy_regex::Regex::new(&source).map_err(|e| PatternError(e.to_string()))?;
        Ok(PreTokenizer { source, regex })
    }

    /// The regex source this pre-tokenizer implements.
    pub fn pattern(&self) -> &str {
        &self.source
    }

    /// Call `f` on each piece of `text`, in order. Pieces cover the matched text;
    /// text the pattern does not match (possible only with custom patterns) is skipped,
    /// as `regex.finditer` skips it.
    pub fn for_each_piece<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) {
        for m in self.regex.find_iter(text) {
            match m {
                Ok(m) => f(m.as_str()),
                // fancy-regex gives up only on pathological backtracking in custom patterns.
                Err(_) => break,
            }
        }
    }

    /// The pieces of `text` as a vector (convenient for tests and small inputs).
    pub fn pieces<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        self.for_each_piece(text, |p| out.push(p));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_splits_contractions_and_spaces() {
        let p = PreTokenizer::new("gpt2").unwrap();
        assert_eq!(p.pieces("I'll  go!\n\n x"), vec!["I", "'ll", " ", " go", "!", "\n\n", " x"]);
    }

    #[test]
    fn invalid_custom_pattern_is_an_error() {
        assert!(PreTokenizer::new("(unclosed").is_err());
    }
}
