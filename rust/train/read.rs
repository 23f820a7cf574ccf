//! Stage 1: read the input in bounded chunks, each ending at an exact cut (the rule is
//! `crate::cut`'s: a special-token match, or for the built-in patterns a text cut), through
//! the one chunk reader (`crate::chunks`), on a thread of its own.
//!
//! A chunk grows past the target size only when no exact cut exists in it (e.g. a custom
//! pattern and no special token for megabytes); see `Trainer::cut`.

use std::io::{self, Read};

use crate::buffers::BufferPool;
use crate::chunks::{Chunk, Chunker};

/// Reads one input (a file, or the decompressed stream of one; `size`: its size when
/// known) in chunks ending at cut positions chosen by `cut(buffer, at_end)` (None: read
/// more first; at the end of the input it must cut at the end). `cut` also returns what
/// it found about the chunk (`M`), handed to `f(chunk, found, offset)` with the chunk, on
/// the calling thread. A reader thread reads and cuts the next chunk while `f` works on
/// the current one (a few chunks exist at a time); the chunk buffers come from `bufs`
/// and go back to it. With `skip_bom`, a UTF-8 byte-order mark at the start is skipped
/// (the first chunk then starts at offset 3): an input read from its start, not a part.
#[allow(clippy::too_many_arguments)]
pub(crate) fn for_each_chunk<M: Send, E>(
    input: impl Read + Send,
    size: Option<u64>,
    chunk_size: usize,
    skip_bom: bool,
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
    let (tx, rx) = std::sync::mpsc::sync_channel::<io::Result<Chunk<M>>>(1);
    std::thread::scope(|scope| {
        let cut = &cut;
        scope.spawn(move || {
            let r = produce_chunks(input, chunk_size, skip_bom, cut, on_read, bufs, |chunk| tx.send(Ok(chunk)).is_ok());
            if let Err(e) = r {
                let _ = tx.send(Err(e));
            }
        });
        let rx = rx; // owned here, so that it is dropped before the scope joins the reader
        let result = (|| {
            for msg in rx.iter() {
                let chunk = msg?;
                if chunk.len > 0 {
                    f(&chunk.data[..chunk.len], chunk.found, chunk.offset)?;
                }
                bufs.put(chunk.data);
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

/// The reader side of `for_each_chunk`: `emit(chunk)` hands over a chunk and returns
/// false to stop. Each chunk reads `step` bytes past half a step beyond the previous
/// chunk's tail, and a buffer without a cut grows by a step.
fn produce_chunks<M>(
    mut file: impl Read,
    chunk_size: usize,
    skip_bom: bool,
    cut: &impl Fn(&[u8], bool) -> Option<(usize, M)>,
    mut on_read: impl FnMut(usize),
    bufs: &BufferPool,
    mut emit: impl FnMut(Chunk<M>) -> bool,
) -> io::Result<()> {
    let mut chunker = Chunker::new(0, skip_bom);
    let mut step = chunk_size.min(FIRST_CHUNK);
    loop {
        let target = step.max(chunker.tail() + step / 2);
        let chunk = chunker.next(&mut file, bufs, target, |filled| filled + step, cut, &mut on_read)?;
        let last = chunk.last;
        if !emit(chunk) || last {
            return Ok(());
        }
        step = (step * 2).min(chunk_size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::specials::SpecialMatcher;
    use std::fs::File;
    use std::path::Path;

    fn test_cut(buf: &[u8], end: bool, sp: &SpecialMatcher, builtin: bool) -> Option<(usize, ())> {
        if end {
            return Some((buf.len(), ()));
        }
        crate::cut::last_cut(buf, sp, builtin).map(|c| (c.at, ()))
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
            true,
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
                true,
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
                true,
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
