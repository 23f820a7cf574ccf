//! The source of truth for the Unicode classes of the built-in patterns: the regex
//! engine's own tables (the `regex-syntax` crate behind fancy-regex, which also runs
//! custom patterns, and the same engine tiktoken uses).
//!
//! `unicode_tables.rs` (the scanners' tables) and `python/ferrolm/bpe/unicode_classes.py`
//! (the reference's class definitions) are generated from [`engine_classes`] by
//! tools/gen_unicode_tables.py; a test checks the tables still equal it.

/// The classes, disjoint; code points in none are 0 (other). Their unions are what the
/// patterns use: `\p{L}` = Lu|Lt|Ll|Lm|Lo, and `\p{M}`, `\p{N}`, `\s` (White_Space).
pub const FINE_CLASSES: [(u8, &str, &str); 8] = [
    (1, "s", r"\s"),
    (2, "N", r"\p{N}"),
    (3, "M", r"\p{M}"),
    (4, "Lu", r"\p{Lu}"),
    (5, "Lt", r"\p{Lt}"),
    (6, "Ll", r"\p{Ll}"),
    (7, "Lm", r"\p{Lm}"),
    (8, "Lo", r"\p{Lo}"),
];

/// Every Unicode scalar value, in order.
fn all_chars() -> String {
    (0..0xd800u32).chain(0xe000..0x110000).filter_map(char::from_u32).collect()
}

/// The fine class ([`FINE_CLASSES`]) of every code point 0..0x110000 as the regex engine
/// classifies it (surrogates: 0). Panics if the engine's classes overlap or the letter
/// classes do not make up `\p{L}`, which would make the scanners' tables wrong.
pub fn engine_classes() -> Vec<u8> {
    let all = all_chars();
    let mut class = vec![0u8; 0x110000];
    let each = |pattern: &str, f: &mut dyn FnMut(u32)| {
        let re = fancy_regex::Regex::new(&format!("{pattern}+")).expect("a Unicode class");
        for m in re.find_iter(&all) {
            m.expect("no backtracking limit on a class").as_str().chars().for_each(|c| f(c as u32));
        }
    };
    for (value, name, pattern) in FINE_CLASSES {
        each(pattern, &mut |cp| {
            let old = class[cp as usize];
            assert!(old == 0, "U+{cp:04X} is in {name} and in class {old}");
            class[cp as usize] = value;
        });
    }
    let mut letters = 0usize;
    each(r"\p{L}", &mut |cp| {
        assert!((4..=8).contains(&class[cp as usize]), "U+{cp:04X} is \\p{{L}} but not Lu/Lt/Ll/Lm/Lo");
        letters += 1;
    });
    assert_eq!(letters, class.iter().filter(|&&c| (4..=8).contains(&c)).count(), "Lu/Lt/Ll/Lm/Lo outside \\p{{L}}");
    class
}

/// The Unicode version of the regex engine's tables ("16.0.0"): the newest `Age` value
/// it knows (versions with a third number assign no characters).
pub fn engine_unicode_version() -> String {
    for major in (1..=40).rev() {
        for minor in (0..=3).rev() {
            if fancy_regex::Regex::new(&format!(r"\p{{Age={major}.{minor}}}")).is_ok() {
                return format!("{major}.{minor}.0");
            }
        }
    }
    "unknown".to_string()
}
