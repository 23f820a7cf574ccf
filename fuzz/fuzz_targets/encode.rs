//! The encoder against a plain reference: special tokens split the text (leftmost,
//! then longest), fancy-regex cuts each span into pieces, a piece that is a token is
//! that token, and any other piece merges its lowest-ranked pair (leftmost first) until
//! none is left. Also: decode gives the text back, and a stream fed the text in two
//! chunks gives the ids of the whole.
//!
//! Vocabularies: one trained by ferrolm on a small built-in text (its merges rise: huge
//! pieces take the bucket queue), the same with a late merge moved first (they do not:
//! the heap), each with the three built-in patterns. The input's first byte picks one
//! and may ask for the rest to be repeated into pieces of several KB.

#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;

use ferrolm::encode::{Encoder, StreamEncoder};
use ferrolm::pretokenize::PreTokenizer;
use ferrolm::train::{Control, Trainer, Utf8Errors};
use libfuzzer_sys::fuzz_target;

const SPECIALS: [&str; 2] = ["<|endoftext|>", "<|endoftext|><|sep|>"];

/// Text to train on: words, numbers, punctuation, runs, whitespace, contractions, and
/// multi-byte characters, so that merges touch many kinds of bytes.
fn training_text() -> String {
    let mut s = String::new();
    for i in 0..200 {
        s.push_str("The quick brown fox jumps over the lazy dog; it's 1999, we're here!\n");
        s.push_str(&format!("{i} {} {}\t\t  indent\r\n", i * 37, i * i));
        s.push_str("aaaa aaaaaaaa 1111111 ---- ==== ....  \n\n");
        s.push_str("café naïve 日本語のテキスト 😀😀 Ünïcödé ñandú\u{a0}\u{3000}x<|endoftext|>");
    }
    s
}

struct Reference {
    encoder: Encoder,
    regex: PreTokenizer,
    /// Token bytes -> smallest id (special tokens apart).
    ids: HashMap<Vec<u8>, u32>,
    /// (left, right) -> rank (the first rank of a repeated merge).
    ranks: HashMap<(Vec<u8>, Vec<u8>), usize>,
    special_ids: Vec<(String, u32)>,
}

fn references() -> &'static [Reference] {
    static REFS: OnceLock<Vec<Reference>> = OnceLock::new();
    REFS.get_or_init(|| {
        let specials: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
        let ctl = Control::default();
        let mut t = Trainer::new(&specials, "gpt2", Some(1), Utf8Errors::Strict, 1 << 16).unwrap();
        t.feed_text(&training_text(), &ctl).unwrap();
        t.finish_text(&ctl).unwrap();
        let rising = t.learn(600, &ctl).unwrap().to_vecs();
        let mut falling = rising.clone();
        let late = falling.remove(falling.len() - 1);
        falling.insert(0, late);
        let mut out = Vec::new();
        for merges in [rising, falling] {
            for pattern in ["gpt2", "cl100k", "o200k"] {
                out.push(Reference::new(merges.clone(), &specials, pattern));
            }
        }
        out
    })
}

impl Reference {
    fn new(merges: Vec<(Vec<u8>, Vec<u8>)>, specials: &[String], pattern: &str) -> Reference {
        let mut vocab: Vec<(u64, Vec<u8>)> = (0..256u64).map(|b| (b, vec![b as u8])).collect();
        for (a, b) in &merges {
            vocab.push((vocab.len() as u64, [a.as_slice(), b.as_slice()].concat()));
        }
        let mut ids = HashMap::new();
        for (id, bytes) in &vocab {
            ids.entry(bytes.clone()).or_insert(*id as u32);
        }
        let mut ranks = HashMap::new();
        for (rank, m) in merges.iter().enumerate() {
            ranks.entry(m.clone()).or_insert(rank);
        }
        let encoder = Encoder::new(vocab, merges, specials.to_vec(), pattern).unwrap();
        let special_ids = encoder.special_tokens().to_vec();
        Reference { encoder, regex: PreTokenizer::new_regex(pattern).unwrap(), ids, ranks, special_ids }
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut pos = 0;
        while let Some((start, special, id)) = self.next_special(text, pos) {
            self.encode_span(&text[pos..start], &mut out);
            out.push(id);
            pos = start + special.len();
        }
        self.encode_span(&text[pos..], &mut out);
        out
    }

    /// The special token that starts first at or after `from` (the longest of those
    /// starting there).
    fn next_special<'a>(&'a self, text: &str, from: usize) -> Option<(usize, &'a str, u32)> {
        self.special_ids
            .iter()
            .filter_map(|(s, id)| text[from..].find(s.as_str()).map(|at| (from + at, s.as_str(), *id)))
            .min_by_key(|&(at, s, _)| (at, std::cmp::Reverse(s.len())))
    }

    fn encode_span(&self, span: &str, out: &mut Vec<u32>) {
        for piece in self.regex.pieces(span) {
            let piece = piece.as_bytes();
            if let Some(&id) = self.ids.get(piece) {
                out.push(id);
                continue;
            }
            let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
            loop {
                let best = (0..parts.len().saturating_sub(1))
                    .filter_map(|i| self.ranks.get(&(parts[i].clone(), parts[i + 1].clone())).map(|&r| (r, i)))
                    .min();
                let Some((_, i)) = best else { break };
                let right = parts.remove(i + 1);
                parts[i].extend(right);
            }
            out.extend(parts.iter().map(|p| self.ids[p]));
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let refs = references();
    let r = &refs[pick as usize % refs.len()];
    let mut text = String::from_utf8_lossy(rest).into_owned();
    // One input in eight becomes pieces of several KB (the heap and the bucket queue).
    if pick >= 0xE0 && !text.is_empty() {
        let unit = text.clone();
        while text.len() < 5000 {
            text.push_str(&unit);
        }
    }
    let ids = r.encoder.encode(&text, true);
    assert_eq!(ids, r.encode(&text), "{text:?}");
    assert_eq!(r.encoder.decode_bytes(&ids).unwrap(), text.as_bytes());
    let mut cut = (pick as usize * 7919) % (text.len() + 1);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let (mut stream, mut streamed) = (StreamEncoder::new(true), Vec::new());
    stream.push(&r.encoder, &text[..cut], &mut streamed);
    stream.push(&r.encoder, &text[cut..], &mut streamed);
    stream.finish(&r.encoder, &mut streamed);
    assert_eq!(streamed, ids, "{text:?} cut at {cut}");
});
