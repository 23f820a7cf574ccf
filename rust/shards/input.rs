//! What an input is (format, compression) and where chunks and parts of it may be cut;
//! `reader.rs` reads them.
//!
//! Cut points. A chunk always ends at an exact cut (`crate::cut`: where encoding may
//! restart without changing a single id), so the output is the same for any chunk size:
//!
//! * plain text: at the end of a special-token match (the reader's matcher holds the
//!   end-of-text separator) or, with `text_cuts`, at a text cut inside a long document. The
//!   caller enables text cuts only for the built-in patterns and when no special token
//!   holds a space or a newline (only such a token can straddle a text cut);
//! * JSON Lines: right after a newline (each line is its own document).
//!
//! A part boundary is the first exact cut at or after its nominal place, preferring the
//! end of a special-token match (a document boundary) within `SEPARATOR_WINDOW` bytes.
//!
//! A document longer than the chunk size without any allowed cut grows its chunk until it
//! ends, so memory is bounded by max(chunk size, longest uncuttable document) per chunk.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::ShardError;
use crate::cut;
use crate::specials::SpecialMatcher;

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

impl Format {
    /// The format a user gives by name: `None` (or "auto") to tell from the input.
    pub fn given(name: Option<&str>) -> Result<Option<Format>, String> {
        match name {
            None | Some("auto") => Ok(None),
            Some("text") => Ok(Some(Format::Text)),
            Some("jsonl") => Ok(Some(Format::Jsonl)),
            Some(other) => Err(format!("input format must be auto, text or jsonl, got {other:?}")),
        }
    }
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
/// `raw`: the file, or a reader around it (the sniffer's head; the chunk reader opens its
/// inputs as `crate::chunks::Stream`, to count and hash the raw bytes it reads through them).
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

/// (file index, raw range) of the inputs that the part `byte_range` reads, in order.
pub(crate) fn part_files(inputs: &[InputSpec], sizes: &[u64], byte_range: (u64, u64)) -> Vec<(usize, (u64, u64))> {
    let total: u64 = sizes.iter().sum();
    let (c0, c1) = byte_range;
    let mut plan = Vec::new();
    let mut fs = 0u64;
    for (f, spec) in inputs.iter().enumerate() {
        let fe = fs + sizes[f];
        if fs == fe {
            // Empty file (or documents without a file): in the part where it sits (the
            // last part for those at the end).
            if (c0 <= fs && fs < c1) || (fs == total && c1 == total) {
                plan.push((f, (0, 0)));
            }
        } else if !spec.splittable() {
            if c0 <= fs && fs < c1 {
                plan.push((f, (0, fe - fs)));
            }
        } else {
            let (a, b) = (c0.max(fs), c1.min(fe));
            if a < b {
                plan.push((f, (a - fs, b - fs)));
            }
        }
        fs = fe;
    }
    plan
}

/// Bytes after which the chunk/part cut search prefers a newline cut to waiting for a separator.
const SEPARATOR_WINDOW: u64 = 16 << 20;

/// The byte range `[start, end)` of the concatenated raw inputs that part `i` of `n` covers.
///
/// Nominal boundaries `k * total / n` move forward to the next exact cut (see the module
/// docs; `specials`: the special tokens that are cuts, `text_cuts`: whether text cuts are
/// allowed); a compressed file cannot be split, so it belongs whole to the part in which
/// it starts. Consecutive parts tile the inputs exactly.
pub fn part_range(
    inputs: &[InputSpec],
    sizes: &[u64],
    i: u64,
    n: u64,
    specials: &SpecialMatcher,
    text_cuts: bool,
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
        cut_at_or_after(inputs, sizes, &starts, b, specials, text_cuts)
    };
    Ok((boundary(i)?, boundary(i + 1)?))
}

fn cut_at_or_after(
    inputs: &[InputSpec],
    sizes: &[u64],
    starts: &[u64],
    b: u64,
    specials: &SpecialMatcher,
    text_cuts: bool,
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
    let local = first_cut_in_file(spec, sizes[f], b - fs, specials, text_cuts)?;
    Ok(fs + local)
}

/// The first exact cut >= `lb` in a plain file (its size if there is none).
fn first_cut_in_file(
    spec: &InputSpec,
    size: u64,
    lb: u64,
    specials: &SpecialMatcher,
    text_cuts: bool,
) -> Result<u64, ShardError> {
    // Room before `lb` for the matches that end at or after it, and for the occurrences
    // that could straddle their starts (see `cut::first_special_cut`).
    let max_len = specials.max_len();
    let from = lb.saturating_sub(2 * max_len as u64 + 2);
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
            Format::Text if specials.is_empty() && !text_cuts => return Ok(size),
            Format::Text => {
                if let Some(c) = cut::first_special_cut(&buf, lb_rel, specials, at_eof) {
                    return Ok(from + c as u64);
                }
                if text_cuts && (window >= SEPARATOR_WINDOW || at_eof || specials.is_empty()) {
                    // An occurrence that straddles c lies within max_len bytes of it.
                    let seen = |c: usize| at_eof || c + max_len <= buf.len();
                    if let Some(c) =
                        cut::first_text_cut(&buf, lb_rel, buf.len(), |c| seen(c) && !specials.straddles(&buf, c))
                    {
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

/// The last exact cut of `buf` (a chunk that starts at one, and whose input goes on
/// after it), if any.
pub(crate) fn last_cut(buf: &[u8], format: Format, specials: &SpecialMatcher, text_cuts: bool) -> Option<usize> {
    match format {
        Format::Docs => None,
        Format::Jsonl => memchr::memrchr(b'\n', buf).map(|p| p + 1),
        Format::Text => cut::last_cut_at(buf, specials, text_cuts),
    }
}
