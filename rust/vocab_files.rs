//! Fast paths for tokenizer files: reading GPT-2-style `vocab.json` and `merges.txt`
//! (tokens in GPT-2's byte-to-unicode form), and the tokenizer fingerprint.
//!
//! `ferrolm.tokenizer_files` (Python) defines these formats and reports every problem
//! with the file, line and token at fault. Reading GPT-2's 50,000 merges there takes
//! about half a second; here a few milliseconds. The readers accept exactly what the
//! Python readers accept and give up (`None`) on anything else, so the Python reader
//! runs then and reports the problem: errors are written once.

use sha2::{Digest, Sha256};

/// The bytes outside GPT-2's printable set, in byte order: the k-th is written as the
/// character U+0100 + k.
const UNPRINTABLE: [u8; 68] = {
    let mut out = [0u8; 68];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        if !is_printable(b as u32) {
            out[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    assert!(n == 68);
    out
};

/// Printable Latin-1 (`!`..`~`, `¡`..`¬`, `®`..`ÿ`): GPT-2 writes these bytes as themselves.
const fn is_printable(u: u32) -> bool {
    (u >= 0x21 && u <= 0x7E) || (u >= 0xA1 && u <= 0xAC) || (u >= 0xAE && u <= 0xFF)
}

/// The bytes of a token written in GPT-2's byte-to-unicode form, or None if a character
/// is not in that alphabet (or the token is empty).
pub fn token_from_gpt2_str(s: &str) -> Option<Vec<u8>> {
    if s.is_empty() {
        return None;
    }
    s.chars()
        .map(|c| {
            let u = c as u32;
            if is_printable(u) {
                Some(u as u8)
            } else {
                UNPRINTABLE.get(u.checked_sub(0x100)? as usize).copied()
            }
        })
        .collect()
}

/// `vocab.json`'s `{token: id}` as (id, token bytes), in no particular order. A token
/// equal to a special token is that token's UTF-8 bytes. None unless every token is
/// non-empty, every id is a distinct integer in 0..2^32 and every other token is in the
/// byte-to-unicode alphabet, and no two tokens have the same bytes (which id such
/// bytes get depends on the file's order, which this reader does not keep). A token
/// given twice keeps its last id (as Python's `json` does).
pub fn read_vocab_json(text: &str, specials: &[String]) -> Option<Vec<(u32, Vec<u8>)>> {
    let Entries(entries) = serde_json::from_str(text).ok()?;
    let mut out = Vec::with_capacity(entries.len());
    let mut seen_ids = rustc_hash::FxHashSet::default();
    let mut seen_bytes = rustc_hash::FxHashSet::default();
    for (token, id) in entries {
        // A repeated key repeats its bytes: given up on below (Python's json keeps the last).
        if token.is_empty() || !seen_ids.insert(id) {
            return None;
        }
        let bytes = if specials.iter().any(|s| s == &*token) {
            token.as_bytes().to_vec()
        } else {
            token_from_gpt2_str(&token)?
        };
        if !seen_bytes.insert(bytes.clone()) {
            return None;
        }
        out.push((id, bytes));
    }
    Some(out)
}

/// A JSON object whose values are all integers in 0..2^32, as (key, value) in file order.
struct Entries<'a>(Vec<(Key<'a>, u32)>);

/// A JSON string, borrowed from the text unless it has escapes.
struct Key<'a>(std::borrow::Cow<'a, str>);

impl std::ops::Deref for Key<'_> {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(s.into()))
            }
            fn visit_str<E>(self, s: &str) -> Result<Key<'de>, E> {
                Ok(Key(s.to_owned().into()))
            }
        }
        d.deserialize_str(Visit)
    }
}

impl<'de> serde::Deserialize<'de> for Entries<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Entries<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of token: id")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Entries<'de>, A::Error> {
                let mut out = Vec::with_capacity(map.size_hint().unwrap_or(1 << 16));
                while let Some((k, v)) = map.next_entry::<Key<'de>, u32>()? {
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(Visit)
    }
}

/// `merges.txt`: an optional first line `#version...`, then `a b` per line (blank lines
/// skipped, trailing `\r`s ignored). None on any other line or an unknown character.
pub fn read_merges_txt(text: &str) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::with_capacity(text.len() / 8);
    for (i, line) in text.split('\n').enumerate() {
        let line = line.trim_end_matches('\r');
        if line.is_empty() || (i == 0 && line.starts_with("#version")) {
            continue;
        }
        let (a, b) = line.split_once(' ')?;
        if b.contains(' ') {
            return None;
        }
        out.push((token_from_gpt2_str(a)?, token_from_gpt2_str(b)?));
    }
    Some(out)
}

/// The tokenizer fingerprint: sha256 over the vocab (ids ascending), the merges, the
/// special tokens and the pattern source, in the text form
/// `ferrolm.tokenizer_files.fingerprint` defines (and a test compares against).
pub fn fingerprint<'a>(
    vocab: impl Iterator<Item = (u32, &'a [u8])>,
    merges: impl Iterator<Item = (&'a [u8], &'a [u8])>,
    specials: &[String],
    pattern: &str,
) -> String {
    use std::fmt::Write;
    let mut text = String::with_capacity(1 << 20);
    text.push_str("ferrolm-tokenizer-v1\nvocab\n");
    for (id, bytes) in vocab {
        let _ = write!(text, "{id} ");
        push_hex(&mut text, bytes);
        text.push('\n');
    }
    text.push_str("merges\n");
    for (a, b) in merges {
        push_hex(&mut text, a);
        text.push(' ');
        push_hex(&mut text, b);
        text.push('\n');
    }
    text.push_str("specials\n");
    for s in specials {
        push_hex(&mut text, s.as_bytes());
        text.push('\n');
    }
    text.push_str("pattern\n");
    text.push_str(pattern);
    let digest = Sha256::digest(text.as_bytes());
    let mut out = String::with_capacity(64);
    push_hex(&mut out, &digest);
    out
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for &b in bytes {
        out.push(HEX[(b >> 4) as usize] as char);
        out.push(HEX[(b & 15) as usize] as char);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_is_a_bijection_onto_bytes() {
        let mut seen = [false; 256];
        for u in (0x21..0x100).chain(0x100..0x100 + 68) {
            let c = char::from_u32(u).unwrap();
            if let Some(b) = token_from_gpt2_str(&c.to_string()) {
                assert!(!seen[b[0] as usize], "byte {} twice", b[0]);
                seen[b[0] as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(token_from_gpt2_str("Ġthe"), Some(b" the".to_vec()));
        assert_eq!(token_from_gpt2_str("Ċ"), Some(b"\n".to_vec()));
        assert_eq!(token_from_gpt2_str("a b"), None);
        assert_eq!(token_from_gpt2_str("\u{144}"), None);
        assert_eq!(token_from_gpt2_str(""), None);
    }

    #[test]
    fn readers_give_up_on_what_they_do_not_accept() {
        assert_eq!(
            read_merges_txt("#version: 0.2\nĠ t\r\n\nh e\n"),
            Some(vec![(b" ".to_vec(), b"t".to_vec()), (b"h".to_vec(), b"e".to_vec())])
        );
        assert_eq!(read_merges_txt("a b c\n"), None);
        assert_eq!(read_merges_txt("a  b\n"), None);
        assert_eq!(read_merges_txt("ab\n"), None);
        assert_eq!(read_merges_txt("x\n#version: 0.2\n"), None);
        let specials = vec!["<|endoftext|>".to_string(), "a b".to_string()];
        let mut v = read_vocab_json(r#"{"a": 0, "Ġ": 1, "<|endoftext|>": 2}"#, &specials).unwrap();
        v.sort();
        assert_eq!(read_vocab_json(r#"{"\\\"": 7}"#, &specials), Some(vec![(7, b"\\\"".to_vec())]));
        assert_eq!(v, vec![(0, b"a".to_vec()), (1, b" ".to_vec()), (2, b"<|endoftext|>".to_vec())]);
        for bad in [
            r#"{"a": 0, "b": 0}"#,
            r#"{"a": -1}"#,
            r#"{"a": 1.0}"#,
            r#"{"a": true}"#,
            r#"{"": 0}"#,
            r#"{"a c": 0}"#,
            r#"[1]"#,
            r#"{"a": 4294967296}"#,
            r#"{"aĠb": 0, "a b": 1}"#,
            r#"{"a": 0, "a": 1}"#,
        ] {
            assert_eq!(read_vocab_json(bad, &specials), None, "{bad}");
        }
    }
}
