//! Pre-tokenization: cut text into the pieces BPE merges never cross.
//!
//! Semantics are those of Python's `regex` module applied with `finditer`:
//! leftmost-first alternation, pieces are the successive matches.
//! Built-in patterns are selected by name ("gpt2", "cl100k", "o200k") or by their exact
//! source; they run on hand-written scanners (below) that give exactly the spans
//! `regex.findall` gives, in linear time. Any other string is compiled as a custom
//! regex with fancy-regex.
//!
//! # How the scanners follow the regexes
//!
//! Each scanner has a scalar part, a function `end = next_end(bytes, start)` giving the
//! end of the match that `regex` finds at `start` (the general `*_end` functions below,
//! behind fast paths for ASCII words). Every one of the three patterns matches at
//! every position (each code point is a letter, a number, whitespace or "other", and
//! each of those classes has an alternative that accepts it), so the pieces tile the
//! text and no position is ever skipped. Code points are classified with a table
//! generated from the regex engine's own Unicode classes (`unicode_tables.rs`, from
//! regex-syntax, the crate behind fancy-regex and tiktoken); ASCII uses a 128-entry table.
//!
//! On x86_64, ASCII text goes 64 bytes at a time instead: a window starts at a piece
//! start, vector compares give bit masks of byte classes (SSE2 on every x86_64 CPU, AVX2
//! or AVX-512BW where the CPU has them, chosen at run time: [`Simd`]), and the piece
//! starts follow from neighbouring bytes by bit operations (see "windows" below); the
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
//! Tests: unit tests here (hand-picked cases, a random differential test against
//! fancy-regex, linear time on long runs, the tables against the regex engine's classes);
//! tests/test_pretokenize.py and tests/test_unicode.py compare with the pure-Python
//! reference (Python `regex` given the same classes) and with tiktoken.

use std::fmt;

use crate::unicode_tables::{BLOCK_MASK, BLOCK_SHIFT, DIRECT, STAGE1, STAGE2};

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

// ---------------------------------------------------------------------------------
// Character classes

const OTHER: u8 = 0;
const WS: u8 = 1;
const NUM: u8 = 2;
const MARK: u8 = 3;
const UPPER: u8 = 4; // Lu, Lt
const LOWER: u8 = 5; // Ll
const OLET: u8 = 6; // Lm, Lo
/// Past the end of the text; in no set.
const END: u8 = 7;

const fn bit(c: u8) -> u8 {
    1 << c
}
/// `\p{L}`
const SET_L: u8 = bit(UPPER) | bit(LOWER) | bit(OLET);
/// `\p{N}`
const SET_N: u8 = bit(NUM);
/// `\s`
const SET_WS: u8 = bit(WS);
/// `[^\s\p{L}\p{N}]`
const SET_PUNCT: u8 = bit(OTHER) | bit(MARK);
/// o200k's `[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]`
const SET_U: u8 = bit(UPPER) | bit(OLET) | bit(MARK);
/// o200k's `[\p{Ll}\p{Lm}\p{Lo}\p{M}]`
const SET_W: u8 = bit(LOWER) | bit(OLET) | bit(MARK);

#[inline(always)]
fn in_set(c: u8, set: u8) -> bool {
    // In u32, whose shift needs no masking of the amount on x86 (c < 8 anyway).
    ((set as u32) >> (c as u32)) & 1 != 0
}

const fn ascii_table() -> [u8; 128] {
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

static ASCII: [u8; 128] = ascii_table();

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
fn class_of_cp(cp: u32) -> u8 {
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
const MIXED: u8 = 0xff;

/// For the code points U+0000..U+FFFF in groups of 64 (`cp >> 6`, i.e. the lead byte's
/// low four bits and the first continuation byte's six bits of a three-byte UTF-8
/// sequence), the class all of them share, or MIXED.
static THREE_BYTE_GROUPS: [u8; 1024] = three_byte_groups();

const fn three_byte_groups() -> [u8; 1024] {
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

const fn class_of_cp_const(cp: u32) -> u8 {
    let block = STAGE1[(cp >> BLOCK_SHIFT) as usize] as usize;
    STAGE2[(block << BLOCK_SHIFT) | (cp & BLOCK_MASK) as usize]
}

/// Decode the non-ASCII UTF-8 sequence at `b[i]` (a lead byte) and classify it.
/// `b` must be valid UTF-8 (it comes from a `&str`).
#[inline(always)]
fn decode_class(b: &[u8], i: usize) -> (u8, usize) {
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
fn class_at(b: &[u8], i: usize) -> (u8, usize) {
    match b.get(i) {
        None => (END, 0),
        Some(&x) if x < 0x80 => (ASCII[x as usize], 1),
        Some(_) => decode_class(b, i),
    }
}

/// End of the run of chars in `set` starting at `j`.
#[inline(always)]
fn scan(b: &[u8], mut j: usize, set: u8) -> usize {
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
fn non_letter_mask16(b: &[u8], j: usize, lower_only: bool) -> u32 {
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
fn non_letter_mask16_swar(b: &[u8], j: usize, lower_only: bool) -> u32 {
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
fn scan_letters(b: &[u8], mut j: usize) -> usize {
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
fn scan_ascii_lower(b: &[u8], mut j: usize) -> usize {
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
fn scan_newlines(b: &[u8], mut j: usize, slash: bool) -> usize {
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
fn contraction(b: &[u8], j: usize) -> Option<usize> {
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
fn contraction_ci(b: &[u8], j: usize) -> Option<usize> {
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
fn scan_numbers_max(b: &[u8], mut j: usize, more: usize) -> usize {
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
struct WsRun {
    /// End of the run.
    end: usize,
    /// Start of the run's last char.
    last: usize,
    /// End of the last `\r` or `\n` in the run (0 if none).
    newline_end: usize,
}

#[inline(always)]
fn ws_run(b: &[u8], i: usize, l: usize) -> WsRun {
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

// ---------------------------------------------------------------------------------
// Fast paths for the most common pieces of ASCII text (an ASCII word, with or without
// a leading space); everything else goes to the general scanners below.

/// gpt2 and cl100k: `( ?|[^\r\n\p{L}\p{N}]?)\p{L}+` for a word starting with an ASCII letter.
#[inline(always)]
fn ascii_word_end(b: &[u8], i: usize) -> Option<usize> {
    // One branch for both "word" and " word".
    let s = i + (b[i] == b' ') as usize;
    match b.get(s) {
        Some(y) if y.is_ascii_alphabetic() => Some(scan_letters(b, s + 1)),
        _ => None,
    }
}

#[inline(always)]
fn gpt2_next(b: &[u8], i: usize) -> usize {
    match ascii_word_end(b, i) {
        Some(e) => e,
        None => gpt2_end(b, i),
    }
}

#[inline(always)]
fn cl100k_next(b: &[u8], i: usize) -> usize {
    // A contraction starts with an apostrophe, never with a space or a letter.
    match ascii_word_end(b, i) {
        Some(e) => e,
        None => cl100k_end(b, i),
    }
}

#[inline(always)]
fn o200k_next(b: &[u8], i: usize) -> usize {
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
// Windows: ASCII text 64 bytes at a time (x86_64).
//
// A window starts at a piece start. For its ASCII prefix, where a piece starts follows
// from the classes of neighbouring bytes, as bit masks (bit k = byte k). For GPT-2
// (L letter, N digit, W whitespace, P other; cl100k and o200k: see `shared_window`;
// GPT-2 gives the bytes of a non-ASCII char other than whitespace its char's class, so
// its prefix runs to the first non-ASCII whitespace):
//   - a piece starts where the class changes;
//   - except before a non-space preceded by ' ' (the space opens ` ?\p{L}+` etc.);
//   - and at the last char of a whitespace run followed by a non-space (`\s+(?!\S)`
//     gives it back; the text end is never inside a window, except in GPT-2's padded
//     last window, where the padding spaces extend a final run as the end would);
//   - an apostrophe at a piece start followed by s, d, m, t, ll, ve or re is a piece of
//     its own (those are rare; the scalar `contraction` decides each one).
// So a start at k depends only on bytes k-4..=k+1: the starts before the last ASCII
// byte but one are certain. The pieces between them are reported and the next window
// begins at the last certain start; where no piece completes (a non-ASCII char, a
// very long piece) the scalar scanner takes one piece.

#[cfg(target_arch = "x86_64")]
mod windows {
    use super::*;

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
        let store =
            |g: usize, x: __m128i| _mm512_storeu_si512(dst.add(g), _mm512_add_epi64(_mm512_cvtepu8_epi64(x), base));
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
        let mut w = Window {
            letter: 0,
            upper: 0,
            digit: 0,
            space: 0,
            white: 0,
            apostrophe: 0,
            newline: 0,
            slash: 0,
            non_ascii: 0,
        };
        // SAFETY: SSE2 is part of x86_64; the 64 bytes are in bounds (asserted).
        unsafe {
            let set = |x: u8| _mm_set1_epi8(x as i8);
            for k in 0..4 {
                let v = _mm_loadu_si128(b.as_ptr().add(i + 16 * k) as *const __m128i);
                let mask = |m: __m128i| (_mm_movemask_epi8(m) as u32 as u64) << (16 * k);
                let folded = _mm_or_si128(v, set(0x20));
                let letter =
                    _mm_and_si128(_mm_cmpgt_epi8(folded, set(b'a' - 1)), _mm_cmpgt_epi8(set(b'z' + 1), folded));
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
        let change = (w.letter ^ (w.letter << 1))
            | (w.digit ^ (w.digit << 1))
            | (w.white ^ (w.white << 1))
            | (punct ^ (punct << 1));
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
}

// ---------------------------------------------------------------------------------
// GPT-2: '(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

/// End of the GPT-2 piece starting at `i` (< len).
#[inline(always)]
fn gpt2_end(b: &[u8], i: usize) -> usize {
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
fn cl100k_end(b: &[u8], i: usize) -> usize {
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
fn o200k_upper_lower(b: &[u8], s: usize) -> Result<usize, usize> {
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
fn o200k_suffix(b: &[u8], e: usize) -> usize {
    if b.get(e) == Some(&b'\'') {
        if let Some(end) = contraction_ci(b, e + 1) {
            return end;
        }
    }
    e
}

/// End of the o200k piece starting at `i` (< len).
#[inline(always)]
fn o200k_end(b: &[u8], i: usize) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_pieces(name: &str, text: &str) -> Vec<String> {
        PreTokenizer::new(name).unwrap().pieces(text).into_iter().map(String::from).collect()
    }

    fn regex_pieces(name: &str, text: &str) -> Vec<String> {
        PreTokenizer::new_regex(name).unwrap().pieces(text).into_iter().map(String::from).collect()
    }

    #[test]
    fn gpt2_splits_contractions_and_spaces() {
        let p = PreTokenizer::new("gpt2").unwrap();
        assert!(p.is_builtin());
        assert_eq!(p.pieces("I'll  go!\n\n x"), vec!["I", "'ll", " ", " go", "!", "\n\n", " x"]);
    }

    #[test]
    fn pre_tokenizers_are_shareable() {
        fn send_sync_clone<T: Send + Sync + Clone + std::fmt::Debug>() {}
        send_sync_clone::<PreTokenizer>();
        let p = PreTokenizer::new("o200k").unwrap();
        assert!(format!("{p:?}").contains("O200k"));
        assert_eq!(p.clone().pieces("Hi there"), vec!["Hi", " there"]);
    }

    #[test]
    fn invalid_custom_pattern_is_an_error() {
        assert!(PreTokenizer::new("(unclosed").is_err());
    }

    #[test]
    fn custom_patterns_use_the_regex_engine() {
        let p = PreTokenizer::new(r"\d+").unwrap();
        assert!(!p.is_builtin());
        assert_eq!(p.pieces("a12b345"), vec!["12", "345"]);
        assert_eq!(p.piece_ranges("a12b345"), vec![(1, 3), (4, 7)]);
    }

    #[test]
    fn builtin_sources_select_the_scanners() {
        for (name, src) in [("gpt2", GPT2_PATTERN), ("cl100k", CL100K_PATTERN), ("o200k", O200K_PATTERN)] {
            let by_name = PreTokenizer::new(name).unwrap();
            let by_source = PreTokenizer::new(src).unwrap();
            assert!(by_name.is_builtin() && by_source.is_builtin());
            assert_eq!(by_name.pattern(), src);
            assert_eq!(by_name.builtin(), by_source.builtin());
            assert!(!PreTokenizer::new_regex(name).unwrap().is_builtin());
        }
    }

    /// Expected pieces checked against Python's `regex.findall` (regex 2026.5.9).
    #[test]
    fn tricky_cases_match_python_regex() {
        let cases: &[(&str, &str, &[&str])] = &[
            ("o200k", "\u{301}AB", &["\u{301}", "AB"]),
            ("cl100k", "\u{301}AB", &["\u{301}AB"]),
            ("gpt2", "\u{301}AB", &["\u{301}", "AB"]),
            ("o200k", "\u{301}'sX", &["\u{301}'s", "X"]),
            ("cl100k", "\u{301}'sX", &["\u{301}'", "sX"]),
            ("o200k", "!\n/\nx", &["!\n/\n", "x"]),
            ("cl100k", "!\n/\nx", &["!\n", "/\n", "x"]),
            ("gpt2", "!\n/\nx", &["!", "\n", "/", "\n", "x"]),
            ("o200k", "'sam", &["'sam"]),
            ("cl100k", "'sam", &["'s", "am"]),
            ("o200k", "aBC", &["a", "BC"]),
            ("cl100k", "aBC", &["aBC"]),
            ("o200k", "\u{2b0}AB", &["\u{2b0}", "AB"]),
            ("o200k", "A\u{2b0}'S", &["A\u{2b0}'S"]),
            ("cl100k", "A\u{2b0}'S", &["A\u{2b0}", "'S"]),
            ("gpt2", "A\u{2b0}'S", &["A\u{2b0}", "'", "S"]),
            ("o200k", "x  \n\n  \n y", &["x", "  \n\n  \n", " y"]),
            ("gpt2", "  a\t\tb\n", &[" ", " a", "\t", "\t", "b", "\n"]),
            ("cl100k", "  a\t\tb\n", &[" ", " a", "\t", "\tb", "\n"]),
            ("o200k", "a \u{a0}b", &["a", " ", "\u{a0}b"]),
            ("gpt2", "a \u{a0}b", &["a", " ", "\u{a0}", "b"]),
            ("cl100k", "\u{17f} '\u{17f}", &["\u{17f}", " '", "\u{17f}"]),
            ("cl100k", "x'\u{17f}", &["x", "'\u{17f}"]),
            ("cl100k", "x'LL'Ve", &["x", "'LL", "'Ve"]),
            ("gpt2", "x'LL'Ve", &["x", "'", "LL", "'", "Ve"]),
            ("cl100k", "12345", &["123", "45"]),
            ("o200k", "12345", &["123", "45"]),
            ("gpt2", "12345 6", &["12345", " 6"]),
            ("cl100k", "a\n  ", &["a", "\n  "]),
            ("o200k", "a\n  ", &["a", "\n", "  "]),
            ("cl100k", "a \n b", &["a", " \n", " b"]),
        ];
        for (name, text, want) in cases {
            assert_eq!(scan_pieces(name, text), *want, "{name} on {text:?}");
            assert_eq!(regex_pieces(name, text), *want, "fancy-regex, {name} on {text:?}");
        }
    }

    #[test]
    fn swar_letter_masks_equal_the_simple_definition() {
        let mut rng = Rng(12345);
        for _ in 0..20000 {
            let bytes: Vec<u8> = (0..16).map(|_| rng.next() as u8).collect();
            for lower_only in [false, true] {
                let want =
                    (0..16)
                        .filter(|&k| {
                            if lower_only {
                                !bytes[k].is_ascii_lowercase()
                            } else {
                                !bytes[k].is_ascii_alphabetic()
                            }
                        })
                        .fold(0u32, |m, k| m | 1 << k);
                assert_eq!(non_letter_mask16_swar(&bytes, 0, lower_only), want, "{bytes:?}");
                assert_eq!(non_letter_mask16(&bytes, 0, lower_only), want, "{bytes:?}");
            }
        }
    }

    #[test]
    fn three_byte_groups_agree_with_the_tables() {
        for cp in 0..0x10000u32 {
            let g = THREE_BYTE_GROUPS[(cp >> 6) as usize];
            assert!(g == MIXED || g == class_of_cp(cp), "U+{cp:04X}");
        }
        let mixed = THREE_BYTE_GROUPS.iter().filter(|&&g| g == MIXED).count();
        assert!(mixed < 300, "{mixed} mixed groups");
    }

    #[test]
    fn table_shapes() {
        let blocks = STAGE2.len() >> BLOCK_SHIFT;
        assert_eq!(STAGE2.len(), blocks << BLOCK_SHIFT);
        assert!(STAGE1.iter().all(|&k| (k as usize) < blocks));
        assert!(STAGE2.iter().all(|&c| c < END));
    }

    #[test]
    fn classes_of_sample_chars() {
        assert_eq!(char_class('a'), LOWER);
        assert_eq!(char_class('\u{1c5}'), UPPER); // Lt
        assert_eq!(char_class('\u{2b0}'), OLET); // Lm
        assert_eq!(char_class('中'), OLET);
        assert_eq!(char_class('\u{301}'), MARK);
        assert_eq!(char_class('\u{663}'), NUM);
        assert_eq!(char_class('\u{85}'), WS);
        assert_eq!(char_class('\u{3000}'), WS);
        assert_eq!(char_class('\u{1c}'), OTHER); // not \s in the regex module
        assert_eq!(char_class('\u{10ffff}'), OTHER);
        assert_eq!(char_class_flags('\u{301}'), 8 | 16 | 32);
    }

    /// Chars assigned long ago (classified alike by every recent Unicode version), biased
    /// to the characters the patterns treat specially.
    const ALPHABET: &[char] = &[
        ' ',
        ' ',
        ' ',
        '\t',
        '\n',
        '\n',
        '\r',
        '\u{b}',
        '\u{c}',
        '\u{85}',
        '\u{a0}',
        '\u{3000}',
        '\u{2028}',
        '\u{1c}',
        '\0',
        '\'',
        '\'',
        '\'',
        's',
        'S',
        't',
        'T',
        'l',
        'L',
        'v',
        'V',
        'e',
        'E',
        'r',
        'R',
        'd',
        'D',
        'm',
        'M',
        'a',
        'z',
        'Q',
        '\u{17f}',
        '\u{212a}',
        'é',
        'É',
        'ß',
        '\u{1c5}',
        '\u{2b0}',
        'ª',
        '中',
        'あ',
        'Ж',
        'ж',
        'א',
        '\u{301}',
        '\u{903}',
        '\u{20dd}',
        '0',
        '7',
        '\u{663}',
        '\u{216b}',
        '½',
        '²',
        '!',
        '.',
        ',',
        '/',
        '/',
        '-',
        '"',
        '(',
        '😀',
        '\u{200d}',
        '\u{1f3fb}',
        '\u{fe0f}',
        '\u{10400}',
        '\u{10428}',
        '\u{1d400}',
    ];

    /// ASCII chars, weighted like prose.
    const ASCII_ALPHABET: &[char] = &[
        ' ', ' ', ' ', ' ', '\n', '\n', '\t', '\r', '\'', '\'', 's', 't', 'l', 'v', 'e', 'r', 'd', 'm', 'a', 'b', 'x',
        'S', 'L', 'E', 'T', 'R', 'A', '0', '1', '9', '.', ',', '!', '/', '-', '"', '(', '\u{b}', '\u{c}',
    ];

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            // xorshift64*
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    #[test]
    fn random_differential_against_fancy_regex() {
        let names = ["gpt2", "cl100k", "o200k"];
        let regexes: Vec<_> = names.iter().map(|n| PreTokenizer::new_regex(n).unwrap()).collect();
        // Each scanner at each instruction set this CPU has.
        let levels: Vec<Simd> = ALL_SIMD.iter().copied().filter(|&l| l <= Simd::supported()).collect();
        let scanners: Vec<Vec<PreTokenizer>> = names
            .iter()
            .map(|n| levels.iter().map(|&l| PreTokenizer::new(n).unwrap().with_simd(l)).collect())
            .collect();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..4000 {
            // A small sub-alphabet makes runs and repeated structures likely; long,
            // mostly ASCII texts exercise the 64-byte windows.
            let long = round % 2 == 1;
            let k = 2 + rng.below(8);
            let sub: Vec<char> = (0..k)
                .map(|_| {
                    if long && rng.below(4) != 0 {
                        ASCII_ALPHABET[rng.below(ASCII_ALPHABET.len())]
                    } else {
                        ALPHABET[rng.below(ALPHABET.len())]
                    }
                })
                .collect();
            let len = if long { 60 + rng.below(200) } else { rng.below(24) };
            let text: String = (0..len).map(|_| sub[rng.below(sub.len())]).collect();
            for ((name, at_levels), r) in names.iter().zip(&scanners).zip(&regexes) {
                let want = r.pieces(&text);
                for s in at_levels {
                    assert_eq!(s.pieces(&text), want, "round {round}, {name} at {:?} on {text:?}", s.simd());
                }
            }
        }
    }

    /// The byte-compress start writer writes what the bit loop writes, for masks of
    /// every density (the batch driver only runs it where the CPU has VBMI2).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn compressed_start_writes_match_the_bit_loop() {
        if Simd::supported() < Simd::Avx512Vbmi2 {
            eprintln!("skipped: this CPU has no AVX-512 VBMI2");
            return;
        }
        let mut rng = Rng(0x5eed);
        let mut masks: Vec<u64> = vec![0, 1, 1 << 63, u64::MAX, u64::MAX - 1, 0x8000_0000_0000_0001, 0xff00];
        for bits in 1..=64 {
            // A mask with about `bits` bits set.
            masks.push((0..bits).fold(0u64, |m, _| m | 1 << rng.below(64)));
        }
        for &m in &masks {
            for at in [1, 5, 100] {
                let i = rng.below(1 << 20);
                let mut want = [usize::MAX; 200];
                let mut got = [usize::MAX; 200];
                windows::write_starts(&mut want, at, i, m);
                // SAFETY: the CPU has VBMI2 (checked above).
                unsafe { windows::write_starts_vbmi2(&mut got, at, i, m) };
                let n = m.count_ones() as usize;
                assert_eq!(got[..at + n], want[..at + n], "mask {m:#x} at {at}");
                assert!(
                    got[at + n.next_multiple_of(8)..].iter().all(|&v| v == usize::MAX),
                    "mask {m:#x}: wrote past 7 spare"
                );
            }
        }
    }

    const ALL_SIMD: [Simd; 4] = [Simd::Baseline, Simd::Avx2, Simd::Avx512, Simd::Avx512Vbmi2];

    #[test]
    fn simd_levels_are_capped_by_the_cpu() {
        let p = PreTokenizer::new("gpt2").unwrap();
        assert!(p.simd() <= Simd::supported());
        assert_eq!(p.clone().with_simd(Simd::Baseline).simd(), Simd::Baseline);
        assert_eq!(p.with_simd(Simd::Avx512Vbmi2).simd(), Simd::supported());
    }

    /// The pieces of `for_each_piece_batch`, as ranges, checking the batch sizes.
    fn batched_ranges(p: &PreTokenizer, text: &str) -> Vec<(usize, usize)> {
        let mut out: Vec<(usize, usize)> = Vec::new();
        let mut last_short = false;
        p.for_each_piece_batch(text, |b| {
            assert!(b.len() >= 2 && b.len() <= MAX_BATCH, "batch of {} pieces", b.len() - 1);
            // Only the last batch (or one ended by a gap) is short.
            assert!(!last_short || !p.is_builtin(), "a short batch before the last");
            last_short = b.len() - 1 < PIECE_BATCH;
            out.extend(b.windows(2).map(|w| (w[0], w[1])));
        });
        out
    }

    #[test]
    fn batches_give_the_pieces_of_for_each_piece_range() {
        let custom = [r"\d+", r"\p{L}+| ?[^\s\p{L}]", r"(?i)ab|c"];
        let mut pretoks: Vec<PreTokenizer> =
            ["gpt2", "cl100k", "o200k"].iter().chain(custom.iter()).map(|n| PreTokenizer::new(n).unwrap()).collect();
        // The built-in scanners at the baseline too (the batching is the same code at
        // every level, the class masks are not).
        for n in ["gpt2", "cl100k", "o200k"] {
            pretoks.push(PreTokenizer::new(n).unwrap().with_simd(Simd::Baseline));
        }
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for round in 0..600 {
            // Mostly ASCII words and numbers (the windows), some other chars (the scalar
            // path), long enough for several batches.
            let len = if round % 3 == 0 { rng.below(40) } else { 200 + rng.below(3000) };
            let text: String = (0..len)
                .map(|_| {
                    if rng.below(10) == 0 {
                        ALPHABET[rng.below(ALPHABET.len())]
                    } else {
                        ASCII_ALPHABET[rng.below(ASCII_ALPHABET.len())]
                    }
                })
                .collect();
            for p in &pretoks {
                assert_eq!(
                    batched_ranges(p, &text),
                    p.piece_ranges(&text),
                    "round {round}, {} on {text:?}",
                    p.pattern()
                );
            }
        }
        // A window's 63 pieces on top of a batch of 63 (the largest batch).
        let text = "a!".repeat(5000);
        for p in pretoks.iter().filter(|p| p.is_builtin()) {
            assert_eq!(batched_ranges(p, &text), p.piece_ranges(&text));
        }
        assert!(batched_ranges(&pretoks[0], "").is_empty());
    }

    /// The scanners' tables equal the regex engine's classes (regex-syntax, as pinned in
    /// Cargo.lock) on every code point: the Unicode version of the built-in patterns is
    /// that of the engine that runs custom patterns (and tiktoken's).
    #[test]
    fn tables_equal_the_regex_engine_classes() {
        use crate::unicode_classes::{engine_classes, engine_unicode_version};
        use crate::unicode_tables::{REGEX_SYNTAX_VERSION, UNICODE_VERSION};
        // Fine class (unicode_classes::FINE_CLASSES) -> the scanners' class.
        const TABLE: [u8; 9] = [OTHER, WS, NUM, MARK, UPPER, UPPER, LOWER, OLET, OLET];
        let fine = engine_classes();
        let differ: Vec<u32> = (0..0x110000u32)
            .filter_map(char::from_u32)
            .filter(|&c| char_class(c) != TABLE[fine[c as usize] as usize])
            .map(|c| c as u32)
            .collect();
        let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.lock")).unwrap_or_default();
        let locked = lock.split("name = \"regex-syntax\"\nversion = \"").nth(1).and_then(|s| s.split('"').next());
        assert!(
            differ.is_empty(),
            "{} code points (U+{:04X}...) classified unlike the regex engine: the tables are Unicode {UNICODE_VERSION} \
             (regex-syntax {REGEX_SYNTAX_VERSION}), the engine is Unicode {} (regex-syntax {}); \
             run tools/gen_unicode_tables.py",
            differ.len(),
            differ[0],
            engine_unicode_version(),
            locked.unwrap_or("?")
        );
    }

    #[test]
    fn linear_time_on_long_runs() {
        // Each is about a MB; a quadratic scanner would not finish.
        let m = 1 << 20;
        let inputs = [
            "!".repeat(m),
            " ".repeat(m),
            " ".repeat(m) + "x",
            "\n".repeat(m) + "x",
            "\u{a0}".repeat(m / 2) + "x",
            "a".repeat(m),
            "A".repeat(m),
            "\u{4e2d}".repeat(m / 3),
            "\u{2b0}".repeat(m / 2) + "A",
            "A".repeat(m / 2) + "\u{2b0}" + &"A".repeat(m / 2),
            "\u{301}".repeat(m / 2),
            "A\u{301}".repeat(m / 3),
            " \n".repeat(m / 2),
            "\n ".repeat(m / 2) + "x",
            "1".repeat(m),
            "'".repeat(m),
            "'s".repeat(m / 2),
            "a'".repeat(m / 2),
            "aB".repeat(m / 2),
            "!\n/".repeat(m / 3),
            "\u{e9} a".repeat(m / 4),
        ];
        for name in ["gpt2", "cl100k", "o200k"] {
            let p = PreTokenizer::new(name).unwrap();
            for text in &inputs {
                let mut covered = 0;
                p.for_each_piece_range(text, |s, e| {
                    assert_eq!(s, covered);
                    covered = e;
                });
                assert_eq!(covered, text.len());
            }
        }
    }
}
