//! The pre-tokenizer's scanners (every SIMD level this CPU has) against fancy-regex
//! running the same pattern, for the three built-in patterns: the same pieces, tiling
//! the text.

#![no_main]

use std::sync::OnceLock;

use ferrolm::pretokenize::{PreTokenizer, Simd};
use libfuzzer_sys::fuzz_target;

struct Pair {
    scanners: Vec<PreTokenizer>,
    regex: PreTokenizer,
}

fn pairs() -> &'static [Pair] {
    static PAIRS: OnceLock<Vec<Pair>> = OnceLock::new();
    PAIRS.get_or_init(|| {
        ["gpt2", "cl100k", "o200k"]
            .iter()
            .map(|name| Pair {
                scanners: [Simd::Baseline, Simd::Avx2, Simd::Avx512, Simd::Avx512Vbmi2]
                    .into_iter()
                    .map(|s| PreTokenizer::new(name).unwrap().with_simd(s))
                    .collect(),
                regex: PreTokenizer::new_regex(name).unwrap(),
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for pair in pairs() {
        let want = pair.regex.piece_ranges(&text);
        let mut at = 0;
        for &(s, e) in &want {
            assert!(s == at && e > s, "{}: the regex's pieces do not tile {text:?}", pair.regex.pattern());
            at = e;
        }
        assert_eq!(at, text.len());
        for scanner in &pair.scanners {
            assert_eq!(scanner.piece_ranges(&text), want, "{:?} on {text:?}", scanner.simd());
        }
    }
});
