//! Reading inputs: plain, gzip or zstd files, cut into chunks at document boundaries,
//! hashed (sha256 of the raw bytes) on the way.
//!
//! Cut points. A chunk always ends where encoding may restart without changing a single
//! id, so the output is the same for any chunk size:
//!
//! * plain text: right after an occurrence of the end-of-text separator (special tokens
//!   are hard boundaries of pre-tokenization);
//! * JSON Lines: right after a newline (each line is its own document);
//! * plain text with no separator in sight (a file that is one long document) and
//!   `newline_cuts`: right after a `\n` whose neighbours are both printable ASCII
//!   (`X\nY`). For the GPT-2, cl100k and o200k patterns the piece containing that `\n`
//!   ends at it and the next piece starts at `Y`, whether or not the text goes on after
//!   the `\n` (checked in the tests against the regex on both sides of each cut). The
//!   caller enables this only for those patterns and when no special token contains `\n`.
//!
//! A document longer than the chunk size without any allowed cut grows its chunk until it
//! ends, so memory is bounded by max(chunk size, longest uncuttable document) per chunk.

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::PathBuf;

use sha2::{Digest, Sha256};

use super::{EncodeJob, ShardError};
use crate::buffers::BufferPool;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    fn name(self) -> &'static str {
        match self {
            Compression::None => "plain",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Documents separated by the end-of-text special token.
    Text,
    /// One JSON object per line; a string field holds the document.
    Jsonl,
}

#[derive(Debug, Clone)]
pub struct InputSpec {
    pub path: PathBuf,
    pub format: Format,
    pub compression: Compression,
}

impl InputSpec {
    /// Compression from the extension (`.gz`, `.zst`/`.zstd`); format from the name
    /// under it (`.jsonl`/`.ndjson` are JSON Lines) unless `format` is given.
    pub fn detect(path: impl Into<PathBuf>, format: Option<Format>) -> InputSpec {
        let path = path.into();
        let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
        let (compression, base) = if let Some(b) = name.strip_suffix(".gz") {
            (Compression::Gzip, b)
        } else if let Some(b) = name.strip_suffix(".zst").or_else(|| name.strip_suffix(".zstd")) {
            (Compression::Zstd, b)
        } else {
            (Compression::None, name.as_str())
        };
        let detected = if base.ends_with(".jsonl") || base.ends_with(".ndjson") { Format::Jsonl } else { Format::Text };
        InputSpec { path, format: format.unwrap_or(detected), compression }
    }
}

/// Sizes of the inputs on disk (a missing input is an error here, before anything is written).
pub(crate) fn file_sizes(inputs: &[InputSpec]) -> Result<Vec<u64>, ShardError> {
    inputs
        .iter()
        .map(|spec| {
            let meta = std::fs::metadata(&spec.path).map_err(|e| ShardError::io(&spec.path, "reading input", e))?;
            if meta.is_dir() {
                return Err(ShardError::Invalid(format!("input {} is a directory, not a file", spec.path.display())));
            }
            Ok(meta.len())
        })
        .collect()
}

fn global_starts(sizes: &[u64]) -> Vec<u64> {
    let mut starts = Vec::with_capacity(sizes.len() + 1);
    let mut acc = 0u64;
    for &s in sizes {
        starts.push(acc);
        acc += s;
    }
    starts.push(acc);
    starts
}

/// Bytes after which the chunk/part cut search prefers a newline cut to waiting for a separator.
const SEPARATOR_WINDOW: u64 = 16 << 20;

/// The byte range `[start, end)` of the concatenated raw inputs that part `i` of `n` covers.
///
/// Nominal boundaries `k * total / n` move forward to the next cut point (see the module
/// docs); a compressed file cannot be split, so it belongs whole to the part in which it
/// starts. Consecutive parts tile the inputs exactly.
pub fn part_range(
    inputs: &[InputSpec],
    sizes: &[u64],
    i: u64,
    n: u64,
    sep: Option<&str>,
    newline_cuts: bool,
) -> Result<(u64, u64), ShardError> {
    let starts = global_starts(sizes);
    let total = *starts.last().unwrap();
    let boundary = |k: u64| -> Result<u64, ShardError> {
        if k == 0 {
            return Ok(0);
        }
        if k >= n {
            return Ok(total);
        }
        let b = ((total as u128 * k as u128) / n as u128) as u64;
        cut_at_or_after(inputs, sizes, &starts, b, sep, newline_cuts)
    };
    Ok((boundary(i)?, boundary(i + 1)?))
}

fn cut_at_or_after(
    inputs: &[InputSpec],
    sizes: &[u64],
    starts: &[u64],
    b: u64,
    sep: Option<&str>,
    newline_cuts: bool,
) -> Result<u64, ShardError> {
    let total = *starts.last().unwrap();
    // The file that contains byte b (files of size 0 contain nothing).
    let Some(f) = (0..inputs.len()).find(|&f| starts[f] <= b && b < starts[f] + sizes[f]) else {
        return Ok(total.min(b));
    };
    let (fs, fe) = (starts[f], starts[f] + sizes[f]);
    if b == fs {
        return Ok(b);
    }
    let spec = &inputs[f];
    if spec.compression != Compression::None {
        return Ok(fe);
    }
    let local = first_cut_in_file(spec, sizes[f], b - fs, sep, newline_cuts)?;
    Ok(fs + local)
}

/// The first cut point >= `lb` in a plain file (its size if there is none).
fn first_cut_in_file(
    spec: &InputSpec,
    size: u64,
    lb: u64,
    sep: Option<&str>,
    newline_cuts: bool,
) -> Result<u64, ShardError> {
    let sep = sep.map(str::as_bytes).filter(|s| !s.is_empty());
    let back = sep.map_or(0, |s| s.len() as u64).max(2);
    let from = lb.saturating_sub(back);
    let mut file = File::open(&spec.path).map_err(|e| ShardError::io(&spec.path, "reading input", e))?;
    let mut window = 1u64 << 20;
    loop {
        let end = size.min(lb.saturating_add(window));
        let mut buf = vec![0u8; (end - from) as usize];
        file.seek(SeekFrom::Start(from))
            .and_then(|_| file.read_exact(&mut buf))
            .map_err(|e| ShardError::io(&spec.path, "reading input", e))?;
        let at_eof = end == size;
        let lb_rel = (lb - from) as usize;
        match spec.format {
            Format::Jsonl => {
                if let Some(p) = memchr::memchr_iter(b'\n', &buf).find(|&p| p + 1 >= lb_rel) {
                    return Ok(from + p as u64 + 1);
                }
            }
            Format::Text => {
                if let Some(sep) = sep {
                    let found = memchr::memmem::find_iter(&buf, sep).map(|p| p + sep.len()).find(|&c| c >= lb_rel);
                    if let Some(c) = found {
                        return Ok(from + c as u64);
                    }
                }
                if newline_cuts && (window >= SEPARATOR_WINDOW || at_eof || sep.is_none()) {
                    if let Some(c) = newline_cuts_iter(&buf).find(|&c| c >= lb_rel) {
                        return Ok(from + c as u64);
                    }
                }
            }
        }
        if at_eof {
            return Ok(size);
        }
        window *= 2;
    }
}

fn newline_ok(buf: &[u8], p: usize) -> bool {
    p >= 1 && p + 1 < buf.len() && buf[p - 1].is_ascii_graphic() && buf[p + 1].is_ascii_graphic()
}

/// Cut points (index after the `\n`) of `X\nY` newlines, in increasing order.
fn newline_cuts_iter(buf: &[u8]) -> impl Iterator<Item = usize> + '_ {
    memchr::memchr_iter(b'\n', buf).filter(move |&p| newline_ok(buf, p)).map(|p| p + 1)
}

/// The last cut point of `buf` (a chunk that starts at a cut point), if any.
pub(crate) fn last_cut(buf: &[u8], format: Format, sep: Option<&[u8]>, newline_cuts: bool) -> Option<usize> {
    match format {
        Format::Jsonl => memchr::memrchr(b'\n', buf).map(|p| p + 1),
        Format::Text => {
            if let Some(sep) = sep {
                if let Some(p) = memchr::memmem::rfind(buf, sep) {
                    return Some(p + sep.len());
                }
            }
            if newline_cuts {
                memchr::memrchr_iter(b'\n', buf).find(|&p| newline_ok(buf, p)).map(|p| p + 1)
            } else {
                None
            }
        }
    }
}

/// A chunk of one input, cut at a document boundary.
pub(crate) struct Chunk {
    pub file: usize,
    /// Logical (decompressed) offset of `data` in the file.
    pub start: u64,
    /// A pooled buffer: the chunk is `data[..len]` (bytes after `len` are stale).
    pub data: Vec<u8>,
    pub len: usize,
    /// The chunk ends at the end of the file (not merely at the end of this part's range).
    pub at_file_end: bool,
    /// Newlines before `start` in the file (JSON Lines error messages).
    pub first_line: u64,
    /// Input position right after this chunk, for the progress journal.
    pub next_pos: (usize, u64),
    /// Raw bytes of this part's range consumed once this chunk was read.
    pub raw_done: u64,
}

/// sha256 and byte count of everything read through it.
struct RawReader {
    inner: io::Take<File>,
    hasher: Option<Sha256>,
    count: u64,
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

const RAW_BUFFER: usize = 1 << 20;

enum Src {
    Plain(RawReader),
    Gzip(flate2::bufread::MultiGzDecoder<BufReader<RawReader>>),
    Zstd(zstd::stream::read::Decoder<'static, BufReader<RawReader>>),
}

impl Src {
    fn raw(&self) -> &RawReader {
        match self {
            Src::Plain(r) => r,
            Src::Gzip(d) => d.get_ref().get_ref(),
            Src::Zstd(d) => d.get_ref().get_ref(),
        }
    }
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Src::Plain(r) => r.read(buf),
            Src::Gzip(d) => d.read(buf),
            Src::Zstd(d) => d.read(buf),
        }
    }
    /// Read what the decoder left of the raw file (so the hash covers every byte).
    fn into_raw(self) -> io::Result<RawReader> {
        let mut raw = match self {
            Src::Plain(r) => return Ok(r),
            Src::Gzip(d) => d.into_inner().into_inner(),
            Src::Zstd(d) => d.finish().into_inner(),
        };
        io::copy(&mut raw, &mut io::sink())?;
        Ok(raw)
    }
}

struct OpenFile {
    idx: usize,
    src: Src,
    /// Logical offset of the first byte not yet handed out in a chunk.
    emitted: u64,
    /// Newlines in the bytes handed out so far (JSON Lines only).
    lines: u64,
    /// Raw range of the file this part reads.
    range: (u64, u64),
    eof: bool,
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
    /// (file index, raw range) of the files this part reads, in order.
    plan: Vec<(usize, (u64, u64))>,
    plan_idx: usize,
    cur: Option<OpenFile>,
    carry: Vec<u8>,
    records: Vec<FileSummary>,
    /// Raw bytes of this part's range in the files already finished.
    raw_before: u64,
    /// Where an interrupted run stopped: everything before is hashed but not chunked.
    resume: Option<(usize, u64)>,
    /// Raw bytes in this part's range.
    raw_total: u64,
    /// Near the end, chunks shrink to about (bytes left) / `tail_split` so that the last
    /// chunks spread over all threads instead of leaving some idle.
    tail_split: u64,
}

/// Chunks never shrink below this for tail balancing.
const MIN_TAIL_CHUNK: usize = 256 << 10;

impl<'a> ChunkReader<'a> {
    pub fn new(
        job: &'a EncodeJob,
        sizes: &'a [u64],
        byte_range: (u64, u64),
        resume: Option<(usize, u64)>,
    ) -> Result<Self, ShardError> {
        let starts = global_starts(sizes);
        let total = *starts.last().unwrap();
        let (c0, c1) = byte_range;
        let mut plan = Vec::new();
        for (f, spec) in job.inputs.iter().enumerate() {
            let (fs, fe) = (starts[f], starts[f + 1]);
            if fs == fe {
                // Empty file: in the part where it sits (the last part for files at the end).
                if (c0 <= fs && fs < c1) || (fs == total && c1 == total) {
                    plan.push((f, (0, 0)));
                }
                continue;
            }
            if spec.compression != Compression::None {
                if c0 <= fs && fs < c1 {
                    plan.push((f, (0, fe - fs)));
                }
                continue;
            }
            let (a, b) = (c0.max(fs), c1.min(fe));
            if a < b {
                plan.push((f, (a - fs, b - fs)));
            }
        }
        Ok(ChunkReader {
            job,
            sizes,
            plan,
            plan_idx: 0,
            cur: None,
            carry: Vec::new(),
            records: Vec::new(),
            raw_before: 0,
            resume,
            raw_total: c1 - c0,
            tail_split: 1,
        })
    }

    /// Balance the last chunks over `threads` encoding threads.
    pub fn balance_tail(&mut self, threads: usize) {
        self.tail_split = 2 * threads.max(1) as u64;
    }

    /// What was read of each input (complete once the reader is exhausted).
    pub fn records(&self) -> Vec<super::InputRecord> {
        self.records.iter().cloned().map(Into::into).collect()
    }

    fn open(&self, idx: usize, range: (u64, u64)) -> Result<OpenFile, ShardError> {
        let spec = &self.job.inputs[idx];
        let mut file = File::open(&spec.path).map_err(|e| ShardError::io(&spec.path, "reading input", e))?;
        if range.0 > 0 {
            file.seek(SeekFrom::Start(range.0)).map_err(|e| ShardError::io(&spec.path, "reading input", e))?;
        }
        let raw = RawReader { inner: file.take(range.1 - range.0), hasher: self.job.hash.then(Sha256::new), count: 0 };
        let src = match spec.compression {
            Compression::None => Src::Plain(raw),
            Compression::Gzip => {
                Src::Gzip(flate2::bufread::MultiGzDecoder::new(BufReader::with_capacity(RAW_BUFFER, raw)))
            }
            Compression::Zstd => Src::Zstd(
                zstd::stream::read::Decoder::with_buffer(BufReader::with_capacity(RAW_BUFFER, raw))
                    .map_err(|e| ShardError::io(&spec.path, "opening zstd stream of", e))?,
            ),
        };
        let logical_start = if spec.compression == Compression::None { range.0 } else { 0 };
        Ok(OpenFile { idx, src, emitted: logical_start, lines: 0, range, eof: false })
    }

    fn read_err(&self, f: &OpenFile, e: io::Error) -> ShardError {
        let spec = &self.job.inputs[f.idx];
        match spec.compression {
            Compression::None => ShardError::io(&spec.path, "reading input", e),
            c => ShardError::Corrupt {
                path: spec.path.clone(),
                format: c.name(),
                raw_offset: f.src.raw().count,
                source: e,
            },
        }
    }

    /// Read into `buf[*filled..target]` until `*filled == target` or the file ends. `buf`'s
    /// length is only ever grown (pooled buffers stay initialized, so nothing is re-zeroed).
    fn fill(&self, f: &mut OpenFile, buf: &mut Vec<u8>, filled: &mut usize, target: usize) -> Result<(), ShardError> {
        if buf.len() < target {
            buf.resize(target, 0);
        }
        while *filled < target {
            match f.src.read(&mut buf[*filled..target]) {
                Ok(0) => {
                    f.eof = true;
                    break;
                }
                Ok(n) => *filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.read_err(f, e)),
            }
        }
        Ok(())
    }

    /// Close the current file: finish its hash, check its size, record it.
    fn finish(&mut self, f: OpenFile) -> Result<(), ShardError> {
        let spec = &self.job.inputs[f.idx];
        let logical_end = f.emitted;
        let raw = match f.src.into_raw() {
            Ok(raw) => raw,
            Err(e) => {
                return Err(ShardError::Corrupt {
                    path: spec.path.clone(),
                    format: spec.compression.name(),
                    raw_offset: 0,
                    source: e,
                })
            }
        };
        let expected = f.range.1 - f.range.0;
        if raw.count != expected {
            return Err(ShardError::Changed { path: spec.path.clone(), expected, got: raw.count });
        }
        let sha256 = raw.hasher.map(|h| h.finalize().iter().map(|b| format!("{b:02x}")).collect());
        self.records.push(FileSummary {
            path: spec.path.clone(),
            size: self.sizes[f.idx],
            sha256,
            range: f.range,
            uncompressed: if spec.compression == Compression::None { None } else { Some(logical_end) },
        });
        self.raw_before += expected;
        Ok(())
    }

    /// Read and hash, without handing out, the bytes before the resume point.
    fn skip_to(&self, f: &mut OpenFile, target: Option<u64>) -> Result<(), ShardError> {
        let mut scratch = vec![0u8; RAW_BUFFER];
        let jsonl = self.job.inputs[f.idx].format == Format::Jsonl;
        loop {
            let want = match target {
                Some(t) => (t - f.emitted).min(scratch.len() as u64) as usize,
                None => scratch.len(),
            };
            if want == 0 {
                return Ok(());
            }
            match f.src.read(&mut scratch[..want]) {
                Ok(0) => {
                    f.eof = true;
                    return match target {
                        Some(t) if t != f.emitted => Err(ShardError::Changed {
                            path: self.job.inputs[f.idx].path.clone(),
                            expected: t,
                            got: f.emitted,
                        }),
                        _ => Ok(()),
                    };
                }
                Ok(n) => {
                    if jsonl {
                        f.lines += memchr::memchr_iter(b'\n', &scratch[..n]).count() as u64;
                    }
                    f.emitted += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.read_err(f, e)),
            }
        }
    }

    /// The next chunk in input order, `None` when this part's inputs are exhausted.
    pub fn next_chunk(&mut self, pool: &BufferPool) -> Result<Option<Chunk>, ShardError> {
        loop {
            if self.cur.is_none() {
                let Some(&(idx, range)) = self.plan.get(self.plan_idx) else {
                    return Ok(None);
                };
                let mut f = self.open(idx, range)?;
                match self.resume {
                    Some((rf, _)) if idx < rf => {
                        // Done by the interrupted run: hash only.
                        self.skip_to(&mut f, None)?;
                        self.finish(f)?;
                        self.plan_idx += 1;
                        continue;
                    }
                    Some((rf, ro)) if idx == rf => {
                        self.skip_to(&mut f, Some(ro))?;
                        self.resume = None;
                    }
                    _ => self.resume = None,
                }
                self.carry.clear();
                self.cur = Some(f);
            }
            let mut f = self.cur.take().unwrap();
            let spec = &self.job.inputs[f.idx];
            let sep = self.job.eos.as_ref().map(|(s, _)| s.as_bytes());
            let mut buf = pool.take();
            let mut filled = self.carry.len();
            if buf.len() < filled {
                buf.resize(filled, 0);
            }
            buf[..filled].copy_from_slice(&self.carry);
            self.carry.clear();
            let left = self.raw_total.saturating_sub(self.raw_before + f.src.raw().count) + filled as u64;
            let balanced = ((left / self.tail_split) as usize).max(MIN_TAIL_CHUNK);
            let mut target = self.job.chunk_size.min(balanced).max(filled + 1);
            let cut = loop {
                if let Err(e) = self.fill(&mut f, &mut buf, &mut filled, target) {
                    self.cur = Some(f);
                    return Err(e);
                }
                if f.eof {
                    break filled;
                }
                if let Some(c) = last_cut(&buf[..filled], spec.format, sep, self.job.newline_cuts) {
                    break c;
                }
                target = filled.saturating_mul(2);
            };
            self.carry.extend_from_slice(&buf[cut..filled]);
            let len = cut;
            let start = f.emitted;
            let first_line = f.lines;
            if spec.format == Format::Jsonl {
                f.lines += memchr::memchr_iter(b'\n', &buf[..len]).count() as u64;
            }
            f.emitted += cut as u64;
            let done_with_file = f.eof && self.carry.is_empty();
            let at_file_end = done_with_file && f.range.1 == self.sizes[f.idx];
            let file = f.idx;
            let (next_pos, raw_done) = if done_with_file {
                self.finish(f)?;
                self.plan_idx += 1;
                let next = self.plan.get(self.plan_idx).map_or((self.job.inputs.len(), 0), |&(i, r)| {
                    (i, if self.job.inputs[i].compression == Compression::None { r.0 } else { 0 })
                });
                (next, self.raw_before)
            } else {
                let pos = (f.idx, f.emitted);
                let raw = self.raw_before + f.src.raw().count;
                self.cur = Some(f);
                (pos, raw)
            };
            return Ok(Some(Chunk { file, start, data: buf, len, at_file_end, first_line, next_pos, raw_done }));
        }
    }
}
