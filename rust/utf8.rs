//! The UTF-8 check of input text: SIMD (simdutf8, which picks AVX2 or SSE4.2 at run
//! time) for valid text, which is nearly all of it; the standard library's check for
//! the details (the offset of the first bad byte) of text that is not valid.

/// What to do with input bytes that are not UTF-8 (the trainer's and the shard writer's
/// `errors` option).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Utf8Errors {
    /// Stop with an error naming the file and the byte offset.
    Strict,
    /// Replace each invalid sequence by U+FFFD (as Python's `errors="replace"`).
    Replace,
}

impl std::str::FromStr for Utf8Errors {
    type Err = String;

    /// "strict" or "replace"; anything else is an error that says so.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "strict" => Ok(Utf8Errors::Strict),
            "replace" => Ok(Utf8Errors::Replace),
            other => Err(format!("errors must be \"strict\" or \"replace\", got {other:?}")),
        }
    }
}

/// `bytes` as a `&str`, or the standard library's error.
#[inline]
pub(crate) fn to_str(bytes: &[u8]) -> Result<&str, std::str::Utf8Error> {
    match simdutf8::basic::from_utf8(bytes) {
        Ok(s) => Ok(s),
        Err(_) => std::str::from_utf8(bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::{to_str, Utf8Errors};

    #[test]
    fn error_modes_parse() {
        assert_eq!("strict".parse(), Ok(Utf8Errors::Strict));
        assert_eq!("replace".parse(), Ok(Utf8Errors::Replace));
        let err = "ignore".parse::<Utf8Errors>().unwrap_err();
        assert_eq!(err, r#"errors must be "strict" or "replace", got "ignore""#);
    }

    #[test]
    fn agrees_with_the_standard_library() {
        let mut cases: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            "plain ASCII text, long enough for a vector or two: 0123456789abcdef".into(),
            "\u{e9}\u{4e2d}\u{1f600} mixed".into(),
            vec![0xff],
            vec![b'a'; 100].into_iter().chain([0xe4, 0xb8]).collect(),
            vec![b'a'; 70].into_iter().chain([0xc0, 0x80]).chain(vec![b'b'; 40]).collect(),
            vec![0xed, 0xa0, 0x80],
        ];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..2000 {
            let len = (x % 200) as usize;
            let v: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    // Mostly ASCII, some lead and continuation bytes.
                    [b'a', b' ', 0xc3, 0xa9, 0xe4, 0xb8, 0xad, 0xf0, 0x9f, 0x80][(x % 10) as usize]
                })
                .collect();
            cases.push(v);
        }
        for c in &cases {
            let ours = to_str(c).map_err(|e| (e.valid_up_to(), e.error_len()));
            let std = std::str::from_utf8(c).map_err(|e| (e.valid_up_to(), e.error_len()));
            assert_eq!(ours, std, "{c:?}");
        }
    }
}
