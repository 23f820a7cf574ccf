//! One JSON Lines record → the text of its document field, without building the
//! whole object (other fields are skipped unparsed into values).

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

/// The string value of `field` in the JSON object `line`, or a message saying what is wrong.
///
/// A lone surrogate escape (`"\ud800"`, which Python's `json` writes for a str holding
/// one) becomes U+FFFD, as `Tokenizer.encode(str)` treats such a str; an escaped pair is
/// the one character it encodes.
pub(crate) fn field<'a>(line: &'a str, field: &str) -> Result<Cow<'a, str>, String> {
    match parse_field(line, field) {
        Err(e) if e.contains("surrogate") || e.contains("hex escape") => match without_lone_surrogates(line) {
            Some(fixed) => parse_field(&fixed, field).map(|doc| Cow::Owned(doc.into_owned())),
            None => Err(e),
        },
        r => r,
    }
}

fn parse_field<'a>(line: &'a str, field: &str) -> Result<Cow<'a, str>, String> {
    let mut de = serde_json::Deserializer::from_str(line);
    let found = FieldSeed { field }.deserialize(&mut de).map_err(|e| format!("invalid JSON Lines record: {e}"))?;
    de.end().map_err(|e| format!("invalid JSON Lines record: {e}"))?;
    found.ok_or_else(|| format!("record has no {field:?} field (choose the field with --column)"))
}

/// `line` with each `\uXXXX` escape of a lone surrogate (a high one not followed by a
/// low one, or a low one alone) written as `\ufffd`; `None` when it has none.
fn without_lone_surrogates(line: &str) -> Option<String> {
    let b = line.as_bytes();
    let escape_at = |i: usize| -> Option<u32> {
        let hex = b.get(i..i + 6)?;
        if hex[0] != b'\\' || hex[1] != b'u' {
            return None;
        }
        u32::from_str_radix(std::str::from_utf8(&hex[2..]).ok()?, 16).ok()
    };
    let mut out = String::with_capacity(line.len());
    let (mut i, mut copied, mut fixed) = (0, 0, false);
    while let Some(p) = memchr::memchr(b'\\', &b[i..]) {
        let at = i + p;
        match escape_at(at) {
            Some(0xD800..=0xDBFF) if escape_at(at + 6).is_some_and(|lo| (0xDC00..=0xDFFF).contains(&lo)) => i = at + 12,
            Some(0xD800..=0xDFFF) => {
                out.push_str(&line[copied..at]);
                out.push_str("\\ufffd");
                (i, copied, fixed) = (at + 6, at + 6, true);
            }
            // Any other escape is two bytes or more; skipping two keeps `\\` apart.
            _ => i = at + 2,
        }
        if i >= b.len() {
            break;
        }
    }
    fixed.then(|| {
        out.push_str(&line[copied..]);
        out
    })
}

/// Calls `f` with the document of each non-blank line of `text` (whole lines of JSON
/// Lines, `\n` or `\r\n` ended); an error is `(line number, message)`, counting
/// `first_line` lines before `text`.
pub(crate) fn for_each_document(
    text: &str,
    first_line: u64,
    field_name: &str,
    mut f: impl FnMut(&str),
) -> Result<(), (u64, String)> {
    for (line_no, line) in (first_line + 1..).zip(text.split('\n')) {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.trim().is_empty() {
            continue;
        }
        f(&field(line, field_name).map_err(|message| (line_no, message))?);
    }
    Ok(())
}

struct FieldSeed<'f> {
    field: &'f str,
}

impl<'de, 'f> DeserializeSeed<'de> for FieldSeed<'f> {
    type Value = Option<Cow<'de, str>>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(ObjectVisitor { field: self.field })
    }
}

struct ObjectVisitor<'f> {
    field: &'f str,
}

impl<'de, 'f> Visitor<'de> for ObjectVisitor<'f> {
    type Value = Option<Cow<'de, str>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a JSON object with a string field {:?}", self.field)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(key) = map.next_key::<Str<'de>>()? {
            if key.0 == self.field && found.is_none() {
                found = Some(map.next_value_seed(StringOnly { field: self.field })?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// A string that borrows from the input when it has no escapes.
struct Str<'de>(Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for Str<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(StrVisitor { what: None }).map(Str)
    }
}

struct StringOnly<'f> {
    field: &'f str,
}

impl<'de, 'f> DeserializeSeed<'de> for StringOnly<'f> {
    type Value = Cow<'de, str>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(StrVisitor { what: Some(self.field) })
    }
}

struct StrVisitor<'f> {
    what: Option<&'f str>,
}

impl<'de, 'f> Visitor<'de> for StrVisitor<'f> {
    type Value = Cow<'de, str>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self.what {
            Some(field) => write!(f, "a string in field {field:?}"),
            None => write!(f, "a string"),
        }
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

#[cfg(test)]
mod tests {
    use super::field;

    #[test]
    fn extracts_the_field_and_skips_others() {
        let line = r#"{"id": 3, "meta": {"a": [1, 2, {"text": "no"}]}, "text": "hi\nthere \u00e9", "x": null}"#;
        assert_eq!(field(line, "text").unwrap(), "hi\nthere é");
        assert_eq!(field(r#"{"story":"plain"}"#, "story").unwrap(), "plain");
    }

    #[test]
    fn lone_surrogate_escapes_become_replacement_characters() {
        // What Python's json.dumps writes for "a\ud800b", "\udc00", a pair, and a
        // backslash followed by the letters of an escape.
        assert_eq!(field(r#"{"text": "a\ud800b"}"#, "text").unwrap(), "a\u{fffd}b");
        assert_eq!(field(r#"{"text": "\udc00\uD800"}"#, "text").unwrap(), "\u{fffd}\u{fffd}");
        assert_eq!(field(r#"{"text": "\ud800\ud800\udc00"}"#, "text").unwrap(), "\u{fffd}\u{10000}");
        assert_eq!(field(r#"{"text": "\\ud800 \ud83d\ude00", "x": "\ud800"}"#, "text").unwrap(), "\\ud800 \u{1f600}");
        assert!(field(r#"{"text": "\ud800"#, "text").unwrap_err().contains("invalid JSON Lines record"));
    }

    #[test]
    fn clear_errors() {
        assert!(field(r#"{"id": 3}"#, "text").unwrap_err().contains("no \"text\" field"));
        assert!(field(r#"{"text": 3}"#, "text").unwrap_err().contains("string"));
        assert!(field(r#"[1, 2]"#, "text").unwrap_err().contains("invalid JSON Lines record"));
        assert!(field(r#"{"text": "a"} trailing"#, "text").unwrap_err().contains("invalid"));
        assert!(field(r#"{"text": "a""#, "text").is_err());
    }
}
