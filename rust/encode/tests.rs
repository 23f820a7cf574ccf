//! Unit tests of the encoder on small hand-made vocabularies.

use super::*;

/// Bytes at their own ids, then the given merges (a trained tokenizer's layout).
fn trained(merges: &[(&str, &str)], specials: &[&str], pattern: &str) -> Encoder {
    let mut vocab: Vec<(u64, Vec<u8>)> = (0..256u64).map(|b| (b, vec![b as u8])).collect();
    let mut m = Vec::new();
    for (i, (a, b)) in merges.iter().enumerate() {
        vocab.push((256 + i as u64, format!("{a}{b}").into_bytes()));
        m.push((a.as_bytes().to_vec(), b.as_bytes().to_vec()));
    }
    Encoder::new(vocab, m, specials.iter().map(|s| s.to_string()).collect(), pattern).unwrap()
}

fn toy() -> Encoder {
    trained(
        &[("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), (" ", "w"), ("a", "a"), ("aa", "aa"), ("aa", "a"), ("!", "!")],
        &["<|endoftext|>", "<|endoftext|><|endoftext|>"],
        "gpt2",
    )
}

/// Reference BPE: repeatedly merge the lowest-rank pair, leftmost first.
fn naive(merges: &[(&str, &str)], piece: &str) -> Vec<Vec<u8>> {
    let mut parts: Vec<Vec<u8>> = piece.bytes().map(|b| vec![b]).collect();
    loop {
        let mut best: Option<(usize, usize)> = None;
        for i in 0..parts.len().saturating_sub(1) {
            if let Some(r) = merges.iter().position(|(a, b)| a.as_bytes() == &parts[i][..] && b.as_bytes() == &parts[i + 1][..]) {
                if best.map_or(true, |(br, _)| r < br) {
                    best = Some((r, i));
                }
            }
        }
        match best {
            None => return parts,
            Some((_, i)) => {
                let right = parts.remove(i + 1);
                parts[i].extend(right);
            }
        }
    }
}

#[test]
fn whole_token_and_merges() {
    let e = toy();
    assert_eq!(e.encode("hello", false), vec![259]);
    assert_eq!(e.encode("hello world", false).len(), 1 + 1 + 4);
    assert_eq!(e.decode(&e.encode("hello world!!!", true)).unwrap(), "hello world!!!");
}

#[test]
fn specials_longest_first_and_ordinary() {
    let e = toy();
    let eot = e.special_tokens()[0].1;
    let eot2 = e.special_tokens()[1].1;
    assert_eq!(eot, 265);
    assert_eq!(eot2, 266);
    assert_eq!(e.encode("<|endoftext|><|endoftext|>", true), vec![eot2]);
    assert_eq!(e.encode("<|endoftext|><|endoftext|><|endoftext|>", true), vec![eot2, eot]);
    assert_eq!(e.encode("a<|endoftext|>b", true), vec![b'a' as u32, eot, b'b' as u32]);
    let ordinary = e.encode("<|endoftext|>", false);
    assert!(ordinary.len() > 1);
    assert_eq!(e.decode(&ordinary).unwrap(), "<|endoftext|>");
}

#[test]
fn small_and_large_bpe_agree_with_naive() {
    let merges = [("a", "a"), ("b", "a"), ("aa", "a"), ("ab", "a"), ("a", "b"), ("ba", "aa"), ("aaa", "aa"), ("b", "b")];
    let e = trained(&merges, &[], "gpt2");
    let mut state = 12345u64;
    for _ in 0..2000 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let n = 2 + (state >> 60) as usize * 3;
        let s: String = (0..n)
            .map(|i| if (state >> (i % 60)) & 1 == 1 { 'a' } else { 'b' })
            .collect();
        let want: Vec<u32> = naive(&merges, &s)
            .iter()
            .map(|p| e.whole.get(p).expect("naive produced a token"))
            .collect();
        assert_eq!(bpe::bpe_small_for_test(&e, s.as_bytes()), want, "small {s}");
        assert_eq!(bpe::bpe_large_for_test(&e, s.as_bytes()), want, "large {s}");
    }
}

#[test]
fn long_runs_are_fast_enough_and_exact() {
    let e = toy();
    let s = "a".repeat(100_001);
    let ids = e.encode(&s, false);
    assert_eq!(e.decode(&ids).unwrap(), s);
    // "aaaa" merges first everywhere, then the leftover.
    assert_eq!(ids.iter().filter(|&&i| i == 262).count(), 25_000);
    let bang = "!".repeat(100_001);
    assert_eq!(e.decode(&e.encode(&bang, false)).unwrap(), bang);
}

#[test]
fn streaming_equals_whole() {
    let e = toy();
    let text = "hello world<|endoftext|>\n\n  hello  \n aaaa<|endoftext|><|endoftext|>!! x\n".repeat(50);
    let want = e.encode(&text, true);
    for step in [1usize, 2, 3, 7, 13, 100] {
        let chars: Vec<char> = text.chars().collect();
        let mut ids = Vec::new();
        let mut s = StreamEncoder::new(true);
        let mut buf = String::new();
        for c in chars.chunks(step) {
            buf.extend(c.iter());
            let done = e.encode_stable_prefix(&buf, true, &mut ids);
            buf.drain(..done);
        }
        e.encode_into(&buf, true, &mut ids);
        assert_eq!(ids, want, "step {step}");
        let mut ids2 = Vec::new();
        for c in chars.chunks(step) {
            let chunk: String = c.iter().collect();
            s.push(&e, &chunk, &mut ids2);
        }
        s.finish(&e, &mut ids2);
        assert_eq!(ids2, want, "push step {step}");
    }
}

#[test]
fn parallel_equals_serial() {
    let e = toy();
    let text = "hello world, hello! aaaa<|endoftext|> x y\n\n z ".repeat(30_000);
    let want = e.encode(&text, true);
    assert_eq!(e.encode_parallel(&text, true, Some(3)), want);
    let want_o = e.encode(&text, false);
    assert_eq!(e.encode_parallel(&text, false, Some(2)), want_o);
    let cuts = e.safe_cuts(&text, true, 1000);
    assert!(cuts.len() > 100);
    let docs: Vec<&str> = text.split("<|endoftext|>").take(100).collect();
    let batch = e.encode_batch(&docs, true, Some(2));
    for (d, ids) in docs.iter().zip(&batch) {
        assert_eq!(&e.encode(d, true), ids);
    }
}

#[test]
fn bad_inputs_are_errors() {
    let bytes: Vec<(u64, Vec<u8>)> = (0..256u64).map(|b| (b, vec![b as u8])).collect();
    let m = |a: &str, b: &str| (a.as_bytes().to_vec(), b.as_bytes().to_vec());
    // merge result missing
    let r = Encoder::new(bytes.clone(), vec![m("a", "b")], vec![], "gpt2");
    assert!(matches!(r, Err(EncodeError::Merges(_))), "{r:?}");
    // merge side missing
    let mut v = bytes.clone();
    v.push((256, b"xyz".to_vec()));
    let r = Encoder::new(v, vec![m("xy", "z")], vec![], "gpt2");
    assert!(matches!(r, Err(EncodeError::Merges(_))), "{r:?}");
    // missing byte
    let r = Encoder::new(bytes[1..].to_vec(), vec![], vec![], "gpt2");
    assert!(matches!(r, Err(EncodeError::Vocab(_))));
    // duplicate special
    let r = Encoder::new(bytes.clone(), vec![], vec!["<s>".into(), "<s>".into()], "gpt2");
    assert!(matches!(r, Err(EncodeError::Specials(_))));
    // id too large
    let mut v = bytes.clone();
    v.push((1 << 32, b"ab".to_vec()));
    assert!(matches!(Encoder::new(v, vec![], vec![], "gpt2"), Err(EncodeError::Vocab(_))));
    // bad pattern
    assert!(matches!(Encoder::new(bytes.clone(), vec![], vec![], "(unclosed"), Err(EncodeError::Pattern(_))));
    // decode out of range
    let e = Encoder::new(bytes, vec![], vec![], "gpt2").unwrap();
    assert!(matches!(e.decode_bytes(&[300]), Err(EncodeError::IdOutOfRange { id: 300, .. })));
}

#[test]
fn duplicate_token_bytes_from_training() {
    // merges (b,c) -> "bc", (a,bc) -> "abc", (a,b) -> "ab", (ab,c) -> "abc" again: the
    // smallest id with those bytes is the one produced.
    let e = trained(&[("b", "c"), ("a", "bc"), ("a", "b"), ("ab", "c")], &[], "gpt2");
    assert_eq!(e.encode("abc", false), vec![257]);
    assert_eq!(e.encode("xabcab", false), vec![b'x' as u32, 257, 258]);
    assert_eq!(e.token_bytes(259), Some(&b"abc"[..]));
}
