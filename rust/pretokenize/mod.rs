//! Pre-tokenization: cut text into the pieces BPE merges never cross.
//!
//! Semantics are those of Python's `regex` module applied with `finditer`:
//! leftmost-first alternation, pieces are the successive matches.
//! Built-in patterns are selected by name ("gpt2", "cl100k", "o200k") or by their exact
//! source; they run on hand-written scanners (`scan.rs`, `windows.rs`) that give exactly
//! the spans `regex.findall` gives, in linear time. Any other string is compiled as a
//! custom regex with fancy-regex.
//!
//! # How the scanners follow the regexes
//!
//! Each scanner has a scalar part, a function `end = next_end(bytes, start)` giving the
//! end of the match that `regex` finds at `start` (the general `*_end` functions in
//! `scan.rs`, behind fast paths for ASCII words). Every one of the three patterns
//! matches at every position (each code point is a letter, a number, whitespace or
//! "other", and each of those classes has an alternative that accepts it), so the
//! pieces tile the text and no position is ever skipped. Code points are classified
//! with a table generated from the regex engine's own Unicode classes
//! (`unicode_tables.rs`, from regex-syntax, the crate behind fancy-regex and tiktoken);
//! ASCII uses a 128-entry table (`classes.rs`).
//!
//! On x86_64, ASCII text goes 64 bytes at a time instead: a window starts at a piece
//! start, vector compares give bit masks of byte classes (SSE2 on every x86_64 CPU, AVX2
//! or AVX-512BW where the CPU has them, chosen at run time: [`Simd`]), and the piece
//! starts follow from neighbouring bytes by bit operations (`windows.rs`); the
//! few starts that need more context (contractions, whitespace runs with newlines) are
//! settled one by one. Where a window cannot finish a piece (non-ASCII text), the
//! scalar part does. The GPT-2 scanner's windows also take a few non-ASCII chars (each
//! one's bytes get its class from the table) and the last bytes of a text (padded with
//! spaces, which its rules treat as the end of the text).
//!
//! Classes: `\p{L}` = UPPER (Lu, Lt) | LOWER (Ll) | OLET (Lm, Lo); `\p{M}` = MARK;
//! `\p{N}` = NUM; `\s` = WS; everything else OTHER. The classes are disjoint (the
//! generator checks it).
//!
//! Tests: unit tests in `tests.rs` (hand-picked cases, a random differential test
//! against fancy-regex, linear time on long runs, the tables against the regex engine's
//! classes); tests/test_pretokenize.py and tests/test_unicode.py compare with the
//! pure-Python reference (Python `regex` given the same classes) and with tiktoken.

use std::fmt;

mod classes;
mod scan;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod windows;

pub use classes::{char_class, char_class_flags};
#[cfg(not(target_arch = "x86_64"))]
use scan::{cl100k_next, gpt2_next, o200k_next};

/// Run a scanner's `next_end(bytes, start) -> end` from the start of `b` to its end,
/// reporting each piece to `f(start, end)`. (A macro, so that the scanner is inlined
/// into the loop rather than called through a function pointer.)
#[allow(unused_macros)]
macro_rules! drive {
    ($b:expr, $next_end:ident, $f:expr) => {{
        let b: &[u8] = $b;
        let mut f = $f;
        let mut i = 0;
        while i < b.len() {
            let e = $next_end(b, i);
            debug_assert!(e > i && e <= b.len());
            f(i, e);
            i = e;
        }
    }};
}

/// Call `f(start, end)` for each piece of a batch of boundaries.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn each_range(bounds: &[usize], f: &mut impl FnMut(usize, usize)) {
    for w in bounds.windows(2) {
        f(w[0], w[1]);
    }
}

/// [`PreTokenizer::for_each_piece_batch`] hands over at least this many pieces at once
/// (but for the last batch of a text)... The encoder prefetches the table slots of a whole
/// batch before it reads any: 192 measured 1.02-1.03x the speed of 64 in batch encoding.
pub const PIECE_BATCH: usize = 192;
/// ... and fewer than this many.
pub const MAX_BATCH: usize = PIECE_BATCH + 64;

/// GPT-2's pattern (also r50k/p50k).
pub const GPT2_PATTERN: &str = r"'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

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

/// The Unicode version of the built-in patterns' classes (`unicode_tables.rs`).
pub fn unicode_version() -> &'static str {
    crate::unicode_tables::UNICODE_VERSION
}

/// Resolve a pattern name to its regex source; other strings are returned as given.
pub fn resolve_pattern(name_or_regex: &str) -> &str {
    match Builtin::by_name(name_or_regex) {
        Some(b) => b.source(),
        None => name_or_regex,
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

/// Which built-in scanner a pattern source corresponds to, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    Gpt2,
    Cl100k,
    O200k,
}

impl Builtin {
    /// The built-in whose regex source is exactly `source`.
    pub fn from_source(source: &str) -> Option<Builtin> {
        if source == GPT2_PATTERN {
            Some(Builtin::Gpt2)
        } else if source == CL100K_PATTERN {
            Some(Builtin::Cl100k)
        } else if source == O200K_PATTERN {
            Some(Builtin::O200k)
        } else {
            None
        }
    }

    /// The built-in of a pattern name ("gpt2", "r50k", "p50k", "cl100k", "cl100k_base",
    /// "o200k", "o200k_base").
    pub fn by_name(name: &str) -> Option<Builtin> {
        match name {
            "gpt2" | "r50k" | "p50k" => Some(Builtin::Gpt2),
            "cl100k" | "cl100k_base" => Some(Builtin::Cl100k),
            "o200k" | "o200k_base" => Some(Builtin::O200k),
            _ => None,
        }
    }

    /// The regex source this scanner implements.
    pub fn source(self) -> &'static str {
        match self {
            Builtin::Gpt2 => GPT2_PATTERN,
            Builtin::Cl100k => CL100K_PATTERN,
            Builtin::O200k => O200K_PATTERN,
        }
    }
}

#[derive(Clone)]
enum Engine {
    Scanner(Builtin),
    Regex(Box<fancy_regex::Regex>),
}

/// A compiled pre-tokenizer. Cheap to share between threads (`Sync`).
#[derive(Clone)]
pub struct PreTokenizer {
    source: String,
    engine: Engine,
    /// The instruction set of the built-in scanners.
    simd: Simd,
}

/// The instruction set the built-in scanners (and the trainer's word rewrite) use
/// (x86_64), chosen at run time: the best the CPU has, or less where the environment
/// variable `FERROLM_SIMD` (`baseline`, `avx2`, `avx512`) caps it. All levels give the
/// same pieces (and merges).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    /// SSE2 on x86_64 (every x86_64 CPU has it); portable code elsewhere.
    Baseline,
    /// AVX2, BMI1/2, LZCNT, POPCNT.
    Avx2,
    /// AVX-512F and AVX-512BW, with the above.
    Avx512,
    /// AVX-512 VBMI2 (byte compress, for writing a window's piece starts), with the above.
    Avx512Vbmi2,
}

impl Simd {
    /// The level used by default: the best this CPU has, capped by `FERROLM_SIMD`.
    pub fn detected() -> Simd {
        static LEVEL: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
        *LEVEL.get_or_init(|| {
            let cap = match std::env::var("FERROLM_SIMD").as_deref() {
                Ok("baseline") | Ok("sse2") => Simd::Baseline,
                Ok("avx2") => Simd::Avx2,
                Ok("avx512") => Simd::Avx512,
                _ => Simd::Avx512Vbmi2,
            };
            Simd::supported().min(cap)
        })
    }

    /// The best level this CPU has.
    fn supported() -> Simd {
        #[cfg(target_arch = "x86_64")]
        {
            let v3 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("bmi1")
                && is_x86_feature_detected!("bmi2")
                && is_x86_feature_detected!("lzcnt")
                && is_x86_feature_detected!("popcnt");
            if v3 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                if is_x86_feature_detected!("avx512vbmi2") {
                    return Simd::Avx512Vbmi2;
                }
                return Simd::Avx512;
            }
            if v3 {
                return Simd::Avx2;
            }
        }
        Simd::Baseline
    }
}

impl fmt::Debug for PreTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PreTokenizer")
            .field("builtin", &self.builtin())
            .field("simd", &self.simd)
            .field("pattern", &self.source)
            .finish()
    }
}

impl PreTokenizer {
    /// `pattern` is "gpt2", "cl100k", "o200k" or a regex in Python `regex` syntax.
    /// The built-in patterns (by name or by exact source) use the hand-written scanners.
    pub fn new(pattern: &str) -> Result<Self, PatternError> {
        let source = resolve_pattern(pattern);
        match Builtin::from_source(source) {
            Some(b) => {
                Ok(PreTokenizer { source: source.to_string(), engine: Engine::Scanner(b), simd: Simd::detected() })
            }
            None => Self::new_regex(source),
        }
    }

    /// Compile `pattern` (a name or a regex) with fancy-regex even when it is a built-in.
    /// For differential tests and benchmarks of the scanners.
    pub fn new_regex(pattern: &str) -> Result<Self, PatternError> {
        let source = resolve_pattern(pattern).to_string();
        let regex = fancy_regex::Regex::new(&source).map_err(|e| PatternError(e.to_string()))?;
        Ok(PreTokenizer { source, engine: Engine::Regex(Box::new(regex)), simd: Simd::detected() })
    }

    /// This pre-tokenizer with its scanner at `simd`, or at the best level the CPU has
    /// if that is lower (for tests and benchmarks: every level gives the same pieces).
    pub fn with_simd(mut self, simd: Simd) -> Self {
        self.simd = simd.min(Simd::supported());
        self
    }

    /// The instruction set of its scanner.
    pub fn simd(&self) -> Simd {
        self.simd
    }

    /// The regex source this pre-tokenizer implements.
    pub fn pattern(&self) -> &str {
        &self.source
    }

    /// True when a hand-written scanner (not a regex engine) does the work.
    pub fn is_builtin(&self) -> bool {
        matches!(self.engine, Engine::Scanner(_))
    }

    /// The built-in scanner in use, if any.
    pub fn builtin(&self) -> Option<Builtin> {
        match self.engine {
            Engine::Scanner(b) => Some(b),
            Engine::Regex(_) => None,
        }
    }

    /// Call `f(start, end)` with the byte range of each piece of `text`, in order.
    /// Ranges are on char boundaries. With a built-in pattern they tile the text; text a
    /// custom pattern does not match is skipped, as `regex.finditer` skips it.
    #[inline]
    pub fn for_each_piece_range(&self, text: &str, mut f: impl FnMut(usize, usize)) {
        match &self.engine {
            #[cfg(target_arch = "x86_64")]
            Engine::Scanner(Builtin::Gpt2) => {
                windows::batches::<windows::Gpt2>(self.simd, text.as_bytes(), |b| each_range(b, &mut f))
            }
            #[cfg(target_arch = "x86_64")]
            Engine::Scanner(Builtin::Cl100k) => {
                windows::batches::<windows::Cl100k>(self.simd, text.as_bytes(), |b| each_range(b, &mut f))
            }
            #[cfg(target_arch = "x86_64")]
            Engine::Scanner(Builtin::O200k) => {
                windows::batches::<windows::O200k>(self.simd, text.as_bytes(), |b| each_range(b, &mut f))
            }
            #[cfg(not(target_arch = "x86_64"))]
            Engine::Scanner(Builtin::Gpt2) => drive!(text.as_bytes(), gpt2_next, f),
            #[cfg(not(target_arch = "x86_64"))]
            Engine::Scanner(Builtin::Cl100k) => drive!(text.as_bytes(), cl100k_next, f),
            #[cfg(not(target_arch = "x86_64"))]
            Engine::Scanner(Builtin::O200k) => drive!(text.as_bytes(), o200k_next, f),
            Engine::Regex(regex) => {
                for m in regex.find_iter(text) {
                    match m {
                        Ok(m) => f(m.start(), m.end()),
                        // fancy-regex gives up only on pathological backtracking in custom patterns.
                        Err(_) => break,
                    }
                }
            }
        }
    }

    /// The pieces of `text` in batches, for callers that look pieces up in bulk: `f(b)`
    /// gets piece boundaries, the pieces being `b[k]..b[k + 1]`, at least
    /// [`PIECE_BATCH`] of them per call (but for the last call, or where a custom
    /// pattern skips text) and fewer than [`MAX_BATCH`]. Same pieces, same order as
    /// [`PreTokenizer::for_each_piece_range`]. With a built-in scanner the pieces of a
    /// whole 64-byte window are written at once, with the count kept in a register,
    /// instead of one callback per piece.
    #[inline]
    pub fn for_each_piece_batch(&self, text: &str, mut f: impl FnMut(&[usize])) {
        match &self.engine {
            #[cfg(target_arch = "x86_64")]
            Engine::Scanner(Builtin::Gpt2) => windows::batches::<windows::Gpt2>(self.simd, text.as_bytes(), f),
            #[cfg(target_arch = "x86_64")]
            Engine::Scanner(Builtin::Cl100k) => windows::batches::<windows::Cl100k>(self.simd, text.as_bytes(), f),
            #[cfg(target_arch = "x86_64")]
            Engine::Scanner(Builtin::O200k) => windows::batches::<windows::O200k>(self.simd, text.as_bytes(), f),
            _ => {
                // One piece at a time; a gap (text a custom pattern skips) ends a batch.
                let mut bounds = [0usize; PIECE_BATCH + 1];
                let mut n = 0;
                self.for_each_piece_range(text, |s, e| {
                    if n == PIECE_BATCH || (n > 0 && bounds[n] != s) {
                        f(&bounds[..=n]);
                        n = 0;
                    }
                    if n == 0 {
                        bounds[0] = s;
                    }
                    n += 1;
                    bounds[n] = e;
                });
                if n > 0 {
                    f(&bounds[..=n]);
                }
            }
        }
    }

    /// Call `f` on each piece of `text`, in order. With a built-in pattern the pieces
    /// cover the text; text a custom pattern does not match is skipped, as
    /// `regex.finditer` skips it.
    #[inline]
    pub fn for_each_piece<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) {
        self.for_each_piece_range(text, |s, e| {
            debug_assert!(s < e && text.is_char_boundary(s) && text.is_char_boundary(e));
            // SAFETY: scanners advance by whole UTF-8 sequences of a valid &str, and regex
            // matches are on char boundaries, so s..e is a valid char range of `text`.
            f(unsafe { text.get_unchecked(s..e) })
        });
    }

    /// The pieces of `text` as a vector (convenient for tests and small inputs).
    pub fn pieces<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        self.for_each_piece(text, |p| out.push(p));
        out
    }

    /// The byte ranges of the pieces of `text`.
    pub fn piece_ranges(&self, text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        self.for_each_piece_range(text, |s, e| out.push((s, e)));
        out
    }
}
