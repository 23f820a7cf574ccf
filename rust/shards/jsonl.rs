//! One JSON Lines record → the text of its document field, without building the
//! whole object (other fields are skipped unparsed into values).

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

/// The string value of `field` in the JSON object `line`, or a message saying what is wrong.
pub(crate) fn field<'a>(line: &'a str, field: &str) -> Result<Cow<'a, str>, String> {
    let mut de = serde_json::Deserializer::from_str(line);
    let found = FieldSeed { field }.deserialize(&mut de).map_err(|e| format!("invalid JSON Lines record: {e}"))?;
    de.end().map_err(|e| format!("invalid JSON Lines record: {e}"))?;
    found.ok_or_else(|| format!("record has no {field:?} field (choose the field with --jsonl-field)"))
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
    fn clear_errors() {
        assert!(field(r#"{"id": 3}"#, "text").unwrap_err().contains("no \"text\" field"));
        assert!(field(r#"{"text": 3}"#, "text").unwrap_err().contains("string"));
        assert!(field(r#"[1, 2]"#, "text").unwrap_err().contains("invalid JSON Lines record"));
        assert!(field(r#"{"text": "a"} trailing"#, "text").unwrap_err().contains("invalid"));
        assert!(field(r#"{"text": "a""#, "text").is_err());
    }
}
