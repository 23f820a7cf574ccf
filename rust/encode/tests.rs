//! Unit tests of the encoder on small hand-made vocabularies.

use super::*;
use crate::pretokenize::{MAX_BATCH, PIECE_BATCH};
use std::sync::Arc;

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
        &[
            ("h", "e"),
            ("l", "l"),
            ("he", "ll"),
            ("hell", "o"),
            (" ", "w"),
            ("a", "a"),
            ("aa", "aa"),
            ("aa", "a"),
            ("!", "!"),
        ],
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
            if let Some(r) =
                merges.iter().position(|(a, b)| a.as_bytes() == &parts[i][..] && b.as_bytes() == &parts[i + 1][..])
            {
                if best.is_none_or(|(br, _)| r < br) {
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
fn tokens_not_made_by_merges_are_those_bpe_never_outputs() {
    // "abc" is a token, but merging its bytes joins (b, c) first and ends at [a, bc];
    // "zq" is a token no merge makes. The specials: one is a token, one is appended.
    let mut vocab: Vec<(u64, Vec<u8>)> = (0..256u64).map(|b| (b, vec![b as u8])).collect();
    for (id, t) in [(256u64, "bc"), (257, "ab"), (258, "abc"), (259, "zq"), (260, "<s>")] {
        vocab.push((id, t.as_bytes().to_vec()));
    }
    let merges = [("b", "c"), ("a", "b"), ("ab", "c")];
    let merges = merges.iter().map(|(a, b)| (a.as_bytes().to_vec(), b.as_bytes().to_vec())).collect();
    let enc = Encoder::new(vocab, merges, vec!["<s>".into(), "</s>".into()], "gpt2").unwrap();
    assert_eq!(enc.tokens_not_made_by_merges(), vec![258, 259, 260, 261]);
    assert!(toy().tokens_not_made_by_merges().iter().all(|&id| toy().token_bytes(id).unwrap().starts_with(b"<|")));
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
    let merges =
        [("a", "a"), ("b", "a"), ("aa", "a"), ("ab", "a"), ("a", "b"), ("ba", "aa"), ("aaa", "aa"), ("b", "b")];
    let e = trained(&merges, &[], "gpt2");
    let mut state = 12345u64;
    for _ in 0..2000 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let n = 2 + (state >> 60) as usize * 3;
        let s: String = (0..n).map(|i| if (state >> (i % 60)) & 1 == 1 { 'a' } else { 'b' }).collect();
        let want: Vec<u32> =
            naive(&merges, &s).iter().map(|p| e.whole_token(p).expect("naive produced a token")).collect();
        let mut out = Vec::new();
        e.bpe(s.as_bytes(), &mut out); // up to 16 bytes: the short arrays
        assert_eq!(out, want, "bpe {s}");
        assert_eq!(bpe::bpe_small_for_test(&e, s.as_bytes()), want, "small {s}");
        assert_eq!(bpe::bpe_large_for_test(&e, s.as_bytes()), want, "large {s}");
    }
}

/// Merges that each join two tokens made before them, over the letters "abc" (a
/// trained vocab's shape), some joining tokens whose bytes another merge made already.
fn rising_merges(count: usize, seed: u64) -> Vec<(String, String)> {
    let mut x = seed;
    let mut next = |m: usize| {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as usize % m
    };
    let mut tokens: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
    let mut merges = Vec::new();
    while merges.len() < count {
        let (l, r) = (tokens[next(tokens.len())].clone(), tokens[next(tokens.len())].clone());
        if l.len() + r.len() <= 8 && !merges.contains(&(l.clone(), r.clone())) {
            tokens.push(format!("{l}{r}"));
            merges.push((l, r));
        }
    }
    merges
}

/// Text of random runs of the letters "abc" (runs of one token are where the merge
/// order within a rank matters).
fn runs_text(len: usize, seed: u64) -> String {
    let mut x = seed | 1;
    let mut s = String::new();
    while s.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let c = ["a", "b", "c", "ab", "abc"][(x % 5) as usize];
        s.push_str(&c.repeat(1 + (x >> 8) as usize % 12));
    }
    s.truncate(len);
    s
}

#[test]
fn huge_piece_buckets_agree_with_the_heap_and_naive() {
    let mut checked = 0;
    for seed in 0..40u64 {
        let merges = rising_merges(30, seed);
        let refs: Vec<(&str, &str)> = merges.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        let e = trained(&refs, &[], "gpt2");
        let unique = merges.iter().map(|(a, b)| format!("{a}{b}")).collect::<FxHashSet<_>>().len() == merges.len();
        assert!(e.merges_rise || !unique, "seed {seed}: merges that join earlier tokens rise");
        if !e.merges_rise {
            continue;
        }
        checked += 1;
        for (k, len) in [2usize, 3, 17, 60, 500, 5000].into_iter().enumerate() {
            let s = runs_text(len, seed * 31 + k as u64);
            let heap = bpe::bpe_large_for_test(&e, s.as_bytes());
            assert_eq!(bpe::bpe_huge_for_test(&e, s.as_bytes()), heap, "seed {seed}: {s}");
            if len <= 60 {
                let want: Vec<u32> = naive(&refs, &s).iter().map(|p| e.whole_token(p).unwrap()).collect();
                assert_eq!(heap, want, "seed {seed}: {s}");
            }
        }
    }
    assert!(checked >= 20, "only {checked} merge lists rose");
}

#[test]
fn merges_rise_only_when_each_merge_joins_earlier_tokens() {
    assert!(toy().merges_rise);
    // "ab" + "c" ranks before the merge that makes "ab": a huge piece takes the heap.
    let e = trained(&[("ab", "c"), ("a", "b")], &[], "gpt2");
    assert!(!e.merges_rise);
    let s = "abc".repeat(3000);
    let mut out = Vec::new();
    e.bpe(s.as_bytes(), &mut out);
    assert_eq!(out, bpe::bpe_large_for_test(&e, s.as_bytes()));
    assert_eq!(e.decode(&out).unwrap(), s);
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
fn parallel_cuts_never_split_a_special_token() {
    // Special tokens with spaces inside, after printable ASCII (where the pre-tokenizer
    // alone would cut), and overlapping each other: every cut must fall outside them,
    // and the parts must encode as the whole does.
    let e = trained(&[("h", "e"), ("l", "l"), (" ", "w")], &["<|end of text|>", "a b", "a b c d"], "gpt2");
    let unit = "hello<|end of text|>x a b c d e a b wo a b c hel<|end of text|>lo ";
    let text = unit.repeat(40_000);
    let want = e.encode(&text, true);
    assert_eq!(e.encode_parallel(&text, true, Some(3)), want);
    assert_eq!(e.encode_parallel(&text, false, Some(2)), e.encode(&text, false));
    let cuts = e.safe_cuts(&text, true, 997);
    assert!(cuts.len() > 1000);
    let matches: Vec<(usize, usize)> = e.specials.find_iter(text.as_bytes()).map(|(s, e, _)| (s, e)).collect();
    for &c in &cuts {
        let i = matches.partition_point(|&(_, e)| e <= c);
        assert!(matches.get(i).is_none_or(|&(s, _)| s >= c), "cut {c} inside a special token");
    }
    // Text with no space to cut before: cuts come from the special tokens alone.
    let dense = "漢字かな<|end of text|>".repeat(100_000);
    let cuts = e.safe_cuts(&dense, true, 4096);
    assert!(cuts.len() > 100);
    assert_eq!(e.encode_parallel(&dense, true, Some(2)), e.encode(&dense, true));
}

#[test]
fn files_read_or_mapped_in_parallel_are_read_exactly() {
    let dir = std::env::temp_dir().join(format!("ferrolm-read-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Over the parallel threshold, with 2- 3- and 4-byte characters across every task
    // boundary, then the same with invalid bytes (read as U+FFFD, as from_utf8_lossy).
    let mut valid = Vec::new();
    let mut k = 0u32;
    while valid.len() < 9 << 20 {
        valid.extend_from_slice(["é", "漢", "😀", "a"][(k % 4) as usize].as_bytes());
        k = k.wrapping_mul(1_103_515_245).wrapping_add(12_345) >> 3;
    }
    let mut invalid = valid.clone();
    invalid[5 << 20] = 0xFF;
    invalid.push(0xE6); // a character cut short at the end
                        // A continuation byte first: the first task must check from byte 0, not from the
                        // first character start.
    let mut leading = vec![0x80];
    leading.extend_from_slice(&valid);
    // Bad bytes at task boundaries (every 2 MiB): a character cut short just before one,
    // a stray continuation byte just after one, each between ASCII.
    let mut at_bounds = vec![b'a'; 9 << 20];
    at_bounds[(4 << 20) - 1] = 0xE6;
    at_bounds[6 << 20] = 0x80;
    let cases =
        [("valid", &valid), ("invalid", &invalid), ("leading continuation", &leading), ("at task bounds", &at_bounds)];
    for (name, bytes) in cases {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let want = String::from_utf8_lossy(bytes).into_owned();
        for threads in [Some(1), Some(2), Some(3)] {
            assert!(crate::encode::read_text_file(&path, threads).unwrap() == want, "{name}, {threads:?} threads");
            let mapped = crate::encode::map_text_file(&path, threads).unwrap();
            assert!(*mapped == *want, "{name}, {threads:?} threads, mapped");
            // Only valid text stays mapped.
            let valid = std::str::from_utf8(bytes).is_ok();
            assert_eq!(matches!(mapped, crate::encode::FileText::Mapped(_)), valid, "{name}");
        }
    }
    // Small files are read, not mapped.
    let small = dir.join("small");
    std::fs::write(&small, "héllo <|endoftext|>").unwrap();
    let text = crate::encode::map_text_file(&small, Some(2)).unwrap();
    assert!(matches!(text, crate::encode::FileText::Owned(_)) && &*text == "héllo <|endoftext|>");
    assert!(crate::encode::read_text_file(&dir.join("missing"), Some(2)).is_err());
    assert!(crate::encode::map_text_file(&dir.join("missing"), Some(2)).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn grouped_batch_equals_one_call_per_text() {
    let e = toy();
    // Texts of very different sizes (groups are cut by bytes), empty ones included, and
    // some larger than a group (GROUP_BYTES); 13 MB in all, so that the debug build of
    // this test takes seconds (it took a minute with 160 MB).
    let docs: Vec<String> = (0..3000)
        .map(|i| match i % 7 {
            0 => String::new(),
            3 if i % 70 == 3 => "hello world, aaaa! ".repeat(15_000),
            3 => "hello world, aaaa! ".repeat(i % 64),
            _ => format!("doc {i}: hello<|endoftext|>x y  z"),
        })
        .collect();
    assert!(docs.iter().any(|d| d.len() > parallel::GROUP_BYTES));
    let want: Vec<Vec<u32>> = docs.iter().map(|d| e.encode(d, true)).collect();
    for threads in [Some(1), Some(2), Some(3), None] {
        let groups = e.encode_batch_grouped(&docs, true, threads);
        assert!(threads != Some(1) || groups.len() == 1);
        let mut got = Vec::new();
        for g in &groups {
            assert_eq!(g.ends.last().copied().unwrap_or(0), g.ids.len());
            got.extend(g.texts().map(<[u32]>::to_vec));
        }
        assert_eq!(got, want, "threads {threads:?}");
    }
    assert!(e.encode_batch_grouped::<u32, _>(&docs, true, Some(3)).len() > 3);
    assert_eq!(e.encode_batch_grouped::<u32, &str>(&[], true, Some(2)), vec![BatchIds::default()]);
    // Stored as u16 (through the drained buffer): the same ids, the same grouping.
    for threads in [Some(1), Some(3)] {
        let wide = e.encode_batch_grouped::<u32, _>(&docs, true, threads);
        let narrow = e.encode_batch_grouped::<u16, _>(&docs, true, threads);
        assert_eq!(narrow.len(), wide.len());
        for (n, w) in narrow.iter().zip(&wide) {
            assert_eq!(n.ends, w.ends);
            assert!(n.ids.iter().zip(&w.ids).all(|(&a, &b)| a as u32 == b) && n.ids.len() == w.ids.len());
        }
    }
}

#[test]
fn drained_encoding_equals_encode_into() {
    let e = toy();
    // Long enough for many drains (DRAIN_IDS ids each), with special tokens between.
    let text = "some words, 12345 and more<|endoftext|>".repeat(2000);
    let want = e.encode(&text, true);
    assert!(want.len() > 4 * DRAIN_IDS);
    let mut buf = vec![7u32; 3];
    let mut got = Vec::new();
    let mut sizes = Vec::new();
    e.encode_drained(&text, true, &mut buf, |ids| {
        sizes.push(ids.len());
        got.extend_from_slice(ids)
    });
    assert_eq!(got, want);
    assert!(buf.is_empty());
    // Drains come at batch ends once the buffer holds DRAIN_IDS ids.
    assert!(sizes[..sizes.len() - 1].iter().all(|&n| (DRAIN_IDS..DRAIN_IDS + 3 * MAX_BATCH + 64).contains(&n)));
    // The whole text as u16 parts, on several threads.
    let big = "hello world, aaaa! ".repeat(200_000);
    let parts = e.encode_parallel_parts::<u16>(&big, true, Some(2));
    assert!(parts.len() > 1);
    let flat: Vec<u32> = parts.concat().into_iter().map(u32::from).collect();
    assert_eq!(flat, e.encode(&big, true));
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

/// Timing of the piece loop alone (lookups, cache, merges) on real text with GPT-2's
/// vocab: `FERROLM_SHARED=../shared cargo test --release --lib piece_loop_speed -- --ignored --nocapture`.
#[test]
#[ignore]
fn piece_loop_speed() {
    // CPU time of this process (the machine is shared; wall time is noise).
    struct Instant(f64);
    impl Instant {
        fn now() -> Self {
            let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: a valid timespec to fill.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
            Instant(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
        }
        fn elapsed(&self) -> std::time::Duration {
            std::time::Duration::from_secs_f64(Instant::now().0 - self.0)
        }
    }
    let shared = std::env::var("FERROLM_SHARED").unwrap_or_else(|_| "../shared".into());
    let vocab_json = std::fs::read_to_string(format!("{shared}/fixtures/gpt2_vocab.json")).unwrap();
    let merges_txt = std::fs::read_to_string(format!("{shared}/fixtures/gpt2_merges.txt")).unwrap();
    // GPT-2's byte-to-unicode map, inverted.
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut map = std::collections::HashMap::new();
    let mut extra = 0;
    for b in 0..256u32 {
        if printable.contains(&b) {
            map.insert(char::from_u32(b).unwrap(), b as u8);
        } else {
            map.insert(char::from_u32(256 + extra).unwrap(), b as u8);
            extra += 1;
        }
    }
    printable.clear();
    let decode = |s: &str| -> Vec<u8> { s.chars().map(|c| map[&c]).collect() };
    // Minimal JSON object reader for {"token": id, ...}.
    let mut vocab = Vec::new();
    let body = vocab_json.trim().trim_start_matches('{').trim_end_matches('}');
    let mut chars = body.chars().peekable();
    loop {
        while matches!(chars.peek(), Some(' ') | Some(',') | Some('\n')) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        assert_eq!(chars.next(), Some('"'));
        let mut key = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    let e = chars.next().unwrap();
                    match e {
                        'u' => {
                            let h: String = (0..4).map(|_| chars.next().unwrap()).collect();
                            key.push(char::from_u32(u32::from_str_radix(&h, 16).unwrap()).unwrap());
                        }
                        other => key.push(other),
                    }
                }
                '"' => break,
                c => key.push(c),
            }
        }
        assert_eq!(chars.next(), Some(':'));
        while chars.peek() == Some(&' ') {
            chars.next();
        }
        let mut num = String::new();
        while matches!(chars.peek(), Some(c) if c.is_ascii_digit()) {
            num.push(chars.next().unwrap());
        }
        let id: u64 = num.parse().unwrap();
        let bytes = if key == "<|endoftext|>" { key.into_bytes() } else { decode(&key) };
        vocab.push((id, bytes));
    }
    let merges: Vec<(Vec<u8>, Vec<u8>)> = merges_txt
        .lines()
        .skip(1)
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (a, b) = l.split_once(' ').unwrap();
            (decode(a), decode(b))
        })
        .collect();
    let t = Instant::now();
    let e = Encoder::new(vocab, merges, vec!["<|endoftext|>".into()], "gpt2").unwrap();
    println!("build {:?}", t.elapsed());
    let text =
        std::fs::read_to_string(format!("{shared}/corpora/webtext/enwiki_2021_wikiextractor_part01.txt")).unwrap();
    let docs: Vec<&str> = text.split("\n<|endoftext|>\n").collect();
    for round in 0..6 {
        let t = Instant::now();
        let mut n = 0;
        for d in &docs {
            n += e.encode(d, true).len();
        }
        let dt = t.elapsed().as_secs_f64();
        println!("encode per document, round {round}: {:.1} MB/s ({n} ids)", text.len() as f64 / 1e6 / dt);
    }
    for round in 0..3 {
        let t = Instant::now();
        let mut n = 0;
        e.pretok.for_each_piece(&text, |p| n += p.len());
        let dt = t.elapsed().as_secs_f64();
        println!("pretokenize only, round {round}: {:.1} MB/s ({n})", text.len() as f64 / 1e6 / dt);
    }
    let t = Instant::now();
    let pieces = e.pretok.pieces(&text);
    let dt = t.elapsed().as_secs_f64();
    println!("pretokenize {:.1} MB/s, {} pieces", text.len() as f64 / 1e6 / dt, pieces.len());
    for _ in 0..3 {
        let t = Instant::now();
        let mut acc = 0u64;
        for p in &pieces {
            acc = acc.wrapping_add(p.len() as u64 ^ p.as_bytes()[0] as u64);
        }
        let dt = t.elapsed().as_secs_f64();
        println!("calibration (touch pieces only): {:.1} ns/piece {acc}", dt * 1e9 / pieces.len() as f64);
    }
    // The pieces tile the text: their starts and the text's end.
    let bounds: Vec<usize> =
        pieces.iter().map(|p| p.as_ptr() as usize - text.as_ptr() as usize).chain([text.len()]).collect();
    if let Ok(sm) = std::fs::read_to_string("/proc/self/smaps_rollup") {
        for l in sm.lines().filter(|l| l.starts_with("AnonHugePages") || l.starts_with("Rss")) {
            println!("{l}");
        }
    }
    let whole = pieces.iter().filter(|p| e.whole_token(p.as_bytes()).is_some()).count();
    println!("{:.1}% of pieces are whole tokens", 100.0 * whole as f64 / pieces.len() as f64);
    let mut out = Vec::with_capacity(text.len() / 3);
    for round in 0..6 {
        out.clear();
        let t = Instant::now();
        {
            let mut held = e.live.load();
            for lo in (0..pieces.len()).step_by(PIECE_BATCH) {
                let hi = (lo + PIECE_BATCH).min(pieces.len());
                e.encode_bounds(text.as_bytes(), &bounds[lo..=hi], e.current(&mut held), &mut out);
            }
        }
        let a = t.elapsed().as_secs_f64();
        let n = out.len();
        out.clear();
        let t = Instant::now();
        {
            let mut held = e.live.load();
            let mut b: [&[u8]; PIECE_BATCH] = [&[]; PIECE_BATCH];
            for chunk in pieces.chunks(PIECE_BATCH) {
                for (d, p) in b.iter_mut().zip(chunk) {
                    *d = p.as_bytes();
                }
                e.encode_pieces(&b[..chunk.len()], e.current(&mut held), &mut out);
            }
        }
        let b = t.elapsed().as_secs_f64();
        assert_eq!(n, out.len());
        let per = |x: f64| x * 1e9 / pieces.len() as f64;
        println!(
            "round {round}: piece loop {:.1} ns/piece = {:.0} MB/s (ranges, masked loads); {:.1} ns/piece (slices)",
            per(a),
            text.len() as f64 / 1e6 / a,
            per(b)
        );
    }
}

#[test]
fn piece_table_all_lengths() {
    // Keys inline, at the 16-byte edge and long, with ids inline and in the overflow.
    let base = cache::PieceTable::with_capacity(1024);
    let t = cache::SharedTable::from_base(&base, cache::TableLimits::for_base(&base));
    let get = |k: &[u8]| {
        let mut ids = Vec::new();
        t.emit(&cache::Probe::of(k), k, &mut ids).then_some(ids)
    };
    let keys: Vec<Vec<u8>> = (1..40usize)
        .flat_map(|n| (0..20u8).map(move |k| (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(k)).collect()))
        .collect();
    let ids_for = |i: usize| -> Vec<u32> { (0..(i % 6) + 1).map(|j| (i * 7 + j) as u32).collect() };
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(t.insert(k, &ids_for(i)), None);
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(get(k), Some(ids_for(i)));
        let mut other = k.clone();
        other.push(0);
        assert_ne!(get(&other), Some(ids_for(i)));
        let mut z = k.clone();
        *z.last_mut().unwrap() ^= 0x80;
        assert_ne!(get(&z), Some(ids_for(i)));
    }
    assert_eq!(get(b""), None);
    assert_eq!(get(&[0u8, 0, 0]), None);
}

/// Distinct random pieces of letters a-f (each one pre-token after a space), short and
/// long ones: more than a small table holds.
fn random_words(n: u32, seed: u64) -> Vec<String> {
    let mut x: u64 = seed | 1;
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = if i % 50 == 0 { 20 + (x % 90) as usize } else { 2 + (x % 14) as usize };
            (0..len).map(|k| (b'a' + ((x >> (k % 60)) % 6) as u8) as char).collect()
        })
        .collect()
}

/// The ids of `" " + w` by the naive BPE of `merges`.
fn naive_ids(e: &Encoder, merges: &[(&str, &str)], w: &str) -> Vec<u32> {
    naive(merges, &format!(" {w}"))
        .iter()
        .map(|t| if t.len() == 1 { t[0] as u32 } else { e.encode(std::str::from_utf8(t).unwrap(), false)[0] })
        .collect()
}

const BOUNDED_MERGES: &[(&str, &str)] = &[("a", "b"), ("c", "d"), ("ab", "cd"), ("e", "f")];

/// The piece table stays within its bounds however many distinct pieces it sees (it is
/// replaced by the vocab's table when full), and the ids stay right across replacements.
#[test]
fn piece_table_is_bounded() {
    let e = trained(BOUNDED_MERGES, &[], "gpt2");
    e.set_table_limits(1 << 13, 1 << 14);
    let words = random_words(200_000, 1);
    let mut max_slots = 0;
    let mut max_side = 0;
    let mut bounds = (0, 0);
    let mut tables = std::collections::HashSet::new();
    for chunk in words.chunks(997) {
        let doc: String = chunk.iter().map(|w| format!(" {w}")).collect();
        let ids = e.encode(&doc, false);
        assert_eq!(e.decode(&ids).unwrap(), doc);
        let t = e.live.load();
        tables.insert(Arc::as_ptr(&t) as usize);
        let ((slots, side), b) = t.usage();
        max_slots = max_slots.max(slots);
        max_side = max_side.max(side);
        bounds = b;
    }
    assert!(max_slots <= bounds.0, "{max_slots} slots > {}", bounds.0);
    assert!(max_side <= bounds.1, "{max_side} side bytes > {}", bounds.1);
    assert!(tables.len() > 3, "the table was replaced {} times", tables.len() - 1);
    // Spot-check ids against the naive BPE after many replacements.
    for w in words.iter().step_by(1999) {
        assert_eq!(e.encode(&format!(" {w}"), false), naive_ids(&e, BOUNDED_MERGES, w), "{w}");
    }
}

/// Threads that encode with one encoder at once, adding the same and different pieces
/// to its table while it is replaced under them, get the ids of one thread alone.
#[test]
fn piece_table_shared_by_threads() {
    let e = Arc::new(trained(BOUNDED_MERGES, &[], "gpt2"));
    e.set_table_limits(1 << 12, 1 << 12);
    let words = random_words(40_000, 7);
    let docs: Vec<String> = words.chunks(101).map(|c| c.iter().map(|w| format!(" {w}")).collect()).collect();
    // Ids from a private encoder, one document at a time.
    let solo = trained(BOUNDED_MERGES, &[], "gpt2");
    let want: Vec<Vec<u32>> = docs.iter().map(|d| solo.encode(d, false)).collect();
    let docs = Arc::new(docs);
    let want = Arc::new(want);
    let first = e.live.load_full();
    let workers: Vec<_> = (0..4)
        .map(|k| {
            let (e, docs, want) = (e.clone(), docs.clone(), want.clone());
            std::thread::spawn(move || {
                // Each thread starts at another document, so that they overlap.
                for round in 0..3 {
                    for j in 0..docs.len() {
                        let i = (j + k * docs.len() / 4 + round) % docs.len();
                        assert_eq!(e.encode(&docs[i], false), want[i], "thread {k}, document {i}");
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let last = e.live.load_full();
    assert!(!Arc::ptr_eq(&first, &last), "the table was never replaced");
    let ((slots, side), (max_slots, max_side)) = last.usage();
    assert!(slots <= max_slots && side <= max_side);
}

#[test]
fn a_set_flag_stops_encoding_and_the_encoder_goes_on() {
    use std::sync::atomic::AtomicBool;
    let e = toy();
    let text = "hello world aaaa!! ".repeat(200_000);
    let want = e.encode(&text, true);
    let stop = Arc::new(AtomicBool::new(true));
    let threads = Some(2);
    assert_eq!(cancel::under(stop.clone(), || e.encode(&text, true)), Err(cancel::Cancelled));
    let parts = cancel::under(stop.clone(), || e.encode_parallel_parts::<u32>(&text, true, threads));
    assert_eq!(parts, Err(cancel::Cancelled));
    let batch = cancel::under(stop.clone(), || e.encode_batch(&[&text[..], &text[..]], true, threads));
    assert_eq!(batch, Err(cancel::Cancelled));
    let huge = "a".repeat(100_000);
    assert_eq!(cancel::under(stop, || e.encode(&huge, true)), Err(cancel::Cancelled));
    // Unset, or outside `under`: the ids as before.
    let go = Arc::new(AtomicBool::new(false));
    assert_eq!(cancel::under(go, || e.encode_parallel(&text, true, threads)), Ok(want.clone()));
    assert_eq!(e.encode(&text, true), want);
}
