use super::classes::*;
use super::*;
use crate::unicode_tables::{BLOCK_SHIFT, STAGE1, STAGE2};

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
            let want = (0..16)
                .filter(|&k| if lower_only { !bytes[k].is_ascii_lowercase() } else { !bytes[k].is_ascii_alphabetic() })
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
    ' ', ' ', ' ', ' ', '\n', '\n', '\t', '\r', '\'', '\'', 's', 't', 'l', 'v', 'e', 'r', 'd', 'm', 'a', 'b', 'x', 'S',
    'L', 'E', 'T', 'R', 'A', '0', '1', '9', '.', ',', '!', '/', '-', '"', '(', '\u{b}', '\u{c}',
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
    let scanners: Vec<Vec<PreTokenizer>> =
        names.iter().map(|n| levels.iter().map(|&l| PreTokenizer::new(n).unwrap().with_simd(l)).collect()).collect();
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
            assert_eq!(batched_ranges(p, &text), p.piece_ranges(&text), "round {round}, {} on {text:?}", p.pattern());
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
