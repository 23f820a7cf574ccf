//! The cut rule against its definition: a position is exact when tokenizing the two sides
//! apart gives the tokens of the whole text.

use super::*;

#[derive(Debug, PartialEq, Eq)]
enum Tok<'a> {
    Special(u32),
    Piece(&'a str),
}

/// Special tokens (leftmost-longest), then the pieces of the text between them.
fn tokens<'a>(text: &'a str, sp: &SpecialMatcher, pre: &PreTokenizer) -> Vec<Tok<'a>> {
    let mut out = Vec::new();
    let mut pos = 0;
    let span = |s: usize, e: usize, out: &mut Vec<Tok<'a>>| {
        pre.for_each_piece_range(&text[s..e], |a, b| out.push(Tok::Piece(&text[s + a..s + b])));
    };
    for (s, e, id) in sp.find_iter(text.as_bytes()) {
        span(pos, s, &mut out);
        out.push(Tok::Special(id));
        pos = e;
    }
    span(pos, text.len(), &mut out);
    out
}

fn exact(text: &str, c: usize, sp: &SpecialMatcher, pre: &PreTokenizer) -> bool {
    let mut parts = tokens(&text[..c], sp, pre);
    parts.extend(tokens(&text[c..], sp, pre));
    parts == tokens(text, sp, pre)
}

fn builtin_pretokenizers() -> Vec<PreTokenizer> {
    ["gpt2", "cl100k", "o200k"]
        .iter()
        .flat_map(|p| [PreTokenizer::new(p).unwrap(), PreTokenizer::new_regex(p).unwrap()])
        .collect()
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// Adversarial texts: special tokens whole, nested, overlapping and cut short, tokens
/// that hold a space or a newline, multi-byte characters, whitespace runs, punctuation
/// before newlines, contractions and digit runs.
fn adversarial(rng: &mut Rng) -> String {
    const PARTS: [&str; 30] = [
        "<|end|>",
        "<|en",
        "<s>",
        "<s><s>",
        "<| |>",
        "<|",
        "p\nQ",
        "a b",
        "x\ny",
        "\n",
        " ",
        "  ",
        "\t",
        ".\n",
        "!\n",
        "'s",
        "'S",
        "日本語",
        "é",
        " é",
        "12345",
        "Hello",
        "!!",
        "\r\n",
        "\n\n",
        "q\nR",
        ".",
        "\u{a0}",
        "😀",
        "Ab",
    ];
    (0..rng.below(28)).map(|_| PARTS[rng.below(PARTS.len())]).collect()
}

fn specials() -> SpecialMatcher {
    SpecialMatcher::from_strings(&["<|end|>".into(), "<s>".into(), "<s><s>".into(), "<| |>".into(), "p\nQ".into()])
}

#[test]
fn every_position_the_rule_allows_is_exact() {
    let sp = specials();
    let pres = builtin_pretokenizers();
    let mut rng = Rng(11);
    let mut checked = 0;
    for _ in 0..400 {
        let text = adversarial(&mut rng);
        let bytes = text.as_bytes();
        let matches: Vec<(usize, usize)> = sp.find_iter(bytes).map(|(s, e, _)| (s, e)).collect();
        for c in 1..bytes.len() {
            let straddled = sp.straddles(bytes, c);
            let at_match = matches.iter().any(|&(s, e)| s == c || e == c);
            if straddled || !(at_match || is_text_cut(bytes, c)) {
                continue;
            }
            for pre in &pres {
                assert!(exact(&text, c, &sp, pre), "{} cut at {c} of {text:?}", pre.pattern());
                checked += 1;
            }
        }
    }
    assert!(checked > 10_000, "{checked}");
}

#[test]
fn cuts_found_in_a_window_are_exact_for_the_whole_text() {
    // Each search sees part of the text only (a buffer that the text goes on after, a
    // window from some offset): what it returns must be exact for the whole text.
    let sp = specials();
    let pres = builtin_pretokenizers();
    let mut rng = Rng(5);
    let mut found = [0; 4];
    for _ in 0..600 {
        let text = adversarial(&mut rng) + &adversarial(&mut rng);
        let bytes = text.as_bytes();
        if bytes.len() < 2 {
            continue;
        }
        let len = 1 + rng.below(bytes.len());
        let mut at = Vec::new();
        if let Some(cut) = last_cut(&bytes[..len], &sp, true) {
            let mut again = vec![];
            sp.segments(&bytes[..cut.at], 0, &mut again);
            assert_eq!(cut.segments, again, "{text:?}");
            at.push((0, cut.at));
        }
        let tail = if rng.below(2) == 0 { TAIL } else { 1 + rng.below(24) };
        if let Some(c) = last_cut_in_tails(&bytes[..len], &sp, true, tail) {
            at.push((3, c));
        }
        let lo = rng.below(bytes.len());
        let from = lo.saturating_sub(sp.max_len());
        let end = (lo + 1 + rng.below(bytes.len() - lo)).max(lo);
        let window = &bytes[from..end];
        if let Some(c) = first_special_cut(window, lo - from, &sp, end == bytes.len()) {
            at.push((1, from + c));
        }
        if let Some(c) = first_text_cut(bytes, lo, bytes.len(), |c| !sp.straddles(bytes, c)) {
            at.push((2, c));
        }
        for (kind, c) in at {
            if c == 0 || c == bytes.len() {
                continue;
            }
            found[kind] += 1;
            for pre in &pres {
                assert!(exact(&text, c, &sp, pre), "{} cut {kind} at {c} of {text:?}", pre.pattern());
            }
        }
    }
    assert!(found.iter().all(|&n| n > 50), "{found:?}");
}

#[test]
fn text_cuts_are_found_from_either_side() {
    let text = b"ab cd\nEf  g\n\nh.\ni \xc3\xa9 j";
    let all: Vec<usize> = (0..text.len()).filter(|&c| is_text_cut(text, c)).collect();
    assert_eq!(all, vec![2, 6, 8, 16, 17]);
    for lo in 0..=text.len() {
        for hi in lo..=text.len() {
            let inside: Vec<usize> = all.iter().copied().filter(|&c| lo <= c && c < hi).collect();
            assert_eq!(last_text_cut(text, lo, hi), inside.last().copied(), "{lo}..{hi}");
            assert_eq!(first_text_cut(text, lo, hi, |_| true), inside.first().copied(), "{lo}..{hi}");
        }
    }
}

#[test]
fn segments_skip_specials_longest_first() {
    let sp = SpecialMatcher::from_strings(&["<s>".into(), "<s><s>".into()]);
    let mut out = vec![];
    sp.segments(b"a<s><s>b<s>", 0, &mut out);
    assert_eq!(out, vec![(0, 1), (7, 8)]);
}

#[test]
fn a_cut_brings_the_segments_a_search_of_its_part_finds() {
    // Overlapping and nested specials, text cuts and specials near the buffer's end:
    // the segments found while cutting must be those of searching the part again.
    let sp = SpecialMatcher::from_strings(&["<s>".into(), "<s><s>".into(), "<|end|>".into()]);
    let mut rng: u64 = 7;
    let mut next = |n: u64| {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    let parts = ["<s>", "<s><s>", "<|end|>", "<|en", "ab", "Cd\nEf", " x", "\n", ".\nZ", "<"];
    let mut cuts = 0;
    for _ in 0..3000 {
        let buf: String = (0..next(24)).map(|_| parts[next(parts.len() as u64) as usize]).collect();
        let buf = buf.as_bytes();
        for builtin in [false, true] {
            if let Some(cut) = last_cut(buf, &sp, builtin) {
                let mut again = vec![];
                sp.segments(&buf[..cut.at], 0, &mut again);
                assert_eq!(cut.segments, again, "{:?}", String::from_utf8_lossy(buf));
                cuts += 1;
            }
        }
        assert_eq!(Cut::whole(buf, &sp).segments, {
            let mut v = vec![];
            sp.segments(buf, 0, &mut v);
            v
        });
    }
    assert!(cuts > 1000, "{cuts}");
}

#[test]
fn text_cut_is_exact_for_builtin_patterns() {
    let text = "Hello world.\nThe end  \nx\n\nYes!\nok 12\nZ\n  a\tb\nc";
    let bytes = text.as_bytes();
    let pres = ["gpt2", "cl100k", "o200k"]
        .iter()
        .flat_map(|p| [PreTokenizer::new(p).unwrap(), PreTokenizer::new_regex(p).unwrap()]);
    for pre in pres {
        let pat = pre.pattern().to_string();
        let whole: Vec<&str> = pre.pieces(text);
        let mut hi = bytes.len();
        let mut cuts = 0;
        while let Some(c) = last_text_cut(bytes, 1, hi) {
            let mut parts = pre.pieces(&text[..c]);
            parts.extend(pre.pieces(&text[c..]));
            assert_eq!(parts, whole, "pattern {pat}, cut at {c}");
            cuts += 1;
            hi = c;
        }
        assert!(cuts >= 3);
    }
}

#[test]
fn hold_back_keeps_two_pieces_and_partial_specials() {
    let sp = SpecialMatcher::from_strings(&["<|end|>".into()]);
    let pre = PreTokenizer::new("gpt2").unwrap();
    // Only "one two three four fi" is surely free of a special-token start.
    assert_eq!(hold_back_cut(b"one two three four five six", &sp, &pre).map(|c| c.at), Some(13));
    // The last 6 bytes may start a special token: held back, with the two pieces before.
    assert_eq!(hold_back_cut(b"a b c d<|en", &sp, &pre).map(|c| c.at), Some(1));
    assert_eq!(hold_back_cut(b"x<|end|>a b", &sp, &pre).map(|c| c.at), None);
    assert_eq!(hold_back_cut(b"x<|end|>a b c d e f g", &sp, &pre).map(|c| c.at), Some(11));
    // The segments come from the same search: those of the part before the cut.
    for buf in [&b"x<|end|>a b c d e f g"[..], b"<|end|>y<|end|>one two three<|en", b"one two three four five six"] {
        let cut = hold_back_cut(buf, &sp, &pre).unwrap();
        let mut again = vec![];
        sp.segments(&buf[..cut.at], 0, &mut again);
        assert_eq!(cut.segments, again, "{:?}", String::from_utf8_lossy(buf));
    }
}
