use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::*;
use crate::shards::Format;
use crate::specials::SpecialMatcher;

/// A small text with every kind of cut: end-of-text tokens, spaces, newlines, JSON-ish
/// lines, multibyte characters and runs without any cut.
fn sample() -> Vec<u8> {
    let words =
        ["alpha", "b", "  ", "\n", "x\ny", "<|endoftext|>", "héllo", "日本", "{\"text\": \"a b\"}\n", "zzzzzzzz"];
    let mut state = 7u64;
    let mut out = Vec::new();
    for _ in 0..700 {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        out.extend_from_slice(words[(state >> 33) as usize % words.len()].as_bytes());
        if state & 3 == 0 {
            out.push(b' ');
        }
    }
    out
}

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("ferrolm-chunks-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `text` written as a file of each kind: plain, gzip (two members), zstd.
fn files(dir: &Path, text: &[u8]) -> Vec<(PathBuf, Compression)> {
    let plain = dir.join("a.txt");
    std::fs::write(&plain, text).unwrap();
    let gz = dir.join("a.txt.gz");
    let mut bytes = Vec::new();
    for half in [&text[..text.len() / 2], &text[text.len() / 2..]] {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(half).unwrap();
        bytes.extend(e.finish().unwrap());
    }
    std::fs::write(&gz, bytes).unwrap();
    let zst = dir.join("a.txt.zst");
    std::fs::write(&zst, zstd::encode_all(text, 3).unwrap()).unwrap();
    vec![(plain, Compression::None), (gz, Compression::Gzip), (zst, Compression::Zstd)]
}

fn open(path: &Path, compression: Compression, hash: bool) -> Stream {
    let len = std::fs::metadata(path).unwrap().len();
    Stream::open(path, File::open(path).unwrap(), len, compression, hash).unwrap()
}

/// Hands out at most one byte per read, and an interruption before each.
struct Trickle<'a>(&'a [u8], bool);

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.1 = !self.1;
        if self.1 {
            return Err(io::ErrorKind::Interrupted.into());
        }
        let n = buf.len().min(self.0.len()).min(1);
        buf[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        Ok(n)
    }
}

type Cut<'a> = &'a dyn Fn(&[u8]) -> Option<usize>;

/// (offset, bytes) of the chunks the chunker hands out, sizes as in `expected`.
fn chunks(src: &mut impl Read, first: usize, more: usize, cut: Cut, skip_bom: bool) -> Vec<(u64, Vec<u8>)> {
    let bufs = BufferPool::default();
    let mut chunker = Chunker::new(0, skip_bom);
    let mut out = Vec::new();
    loop {
        let target = chunker.tail() + first;
        let at = |b: &[u8], end: bool| if end { Some((b.len(), ())) } else { cut(b).map(|c| (c, ())) };
        let c = chunker.next(src, &bufs, target, |f| f + more, at, |_| {}).unwrap();
        out.push((c.offset, c.data[..c.len].to_vec()));
        bufs.put(c.data);
        if c.last {
            return out;
        }
    }
}

/// The chunks the cut rule gives for `text` read `first` bytes past the last chunk's
/// tail, `more` bytes more while no cut is found: each chunk is the buffer read up to its
/// last cut, the last one the rest.
fn expected(text: &[u8], first: usize, more: usize, cut: Cut) -> Vec<(u64, Vec<u8>)> {
    let (mut pos, mut tail) = (0, 0);
    let mut out = Vec::new();
    loop {
        let mut target = tail + first;
        loop {
            if text.len() - pos < target {
                out.push((pos as u64, text[pos..].to_vec()));
                return out;
            }
            if let Some(c) = cut(&text[pos..pos + target]) {
                out.push((pos as u64, text[pos..pos + c].to_vec()));
                (pos, tail) = (pos + c, target - c);
                break;
            }
            target += more;
        }
    }
}

#[test]
fn chunks_end_where_the_cut_rule_says_for_every_source_and_tiny_buffers() {
    let dir = Dir::new("rule");
    let text = sample();
    let sp = SpecialMatcher::from_strings(&["<|endoftext|>".into()]);
    let rules: [(&str, Cut); 3] = [
        ("text", &|b| crate::shards::input::last_cut(b, Format::Text, &sp, true)),
        ("specials only", &|b| crate::shards::input::last_cut(b, Format::Text, &sp, false)),
        ("jsonl", &|b| crate::shards::input::last_cut(b, Format::Jsonl, &sp, false)),
    ];
    let sources = files(&dir.0, &text);
    for (name, cut) in rules {
        for (first, more) in [(1, 1), (2, 3), (5, 1), (13, 7), (40, 40), (300, 1), (5000, 8)] {
            let want = expected(&text, first, more, cut);
            assert!(want.len() > 1 || first >= text.len(), "{name}: no cut at all");
            for (path, compression) in &sources {
                let got = chunks(&mut open(path, *compression, false), first, more, cut, false);
                assert!(got == want, "{name}, {compression:?}, sizes {first}+{more}");
            }
            let got = chunks(&mut Trickle(&text, false), first, more, cut, false);
            assert!(got == want, "{name}, one byte per read, sizes {first}+{more}");
        }
    }
}

#[test]
fn a_byte_order_mark_is_skipped_only_when_asked() {
    let mut text = BOM.to_vec();
    text.extend_from_slice(b"one two<|endoftext|>three");
    let sp = SpecialMatcher::from_strings(&["<|endoftext|>".into()]);
    let cut: Cut = &|b| crate::shards::input::last_cut(b, Format::Text, &sp, true);
    for first in [1, 4, 9, 100] {
        let kept = chunks(&mut &text[..], first, 2, cut, false);
        assert_eq!(kept, expected(&text, first, 2, cut));
        let skipped = chunks(&mut &text[..], first, 2, cut, true);
        assert_eq!(skipped[0].0, 3, "the first chunk starts after the mark");
        let joined: Vec<u8> = skipped.iter().flat_map(|c| c.1.clone()).collect();
        assert_eq!(joined, &text[3..]);
        let mut at = 3;
        for (offset, bytes) in &skipped {
            assert_eq!(*offset, at);
            at += bytes.len() as u64;
        }
    }
}

#[test]
fn an_empty_stream_gives_one_empty_last_chunk() {
    let bufs = BufferPool::default();
    let mut chunker = Chunker::new(5, true);
    let c = chunker.next(&mut io::empty(), &bufs, 10, |f| f + 1, |b, _| Some((b.len(), ())), |_| {}).unwrap();
    assert_eq!((c.len, c.offset, c.last), (0, 5, true));
}

#[test]
fn skipping_hands_over_the_prefix_and_chunks_go_on_after_it() {
    let text = sample();
    let cut =
        |b: &[u8], end: bool| if end { Some((b.len(), ())) } else { memchr::memrchr(b' ', b).map(|p| (p + 1, ())) };
    for n in [0u64, 1, 777, text.len() as u64, text.len() as u64 + 9] {
        let bufs = BufferPool::default();
        let mut src = &text[..];
        let mut chunker = Chunker::new(0, true);
        let mut seen = Vec::new();
        let skipped = chunker.skip(&mut src, Some(n), |b| seen.extend_from_slice(b)).unwrap();
        assert_eq!(skipped, n.min(text.len() as u64));
        assert_eq!(seen, &text[..skipped as usize]);
        let mut rest = Vec::new();
        loop {
            let c = chunker.next(&mut src, &bufs, chunker.tail() + 64, |f| f * 2, cut, |_| {}).unwrap();
            assert_eq!(c.offset, skipped + rest.len() as u64);
            rest.extend_from_slice(&c.data[..c.len]);
            if c.last {
                break;
            }
        }
        assert_eq!(rest, &text[skipped as usize..]);
    }
    // Skipping to the end: the next chunk is the empty last one.
    let mut chunker = Chunker::new(0, false);
    let mut src = &text[..];
    assert_eq!(chunker.skip(&mut src, None, |_| {}).unwrap(), text.len() as u64);
    let c = chunker.next(&mut src, &BufferPool::default(), 8, |f| f * 2, cut, |_| {}).unwrap();
    assert!(c.last && c.len == 0);
}

#[test]
fn streams_count_and_hash_every_raw_byte() {
    let dir = Dir::new("raw");
    let text = sample();
    for (path, compression) in files(&dir.0, &text) {
        let raw = std::fs::read(&path).unwrap();
        let mut s = open(&path, compression, true);
        // A decoder may stop before the end of its file (here it is stopped after part of
        // the text): the rest is read when the stream is closed.
        let mut head = vec![0u8; if compression == Compression::None { text.len() } else { 100 }];
        s.read_exact(&mut head).unwrap();
        assert_eq!(head, &text[..head.len()]);
        let r = s.into_raw().unwrap();
        assert_eq!(r.count, raw.len() as u64, "{compression:?}");
        assert_eq!(<[u8; 32]>::from(r.hasher.unwrap().finalize()), <[u8; 32]>::from(Sha256::digest(&raw)));
    }
}

#[test]
fn a_read_error_is_returned_and_the_tail_kept() {
    struct Fails(usize);
    impl Read for Fails {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0 == 0 {
                return Err(io::Error::other("disk on fire"));
            }
            let n = buf.len().min(self.0);
            buf[..n].fill(b'a');
            self.0 -= n;
            Ok(n)
        }
    }
    let bufs = BufferPool::default();
    let mut chunker = Chunker::new(0, false);
    let never = |b: &[u8], end: bool| end.then_some((b.len(), ()));
    let e = chunker.next(&mut Fails(50), &bufs, 20, |f| f + 20, never, |_| {}).err().unwrap();
    assert_eq!(e.to_string(), "disk on fire");
    assert_eq!(chunker.tail(), 50);
}
