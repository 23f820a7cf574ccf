//! The shard writer behind `ferrolm encode`: text files in, a flat little-endian
//! uint16/uint32 token file out, at the encoder's speed.
//!
//! Pipeline (one call of [`encode_to_shard`]):
//!
//! * the calling thread reads the inputs in large chunks cut at document boundaries
//!   (right after an end-of-text separator, or after a newline for JSON Lines), hashing
//!   every raw byte it reads (sha256) and decompressing `.gz` / `.zst` on the way;
//! * a rayon pool encodes the chunks in parallel; at most `window` chunks are in flight,
//!   so memory is bounded by the window, not by the input;
//! * the calling thread writes the encoded chunks in input order to `P.bin.partial`, and
//!   every `commit_interval` it fsyncs the data and then atomically rewrites the progress
//!   journal `P.progress.json` (input position of the last written chunk, token count,
//!   parameters). A rerun of the same job truncates the partial file to the journal's
//!   token count and continues after that chunk, so a run killed at any moment (kill -9
//!   included) ends with the same bytes as an uninterrupted one.
//!
//! Encoding a chunk cut right after a special token gives exactly the ids of encoding the
//! whole text (special tokens are hard boundaries), so the output does not depend on the
//! chunk size or on the number of threads.
//!
//! The encoder is injected ([`TextEncoder`]), so this module does not depend on how BPE
//! is implemented; the final rename and the sidecar JSON are the caller's (Python's) job.

mod docs;
pub(crate) mod input;
pub(crate) mod jsonl;
mod parquet;
mod reader;
pub(crate) mod sniff;
mod writer;

use std::borrow::Cow;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::buffers::BufferPool;

pub use crate::utf8::Utf8Errors;
pub use docs::{check_documents_utf8, DocBatch, DocSource, VecSource};
pub use input::{part_range, regular_file_size, Compression, Format, InputSpec, BOM};
pub use parquet::{ParquetDocs, PARQUET_BATCH_BYTES};
use reader::{Chunk, ChunkReader, FileSummary};
use writer::{Journal, PartialWriter};

/// Turns text into token ids, appending to `out`. Must be deterministic and `Sync`
/// (one instance is shared by all encoding threads).
pub trait TextEncoder: Sync {
    /// Encode with special tokens recognised (used for plain text, whose documents are
    /// separated by the end-of-text special token).
    fn encode(&self, text: &str, out: &mut Vec<u32>);
    /// Encode with special tokens treated as ordinary text (used for JSON Lines documents,
    /// which are delimited by the file structure). Defaults to [`TextEncoder::encode`].
    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        self.encode(text, out)
    }
}

/// The real BPE encoder: special tokens allowed in plain text, ordinary in JSON Lines.
impl TextEncoder for crate::encode::Encoder {
    fn encode(&self, text: &str, out: &mut Vec<u32>) {
        self.encode_into(text, true, out)
    }
    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        self.encode_into(text, false, out)
    }
}

impl<F: Fn(&str, &mut Vec<u32>) + Sync> TextEncoder for F {
    fn encode(&self, text: &str, out: &mut Vec<u32>) {
        self(text, out)
    }
}

/// Element type of the output file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    U16,
    U32,
}

impl Dtype {
    pub fn itemsize(self) -> u64 {
        match self {
            Dtype::U16 => 2,
            Dtype::U32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Dtype::U16 => "uint16",
            Dtype::U32 => "uint32",
        }
    }
    pub fn parse(s: &str) -> Option<Dtype> {
        match s {
            "uint16" | "u16" => Some(Dtype::U16),
            "uint32" | "u32" => Some(Dtype::U32),
            _ => None,
        }
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Dtype, String> {
        Dtype::parse(s).ok_or_else(|| format!("dtype must be uint16 or uint32, got {s:?}"))
    }
}

/// Everything that defines one encode job. Output paths are derived from `out_bin`
/// (`P.bin` → `P.bin.partial`, `P.progress.json`).
#[derive(Debug, Clone)]
pub struct EncodeJob {
    pub inputs: Vec<InputSpec>,
    /// The final name of the token file (`P.bin`); this module writes `P.bin.partial`.
    pub out_bin: PathBuf,
    pub opts: ShardOptions,
}

/// How an encode job reads, encodes and writes (all but its inputs and output); `new`
/// gives `ferrolm encode`'s defaults.
#[derive(Debug, Clone)]
pub struct ShardOptions {
    pub dtype: Dtype,
    /// The end-of-text token: its text (the document separator of plain-text inputs) and id.
    pub eos: Option<(String, u32)>,
    /// Field of a JSON Lines record that holds the document text.
    pub jsonl_field: String,
    /// The inputs' format when given (else from their names and first bytes).
    pub input_format: Option<Format>,
    pub errors: Utf8Errors,
    /// Target chunk size in bytes (a chunk grows past it only to reach a document boundary).
    pub chunk_size: usize,
    /// Encoding threads (0: all cores).
    pub threads: usize,
    /// Chunks in flight at once (0: automatic, twice the threads plus two).
    pub window: usize,
    /// `Some((i, n))`: encode only the i-th (0-based) of n byte ranges of the inputs.
    pub part: Option<(u64, u64)>,
    /// Allow text cuts inside a document (`crate::cut`: exact for the built-in
    /// gpt2/cl100k/o200k patterns when no special token holds a space or a newline).
    pub newline_cuts: bool,
    /// Opaque description of the job (tokenizer fingerprint, options, input sizes...):
    /// a journal is resumed only if it records exactly this string.
    pub params: String,
    /// Minimum time between two commits of the progress journal (zero: after every chunk).
    pub commit_interval: Duration,
    /// Compute the sha256 of the inputs (about 0.7 ns/byte of CPU with SHA-NI).
    pub hash: bool,
}

impl ShardOptions {
    pub fn new(dtype: Dtype) -> Self {
        ShardOptions {
            dtype,
            eos: None,
            jsonl_field: "text".into(),
            input_format: None,
            errors: Utf8Errors::Strict,
            chunk_size: 1 << 20,
            threads: 0,
            window: 0,
            part: None,
            newline_cuts: true,
            params: String::new(),
            commit_interval: Duration::from_secs(5),
            hash: true,
        }
    }
}

impl EncodeJob {
    /// A job on `paths` (an empty path: documents from the caller, with no file behind
    /// them), each input's kind guessed from its name unless `opts` gives the format.
    pub fn new(paths: Vec<PathBuf>, out_bin: PathBuf, opts: ShardOptions) -> Self {
        let inputs = paths
            .into_iter()
            .map(|p| {
                if p.as_os_str().is_empty() {
                    InputSpec::documents()
                } else {
                    InputSpec::detect(p, opts.input_format)
                }
            })
            .collect();
        EncodeJob { inputs, out_bin, opts }
    }

    /// The matcher of the cuts at special tokens in plain text: the end-of-text separator.
    pub(crate) fn separator(&self) -> crate::specials::SpecialMatcher {
        crate::specials::SpecialMatcher::new(self.opts.eos.iter().cloned().collect())
    }
    pub fn partial_path(&self) -> PathBuf {
        with_suffix(&self.out_bin, ".partial")
    }
    pub fn journal_path(&self) -> PathBuf {
        let s = self.out_bin.to_string_lossy();
        let stem = s.strip_suffix(".bin").unwrap_or(&s);
        PathBuf::from(format!("{stem}.progress.json"))
    }
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// Progress reported after each written chunk.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    /// Raw (on-disk) input bytes consumed so far, out of `raw_total`.
    pub raw_done: u64,
    pub raw_total: u64,
    pub tokens: u64,
    pub documents: u64,
}

/// One input as it went into the shard.
#[derive(Debug, Clone)]
pub struct InputRecord {
    pub path: PathBuf,
    /// Size of the file on disk.
    pub bytes: u64,
    /// sha256 of the raw bytes of `range` (the whole file unless `--part` split it);
    /// `None` when the job does not hash (`ShardOptions::hash`).
    pub sha256: Option<String>,
    /// Byte range of the file this shard encoded, `[start, end)`.
    pub range: (u64, u64),
    /// Decompressed size, for `.gz` / `.zst` inputs.
    pub uncompressed_bytes: Option<u64>,
}

/// The result of a completed job.
#[derive(Debug, Clone)]
pub struct Summary {
    pub num_tokens: u64,
    pub num_documents: u64,
    pub dtype: Dtype,
    pub inputs: Vec<InputRecord>,
    /// Range of the concatenated raw inputs this shard covers.
    pub byte_range: (u64, u64),
    /// Tokens that were already on disk from an interrupted run (0 for a fresh start).
    pub resumed_tokens: u64,
    /// Bytes of document text this run encoded (decompressed, the JSON Lines fields'
    /// text, the Parquet column's text; a UTF-8 byte-order mark not counted): what
    /// bytes per token and throughput are measured over.
    pub text_bytes: u64,
    /// Why an existing journal was not resumed, if there was one.
    pub restart_reason: Option<String>,
    /// The partial file, complete and fsynced, for the caller to rename to `out_bin`.
    pub partial_path: PathBuf,
}

/// Everything that can go wrong, each with enough context for a one-line message.
#[derive(Debug)]
pub enum ShardError {
    /// An I/O error on `path` while `doing` something (reading, writing, ...).
    Io { path: PathBuf, doing: &'static str, source: io::Error },
    /// Compressed data that does not decompress.
    Corrupt { path: PathBuf, format: &'static str, raw_offset: u64, source: io::Error },
    /// Bytes that are not UTF-8 (offset in the decompressed stream for compressed files).
    Utf8 { path: PathBuf, offset: u64, compressed: bool },
    /// A JSON Lines record that is not an object with a string field.
    Jsonl { path: PathBuf, line: u64, message: String },
    /// A token id that the output dtype cannot hold.
    DtypeOverflow { id: u32, dtype: Dtype, path: PathBuf, chunk_offset: u64 },
    /// An input changed size while it was being read.
    Changed { path: PathBuf, expected: u64, got: u64 },
    /// The progress callback asked to stop (Ctrl-C); everything written so far is committed.
    Interrupted,
    /// A bad argument.
    Invalid(String),
    /// A bug: an encoding thread panicked.
    Panic(String),
}

impl ShardError {
    pub(crate) fn io(path: &Path, doing: &'static str, source: io::Error) -> Self {
        ShardError::Io { path: path.to_path_buf(), doing, source }
    }
    /// Whether a rerun of the same job can continue where this one stopped (I/O failures
    /// such as a full disk, and interruptions); the partial output is kept for it.
    pub fn is_resumable(&self) -> bool {
        matches!(self, ShardError::Io { .. } | ShardError::Interrupted)
    }

    /// True for "no space left on device" (and "file too large") write errors.
    pub fn is_disk_full(&self) -> bool {
        match self {
            ShardError::Io { source, .. } => is_disk_full(source),
            _ => false,
        }
    }
}

pub(crate) fn is_disk_full(e: &io::Error) -> bool {
    // ENOSPC = 28, EFBIG = 27, EDQUOT = 122 on Linux.
    matches!(e.raw_os_error(), Some(28) | Some(27) | Some(122))
}

impl fmt::Display for ShardError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardError::Io { path, doing, source } if is_disk_full(source) => write!(
                f,
                "no space left while {doing} {}: {source}. Nothing was written at the final name; \
                 free some space and rerun the same command to resume from the last completed chunk",
                path.display()
            ),
            ShardError::Io { path, doing, source } if source.kind() == io::ErrorKind::NotFound => {
                write!(f, "{doing} {}: file not found", path.display())
            }
            ShardError::Io { path, doing, source } => write!(f, "{doing} {}: {source}", path.display()),
            ShardError::Corrupt { path, format, raw_offset, source } => write!(
                f,
                "{}: corrupt or truncated {format} data (after {raw_offset} compressed bytes): {source}",
                path.display()
            ),
            ShardError::Utf8 { path, offset, compressed } => write!(
                f,
                "{}: invalid UTF-8 at byte offset {offset}{} (pass --errors replace to substitute U+FFFD)",
                path.display(),
                if *compressed { " of the decompressed text" } else { "" }
            ),
            ShardError::Jsonl { path, line, message } => write!(f, "{}:{line}: {message}", path.display()),
            ShardError::DtypeOverflow { id, dtype, path, chunk_offset } => write!(
                f,
                "token id {id} does not fit in {} (in {} near byte offset {chunk_offset}); use --dtype uint32 or auto",
                dtype.name(),
                path.display()
            ),
            ShardError::Changed { path, expected, got } => {
                write!(f, "{} changed while it was read (expected {expected} bytes, read {got})", path.display())
            }
            ShardError::Interrupted => write!(f, "interrupted"),
            ShardError::Invalid(msg) => write!(f, "{msg}"),
            ShardError::Panic(msg) => write!(f, "internal error: an encoding thread panicked: {msg}"),
        }
    }
}

impl std::error::Error for ShardError {}

/// What an encoding task hands back to the writer.
struct Encoded {
    bytes: Vec<u8>,
    tokens: u64,
    documents: u64,
    text_bytes: u64,
    /// Input position right after this chunk: (file index, logical offset).
    next_pos: (usize, u64),
    raw_done: u64,
    digest: Option<String>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Encode one chunk into the output dtype's little-endian bytes; returns them with the
/// chunk's tokens, documents and text bytes.
fn encode_chunk<E: TextEncoder + ?Sized>(
    enc: &E,
    job: &EncodeJob,
    chunk: &Chunk,
    out: Vec<u8>,
) -> Result<(Vec<u8>, u64, u64, u64), ShardError> {
    SCRATCH.with(|cell| {
        let mut ids = cell.borrow_mut();
        ids.clear();
        let (documents, text_bytes) = match job.inputs[chunk.file].format {
            Format::Docs => (encode_docs(enc, job, chunk, &mut ids)?, chunk.len as u64),
            _ => encode_bytes(enc, job, chunk, &mut ids)?,
        };
        let out = to_dtype(&ids, job, chunk, out)?;
        Ok((out, ids.len() as u64, documents, text_bytes))
    })
}

/// A chunk of plain text or JSON Lines; returns the documents it ended and the bytes of
/// their text.
fn encode_bytes<E: TextEncoder + ?Sized>(
    enc: &E,
    job: &EncodeJob,
    chunk: &Chunk,
    ids: &mut Vec<u32>,
) -> Result<(u64, u64), ShardError> {
    let spec = &job.inputs[chunk.file];
    let mut data = &chunk.data[..chunk.len];
    let mut start = chunk.start;
    if start == 0 && data.starts_with(input::BOM) {
        data = &data[input::BOM.len()..];
        start = input::BOM.len() as u64;
    }
    let text: Cow<str> = match crate::utf8::to_str(data) {
        Ok(s) => Cow::Borrowed(s),
        Err(e) => match job.opts.errors {
            Utf8Errors::Replace => String::from_utf8_lossy(data),
            Utf8Errors::Strict => {
                return Err(ShardError::Utf8 {
                    path: spec.path.clone(),
                    offset: start + e.valid_up_to() as u64,
                    compressed: spec.compression != Compression::None,
                })
            }
        },
    };
    if spec.format == Format::Text {
        return Ok((encode_text(enc, job, chunk, &text, ids), data.len() as u64));
    }
    let (mut documents, mut text_bytes) = (0u64, 0u64);
    jsonl::for_each_document(&text, chunk.first_line, &job.opts.jsonl_field, |doc| {
        enc.encode_ordinary(doc, ids);
        end_document(job, ids);
        documents += 1;
        text_bytes += doc.len() as u64;
    })
    .map_err(|(line, message)| ShardError::Jsonl { path: spec.path.clone(), line, message })?;
    Ok((documents, text_bytes))
}

/// Plain text: encoded with its special tokens; documents end at the end-of-text token.
fn encode_text<E: TextEncoder + ?Sized>(
    enc: &E,
    job: &EncodeJob,
    chunk: &Chunk,
    text: &str,
    ids: &mut Vec<u32>,
) -> u64 {
    enc.encode(text, ids);
    let Some((sep, id)) = job.opts.eos.as_ref() else { return 0 };
    let mut documents = ids.iter().filter(|&&t| t == *id).count() as u64;
    // A file whose last document has no separator: end that document.
    if chunk.at_file_end {
        let tail = match memchr::memmem::rfind(text.as_bytes(), sep.as_bytes()) {
            Some(p) => &text[p + sep.len()..],
            None => text,
        };
        if !tail.trim().is_empty() {
            ids.push(*id);
            documents += 1;
        }
    }
    documents
}

/// Documents handed over by the caller: each encoded as ordinary text, then the eos.
fn encode_docs<E: TextEncoder + ?Sized>(
    enc: &E,
    job: &EncodeJob,
    chunk: &Chunk,
    ids: &mut Vec<u32>,
) -> Result<u64, ShardError> {
    let mut start = 0;
    for (i, &end) in chunk.ends.iter().enumerate() {
        let doc = &chunk.data[start..end];
        start = end;
        let text = match crate::utf8::to_str(doc) {
            Ok(s) => Cow::Borrowed(s),
            Err(_) if job.opts.errors == Utf8Errors::Replace => String::from_utf8_lossy(doc),
            Err(e) => {
                return Err(docs::not_utf8(&job.inputs[chunk.file].path, chunk.start + i as u64, e.valid_up_to()))
            }
        };
        enc.encode_ordinary(&text, ids);
        end_document(job, ids);
    }
    Ok(chunk.ends.len() as u64)
}

fn end_document(job: &EncodeJob, ids: &mut Vec<u32>) {
    if let Some((_, id)) = &job.opts.eos {
        ids.push(*id);
    }
}

/// `ids` as the output dtype's little-endian bytes, in `out` (a pooled buffer whose bytes
/// are initialized: sized without zeroing what it holds, converted in one vectorizable pass).
fn to_dtype(ids: &[u32], job: &EncodeJob, chunk: &Chunk, mut out: Vec<u8>) -> Result<Vec<u8>, ShardError> {
    let size = ids.len() * job.opts.dtype.itemsize() as usize;
    if out.len() < size {
        out.resize(size, 0);
    }
    out.truncate(size);
    match job.opts.dtype {
        Dtype::U16 => {
            if let Some(&id) = ids.iter().find(|&&t| t > u16::MAX as u32) {
                return Err(ShardError::DtypeOverflow {
                    id,
                    dtype: Dtype::U16,
                    path: job.inputs[chunk.file].path.clone(),
                    chunk_offset: chunk.start,
                });
            }
            for (dst, &t) in out.chunks_exact_mut(2).zip(ids.iter()) {
                dst.copy_from_slice(&(t as u16).to_le_bytes());
            }
        }
        Dtype::U32 => {
            for (dst, &t) in out.chunks_exact_mut(4).zip(ids.iter()) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
        }
    }
    Ok(out)
}

/// Run an encode job to completion (or resume an interrupted one).
///
/// `progress` is called on the calling thread after each written chunk; returning `false`
/// stops the job cleanly (what was written is committed to the journal) with
/// [`ShardError::Interrupted`].
pub fn encode_to_shard<E, P>(job: &EncodeJob, encoder: &E, progress: P) -> Result<Summary, ShardError>
where
    E: TextEncoder + ?Sized,
    P: FnMut(&Progress) -> bool,
{
    encode_to_shard_with(job, encoder, None, progress)
}

/// [`encode_to_shard`] with the reader of the job's `Format::Docs` inputs.
pub fn encode_to_shard_with<E, P>(
    job: &EncodeJob,
    encoder: &E,
    source: Option<&mut (dyn DocSource + 'static)>,
    progress: P,
) -> Result<Summary, ShardError>
where
    E: TextEncoder + ?Sized,
    P: FnMut(&Progress) -> bool,
{
    check(job)?;
    // Missing and non-regular inputs are refused before any is sniffed (a pipe would
    // lose the bytes sniffing reads, a device would be read forever).
    let sizes = input::file_sizes(&job.inputs)?;
    let job = &sniffed(job)?;
    // The shared pool of this size (its threads keep their encoder caches between
    // calls), had before anything is written.
    let pool = crate::threads::try_pool(Some(job.opts.threads)).map_err(ShardError::Invalid)?;
    let byte_range = byte_range(job, &sizes)?;
    let mut start = match start(job, &sizes, byte_range, source)? {
        Start::Done(summary) => return Ok(summary),
        Start::Run(s) => s,
    };
    start.reader.balance_tail(pool.current_num_threads());
    let window = if job.opts.window == 0 { 2 * pool.current_num_threads() + 2 } else { job.opts.window.max(1) };
    let mut run = Run {
        job,
        out: start.out,
        journal: start.journal,
        last_commit: Instant::now(),
        committed_tokens: start.resumed_tokens,
        text_bytes: 0,
        undigested: false,
        raw_total: byte_range.1 - byte_range.0,
        progress,
    };
    // Read buffers and output buffers are pooled apart (their sizes differ).
    let bufs = BufferPool::default();
    let result = pool.in_place_scope(|scope| run.pipeline(scope, &mut start.reader, encoder, &bufs, window));
    run.conclude(result, &start.reader, byte_range, start.resumed_tokens, start.restart_reason)
}

fn check(job: &EncodeJob) -> Result<(), ShardError> {
    if job.inputs.is_empty() {
        return Err(ShardError::Invalid("no input files".into()));
    }
    if job.opts.chunk_size == 0 {
        return Err(ShardError::Invalid("chunk size must be positive".into()));
    }
    if let Some((i, n)) = job.opts.part {
        if n == 0 || i >= n {
            return Err(ShardError::Invalid(format!("--part {i}/{n}: need 0 <= I < N")));
        }
    }
    if let Some((sep, _)) = &job.opts.eos {
        if sep.is_empty() {
            return Err(ShardError::Invalid("the end-of-text token is empty".into()));
        }
    }
    Ok(())
}

/// The job with each input's format and compression refined from its content.
fn sniffed(job: &EncodeJob) -> Result<EncodeJob, ShardError> {
    let mut job = job.clone();
    for spec in &mut job.inputs {
        if !spec.path.as_os_str().is_empty() && !spec.path.is_dir() && spec.path.exists() {
            *spec = sniff::sniff(spec, &job.opts.jsonl_field)?;
        }
    }
    Ok(job)
}

/// The range of the concatenated raw inputs that this job's part covers.
fn byte_range(job: &EncodeJob, sizes: &[u64]) -> Result<(u64, u64), ShardError> {
    match job.opts.part {
        Some((i, n)) => part_range(&job.inputs, sizes, i, n, &job.separator(), job.opts.newline_cuts),
        None => Ok((0, sizes.iter().sum())),
    }
}

enum Start<'a> {
    /// A completed run's summary, from its journal.
    Done(Summary),
    Run(Box<Running<'a>>),
}

struct Running<'a> {
    reader: ChunkReader<'a>,
    out: PartialWriter,
    journal: Journal,
    resumed_tokens: u64,
    restart_reason: Option<String>,
}

/// Resume the interrupted run that the journal describes, or start over: the reader
/// positioned after the last committed chunk and the partial file truncated to it.
fn start<'a>(
    job: &'a EncodeJob,
    sizes: &'a [u64],
    byte_range: (u64, u64),
    source: Option<&'a mut (dyn DocSource + 'static)>,
) -> Result<Start<'a>, ShardError> {
    let (mut resume, mut restart_reason) = read_journal(job);
    if let Some(j) = resume.as_ref().filter(|j| j.complete) {
        // The caller may already have renamed the partial file before it was killed.
        let done = if job.partial_path().exists() { job.partial_path() } else { job.out_bin.clone() };
        if let Some(summary) = j.summary(job, &done) {
            return Ok(Start::Done(summary));
        }
        restart_reason = Some("the journal of the completed run is unreadable".into());
        resume = None;
    }
    let mut reader = ChunkReader::new(job, sizes, byte_range, source);
    if let Some(j) = &resume {
        let digest = reader.skip_to((j.next_file, j.next_offset))?;
        if j.digest.is_some() && digest != j.digest {
            restart_reason =
                Some("the inputs' content differs from what the interrupted run read (same sizes and times)".into());
            resume = None;
            reader = ChunkReader::new(job, sizes, byte_range, reader.into_source());
        }
    }
    let journal_path = job.journal_path();
    if resume.is_none() {
        // A journal that does not match is removed before the partial file is reset,
        // so a crash in between never pairs an old journal with new data.
        if let Err(e) = std::fs::remove_file(&journal_path) {
            if e.kind() != io::ErrorKind::NotFound {
                return Err(ShardError::io(&journal_path, "removing the stale progress journal", e));
            }
        }
    }
    let journal = resume.unwrap_or_else(|| Journal::fresh(&job.opts.params));
    let resumed_tokens = journal.tokens;
    let out =
        PartialWriter::open(&job.partial_path(), resumed_tokens * job.opts.dtype.itemsize(), resumed_tokens == 0)?;
    Ok(Start::Run(Box::new(Running { reader, out, journal, resumed_tokens, restart_reason })))
}

/// The journal of an interrupted run of this job, if it can be resumed, and why not if not.
fn read_journal(job: &EncodeJob) -> (Option<Journal>, Option<String>) {
    match Journal::read(&job.journal_path()) {
        Ok(None) => (None, None),
        Ok(Some(j)) => match j.check(&job.opts.params, &job.partial_path(), &job.out_bin, job.opts.dtype.itemsize()) {
            Ok(()) => (Some(j), None),
            Err(why) => (None, Some(why)),
        },
        Err(why) => (None, Some(why)),
    }
}

/// The writing side of a running job: the partial file, the journal and when it was
/// last committed.
struct Run<'j, P> {
    job: &'j EncodeJob,
    out: PartialWriter,
    journal: Journal,
    last_commit: Instant,
    committed_tokens: u64,
    /// Bytes of document text encoded by this run (see `Summary::text_bytes`).
    text_bytes: u64,
    /// The journal stands at a chunk read before its input's hash was known (no digest
    /// to check a resume against), so it is not committed there.
    undigested: bool,
    raw_total: u64,
    progress: P,
}

type Sent = (u64, Result<Encoded, ShardError>);

/// The pipeline's bookkeeping: chunks read, written, in flight, and where it stops.
struct Flow {
    next_read: u64,
    next_write: u64,
    in_flight: usize,
    pending: std::collections::BTreeMap<u64, Result<Encoded, ShardError>>,
    reader_done: bool,
    /// The first error in input order wins: writing stops at this sequence number (a
    /// reader error happens "at" the chunk it could not produce).
    stop_at: Option<(u64, ShardError)>,
}

impl Flow {
    fn stops_at(&self, seq: u64) -> bool {
        self.stop_at.as_ref().is_some_and(|(at, _)| seq >= *at)
    }
    fn stop(&mut self, at: u64, e: ShardError) {
        if self.stop_at.as_ref().is_none_or(|(first, _)| at < *first) {
            self.stop_at = Some((at, e));
        }
    }
}

impl<'j, P: FnMut(&Progress) -> bool> Run<'j, P> {
    /// Read, encode (on the pool, at most `window` chunks at once) and write in input order.
    fn pipeline<'s, E: TextEncoder + ?Sized>(
        &mut self,
        scope: &rayon::Scope<'s>,
        reader: &mut ChunkReader,
        encoder: &'s E,
        bufs: &'s BufferPool,
        window: usize,
    ) -> Result<(), ShardError>
    where
        'j: 's,
    {
        let job = self.job;
        let out_bufs = BufferPool::default();
        let (tx, rx) = mpsc::channel::<Sent>();
        let mut flow = Flow {
            next_read: 0,
            next_write: 0,
            in_flight: 0,
            pending: Default::default(),
            reader_done: false,
            stop_at: None,
        };
        loop {
            while !flow.reader_done && flow.stop_at.is_none() && flow.in_flight < window {
                match reader.next_chunk(bufs) {
                    Ok(Some(chunk)) => {
                        spawn_encode(scope, encoder, job, chunk, out_bufs.take(), bufs, flow.next_read, tx.clone());
                        flow.next_read += 1;
                        flow.in_flight += 1;
                    }
                    Ok(None) => flow.reader_done = true,
                    Err(e) => flow.stop_at = Some((flow.next_read, e)),
                }
            }
            if flow.stops_at(flow.next_write) || flow.in_flight == 0 {
                break;
            }
            let (seq, r) = rx.recv().expect("encoding threads hold a sender");
            flow.in_flight -= 1;
            flow.pending.insert(seq, r);
            self.write_ready(&mut flow, &out_bufs)?;
            if flow.stops_at(flow.next_write) {
                // Let the tasks still running finish (their results are dropped).
                for _ in 0..flow.in_flight {
                    let _ = rx.recv();
                }
                break;
            }
        }
        match flow.stop_at {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// Write the encoded chunks that are next in input order.
    fn write_ready(&mut self, flow: &mut Flow, out_bufs: &BufferPool) -> Result<(), ShardError> {
        while !flow.stops_at(flow.next_write) {
            let Some(r) = flow.pending.remove(&flow.next_write) else { break };
            match r {
                Ok(enc) => {
                    self.write(&enc)?;
                    out_bufs.put(enc.bytes);
                    flow.next_write += 1;
                    let j = &self.journal;
                    let p = Progress {
                        raw_done: enc.raw_done,
                        raw_total: self.raw_total,
                        tokens: j.tokens,
                        documents: j.documents,
                    };
                    if !(self.progress)(&p) {
                        flow.stop(flow.next_write, ShardError::Interrupted);
                    }
                }
                Err(e) => flow.stop(flow.next_write, e),
            }
        }
        Ok(())
    }

    /// Append one encoded chunk and commit the journal when it is due.
    fn write(&mut self, enc: &Encoded) -> Result<(), ShardError> {
        self.out.write(&enc.bytes)?;
        crate::fault::check(crate::fault::Site::ShardWrite);
        let j = &mut self.journal;
        j.tokens += enc.tokens;
        j.documents += enc.documents;
        self.text_bytes += enc.text_bytes;
        (j.next_file, j.next_offset) = enc.next_pos;
        j.digest = enc.digest.clone();
        self.undigested = self.job.opts.hash && enc.digest.is_none();
        if !self.undigested && self.last_commit.elapsed() >= self.job.opts.commit_interval {
            self.commit()?;
        }
        Ok(())
    }

    /// Data first, then the journal that counts it.
    fn commit(&mut self) -> Result<(), ShardError> {
        self.out.sync()?;
        self.journal.write(&self.job.journal_path())?;
        self.committed_tokens = self.journal.tokens;
        self.last_commit = Instant::now();
        Ok(())
    }

    /// The summary of a finished run (journal marked complete), or the error, with the
    /// partial output kept for a rerun when the error allows one and removed otherwise.
    fn conclude(
        mut self,
        result: Result<(), ShardError>,
        reader: &ChunkReader,
        byte_range: (u64, u64),
        resumed_tokens: u64,
        restart_reason: Option<String>,
    ) -> Result<Summary, ShardError> {
        let job = self.job;
        match result {
            Ok(()) => {
                self.out.sync()?;
                let summary = Summary {
                    num_tokens: self.journal.tokens,
                    num_documents: self.journal.documents,
                    dtype: job.opts.dtype,
                    inputs: reader.records(),
                    byte_range,
                    resumed_tokens,
                    restart_reason,
                    text_bytes: self.text_bytes,
                    partial_path: job.partial_path(),
                };
                self.journal.complete = true;
                self.journal.summary = Some(writer::summary_to_json(&summary));
                self.journal.write(&job.journal_path())?;
                Ok(summary)
            }
            Err(e) if e.is_resumable() => {
                // Commit what was written so a rerun continues from here (best effort: after a
                // failed write, the disk may refuse this too; the previous commit then stands).
                if self.journal.tokens != self.committed_tokens && !self.undigested {
                    let _ = self.commit();
                }
                Err(e)
            }
            Err(e) => {
                // Bad input: a rerun needs other inputs or options, so it starts over anyway.
                drop(self.out);
                let _ = std::fs::remove_file(job.journal_path());
                let _ = std::fs::remove_file(job.partial_path());
                Err(e)
            }
        }
    }
}

/// Encode `chunk` on the pool; the result goes to `tx` with its sequence number.
#[allow(clippy::too_many_arguments)]
fn spawn_encode<'s, E: TextEncoder + ?Sized>(
    scope: &rayon::Scope<'s>,
    encoder: &'s E,
    job: &'s EncodeJob,
    chunk: Chunk,
    out_buf: Vec<u8>,
    bufs: &'s BufferPool,
    seq: u64,
    tx: mpsc::Sender<Sent>,
) {
    scope.spawn(move |_| {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| encode_chunk(encoder, job, &chunk, out_buf)));
        let r = match r {
            Ok(Ok((bytes, tokens, documents, text_bytes))) => Ok(Encoded {
                bytes,
                tokens,
                documents,
                text_bytes,
                next_pos: chunk.next_pos,
                raw_done: chunk.raw_done,
                digest: chunk.digest.clone(),
            }),
            Ok(Err(e)) => Err(e),
            Err(p) => Err(ShardError::Panic(panic_message(&p))),
        };
        bufs.put(chunk.data);
        let _ = tx.send((seq, r));
    });
}

/// The message a panic was given (its payload, when it is a string).
pub(crate) fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

impl From<FileSummary> for InputRecord {
    fn from(s: FileSummary) -> Self {
        InputRecord {
            path: s.path,
            bytes: s.size,
            sha256: s.sha256,
            range: s.range,
            uncompressed_bytes: s.uncompressed,
        }
    }
}

#[cfg(test)]
mod tests;
