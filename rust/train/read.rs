//! Stage 1: read the input in bounded chunks and cut it where pre-tokenization
//! may restart without changing a single piece.
//!
//! Exact cut points, in order of preference:
//! 1. a special-token occurrence (special tokens are hard boundaries);
//! 2. for the built-in patterns only: just after a `\n` that follows a printable
//!    ASCII byte and precedes an ASCII letter (`x\nT`). No piece of the GPT-2,
//!    cl100k or o200k pattern contains a newline followed by a letter, and the
//!    newline's own piece is `"\n"` whether or not the text continues (see
//!    `safe_text_cut`).
//!
//! A chunk grows past the target size only when neither kind of cut exists in it
//! (e.g. a custom pattern and no special token for megabytes).

use std::io::{self, Read};

use crate::buffers::BufferPool;
use crate::pretokenize::PreTokenizer;
use crate::specials::SpecialMatcher;

#[inline]
fn is_printable_ascii(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

/// The last exact cut position `c` with `lo <= c <= hi` for the built-in patterns:
/// `text[c-2]` printable ASCII, `text[c-1] == b'\n'`, `text[c]` an ASCII letter.
///
/// Why it is exact (GPT-2, cl100k, o200k): every piece that contains a `\n` either is
/// all whitespace or ends at the newline, and no piece begins with `\n` and goes on
/// into a letter (the optional prefix of the letter alternatives excludes `\r\n` in
/// cl100k/o200k and is a plain space in GPT-2). So a piece ends at `c` in the whole
/// text. Before `c`, the whitespace run is just the `\n` (its left neighbour is not
/// whitespace), so whether the pattern sees the letter (`\s+(?!\S)` fails, `\s+`
/// takes "\n"; `\s++$` fails, `\s*[\r\n]` takes it) or the end of the chunk
/// (`\s+(?!\S)` / `\s++$` take "\n"), the piece is the same `"\n"` (or the same
/// punctuation-plus-newline piece).
pub fn safe_text_cut(text: &[u8], lo: usize, hi: usize) -> Option<usize> {
    let lo = lo.max(2);
    if hi >= text.len() || hi < lo {
        return None;
    }
    // Search for b'\n' at c-1 for c in [lo, hi], from the right.
    let mut end = hi; // exclusive bound on newline index + 1 == c
    while end >= lo {
        let nl = memchr::memrchr(b'\n', &text[lo - 1..end])? + lo - 1;
        let c = nl + 1;
        if text[c].is_ascii_alphabetic() && is_printable_ascii(text[nl - 1]) {
            return Some(c);
        }
        if nl < lo {
            return None;
        }
        end = nl;
    }
    None
}

/// Where a buffer of text is cut, and the spans free of special tokens before the cut
/// (found by the same search, so that the text is searched for special tokens once).
#[derive(Debug, PartialEq, Eq)]
pub struct Cut {
    pub at: usize,
    pub segments: Vec<(usize, usize)>,
}

impl Cut {
    /// The cut at the end of `buf` (the end of the input).
    pub fn whole(buf: &[u8], splitter: &SpecialMatcher) -> Cut {
        let mut segments = Vec::new();
        splitter.segments(buf, 0, &mut segments);
        Cut { at: buf.len(), segments }
    }

    /// The cut at `at`, given the special-token occurrences `matches` of the buffer, in
    /// order, none of which may straddle `at`: those that end by it are then the ones a
    /// search of the part before it finds.
    fn from_matches(matches: &[(usize, usize)], at: usize) -> Cut {
        let mut segments = Vec::with_capacity(matches.len() + 1);
        let mut pos = 0;
        for &(s, e) in matches.iter().take_while(|m| m.1 <= at) {
            if s > pos {
                segments.push((pos, s));
            }
            pos = e;
        }
        if at > pos {
            segments.push((pos, at));
        }
        Cut { at, segments }
    }
}

/// Where to cut a full buffer: the largest exact cut position > 0, or None.
/// Special-token matches are trusted only when they start at least `max_len` bytes
/// before the end of the buffer: then no longer special token, and no earlier one,
/// could be hiding behind the end of the buffer.
pub fn find_cut(buf: &[u8], splitter: &SpecialMatcher, builtin: bool) -> Option<Cut> {
    let limit = buf.len().saturating_sub(splitter.max_len());
    let mut last_safe_end: Option<usize> = None;
    let mut last_end = 0usize;
    let mut matches: Vec<(usize, usize)> = Vec::new();
    splitter.for_each_match(buf, |s, e| {
        if s <= limit && s + splitter.max_len() <= buf.len() {
            last_safe_end = Some(e);
        }
        last_end = e;
        matches.push((s, e));
    });
    let fallback = if builtin {
        // No special token covers any position in [last_end, limit]: a match covering
        // c >= last_end would start at or after last_end (matches do not overlap) and
        // before limit, so it would have been found.
        let hi = limit.min(buf.len().saturating_sub(1));
        safe_text_cut(buf, last_end.max(1), hi)
    } else {
        None
    };
    let at = match (last_safe_end, fallback) {
        (Some(a), Some(b)) => a.max(b),
        (Some(a), None) if a > 0 => a,
        (None, Some(b)) => b,
        _ => return None,
    };
    // No match straddles the cut: it is a match's end, or lies past the last match.
    Some(Cut::from_matches(&matches, at))
}

/// The fallback cut when no exact one exists in a long buffer: hold back the last two
/// pre-tokens of the text after the last special token (and any possible start of a
/// special token at the end), as `ferrolm.reference` does when streaming. Exact for the
/// built-in patterns; for a custom pattern it assumes no match depends on text more
/// than two pre-tokens ahead.
pub fn hold_back_cut(buf: &[u8], splitter: &SpecialMatcher, pre: &PreTokenizer) -> Option<Cut> {
    let limit = buf.len().saturating_sub(splitter.max_len().saturating_sub(1));
    let mut start = 0;
    let mut end = limit;
    let mut matches: Vec<(usize, usize)> = Vec::new();
    splitter.for_each_match(buf, |s, e| {
        if s + splitter.max_len() <= buf.len() {
            start = e; // complete: no longer special token can start here
        } else {
            end = end.min(s);
        }
        matches.push((s, e));
    });
    if end <= start {
        return None;
    }
    let region = &buf[start..end];
    let text = match crate::utf8::to_str(region) {
        Ok(t) => t,
        Err(e) => std::str::from_utf8(&region[..e.valid_up_to()]).unwrap(),
    };
    let mut starts = [usize::MAX; 2];
    pre.for_each_piece_range(text, |s, _| {
        starts = [starts[1], s];
    });
    // The cut lies in [start, end): after every complete match, before any partial one.
    (starts[0] != usize::MAX && start + starts[0] > 0).then(|| Cut::from_matches(&matches, start + starts[0]))
}

/// Reads one input (a file, or the decompressed stream of one; `size`: its size when
/// known) in chunks ending at cut positions chosen by `cut(buffer, at_end)` (None: read
/// more first; at the end of the input it must cut at the end). `cut` also returns what
/// it found about the chunk (`M`), handed to `f(chunk, found, offset)` with the chunk, on
/// the calling thread. A reader thread reads and cuts the next chunk while `f` works on
/// the current one (a few chunks exist at a time); the chunk buffers come from `bufs`
/// and go back to it. A UTF-8 byte-order mark at the start is skipped (the first chunk
/// then starts at offset 3).
pub(crate) fn for_each_chunk<M: Send, E>(
    input: impl Read + Send,
    size: Option<u64>,
    chunk_size: usize,
    bufs: &BufferPool,
    cut: impl Fn(&[u8], bool) -> Option<(usize, M)> + Sync,
    on_read: impl FnMut(usize) + Send,
    mut f: impl FnMut(&[u8], M, u64) -> Result<(), E>,
) -> Result<(), E>
where
    E: From<io::Error>,
{
    // A small file needs no full-size buffer.
    let file_len = size.map_or(usize::MAX, |n| n.min(usize::MAX as u64) as usize);
    let chunk_size = chunk_size.min(file_len.saturating_add(1)).max(64);
    let (tx, rx) = std::sync::mpsc::sync_channel::<io::Result<(Vec<u8>, usize, M, u64)>>(1);
    std::thread::scope(|scope| {
        let cut = &cut;
        scope.spawn(move || {
            let r = produce_chunks(input, chunk_size, cut, on_read, bufs, |chunk, len, found, offset| {
                tx.send(Ok((chunk, len, found, offset))).is_ok()
            });
            if let Err(e) = r {
                let _ = tx.send(Err(e));
            }
        });
        let rx = rx; // owned here, so that it is dropped before the scope joins the reader
        let result = (|| {
            for msg in rx.iter() {
                let (chunk, len, found, offset) = msg?;
                f(&chunk[..len], found, offset)?;
                bufs.put(chunk);
            }
            Ok(())
        })();
        // On an early return the reader may be blocked sending the next chunk: dropping
        // the receiver makes that send fail, so the reader stops and the scope can end.
        drop(rx);
        result
    })
}

/// The first chunk of a file is at most this big, and each next one twice the last up
/// to the chunk size: the consumer waits for the first read alone, once per file.
const FIRST_CHUNK: usize = 1 << 20;

/// The reader side of `for_each_chunk`: `emit(buffer, len, found, offset)` hands over a
/// chunk (the first `len` bytes of the buffer) and returns false to stop. Buffers keep
/// their length when recycled, so they are zeroed only once.
fn produce_chunks<M>(
    mut file: impl Read,
    chunk_size: usize,
    cut: &impl Fn(&[u8], bool) -> Option<(usize, M)>,
    mut on_read: impl FnMut(usize),
    bufs: &BufferPool,
    mut emit: impl FnMut(Vec<u8>, usize, M, u64) -> bool,
) -> io::Result<()> {
    let mut buf = bufs.take();
    let mut filled = 0usize; // bytes of buf holding data
    let mut offset: u64 = 0; // file offset of buf[0]
    let mut step = chunk_size.min(FIRST_CHUNK);
    let mut target = step;
    let mut eof = false;
    let mut first = true;
    loop {
        if buf.len() < target {
            buf.resize(target, 0);
        }
        while filled < target && !eof {
            let n = read_retry(&mut file, &mut buf[filled..target])?;
            if n == 0 {
                eof = true;
            }
            filled += n;
            on_read(n);
        }
        if std::mem::take(&mut first) && buf[..filled].starts_with(crate::shards::BOM) {
            let bom = crate::shards::BOM.len();
            buf.copy_within(bom..filled, 0);
            filled -= bom;
            offset = bom as u64;
        }
        if eof {
            if filled > 0 {
                let (len, found) = cut(&buf[..filled], true).expect("the last chunk is cut at its end");
                debug_assert_eq!(len, filled);
                emit(buf, filled, found, offset);
            }
            return Ok(());
        }
        match cut(&buf[..filled], false) {
            Some((c, found)) => {
                // The tail after the cut starts the next buffer.
                let mut next = bufs.take();
                step = (step * 2).min(chunk_size);
                let want = step.max(filled - c + step / 2);
                if next.len() < want {
                    next.resize(want, 0);
                }
                next[..filled - c].copy_from_slice(&buf[c..filled]);
                if !emit(std::mem::replace(&mut buf, next), c, found, offset) {
                    return Ok(());
                }
                filled -= c;
                offset += c as u64;
                target = want;
            }
            // No exact cut in the whole buffer: read more before processing.
            None => target = filled + step,
        }
    }
}

fn read_retry(file: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match file.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::path::Path;

    fn test_cut(buf: &[u8], end: bool, sp: &SpecialMatcher, builtin: bool) -> Option<(usize, ())> {
        if end {
            return Some((buf.len(), ()));
        }
        find_cut(buf, sp, builtin).map(|c| (c.at, ()))
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
                if let Some(cut) = find_cut(buf, &sp, builtin) {
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
            let mut hi = bytes.len() - 1;
            let mut cuts = 0;
            while let Some(c) = safe_text_cut(bytes, 1, hi) {
                let mut parts = pre.pieces(&text[..c]);
                parts.extend(pre.pieces(&text[c..]));
                assert_eq!(parts, whole, "pattern {pat}, cut at {c}");
                cuts += 1;
                hi = c - 1;
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
        for buf in [&b"x<|end|>a b c d e f g"[..], b"<|end|>y<|end|>one two three<|en", b"one two three four five six"]
        {
            let cut = hold_back_cut(buf, &sp, &pre).unwrap();
            let mut again = vec![];
            sp.segments(&buf[..cut.at], 0, &mut again);
            assert_eq!(cut.segments, again, "{:?}", String::from_utf8_lossy(buf));
        }
    }

    #[test]
    fn an_error_in_the_consumer_stops_the_reader() {
        let dir = std::env::temp_dir().join(format!("ferrolm-read-stop-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.txt");
        std::fs::write(&path, "word<|endoftext|>".repeat(10_000)).unwrap();
        let sp = SpecialMatcher::from_strings(&["<|endoftext|>".into()]);
        let mut calls = 0;
        let r = for_each_chunk::<(), io::Error>(
            File::open(&path).unwrap(),
            None,
            1000,
            &BufferPool::default(),
            |b, end| test_cut(b, end, &sp, true),
            |_| {},
            |_, _, _| {
                calls += 1;
                Err(io::Error::other("stop"))
            },
        );
        assert!(r.is_err());
        assert_eq!(calls, 1);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn reused_buffers_hand_out_only_the_new_file() {
        // Buffers come back from a first file full of its bytes; the chunks of a second,
        // different file read with them must hold its bytes only.
        let dir = std::env::temp_dir().join(format!("ferrolm-read-reuse-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.txt"), dir.join("b.txt"));
        std::fs::write(&a, "aaaa aaaa\nAaaa<|endoftext|>".repeat(3000)).unwrap();
        let text_b: String = (0..900).map(|i| format!("b{i} bb\nBb<|endoftext|>")).collect();
        std::fs::write(&b, &text_b).unwrap();
        let sp = SpecialMatcher::from_strings(&["<|endoftext|>".into()]);
        let bufs = BufferPool::default();
        let read_all = |path: &Path| {
            let mut got = Vec::new();
            for_each_chunk::<(), io::Error>(
                File::open(path).unwrap(),
                None,
                2000,
                &bufs,
                |x, end| test_cut(x, end, &sp, true),
                |_| {},
                |c, _, off| {
                    assert_eq!(off as usize, got.len());
                    got.extend_from_slice(c);
                    Ok(())
                },
            )
            .unwrap();
            got
        };
        assert_eq!(read_all(&a).len(), std::fs::metadata(&a).unwrap().len() as usize);
        let kept = bufs.free();
        assert!(kept >= 2, "buffers were not given back ({kept})");
        assert_eq!(read_all(&b), text_b.as_bytes());
        // At most four buffers are in use at once (one filling, one being handed over,
        // one queued, one being counted): had the second file not reused the first
        // file's buffers, more would be kept now.
        let after = bufs.free();
        assert!(after <= 4, "{after} buffers kept after two files ({kept} after one)");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn chunks_cover_file_and_cut_exactly() {
        let dir = std::env::temp_dir().join(format!("ferrolm-read-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.txt");
        let mut text = String::new();
        for i in 0..2000 {
            text.push_str(&format!("doc {i} says hi.\nAnd more\n<|endoftext|>"));
        }
        std::fs::write(&path, &text).unwrap();
        let sp = SpecialMatcher::from_strings(&["<|endoftext|>".into()]);
        for builtin in [false, true] {
            let mut got = Vec::new();
            let mut n = 0;
            for_each_chunk::<(), io::Error>(
                File::open(&path).unwrap(),
                None,
                1000,
                &BufferPool::default(),
                |b, end| test_cut(b, end, &sp, builtin),
                |_| {},
                |c, _, off| {
                    assert_eq!(off as usize, got.len());
                    got.extend_from_slice(c);
                    n += 1;
                    Ok(())
                },
            )
            .unwrap();
            assert_eq!(got, text.as_bytes());
            assert!(n > 20);
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
