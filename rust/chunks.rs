//! The one chunk reader, for training (`train/read.rs`) and the shard writer
//! (`shards/reader.rs`): an input's byte stream ([`Stream`]: a range of a file, decompressed
//! on the way, its raw bytes counted and hashed when asked) read into pooled buffers, each
//! grown until a cut and handed out as a chunk ([`Chunker`]).
//!
//! Where a chunk may end is the caller's cut function (the rule is `crate::cut`'s for
//! text, after a newline for JSON Lines); how big a buffer is read before the first try
//! and how it grows when it holds no cut are the caller's too (training starts small and
//! doubles, the shard writer balances the last chunks over its threads). The tail after a
//! cut starts the next chunk's buffer. Documents handed over in batches (Parquet, an
//! iterable) are no byte stream and are not read here.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::buffers::BufferPool;
use crate::shards::{Compression, ShardError, BOM};

/// Counts the raw bytes read through it, and hashes them (sha256) when asked.
pub(crate) struct RawReader {
    inner: io::Take<File>,
    pub hasher: Option<Sha256>,
    pub count: u64,
}

impl Read for RawReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(h) = &mut self.hasher {
            h.update(&buf[..n]);
        }
        self.count += n as u64;
        Ok(n)
    }
}

/// What the decoders read from the file at once.
const RAW_BUFFER: usize = 1 << 20;

/// The bytes of an input as its text: plain, or decompressed from gzip or zstd.
pub(crate) enum Stream {
    Plain(RawReader),
    Gzip(Box<flate2::bufread::MultiGzDecoder<BufReader<RawReader>>>),
    Zstd(zstd::stream::read::Decoder<'static, BufReader<RawReader>>),
}

impl Stream {
    /// The next `len` raw bytes of `file` (placed where reading starts), decoded as
    /// `compression` says; `hash`: take the sha256 of the raw bytes.
    pub fn open(path: &Path, file: File, len: u64, compression: Compression, hash: bool) -> Result<Self, ShardError> {
        let raw = RawReader { inner: file.take(len), hasher: hash.then(Sha256::new), count: 0 };
        Ok(match compression {
            Compression::None => Stream::Plain(raw),
            Compression::Gzip => {
                Stream::Gzip(Box::new(flate2::bufread::MultiGzDecoder::new(BufReader::with_capacity(RAW_BUFFER, raw))))
            }
            Compression::Zstd => Stream::Zstd(
                zstd::stream::read::Decoder::with_buffer(BufReader::with_capacity(RAW_BUFFER, raw))
                    .map_err(|e| ShardError::io(path, "opening zstd stream of", e))?,
            ),
        })
    }

    /// Raw bytes read from the file so far.
    pub fn raw_count(&self) -> u64 {
        match self {
            Stream::Plain(r) => r.count,
            Stream::Gzip(d) => d.get_ref().get_ref().count,
            Stream::Zstd(d) => d.get_ref().get_ref().count,
        }
    }

    /// The raw reader, after reading what the decoder left of the file (so that the
    /// count and the hash cover every byte).
    pub fn into_raw(self) -> io::Result<RawReader> {
        let mut raw = match self {
            Stream::Plain(r) => return Ok(r),
            Stream::Gzip(d) => d.into_inner().into_inner(),
            Stream::Zstd(d) => d.finish().into_inner(),
        };
        io::copy(&mut raw, &mut io::sink())?;
        Ok(raw)
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(r) => r.read(buf),
            Stream::Gzip(d) => d.read(buf),
            Stream::Zstd(d) => d.read(buf),
        }
    }
}

/// A chunk: `data[..len]` (a pooled buffer; bytes after `len` are stale), at `offset` in
/// the stream, with what the cut function found about it.
pub(crate) struct Chunk<M> {
    pub data: Vec<u8>,
    pub len: usize,
    pub offset: u64,
    pub found: M,
    /// The stream ends with this chunk (it may be empty).
    pub last: bool,
}

/// Cuts one byte stream into chunks. Buffers come from a [`BufferPool`] and keep their
/// length when recycled, so each is zeroed once.
pub(crate) struct Chunker {
    /// The next chunk's buffer: the tail after the last cut is `buf[..filled]`.
    buf: Vec<u8>,
    filled: usize,
    /// Stream offset of `buf[0]`.
    offset: u64,
    eof: bool,
    skip_bom: bool,
}

impl Chunker {
    /// A stream whose next byte is at `offset`. `skip_bom`: a UTF-8 byte-order mark at
    /// the start is skipped (the first chunk then starts 3 bytes further).
    pub fn new(offset: u64, skip_bom: bool) -> Self {
        Chunker { buf: Vec::new(), filled: 0, offset, eof: false, skip_bom }
    }

    /// Bytes read but not yet handed out (the next chunk's start).
    pub fn tail(&self) -> usize {
        self.filled
    }

    /// The next chunk of `src`: `target` bytes are read (fewer at the end), then
    /// `cut(buffer, at_end)` says where the chunk ends and what it found there; `None`
    /// (read more first) grows the target to `more(bytes read)`, which must exceed it.
    /// At the end of the stream `cut` must cut at the end, and the last chunk is handed
    /// out even when empty. `on_read(n)` follows every read.
    pub fn next<M>(
        &mut self,
        src: &mut impl Read,
        bufs: &BufferPool,
        mut target: usize,
        more: impl Fn(usize) -> usize,
        mut cut: impl FnMut(&[u8], bool) -> Option<(usize, M)>,
        mut on_read: impl FnMut(usize),
    ) -> io::Result<Chunk<M>> {
        let mut buf = std::mem::take(&mut self.buf);
        if buf.is_empty() {
            buf = bufs.take();
        }
        loop {
            if let Err(e) = self.fill(src, &mut buf, target, &mut on_read) {
                self.buf = buf;
                return Err(e);
            }
            let filled = self.filled;
            let offset = self.offset;
            if self.eof {
                let (len, found) = cut(&buf[..filled], true).expect("the last chunk is cut at its end");
                debug_assert_eq!(len, filled);
                self.filled = 0;
                self.offset += len as u64;
                return Ok(Chunk { data: buf, len, offset, found, last: true });
            }
            if let Some((c, found)) = cut(&buf[..filled], false) {
                // The tail after the cut starts the next buffer.
                let mut next = bufs.take();
                if next.len() < filled - c {
                    next.resize(filled - c, 0);
                }
                next[..filled - c].copy_from_slice(&buf[c..filled]);
                self.buf = next;
                self.filled = filled - c;
                self.offset += c as u64;
                // Past the start, a byte-order mark is text.
                self.skip_bom = false;
                return Ok(Chunk { data: buf, len: c, offset, found, last: false });
            }
            target = more(filled);
            debug_assert!(target > filled);
        }
    }

    /// Read into `buf[self.filled..target]` until it is full or the stream ends; then skip
    /// a byte-order mark at the start if asked to. `buf`'s length only ever grows.
    fn fill(
        &mut self,
        src: &mut impl Read,
        buf: &mut Vec<u8>,
        target: usize,
        on_read: &mut impl FnMut(usize),
    ) -> io::Result<()> {
        if buf.len() < target {
            buf.resize(target, 0);
        }
        while self.filled < target && !self.eof {
            let n = read_retry(src, &mut buf[self.filled..target])?;
            self.eof = n == 0;
            self.filled += n;
            on_read(n);
        }
        // Judged once the buffer could hold the whole mark.
        if self.skip_bom && (self.filled >= BOM.len() || self.eof) {
            self.skip_bom = false;
            if buf[..self.filled].starts_with(BOM) {
                buf.copy_within(BOM.len()..self.filled, 0);
                self.filled -= BOM.len();
                self.offset += BOM.len() as u64;
            }
        }
        Ok(())
    }

    /// Read and drop the next `n` bytes (all that is left if `None`), each read handed to
    /// `seen` first; returns how many there were (fewer than `n`: the stream ended). Only
    /// before the first chunk, or at a chunk's end with no tail.
    pub fn skip(&mut self, src: &mut impl Read, n: Option<u64>, mut seen: impl FnMut(&[u8])) -> io::Result<u64> {
        assert_eq!(self.filled, 0, "skipping bytes read and not handed out");
        let mut scratch = vec![0u8; RAW_BUFFER];
        let mut done = 0u64;
        loop {
            let want = n.map_or(scratch.len() as u64, |n| (n - done).min(scratch.len() as u64)) as usize;
            if want == 0 {
                break;
            }
            let k = read_retry(src, &mut scratch[..want])?;
            if k == 0 {
                self.eof = true;
                break;
            }
            seen(&scratch[..k]);
            done += k as u64;
            self.offset += k as u64;
            // Past the start, a byte-order mark is text.
            self.skip_bom = false;
        }
        Ok(done)
    }
}

fn read_retry(src: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match src.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests;
