//! Byte-level BPE training: exact, streaming, parallel.
//!
//! Stages, each its own function:
//! 1. [`read::for_each_chunk`]: read a file in bounded chunks (never the whole file),
//!    cut at special tokens or other exact boundaries;
//! 2. [`count::Counter::count_segments`]: pre-tokenize in parallel and count unique
//!    pre-tokens, one table per worker, merged at the end;
//! 3. and 4. [`merge::learn_merges`]: build words, pair counts and the pair -> words
//!    index, then merge with a lazily invalidated max-heap, rewriting only the
//!    affected words.
//!
//! Semantics (docs/DESIGN.md): special tokens split the text and are never part of a
//! pre-token; each file is its own text (no pre-token spans two), and the texts fed to
//! the text stream are one continuous text;
//! among pairs of equal count the lexicographically greatest (bytes, bytes) wins.
//! Results do not depend on the number of threads or on chunk sizes.
//!
//! Memory: the unique pre-token tables (one per worker until they are merged), the
//! words and pair index built from them, and at most three 8 MiB chunks of the file
//! being read. It does not grow with the size of the corpus beyond the unique pre-tokens.

pub mod count;
pub mod counts_file;
pub mod merge;
pub mod read;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use crate::cut::{self, Cut};
use crate::pretokenize::{PatternError, PreTokenizer};
use crate::shards::PARQUET_BATCH_BYTES;
use crate::shards::{self, sniff::sniff, Compression, DocBatch, Format, InputSpec, ParquetDocs, ShardError};
use crate::specials::SpecialMatcher;

pub use crate::utf8::Utf8Errors;
pub use count::PieceCounts;
use count::{Counter, Segment};
pub use merge::Merges;
use merge::{learn_merges, MergeTimes, Words};

/// Ask Linux to back the spare capacity of `v` with 2 MiB pages (transparent huge pages
/// on request); call it before the memory is first written. The trainer's big tables
/// (pre-token counts, words) are read at random, and with 4 KiB pages most accesses
/// would also miss the TLB, which costs twice over in a virtual machine. A hint only:
/// nothing changes where the OS does not follow it.
pub(crate) fn advise_huge_pages<T>(v: &Vec<T>) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = v.as_ptr() as usize + v.len() * std::mem::size_of::<T>();
        let end = v.as_ptr() as usize + v.capacity() * std::mem::size_of::<T>();
        let first = start.div_ceil(HUGE) * HUGE;
        if end >= first + HUGE {
            let len = (end - first) / HUGE * HUGE;
            // SAFETY: advice on whole pages inside an allocation that `v` owns; it does
            // not change their contents, and failure is harmless.
            unsafe {
                libc::madvise(first as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

/// Default chunk size for reading files.
pub const DEFAULT_CHUNK_SIZE: usize = 8 << 20;

/// Shared between the trainer and whoever watches it: progress counters and a
/// cancellation flag (set by the Python side on Ctrl-C). All fields are atomics.
#[derive(Default)]
pub struct Control {
    cancel: AtomicBool,
    done: AtomicU64,
    total: AtomicU64,
}

impl Control {
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
    pub fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
    pub fn add_done(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }
    pub fn set_done(&self, n: u64) {
        self.done.store(n, Ordering::Relaxed);
    }
    pub fn set_total(&self, n: u64) {
        self.total.store(n, Ordering::Relaxed);
    }
    /// (done, total) of the current stage.
    pub fn progress(&self) -> (u64, u64) {
        (self.done.load(Ordering::Relaxed), self.total.load(Ordering::Relaxed))
    }
}

#[derive(Debug)]
pub enum TrainError {
    /// Opening or reading `path` failed.
    Io {
        path: PathBuf,
        err: io::Error,
    },
    /// `source` is not UTF-8 at byte `offset` (and errors = strict).
    InvalidUtf8 {
        source: String,
        offset: u64,
    },
    /// A bad argument or an unusable corpus; the message says which.
    InvalidInput(String),
    Pattern(PatternError),
    /// Stopped through [`Control::cancel`].
    Cancelled,
}

impl fmt::Display for TrainError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrainError::Io { path, err } => write!(f, "{}: {}", path.display(), err),
            TrainError::InvalidUtf8 { source, offset } => write!(
                f,
                "{source}: invalid UTF-8 at byte offset {offset} (pass errors=\"replace\" to replace invalid bytes with U+FFFD)"
            ),
            TrainError::InvalidInput(msg) => f.write_str(msg),
            TrainError::Pattern(e) => write!(f, "{e}"),
            TrainError::Cancelled => f.write_str("training was cancelled"),
        }
    }
}

impl std::error::Error for TrainError {}

/// The shared input reader's errors (it names the file in each).
impl From<ShardError> for TrainError {
    fn from(e: ShardError) -> Self {
        match e {
            ShardError::Io { path, source, .. } => TrainError::Io { path, err: source },
            e => TrainError::InvalidInput(e.to_string()),
        }
    }
}

/// Where a chunk of JSON Lines may end: the shard writer's rule (after a newline).
fn jsonl_cut(buf: &[u8]) -> Option<usize> {
    shards::input::last_cut(buf, Format::Jsonl, &SpecialMatcher::default(), false)
}

/// An input and the byte range of it that a part reads.
type PartFile = (usize, (u64, u64));

/// Part `i` of `n` of the inputs `specs` as (input, byte range) pairs: nearly equal byte
/// ranges of the inputs read end to end, each boundary moved forward to the first exact
/// cut at the end of a special-token match (`crate::cut`; exact for any pattern) or to a
/// file's end. The shard writer's part rule, with special-token cuts only; compressed,
/// JSON Lines and Parquet files are not cut (each goes whole to the part in which it
/// starts: line numbers in messages count from a file's start).
fn part_plan(specs: &[InputSpec], specials: &SpecialMatcher, i: u64, n: u64) -> Result<Vec<PartFile>, TrainError> {
    if n == 0 || i >= n {
        return Err(TrainError::InvalidInput(format!("part {i}/{n}: need 0 <= I < N")));
    }
    let sizes = specs.iter().map(|s| shards::regular_file_size(&s.path)).collect::<Result<Vec<_>, _>>()?;
    // Documents whole: what `part_range` never cuts.
    let whole: Vec<InputSpec> = specs
        .iter()
        .map(|s| match s.format {
            Format::Jsonl => InputSpec { format: Format::Docs, ..s.clone() },
            _ => s.clone(),
        })
        .collect();
    let range = shards::part_range(&whole, &sizes, i, n, specials, false)?;
    Ok(shards::input::part_files(&whole, &sizes, range))
}

/// The `(path, start, end)` byte ranges that part `i` of `n` of `paths` counts
/// ([`Trainer::count_part`]); `field`: the JSON Lines / Parquet field, for telling formats.
pub fn part_ranges(
    paths: &[PathBuf],
    field: &str,
    special_tokens: &[String],
    i: u64,
    n: u64,
) -> Result<Vec<(PathBuf, u64, u64)>, TrainError> {
    let (specs, _) = Trainer::check_files(paths, field)?;
    let plan = part_plan(&specs, &SpecialMatcher::from_strings(special_tokens), i, n)?;
    Ok(plan.into_iter().map(|(f, (a, b))| (specs[f].path.clone(), a, b)).collect())
}

impl From<PatternError> for TrainError {
    fn from(e: PatternError) -> Self {
        TrainError::Pattern(e)
    }
}

/// Wall-clock seconds spent in each stage, and sizes, for profiling.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    /// Reading files (I/O and cutting chunks), outside pre-tokenization.
    pub read_s: f64,
    /// Pre-tokenizing and counting (parallel).
    pub count_s: f64,
    /// Merging the workers' tables.
    pub merge_tables_s: f64,
    /// Building words, pair counts, the pair index and the heap.
    pub build_s: f64,
    /// The merge loop.
    pub merge_s: f64,
    /// Of `build_s`, building the words alone.
    pub words_s: f64,
    /// Pruning in the merge loop (see `merge`): the first floor (1: none), exact
    /// recounts of all pairs, and rescans of one symbol's pairs.
    pub prune_floor: i64,
    pub recounts: u32,
    pub rescans: u32,
    pub bytes: u64,
    pub unique_pretokens: u64,
    pub words: u64,
    pub merges: u64,
}

/// A BPE training run: count any number of files and texts, then learn merges.
pub struct Trainer {
    pre: PreTokenizer,
    builtin: bool,
    splitter: SpecialMatcher,
    pool: std::sync::Arc<rayon::ThreadPool>,
    counter: Option<Counter>,
    /// Counts added from counts files (`add_counts_file`), merged with the counted ones
    /// when learning.
    loaded: PieceCounts,
    errors: Utf8Errors,
    chunk_size: usize,
    /// The text stream's unprocessed tail, and where it starts in the stream.
    text_buf: Vec<u8>,
    stream_offset: u64,
    pub stats: Stats,
}

impl Trainer {
    /// `num_threads`: None = all cores. `chunk_size`: bytes read from a file at a time.
    pub fn new(
        special_tokens: &[String],
        pattern: &str,
        num_threads: Option<usize>,
        errors: Utf8Errors,
        chunk_size: usize,
    ) -> Result<Self, TrainError> {
        if special_tokens.iter().any(|s| s.is_empty()) {
            return Err(TrainError::InvalidInput("special tokens must not be empty strings".into()));
        }
        if num_threads == Some(0) {
            return Err(TrainError::InvalidInput("num_threads must be at least 1".into()));
        }
        let pre = PreTokenizer::new(pattern)?;
        let builtin = pre.is_builtin();
        // ferrolm's shared, fork-safe pool of this size (kept between calls). Each worker
        // gets its own count tables, so an absurd thread count is refused up front.
        let pool = crate::threads::try_pool(num_threads).map_err(TrainError::InvalidInput)?;
        let counter = Some(Counter::new(pool.current_num_threads()));
        Ok(Trainer {
            pre,
            builtin,
            splitter: SpecialMatcher::from_strings(special_tokens),
            pool,
            counter,
            loaded: PieceCounts::default(),
            errors,
            chunk_size: chunk_size.max(64),
            text_buf: Vec::new(),
            stream_offset: 0,
            stats: Stats::default(),
        })
    }

    fn counter(&self) -> Result<&Counter, TrainError> {
        self.counter
            .as_ref()
            .ok_or_else(|| TrainError::InvalidInput("this trainer has already learned its merges".into()))
    }

    /// Check that every path is a readable regular file and find what it holds (as the
    /// shard writer does); returns the inputs and their total size on disk.
    pub fn check_files(paths: &[PathBuf], field: &str) -> Result<(Vec<InputSpec>, u64), TrainError> {
        let mut total = 0;
        for p in paths {
            total += shards::regular_file_size(p).map_err(TrainError::from)?;
            // Opening now reports unreadable files before any work is done.
            std::fs::File::open(p).map_err(|err| TrainError::Io { path: p.clone(), err })?;
        }
        let specs = paths.iter().map(|p| sniff(&InputSpec::detect(p, None), field)).collect::<Result<_, _>>()?;
        Ok((specs, total))
    }

    /// Count the pre-tokens of each file, each its own text, read as `ferrolm encode`
    /// reads it: plain text, `.gz` / `.zst` compressed text, JSON Lines (the string
    /// `field` of each record is a document) or Parquet (column `field`).
    pub fn count_files(&mut self, paths: &[PathBuf], field: &str, ctl: &Control) -> Result<(), TrainError> {
        self.counter()?;
        let (specs, total) = Self::check_files(paths, field)?;
        ctl.set_total(total);
        ctl.set_done(0);
        let bufs = crate::buffers::BufferPool::default();
        for spec in &specs {
            match spec.format {
                Format::Docs => self.count_parquet(&spec.path, field, ctl)?,
                Format::Text | Format::Jsonl => self.count_file(spec, field, None, &bufs, ctl)?,
            }
        }
        Ok(())
    }

    /// Count part `i` of `n` of the inputs (see [`part_ranges`]), each range its own text;
    /// returns the ranges. The counts of all `n` parts add up to those of `count_files`.
    pub fn count_part(
        &mut self,
        paths: &[PathBuf],
        field: &str,
        i: u64,
        n: u64,
        ctl: &Control,
    ) -> Result<Vec<(PathBuf, u64, u64)>, TrainError> {
        self.counter()?;
        let (specs, _) = Self::check_files(paths, field)?;
        let plan = part_plan(&specs, &self.splitter, i, n)?;
        ctl.set_total(plan.iter().map(|(_, (a, b))| b - a).sum());
        ctl.set_done(0);
        let bufs = crate::buffers::BufferPool::default();
        for &(f, range) in &plan {
            let spec = &specs[f];
            match spec.format {
                Format::Docs => self.count_parquet(&spec.path, field, ctl)?,
                Format::Text | Format::Jsonl => {
                    let range = (spec.compression == Compression::None).then_some(range);
                    self.count_file(spec, field, range, &bufs, ctl)?
                }
            }
        }
        Ok(plan.into_iter().map(|(f, (a, b))| (specs[f].path.clone(), a, b)).collect())
    }

    /// A text or JSON Lines file (decompressed on the way), through the chunk reader;
    /// `range`: only these bytes of a plain file, as a text of their own.
    fn count_file(
        &mut self,
        spec: &InputSpec,
        field: &str,
        range: Option<(u64, u64)>,
        bufs: &crate::buffers::BufferPool,
        ctl: &Control,
    ) -> Result<(), TrainError> {
        use std::io::Seek;
        let path = &spec.path;
        let compressed = spec.compression != Compression::None;
        let name = if compressed { format!("{} (decompressed)", path.display()) } else { path.display().to_string() };
        let io_err = |err| TrainError::Io { path: path.clone(), err };
        let mut file = std::fs::File::open(path).map_err(io_err)?;
        let (size, base) = match range {
            Some((a, b)) => {
                file.seek(io::SeekFrom::Start(a)).map_err(io_err)?;
                (Some(b - a), a)
            }
            None if compressed => (None, 0),
            None => (file.metadata().ok().map(|m| m.len()), 0),
        };
        let input = crate::chunks::Stream::open(path, file, size.unwrap_or(u64::MAX), spec.compression, false)?;
        let t0 = Instant::now();
        let mut count_s = 0.0;
        let mut bytes = 0u64;
        let res = if spec.format == Format::Jsonl {
            let mut lines = 0u64;
            let mut docs = DocBatch::default();
            read::for_each_chunk(
                input,
                size,
                self.chunk_size,
                base == 0,
                bufs,
                |buf, at_end| if at_end { Some((buf.len(), ())) } else { jsonl_cut(buf).map(|c| (c, ())) },
                |n| bytes += n as u64,
                |chunk, (), offset| -> Result<(), ChunkError> {
                    let t = Instant::now();
                    let r = self.count_jsonl(chunk, base + offset, &mut lines, &mut docs, field, &name, ctl);
                    count_s += t.elapsed().as_secs_f64();
                    r.map_err(ChunkError::Train)
                },
            )
        } else {
            read::for_each_chunk(
                input,
                size,
                self.chunk_size,
                base == 0,
                bufs,
                |buf, at_end| self.cut(buf, at_end).map(|c| (c.at, c.segments)),
                |n| bytes += n as u64,
                |chunk, segments, offset| -> Result<(), ChunkError> {
                    let t = Instant::now();
                    let r = self.count_buffer(chunk, segments, base + offset, &name, ctl);
                    count_s += t.elapsed().as_secs_f64();
                    r.map_err(ChunkError::Train)
                },
            )
        };
        let elapsed = t0.elapsed().as_secs_f64();
        self.stats.count_s += count_s;
        self.stats.read_s += elapsed - count_s;
        self.stats.bytes += bytes;
        match res {
            Ok(()) => Ok(()),
            Err(ChunkError::Io(err)) if compressed => Err(TrainError::InvalidInput(format!(
                "{}: corrupt or truncated {} data: {err}",
                path.display(),
                spec.compression.name()
            ))),
            Err(ChunkError::Io(err)) => Err(TrainError::Io { path: path.clone(), err }),
            Err(ChunkError::Train(e)) => Err(e),
        }
    }

    /// Count the documents of a chunk of whole JSON Lines records; `lines`: the lines
    /// before it (advanced past it), `docs`: a batch to reuse.
    #[allow(clippy::too_many_arguments)]
    fn count_jsonl(
        &self,
        chunk: &[u8],
        offset: u64,
        lines: &mut u64,
        docs: &mut DocBatch,
        field: &str,
        source: &str,
        ctl: &Control,
    ) -> Result<(), TrainError> {
        let text = match crate::utf8::to_str(chunk) {
            Ok(t) => std::borrow::Cow::Borrowed(t),
            Err(_) if self.errors == Utf8Errors::Replace => String::from_utf8_lossy(chunk),
            Err(e) => {
                return Err(TrainError::InvalidUtf8 {
                    source: source.to_string(),
                    offset: offset + e.valid_up_to() as u64,
                })
            }
        };
        docs.data.clear();
        docs.ends.clear();
        shards::jsonl::for_each_document(&text, *lines, field, |doc| {
            docs.data.extend_from_slice(doc.as_bytes());
            docs.ends.push(docs.data.len());
        })
        .map_err(|(line, message)| TrainError::InvalidInput(format!("{source}:{line}: {message}")))?;
        *lines += memchr::memchr_iter(b'\n', chunk).count() as u64;
        self.count_documents(&docs.data, &docs.ends, offset, source, ctl)
    }

    /// The documents of column `column` of a Parquet file, a batch at a time.
    fn count_parquet(&mut self, path: &Path, column: &str, ctl: &Control) -> Result<(), TrainError> {
        let mut reader = ParquetDocs::open(path, column, PARQUET_BATCH_BYTES)?;
        let mut docs = DocBatch::default();
        let mut before = 0u64; // documents in the batches before this one
        let name = path.display().to_string();
        loop {
            let t = Instant::now();
            let more = reader.next_batch(&mut docs)?;
            self.stats.read_s += t.elapsed().as_secs_f64();
            if !more {
                return Ok(());
            }
            if self.errors == Utf8Errors::Strict {
                shards::check_documents_utf8(path, &docs, before)?;
            }
            let t = Instant::now();
            let r = self.count_documents(&docs.data, &docs.ends, 0, &name, ctl);
            self.stats.count_s += t.elapsed().as_secs_f64();
            self.stats.bytes += docs.data.len() as u64;
            r?;
            before += docs.len() as u64;
        }
    }

    /// Where to cut a buffer of text that continues beyond it: an exact cut (a special
    /// token, or a safe point for a built-in pattern) if there is one; in a buffer over
    /// twice the chunk size without one, the hold-back cut of `cut::hold_back_cut`;
    /// else None (read more first). At the end of the input (`at_end`), the cut is at the
    /// end. With the cut come the spans before it that hold no special token.
    fn cut(&self, buf: &[u8], at_end: bool) -> Option<Cut> {
        if at_end {
            return Some(Cut::whole(buf, &self.splitter));
        }
        cut::last_cut(buf, &self.splitter, self.builtin).or_else(|| {
            if buf.len() >= 2 * self.chunk_size {
                cut::hold_back_cut(buf, &self.splitter, &self.pre)
            } else {
                None
            }
        })
    }

    /// Pre-tokenize and count the spans `segments` of `buf` (those free of special
    /// tokens, as `cut::Cut` gives them). `offset`: where `buf` starts in its source,
    /// for error messages.
    fn count_buffer(
        &self,
        buf: &[u8],
        segments: Vec<(usize, usize)>,
        offset: u64,
        source: &str,
        ctl: &Control,
    ) -> Result<(), TrainError> {
        let counter = self.counter()?;
        let segs =
            segments.into_iter().map(|(s, e)| Segment { offset: offset + s as u64, bytes: &buf[s..e] }).collect();
        counter.count_segments(&self.pool, &self.pre, self.builtin, self.errors, segs, source, ctl)
    }

    /// Add text to the text stream: all text fed until `finish_text` is one continuous
    /// text (as if concatenated), counted in chunks as it arrives.
    pub fn feed_text(&mut self, text: &str, ctl: &Control) -> Result<(), TrainError> {
        self.counter()?;
        self.text_buf.extend_from_slice(text.as_bytes());
        while self.text_buf.len() >= self.chunk_size {
            let Some(cut) = self.cut(&self.text_buf, false) else { break };
            self.count_stream(cut, ctl)?;
        }
        Ok(())
    }

    /// Count a batch of documents, document `i` being `data[ends[i - 1]..ends[i]]`
    /// (`ends[-1]` = 0). Each document is a text of its own: no pre-token spans two, as if
    /// they were separated by a special token (special tokens inside one still split it).
    pub fn feed_documents(&mut self, data: &[u8], ends: &[usize], ctl: &Control) -> Result<(), TrainError> {
        self.counter()?;
        let t = Instant::now();
        let r = self.count_documents(data, ends, self.stats.bytes, "documents", ctl);
        self.stats.count_s += t.elapsed().as_secs_f64();
        self.stats.bytes += ends.last().map_or(0, |&e| e as u64);
        r
    }

    /// Count documents, each a text of its own (see `feed_documents`); `source` names
    /// them in error messages, with offsets in `data`.
    fn count_documents(
        &self,
        data: &[u8],
        ends: &[usize],
        offset: u64,
        source: &str,
        ctl: &Control,
    ) -> Result<(), TrainError> {
        let mut segments = Vec::new();
        let mut start = 0;
        for &end in ends {
            if end < start || end > data.len() {
                return Err(TrainError::InvalidInput("document offsets are not increasing within the data".into()));
            }
            self.splitter.segments(&data[start..end], start, &mut segments);
            start = end;
        }
        self.count_buffer(&data[..start], segments, offset, source, ctl)
    }

    /// End the text stream: count what is left of it.
    pub fn finish_text(&mut self, ctl: &Control) -> Result<(), TrainError> {
        self.counter()?;
        let cut = Cut::whole(&self.text_buf, &self.splitter);
        self.count_stream(cut, ctl)?;
        self.text_buf = Vec::new();
        self.stream_offset = 0;
        Ok(())
    }

    /// Count the text stream's buffer up to `cut` and drop that part.
    fn count_stream(&mut self, cut: Cut, ctl: &Control) -> Result<(), TrainError> {
        let t = Instant::now();
        let buf = std::mem::take(&mut self.text_buf);
        let at = cut.at;
        let r = self.count_buffer(&buf[..at], cut.segments, self.stream_offset, "text", ctl);
        self.text_buf = buf;
        self.text_buf.drain(..at);
        self.stream_offset += at as u64;
        self.stats.count_s += t.elapsed().as_secs_f64();
        self.stats.bytes += at as u64;
        r
    }

    /// The unique pre-tokens counted so far, with their counts (merging the workers'
    /// tables). Consumes the counts: a trainer learns once.
    pub fn take_counts(&mut self) -> Result<PieceCounts, TrainError> {
        self.counter()?;
        let counter = self.counter.take().unwrap();
        let t = Instant::now();
        let mut counts = self.pool.install(|| counter.into_counts());
        if !self.loaded.is_empty() {
            let loaded = std::mem::take(&mut self.loaded);
            counts = self.pool.install(|| PieceCounts::merge(vec![counts, loaded]));
        }
        self.stats.merge_tables_s = t.elapsed().as_secs_f64();
        self.stats.unique_pretokens = counts.len() as u64;
        Ok(counts)
    }

    /// Add the counts of a counts file (checked whole first; see `counts_file`) to those
    /// counted so far; returns the file's header for the caller to check.
    pub fn add_counts_file(&mut self, path: &Path) -> Result<String, TrainError> {
        self.counter()?;
        let t = Instant::now();
        let header = counts_file::read(path, &mut self.loaded)?;
        self.stats.read_s += t.elapsed().as_secs_f64();
        Ok(header)
    }

    /// Write everything counted so far (and added from counts files) to a counts file
    /// instead of learning; returns the number of unique pre-tokens. Consumes the counts.
    pub fn write_counts(&mut self, path: &Path, header: &str) -> Result<u64, TrainError> {
        let counts = self.take_counts()?;
        counts_file::write(path, header, &counts).map_err(|err| TrainError::Io { path: path.to_path_buf(), err })
    }

    /// Learn up to `num_merges` merges from everything counted so far (stops early when
    /// no pair is left). Consumes the counts: a trainer learns once.
    pub fn learn(&mut self, num_merges: usize, ctl: &Control) -> Result<Merges, TrainError> {
        let counts = self.take_counts()?;
        self.learn_from_counts(counts, num_merges, ctl)
    }

    /// Learn merges from a table of pre-token counts.
    pub fn learn_from_counts(
        &mut self,
        counts: PieceCounts,
        num_merges: usize,
        ctl: &Control,
    ) -> Result<Merges, TrainError> {
        ctl.set_total(num_merges as u64);
        ctl.set_done(0);
        if counts.is_empty() {
            return Err(TrainError::InvalidInput(
                "the corpus is empty: no text to train on (only empty input or special tokens)".into(),
            ));
        }
        let t = Instant::now();
        let words = self.pool.install(|| Words::from_counts(counts))?;
        self.stats.words = words.len() as u64;
        let words_s = t.elapsed().as_secs_f64();
        let mut times = MergeTimes::default();
        let merges = self.pool.install(|| learn_merges(words, num_merges, ctl, &mut times))?;
        self.stats.build_s = words_s + times.build_s;
        self.stats.merge_s = times.merge_s;
        self.stats.words_s = words_s;
        self.stats.prune_floor = times.floor;
        self.stats.recounts = times.recounts;
        self.stats.rescans = times.rescans;
        self.stats.merges = merges.len() as u64;
        Ok(merges)
    }
}

enum ChunkError {
    Io(io::Error),
    Train(TrainError),
}

impl From<io::Error> for ChunkError {
    fn from(e: io::Error) -> Self {
        ChunkError::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn sorted(counts: &PieceCounts) -> BTreeMap<Vec<u8>, u64> {
        let mut out = BTreeMap::new();
        counts.for_each(|piece, n| *out.entry(piece.to_vec()).or_insert(0) += n);
        out
    }

    #[test]
    fn counts_of_all_parts_add_up_to_one_run() {
        let dir = std::env::temp_dir().join(format!("ferrolm-train-parts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // A byte-order mark, special tokens (nested, next to each other, one holding a
        // space), multi-byte text and whitespace runs; a file without specials; JSON Lines.
        let mut a = String::from("\u{feff}");
        for i in 0..3000 {
            let sep = ["<|endoftext|>", "<s><s>", "<s>", "<| |>", "\n\n", " "][i % 6];
            a.push_str(&format!("Doc {i}: naïve café 日本語 it's  {}\t x.\nY{sep}", i * 7919));
        }
        let files = [
            ("a.txt", a.clone()),
            ("b.txt", "no specials here, words\n".repeat(500)),
            ("c.jsonl", { (0..200).map(|i| format!("{{\"text\": \"line {i} <s> x\"}}\n")).collect::<String>() }),
        ];
        let paths: Vec<PathBuf> = files
            .iter()
            .map(|(name, text)| {
                let p = dir.join(name);
                std::fs::write(&p, text).unwrap();
                p
            })
            .collect();
        let specials: Vec<String> = ["<|endoftext|>", "<s>", "<s><s>", "<| |>"].map(String::from).to_vec();
        let ctl = Control::default();
        for pattern in ["gpt2", "o200k", r"\S+|\s+"] {
            let trainer = || Trainer::new(&specials, pattern, Some(2), Utf8Errors::Strict, 4096).unwrap();
            let mut one = trainer();
            one.count_files(&paths, "text", &ctl).unwrap();
            let whole = sorted(&one.take_counts().unwrap());
            for n in [1, 2, 3, 7, 40] {
                let mut sum: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
                let mut covered = 0;
                for i in 0..n {
                    let mut t = trainer();
                    let ranges = t.count_part(&paths, "text", i, n, &ctl).unwrap();
                    covered += ranges.iter().map(|(_, a, b)| b - a).sum::<u64>();
                    for (piece, c) in sorted(&t.take_counts().unwrap()) {
                        *sum.entry(piece).or_insert(0) += c;
                    }
                }
                let total: u64 = files.iter().map(|(_, t)| t.len() as u64).sum();
                assert_eq!(covered, total, "pattern {pattern}, {n} parts");
                assert!(sum == whole, "pattern {pattern}, {n} parts");
            }
        }
        assert!(Trainer::new(&specials, "gpt2", Some(1), Utf8Errors::Strict, 4096)
            .unwrap()
            .count_part(&paths, "text", 3, 3, &ctl)
            .is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
