//! The shard writer's side of the chunk reader: the inputs of one part, in order, cut
//! into chunks at document boundaries (see `input.rs` for where a cut may fall) by the one
//! chunk reader (`crate::chunks`), or handed out a batch of documents at a time, hashed on
//! the way.
//!
//! Two hashes. The sidecar's sha256 of each input is over its raw bytes (what
//! `sha256sum` prints). The resume digest is over what was handed out, in logical units
//! (decompressed bytes, or documents with their lengths), chained over the inputs: each
//! chunk carries the digest of everything read up to its end, the journal records the
//! last written chunk's, and a resumed run recomputes it while it skips the inputs'
//! consumed prefix, so an input edited in place (same size and time) is noticed instead
//! of resumed into a shard that mixes old and new text. For plain files the two hashes
//! are one (their raw bytes are their logical bytes), and a file whose documents the
//! caller decodes (Parquet) is hashed whole, which stands for both: hashing costs one
//! pass either way. That hash runs on a thread of its own from when the file is opened,
//! so encoding starts without waiting for it; chunks read before it ends carry no digest
//! (the writer commits no journal at them).

use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use super::docs::{DocBatch, DocSource};
use super::input::{last_cut, part_files, Compression, Format};
use super::parquet::{ParquetDocs, PARQUET_BATCH_BYTES};
use super::{EncodeJob, ShardError};
use crate::buffers::BufferPool;
use crate::chunks::{Chunker, RawReader, Stream};
use crate::specials::SpecialMatcher;

/// A chunk of one input, cut at a document boundary.
pub(crate) struct Chunk {
    pub file: usize,
    /// Logical offset of `data` in the file (bytes; documents for `Format::Docs`).
    pub start: u64,
    /// A pooled buffer: the chunk is `data[..len]` (bytes after `len` are stale).
    pub data: Vec<u8>,
    pub len: usize,
    /// `Format::Docs`: where each document of `data[..len]` ends.
    pub ends: Vec<usize>,
    /// The chunk ends at the end of the file (not merely at the end of this part's range).
    pub at_file_end: bool,
    /// Newlines before `start` in the file (JSON Lines error messages).
    pub first_line: u64,
    /// Input position right after this chunk, for the progress journal.
    pub next_pos: (usize, u64),
    /// Raw bytes of this part's range consumed once this chunk was read.
    pub raw_done: u64,
    /// Resume digest of everything read up to the end of this chunk.
    pub digest: Option<String>,
}

enum Src {
    /// A text or JSON Lines file: its bytes, and the chunks cut from them so far.
    Bytes { stream: Stream, chunker: Chunker },
    /// Documents: the current batch and the next document in it, from a Parquet file
    /// (`parquet`) or else from the caller's `DocSource`; `eof`: no batch is left.
    Docs { batch: DocBatch, next: usize, total: Option<u64>, parquet: Option<Box<ParquetDocs>>, eof: bool },
}

impl Src {
    fn raw_count(&self) -> u64 {
        match self {
            Src::Bytes { stream, .. } => stream.raw_count(),
            Src::Docs { .. } => 0,
        }
    }
    /// Read what the decoder left of the raw file (so the hash covers every byte).
    fn into_raw(self) -> io::Result<Option<RawReader>> {
        match self {
            Src::Bytes { stream, .. } => stream.into_raw().map(Some),
            Src::Docs { .. } => Ok(None),
        }
    }
}

struct OpenFile {
    idx: usize,
    src: Src,
    /// Logical offset of the first byte (document) not yet handed out in a chunk.
    emitted: u64,
    /// Where the logical stream of this part's range starts.
    logical_start: u64,
    /// Newlines in the bytes handed out so far (JSON Lines only).
    lines: u64,
    /// Raw range of the file this part reads.
    range: (u64, u64),
    /// Hash of the logical bytes handed out or skipped (see the module docs).
    logical: Option<Sha256>,
    /// A file whose documents the caller decodes: the sha256 of the whole file stands for
    /// both hashes (one pass over the smaller, raw bytes); `hashing` until it is known.
    whole: Option<[u8; 32]>,
    hashing: Option<std::thread::JoinHandle<Result<[u8; 32], ShardError>>>,
}

impl OpenFile {
    /// The logical hash so far (the whole file's for a decoded file).
    fn prefix_digest(&self) -> Option<[u8; 32]> {
        self.whole.or_else(|| self.logical.clone().map(|h| h.finalize().into()))
    }

    /// Take the whole-file hash once its thread is done (`wait`: wait for it).
    fn settle(&mut self, wait: bool) -> Result<(), ShardError> {
        if self.hashing.as_ref().is_some_and(|h| wait || h.is_finished()) {
            let h = self.hashing.take().unwrap();
            let r = h.join().map_err(|p| ShardError::Panic(super::panic_message(&p)))?;
            self.whole = Some(r?);
        }
        Ok(())
    }

    fn hash_bytes(&mut self, bytes: &[u8]) {
        if let Some(h) = &mut self.logical {
            h.update(bytes);
        }
    }
}

/// Add documents `from..to` of `batch` to a logical hash (each with its length, so that
/// the boundaries count too).
fn hash_docs(logical: &mut Option<Sha256>, batch: &DocBatch, from: usize, to: usize) {
    if let Some(h) = logical {
        for i in from..to {
            let doc = &batch.data[batch.start(i)..batch.ends[i]];
            h.update((doc.len() as u64).to_le_bytes());
            h.update(doc);
        }
    }
}

/// Where the reader stands after a chunk (see `Chunk`).
struct After {
    next_pos: (usize, u64),
    raw_done: u64,
    digest: Option<String>,
}

/// What the shard records about one input.
#[derive(Debug, Clone)]
pub(crate) struct FileSummary {
    pub path: PathBuf,
    pub size: u64,
    pub sha256: Option<String>,
    pub range: (u64, u64),
    pub uncompressed: Option<u64>,
}

pub(crate) struct ChunkReader<'a> {
    job: &'a EncodeJob,
    sizes: &'a [u64],
    source: Option<&'a mut (dyn DocSource + 'static)>,
    /// (file index, raw range) of the files this part reads, in order.
    plan: Vec<(usize, (u64, u64))>,
    plan_idx: usize,
    cur: Option<OpenFile>,
    records: Vec<FileSummary>,
    /// Logical hashes of the files already finished (the resume digest chains them).
    done_digests: Vec<[u8; 32]>,
    /// Raw bytes of this part's range in the files already finished.
    raw_before: u64,
    /// Raw bytes in this part's range.
    raw_total: u64,
    /// Near the end, chunks shrink to about (bytes left) / `tail_split` so that the last
    /// chunks spread over all threads instead of leaving some idle.
    tail_split: u64,
    /// The special-token cuts of plain text (`EncodeJob::separator`).
    separator: SpecialMatcher,
}

/// Chunks never shrink below this for tail balancing.
const MIN_TAIL_CHUNK: usize = 256 << 10;

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

impl<'a> ChunkReader<'a> {
    pub fn new(
        job: &'a EncodeJob,
        sizes: &'a [u64],
        byte_range: (u64, u64),
        source: Option<&'a mut (dyn DocSource + 'static)>,
    ) -> Self {
        ChunkReader {
            separator: job.separator(),
            job,
            sizes,
            source,
            plan: part_files(&job.inputs, sizes, byte_range),
            plan_idx: 0,
            cur: None,
            records: Vec::new(),
            done_digests: Vec::new(),
            raw_before: 0,
            raw_total: byte_range.1 - byte_range.0,
            tail_split: 1,
        }
    }

    /// Balance the last chunks over `threads` encoding threads.
    pub fn balance_tail(&mut self, threads: usize) {
        self.tail_split = 2 * threads.max(1) as u64;
    }

    /// What was read of each input (complete once the reader is exhausted).
    pub fn records(&self) -> Vec<super::InputRecord> {
        self.records.iter().cloned().map(Into::into).collect()
    }

    /// Give the caller's document reader back (to start over with a new reader).
    pub fn into_source(self) -> Option<&'a mut (dyn DocSource + 'static)> {
        self.source
    }

    /// Read, hash and drop everything before `pos` (where an interrupted run stopped);
    /// returns the resume digest there, to compare with the journal's.
    pub fn skip_to(&mut self, pos: (usize, u64)) -> Result<Option<String>, ShardError> {
        while let Some(&(idx, range)) = self.plan.get(self.plan_idx) {
            if idx > pos.0 {
                break;
            }
            let mut f = self.open(idx, range)?;
            if idx < pos.0 {
                self.skip_in(&mut f, None)?;
                self.finish(f)?;
                self.plan_idx += 1;
                continue;
            }
            self.skip_in(&mut f, Some(pos.1))?;
            f.settle(true)?;
            self.cur = Some(f);
            break;
        }
        Ok(self.digest(self.cur.as_ref()))
    }

    /// The resume digest with `cur` read up to its `emitted` position.
    fn digest(&self, cur: Option<&OpenFile>) -> Option<String> {
        if !self.job.opts.hash {
            return None;
        }
        let mut h = Sha256::new();
        for d in &self.done_digests {
            h.update(d);
        }
        if let Some(f) = cur.filter(|f| f.emitted > f.logical_start) {
            h.update(f.prefix_digest()?);
        }
        Some(hex(&h.finalize()))
    }

    fn open(&mut self, idx: usize, range: (u64, u64)) -> Result<OpenFile, ShardError> {
        let spec = &self.job.inputs[idx];
        let hash = self.job.opts.hash;
        let logical_start = spec.logical_start(range);
        let open = |src, hashing: Option<std::thread::JoinHandle<_>>| OpenFile {
            idx,
            src,
            emitted: logical_start,
            logical_start,
            lines: 0,
            range,
            logical: (hash && hashing.is_none()).then(Sha256::new),
            whole: None,
            hashing,
        };
        if spec.format == Format::Docs {
            if spec.path.as_os_str().is_empty() {
                let source = self.source.as_mut().ok_or_else(no_source)?;
                let total = source.open(idx)?;
                let src = Src::Docs { batch: DocBatch::default(), next: 0, total, parquet: None, eof: false };
                return Ok(open(src, None));
            }
            let docs = ParquetDocs::open(&spec.path, &self.job.opts.jsonl_field, PARQUET_BATCH_BYTES)?;
            let total = Some(docs.num_rows());
            let hashing = hash.then(|| {
                let path = spec.path.clone();
                std::thread::spawn(move || hash_file(&path))
            });
            let parquet = Some(Box::new(docs));
            let src = Src::Docs { batch: DocBatch::default(), next: 0, total, parquet, eof: false };
            return Ok(open(src, hashing));
        }
        let mut file = File::open(&spec.path).map_err(|e| ShardError::io(&spec.path, "reading input", e))?;
        if range.0 > 0 {
            file.seek(SeekFrom::Start(range.0)).map_err(|e| ShardError::io(&spec.path, "reading input", e))?;
        }
        // Plain files are hashed once, as their logical bytes (see the module docs).
        let raw_hash = hash && spec.compression != Compression::None;
        let stream = Stream::open(&spec.path, file, range.1 - range.0, spec.compression, raw_hash)?;
        Ok(open(Src::Bytes { stream, chunker: Chunker::new(logical_start, false) }, None))
    }

    fn read_err(&self, f: &OpenFile, e: io::Error) -> ShardError {
        let spec = &self.job.inputs[f.idx];
        match spec.compression {
            Compression::None => ShardError::io(&spec.path, "reading input", e),
            c => ShardError::Corrupt {
                path: spec.path.clone(),
                format: c.name(),
                raw_offset: f.src.raw_count(),
                source: e,
            },
        }
    }

    /// Close the current file: finish its hashes, check its size, record it.
    fn finish(&mut self, mut f: OpenFile) -> Result<(), ShardError> {
        f.settle(true)?;
        let spec = &self.job.inputs[f.idx];
        let corrupt = |e| ShardError::Corrupt {
            path: spec.path.clone(),
            format: spec.compression.name(),
            raw_offset: 0,
            source: e,
        };
        let logical = f.prefix_digest();
        let expected = f.range.1 - f.range.0;
        let raw_sha = match f.src.into_raw().map_err(corrupt)? {
            Some(raw) => {
                if raw.count != expected {
                    return Err(ShardError::Changed { path: spec.path.clone(), expected, got: raw.count });
                }
                raw.hasher.map(|h| <[u8; 32]>::from(h.finalize()))
            }
            None => f.whole,
        };
        // A plain file's raw bytes are its logical bytes; documents without a file are
        // identified by their logical hash.
        let sha256 = raw_sha.or(logical).map(|d| hex(&d));
        self.records.push(FileSummary {
            path: spec.path.clone(),
            size: self.sizes[f.idx],
            sha256,
            range: f.range,
            uncompressed: (spec.compression != Compression::None).then_some(f.emitted),
        });
        if let Some(d) = logical {
            self.done_digests.push(d);
        }
        self.raw_before += expected;
        Ok(())
    }

    /// Read and hash, without handing out, the logical stream up to `target` (its end if
    /// `None`).
    fn skip_in(&mut self, f: &mut OpenFile, target: Option<u64>) -> Result<(), ShardError> {
        if matches!(f.src, Src::Docs { .. }) {
            return self.skip_docs(f, target);
        }
        let jsonl = self.job.inputs[f.idx].format == Format::Jsonl;
        let want = target.map(|t| t.saturating_sub(f.emitted));
        let OpenFile { src: Src::Bytes { stream, chunker }, logical, lines, .. } = f else { unreachable!() };
        let r = chunker.skip(stream, want, |bytes| {
            if jsonl {
                *lines += memchr::memchr_iter(b'\n', bytes).count() as u64;
            }
            if let Some(h) = logical.as_mut() {
                h.update(bytes);
            }
        });
        match r {
            Ok(n) => {
                f.emitted += n;
                match target {
                    Some(t) if want.is_some_and(|w| n < w) => Err(self.changed(f, t)),
                    _ => Ok(()),
                }
            }
            Err(e) => Err(self.read_err(f, e)),
        }
    }

    fn changed(&self, f: &OpenFile, expected: u64) -> ShardError {
        ShardError::Changed { path: self.job.inputs[f.idx].path.clone(), expected, got: f.emitted }
    }

    fn skip_docs(&mut self, f: &mut OpenFile, target: Option<u64>) -> Result<(), ShardError> {
        while target.is_none_or(|t| f.emitted < t) {
            if !self.fill_batch(f)? {
                return match target {
                    Some(t) => Err(self.changed(f, t)),
                    None => Ok(()),
                };
            }
            let OpenFile { src: Src::Docs { batch, next, .. }, logical, emitted, .. } = f else { unreachable!() };
            let left = (batch.len() - *next) as u64;
            let take = target.map_or(left, |t| left.min(t - *emitted)) as usize;
            hash_docs(logical, batch, *next, *next + take);
            *next += take;
            *emitted += take as u64;
        }
        Ok(())
    }

    /// Make sure the current batch has a document left; `false` at the end of the input.
    fn fill_batch(&mut self, f: &mut OpenFile) -> Result<bool, ShardError> {
        let Src::Docs { batch, next, parquet, eof, .. } = &mut f.src else { unreachable!() };
        while *next >= batch.len() {
            if *eof {
                return Ok(false);
            }
            let more = match parquet {
                Some(docs) => docs.next_batch(batch)?,
                None => self.source.as_mut().expect("a Docs input was opened with a source").next_batch(batch)?,
            };
            if more {
                *next = 0;
            } else {
                *eof = true;
            }
        }
        Ok(true)
    }

    /// The next chunk in input order, `None` when this part's inputs are exhausted.
    pub fn next_chunk(&mut self, pool: &BufferPool) -> Result<Option<Chunk>, ShardError> {
        loop {
            if self.cur.is_none() {
                let Some(&(idx, range)) = self.plan.get(self.plan_idx) else {
                    return Ok(None);
                };
                self.cur = Some(self.open(idx, range)?);
            }
            let f = self.cur.take().unwrap();
            let chunk =
                if matches!(f.src, Src::Docs { .. }) { self.docs_chunk(f, pool)? } else { self.bytes_chunk(f, pool)? };
            if chunk.is_some() {
                return Ok(chunk);
            }
        }
    }

    /// Position and progress after a chunk of `f`; finishes `f` when it is done.
    fn advance(&mut self, mut f: OpenFile, done_with_file: bool) -> Result<After, ShardError> {
        if done_with_file {
            self.finish(f)?;
            self.plan_idx += 1;
            let next = self
                .plan
                .get(self.plan_idx)
                .map_or((self.job.inputs.len(), 0), |&(i, r)| (i, self.job.inputs[i].logical_start(r)));
            return Ok(After { next_pos: next, raw_done: self.raw_before, digest: self.digest(None) });
        }
        if let Err(e) = f.settle(false) {
            self.cur = Some(f);
            return Err(e);
        }
        let pos = (f.idx, f.emitted);
        let raw = self.raw_before
            + match &f.src {
                Src::Docs { total: Some(n), .. } if *n > 0 => self.sizes[f.idx] * f.emitted.min(*n) / n,
                src => src.raw_count(),
            };
        let digest = self.digest(Some(&f));
        self.cur = Some(f);
        Ok(After { next_pos: pos, raw_done: raw, digest })
    }

    /// A chunk of documents from the current batch (never spanning two batches).
    fn docs_chunk(&mut self, mut f: OpenFile, pool: &BufferPool) -> Result<Option<Chunk>, ShardError> {
        if let Err(e) = self.fill_batch(&mut f) {
            self.cur = Some(f);
            return Err(e);
        }
        let OpenFile { src: Src::Docs { batch, next, .. }, logical, .. } = &mut f else { unreachable!() };
        if *next >= batch.len() {
            self.advance(f, true)?;
            return Ok(None);
        }
        let (from, base) = (*next, batch.start(*next));
        let mut to = from + 1;
        while to < batch.len() && batch.ends[to - 1] - base < self.job.opts.chunk_size {
            to += 1;
        }
        // A batch of up to two chunks' worth is one chunk: its buffer is handed over
        // instead of copied.
        let whole = from == 0 && batch.ends[batch.len() - 1] <= 2 * self.job.opts.chunk_size;
        if whole {
            to = batch.len();
        }
        let len = batch.ends[to - 1] - base;
        let ends = batch.ends[from..to].iter().map(|e| e - base).collect();
        hash_docs(logical, batch, from, to);
        let mut data = pool.take();
        if whole {
            // The pooled buffer takes the batch's place, to be refilled by the next batch.
            std::mem::swap(&mut data, &mut batch.data);
        } else {
            if data.len() < len {
                data.resize(len, 0);
            }
            data[..len].copy_from_slice(&batch.data[base..base + len]);
        }
        *next = to;
        let (file, start) = (f.idx, f.emitted);
        f.emitted += (to - from) as u64;
        let After { next_pos, raw_done, digest } = self.advance(f, false)?;
        Ok(Some(Chunk { file, start, data, len, ends, at_file_end: false, first_line: 0, next_pos, raw_done, digest }))
    }

    /// A chunk of bytes cut at the last document boundary that the read found.
    fn bytes_chunk(&mut self, mut f: OpenFile, pool: &BufferPool) -> Result<Option<Chunk>, ShardError> {
        let spec = &self.job.inputs[f.idx];
        let Src::Bytes { stream, chunker } = &mut f.src else { unreachable!() };
        let tail = chunker.tail();
        let left = self.raw_total.saturating_sub(self.raw_before + stream.raw_count()) + tail as u64;
        let balanced = ((left / self.tail_split) as usize).max(MIN_TAIL_CHUNK);
        let target = self.job.opts.chunk_size.min(balanced).max(tail + 1);
        let (separator, newline_cuts) = (&self.separator, self.job.opts.newline_cuts);
        let cut = |buf: &[u8], at_end: bool| match at_end {
            true => Some((buf.len(), ())),
            false => last_cut(buf, spec.format, separator, newline_cuts).map(|c| (c, ())),
        };
        let chunk = match chunker.next(stream, pool, target, |filled| filled.saturating_mul(2), cut, |_| {}) {
            Ok(chunk) => chunk,
            Err(e) => {
                let e = self.read_err(&f, e);
                self.cur = Some(f);
                return Err(e);
            }
        };
        let (data, len) = (chunk.data, chunk.len);
        let (file, start, first_line) = (f.idx, f.emitted, f.lines);
        debug_assert_eq!(start, chunk.offset);
        if spec.format == Format::Jsonl {
            f.lines += memchr::memchr_iter(b'\n', &data[..len]).count() as u64;
        }
        f.hash_bytes(&data[..len]);
        f.emitted += len as u64;
        let done_with_file = chunk.last;
        let at_file_end = done_with_file && f.range.1 == self.sizes[f.idx];
        let After { next_pos, raw_done, digest } = self.advance(f, done_with_file)?;
        Ok(Some(Chunk {
            file,
            start,
            data,
            len,
            ends: Vec::new(),
            at_file_end,
            first_line,
            next_pos,
            raw_done,
            digest,
        }))
    }
}

fn no_source() -> ShardError {
    ShardError::Invalid("documents from the caller were asked for, but no document source was given".to_string())
}

/// sha256 of a whole file (inputs whose documents the caller decoded).
fn hash_file(path: &std::path::Path) -> Result<[u8; 32], ShardError> {
    let err = |e| ShardError::io(path, "hashing input", e);
    let mut file = File::open(path).map_err(err)?;
    let mut h = Sha256::new();
    io::copy(&mut file, &mut h).map_err(err)?;
    Ok(h.finalize().into())
}
