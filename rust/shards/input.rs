//! What an input is (format, compression) and where chunks and parts of it may be cut;
//! `reader.rs` reads them.
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
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::ShardError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    pub(crate) fn name(self) -> &'static str {
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
    /// Documents handed over by the caller's `DocSource` (Parquet files, iterables).
    Docs,
}

#[derive(Debug, Clone)]
pub struct InputSpec {
    pub path: PathBuf,
    pub format: Format,
    pub compression: Compression,
    /// The format was given, not guessed from the name (content sniffing keeps it).
    pub format_given: bool,
}

impl InputSpec {
    /// Compression from the extension (`.gz`, `.zst`/`.zstd`); format from the name
    /// under it (`.jsonl`/`.ndjson` are JSON Lines, `.parquet` documents for the caller's
    /// `DocSource`) unless `format` is given. The job refines both from the content
    /// (`sniff.rs`).
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
        let detected = if base.ends_with(".jsonl") || base.ends_with(".ndjson") {
            Format::Jsonl
        } else if base.ends_with(".parquet") {
            Format::Docs
        } else {
            Format::Text
        };
        InputSpec { path, format: format.unwrap_or(detected), compression, format_given: format.is_some() }
    }

    /// Documents from the caller with no file behind them (an iterable of strings).
    pub fn documents() -> InputSpec {
        InputSpec { path: PathBuf::new(), format: Format::Docs, compression: Compression::None, format_given: true }
    }

    /// Whether a part boundary may fall inside this input (plain bytes only: a compressed
    /// stream or a Parquet file belongs whole to the part in which it starts).
    pub(crate) fn splittable(&self) -> bool {
        self.compression == Compression::None && self.format != Format::Docs
    }

    /// Where reading starts in the logical stream for raw range `range`: bytes for a plain
    /// file, 0 (decompressed bytes or documents) for the others.
    pub(crate) fn logical_start(&self, range: (u64, u64)) -> u64 {
        if self.splittable() {
            range.0
        } else {
            0
        }
    }
}

/// Sizes of the inputs on disk (a missing input is an error here, before anything is written).
pub(crate) fn file_sizes(inputs: &[InputSpec]) -> Result<Vec<u64>, ShardError> {
    inputs
        .iter()
        .map(|spec| if spec.path.as_os_str().is_empty() { Ok(0) } else { regular_file_size(&spec.path) })
        .collect()
}

/// The size of `path`, a regular file. Anything else is refused by name before a byte is
/// read: a directory; a pipe or FIFO (`/dev/stdin`, `<(cmd)`), whose size reads as 0 and
/// which cannot be sniffed, split into parts or reread to resume; a device such as
/// `/dev/zero`, which never ends.
pub fn regular_file_size(path: &Path) -> Result<u64, ShardError> {
    let meta = std::fs::metadata(path).map_err(|e| ShardError::io(path, "reading input", e))?;
    if meta.is_file() {
        return Ok(meta.len());
    }
    if meta.is_dir() {
        return Err(ShardError::Invalid(format!("input {} is a directory, not a file", path.display())));
    }
    let kind = {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            "a pipe or FIFO"
        } else if t.is_char_device() {
            "a character device"
        } else if t.is_block_device() {
            "a block device"
        } else if t.is_socket() {
            "a socket"
        } else {
            "not a file"
        }
    };
    Err(ShardError::Invalid(format!(
        "input {} is not a regular file ({kind}): inputs are read from files, which can be sized, \
         checked and read again to resume; save the stream to a file first",
        path.display()
    )))
}

/// The bytes of `spec`'s file as its documents' text: decompressed for `.gz` / `.zst`.
/// `raw`: the file, or a reader around it (the sniffer's head, the trainer's reads; the
/// chunk reader builds its own decoders, to hash the raw bytes it reads through them).
pub(crate) fn decoded<'r, R: Read + Send + 'r>(
    spec: &InputSpec,
    raw: R,
) -> Result<Box<dyn Read + Send + 'r>, ShardError> {
    Ok(match spec.compression {
        Compression::None => Box::new(raw),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(raw)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::new(raw)
                .map_err(|e| ShardError::io(&spec.path, "opening zstd stream of", e))?,
        ),
    })
}

/// The UTF-8 byte-order mark, skipped at the start of a text or JSON Lines input.
pub const BOM: &[u8] = b"\xef\xbb\xbf";

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
    if !spec.splittable() {
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
            Format::Docs => return Ok(size),
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
        Format::Docs => None,
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
