//! Parallel encoding: many documents (one task per document) or one large text cut
//! at positions where cutting cannot change the ids.

use rayon::prelude::*;

use super::Encoder;
use crate::cut;
use crate::threads;
pub use crate::threads::ThreadCount;

pub(super) fn encode_batch<S: AsRef<str> + Sync>(
    enc: &Encoder,
    texts: &[S],
    allow_special: bool,
    threads: ThreadCount,
) -> Vec<Vec<u32>> {
    let groups = encode_batch_grouped::<S, u32>(enc, texts, allow_special, threads);
    groups.iter().flat_map(BatchIds::texts).map(<[u32]>::to_vec).collect()
}

/// The element type of stored ids: u32, or u16 where the caller knows that every id
/// fits (a vocabulary of at most 65,536 ids).
pub trait IdElem: Copy + Send + Sync + 'static {
    /// Encode `text` onto the end of `out`; `scratch` is a buffer the caller keeps
    /// between calls.
    fn encode_onto(enc: &Encoder, text: &str, allow_special: bool, scratch: &mut Vec<u32>, out: &mut Vec<Self>);
}

impl IdElem for u32 {
    #[inline]
    fn encode_onto(enc: &Encoder, text: &str, allow_special: bool, _scratch: &mut Vec<u32>, out: &mut Vec<u32>) {
        enc.encode_into(text, allow_special, out)
    }
}

impl IdElem for u16 {
    /// Through `scratch`, converted a few thousand ids at a time: the ids are written
    /// once as u16, with no u32 copy of them all first.
    #[inline]
    fn encode_onto(enc: &Encoder, text: &str, allow_special: bool, scratch: &mut Vec<u32>, out: &mut Vec<u16>) {
        enc.encode_drained(text, allow_special, scratch, |ids| {
            debug_assert!(ids.iter().all(|&id| id <= u16::MAX as u32));
            out.extend(ids.iter().map(|&id| id as u16))
        })
    }
}

/// The ids of consecutive texts of a batch, back to back: text `i` of the group has
/// `ids[ends[i - 1]..ends[i]]` (from 0 for the first).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BatchIds<T = u32> {
    pub ids: Vec<T>,
    pub ends: Vec<usize>,
}

impl<T> BatchIds<T> {
    /// The ids of each text of the group, in order.
    pub fn texts(&self) -> impl Iterator<Item = &[T]> + '_ {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(&self.ends).map(|(s, &e)| &self.ids[s..e])
    }
}

/// Texts of about this many bytes make one task of a parallel batch.
pub(super) const GROUP_BYTES: usize = 1 << 18;

pub(super) fn encode_batch_grouped<S: AsRef<str> + Sync, T: IdElem>(
    enc: &Encoder,
    texts: &[S],
    allow_special: bool,
    threads: ThreadCount,
) -> Vec<BatchIds<T>> {
    let encode_group = super::cancel::carried(|group: &[S]| {
        let bytes: usize = group.iter().map(|t| t.as_ref().len()).sum();
        let mut out = BatchIds { ids: Vec::with_capacity(bytes / 4 + 16), ends: Vec::with_capacity(group.len()) };
        let mut scratch = Vec::new();
        for t in group {
            T::encode_onto(enc, t.as_ref(), allow_special, &mut scratch, &mut out.ids);
            out.ends.push(out.ids.len());
        }
        out
    });
    let n = threads::resolve(threads);
    if n <= 1 || texts.len() <= 1 {
        return vec![encode_group(texts)];
    }
    // Contiguous groups of about GROUP_BYTES, at least 4 per thread when there is enough.
    let total: usize = texts.iter().map(|t| t.as_ref().len()).sum();
    let target = (total / (4 * n)).clamp(1, GROUP_BYTES);
    let mut groups: Vec<&[S]> = Vec::new();
    let (mut start, mut acc) = (0, 0);
    for (i, t) in texts.iter().enumerate() {
        acc += t.as_ref().len();
        if acc >= target {
            groups.push(&texts[start..=i]);
            (start, acc) = (i + 1, 0);
        }
    }
    if start < texts.len() {
        groups.push(&texts[start..]);
    }
    threads::install(threads, || groups.par_iter().map(|g| encode_group(g)).collect())
}

pub(super) fn encode_parallel(enc: &Encoder, text: &str, allow_special: bool, threads: ThreadCount) -> Vec<u32> {
    let parts = encode_parallel_parts::<u32>(enc, text, allow_special, threads);
    if parts.len() == 1 {
        return parts.into_iter().next().unwrap_or_default();
    }
    let mut out = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    for p in parts {
        out.extend_from_slice(&p);
    }
    out
}

pub(super) fn encode_parallel_parts<T: IdElem>(
    enc: &Encoder,
    text: &str,
    allow_special: bool,
    threads: ThreadCount,
) -> Vec<Vec<T>> {
    let encode_part = super::cancel::carried(|part: &str| {
        let mut out = Vec::with_capacity(part.len() / 4 + 4);
        T::encode_onto(enc, part, allow_special, &mut Vec::new(), &mut out);
        out
    });
    let n = threads::resolve(threads);
    if n <= 1 || text.len() < (1 << 20) {
        return vec![encode_part(text)];
    }
    let every = (text.len() / (n * 8)).max(1 << 20);
    let cuts = safe_cuts(enc, text, allow_special, every);
    let mut parts: Vec<&str> = Vec::with_capacity(cuts.len() + 1);
    let mut at = 0;
    for &c in cuts.iter().chain(std::iter::once(&text.len())) {
        parts.push(&text[at..c]);
        at = c;
    }
    threads::install(threads, || parts.par_iter().map(|p| encode_part(p)).collect())
}

impl Encoder {
    /// True when the pre-tokenization pattern is one of the built-ins, for which text
    /// cuts (`crate::cut`) are exact.
    pub fn has_builtin_pattern(&self) -> bool {
        self.pretok.is_builtin()
    }
}

/// Sorted cut positions (exclusive of 0 and `text.len()`), about `every` bytes apart.
pub(super) fn safe_cuts(enc: &Encoder, text: &str, allow_special: bool, every: usize) -> Vec<usize> {
    let every = every.max(1);
    let specials = allow_special && !enc.specials.is_empty();
    if enc.has_builtin_pattern() {
        if let Some(cuts) = space_cuts(enc, text.as_bytes(), specials, every) {
            return cuts;
        }
    }
    cuts_between_matches(enc, text, specials, every)
}

/// For the built-in patterns: a text cut (`crate::cut`) about every `every` bytes,
/// without scanning the whole text for special tokens. A candidate that an occurrence of
/// a special token straddles is passed over; at any other one the parts have the same
/// special-token matches as the whole text. None when `every` bytes go by without a
/// candidate (text without spaces or newlines): then [`cuts_between_matches`] also cuts
/// at special tokens.
fn space_cuts(enc: &Encoder, bytes: &[u8], specials: bool, every: usize) -> Option<Vec<usize>> {
    let mut cuts = Vec::new();
    let mut target = every;
    while target < bytes.len() {
        let limit = (target + every).min(bytes.len());
        match cut::first_text_cut(bytes, target, limit, |q| !(specials && enc.specials.straddles(bytes, q))) {
            Some(q) => cuts.push(q),
            // The rest of the text is shorter than `every`: it is the last part.
            None if limit == bytes.len() => break,
            None => return None,
        }
        target = cuts[cuts.len() - 1] + every;
    }
    Some(cuts)
}

/// Cuts at special-token matches (found by one scan of the whole text) and, for the
/// built-in patterns, at text cuts between them.
fn cuts_between_matches(enc: &Encoder, text: &str, specials: bool, every: usize) -> Vec<usize> {
    let bytes = text.as_bytes();
    let builtin = enc.has_builtin_pattern();
    // Special-token matches are hard boundaries (when specials are in force) and must
    // not be cut through.
    let matches: Vec<(usize, usize)> =
        if specials { enc.specials.find_iter(text.as_bytes()).map(|(s, e, _)| (s, e)).collect() } else { Vec::new() };
    let mut cuts = Vec::new();
    let mut target = every;
    let mut mi = 0; // first match ending after `target`
    while target < bytes.len() {
        while mi < matches.len() && matches[mi].1 <= target {
            mi += 1;
        }
        // The next special boundary at or after target.
        let special_cut = matches.get(mi).map(|&(s, e)| if s >= target { s } else { e });
        // The next pre-tokenizer-safe position at or after target, outside any match.
        let mut pretok_cut = None;
        if builtin {
            pretok_cut = cut::first_text_cut(bytes, target, special_cut.unwrap_or(bytes.len()), |_| true);
            // Inside a match that started before target?
            if let (Some(q), Some(&(s, e))) = (pretok_cut, matches.get(mi)) {
                if s < q && q < e {
                    pretok_cut = None;
                }
            }
        }
        let cut = match (pretok_cut, special_cut) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => match a.or(b) {
                Some(c) => c,
                None => break,
            },
        };
        if cut > 0 && cut < bytes.len() && cuts.last().is_none_or(|&l| cut > l) {
            cuts.push(cut);
        }
        target = cut.max(target) + every;
    }
    cuts
}

/// Files at least this big are read and checked on several threads.
const PARALLEL_READ: usize = 4 << 20;
/// Bytes per task when reading and checking a file in parallel.
const READ_TASK: usize = 2 << 20;

/// The text of the file at `path`, with invalid UTF-8 replaced by U+FFFD (as
/// `String::from_utf8_lossy` does). A large file is read and its UTF-8 checked in
/// parallel: done serially, these took a fifth of `encode_file`'s time on two threads.
pub fn read_text_file(path: &std::path::Path, threads: ThreadCount) -> std::io::Result<String> {
    let data = read_file(path, threads, threads::resolve(threads) > 1)?;
    Ok(if is_utf8(&data, threads) {
        // SAFETY: every byte was checked just above.
        unsafe { String::from_utf8_unchecked(data) }
    } else {
        String::from_utf8_lossy(&data).into_owned()
    })
}

/// A file's text for encoding (see [`map_text_file`]).
pub enum FileText {
    /// The file mapped into memory: valid UTF-8 throughout.
    Mapped(memmap2::Mmap),
    /// The file read, invalid UTF-8 replaced by U+FFFD.
    Owned(String),
}

impl std::ops::Deref for FileText {
    type Target = str;
    fn deref(&self) -> &str {
        match self {
            // SAFETY: a mapping is kept only once all its bytes were checked as UTF-8.
            FileText::Mapped(m) => unsafe { std::str::from_utf8_unchecked(m) },
            FileText::Owned(s) => s,
        }
    }
}

/// The text of the file at `path` as [`read_text_file`] gives it, but a large file of
/// valid UTF-8 is mapped into memory, not copied: the copy (and the fresh pages it is
/// copied into) cost about a tenth of encoding a file on two threads. Small files,
/// files that cannot be mapped (pipes) and files with invalid UTF-8 are read.
///
/// As with any file mapping, the file must not be truncated or overwritten while the
/// text is in use: reading a page past a new end raises SIGBUS, and the text was checked
/// as UTF-8 only once. Appending is harmless (the mapping ends at the length first seen).
pub fn map_text_file(path: &std::path::Path, threads: ThreadCount) -> std::io::Result<FileText> {
    let file = std::fs::File::open(path)?;
    if file.metadata()?.len() >= PARALLEL_READ as u64 {
        // SAFETY: the mapping is read-only; see the note above on changes to the file.
        if let Ok(map) = unsafe { memmap2::Mmap::map(&file) } {
            if is_utf8(&map, threads) {
                return Ok(FileText::Mapped(map));
            }
            return Ok(FileText::Owned(String::from_utf8_lossy(&map).into_owned()));
        }
    }
    read_text_file(path, threads).map(FileText::Owned)
}

/// Whether `data` is valid UTF-8; checked in parallel when large.
fn is_utf8(data: &[u8], threads: ThreadCount) -> bool {
    if data.len() < PARALLEL_READ || threads::resolve(threads) <= 1 {
        return crate::utf8::to_str(data).is_ok();
    }
    // Task boundaries moved forward to the start of a character (past at most 3
    // continuation bytes), so that each task checks whole characters. The first stays at
    // 0: bytes before it would go unchecked.
    let mut bounds: Vec<usize> =
        (0..data.len()).step_by(READ_TASK).map(|b| if b == 0 { 0 } else { char_start_at_or_after(data, b) }).collect();
    bounds.push(data.len());
    bounds.dedup();
    threads::install(threads, || bounds.par_windows(2).all(|w| crate::utf8::to_str(&data[w[0]..w[1]]).is_ok()))
}

/// The first position at or after `i` that is not a UTF-8 continuation byte (or the
/// end), looking at most 3 bytes ahead: a valid text has a character start there.
fn char_start_at_or_after(data: &[u8], i: usize) -> usize {
    let mut j = i;
    while j < data.len() && j < i + 3 && (data[j] & 0xC0) == 0x80 {
        j += 1;
    }
    j
}

/// The spare capacity of a byte vector that reading tasks fill, each its own range.
#[cfg(unix)]
struct SpareBytes(*mut u8);

// SAFETY: the tasks write disjoint ranges (see `read_file`).
#[cfg(unix)]
unsafe impl Sync for SpareBytes {}

#[cfg(unix)]
impl SpareBytes {
    fn at(&self, offset: usize) -> *mut u8 {
        self.0.wrapping_add(offset)
    }
}

/// Read exactly `n` bytes of `file` at `offset` into `dst`.
///
/// # Safety
/// `dst` is valid for writes of `n` bytes, and nothing else accesses them meanwhile.
#[cfg(unix)]
unsafe fn pread_exact(file: &std::fs::File, dst: *mut u8, n: usize, offset: u64) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    let mut done = 0;
    while done < n {
        let at = libc::off_t::try_from(offset + done as u64).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        // SAFETY: the caller's guarantee on dst[..n].
        let got = unsafe { libc::pread(file.as_raw_fd(), dst.add(done).cast(), n - done, at) };
        match got {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            g if g < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            g => done += g as usize,
        }
    }
    Ok(())
}

/// The bytes of the file at `path`; a large one is read by the threads of `threads` at
/// once if `parallel`.
fn read_file(path: &std::path::Path, threads: ThreadCount, parallel: bool) -> std::io::Result<Vec<u8>> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        if parallel && len >= PARALLEL_READ as u64 && len <= isize::MAX as u64 {
            let len = len as usize;
            // Read straight into the spare capacity, not zeroed first: zeroing was a serial
            // pass over the whole buffer (memory reused from an earlier call is not zero).
            let mut data: Vec<u8> = Vec::with_capacity(len);
            let spare = SpareBytes(data.as_mut_ptr());
            let read = threads::install(threads, || {
                (0..len.div_ceil(READ_TASK)).into_par_iter().try_for_each(|i| {
                    let start = i * READ_TASK;
                    // SAFETY: tasks fill disjoint ranges of the `len` bytes of capacity.
                    unsafe { pread_exact(&file, spare.at(start), READ_TASK.min(len - start), start as u64) }
                })
            });
            match read {
                Ok(()) => {
                    // SAFETY: every byte up to `len` was written by the reads above.
                    unsafe { data.set_len(len) };
                    // The file may have grown meanwhile: read it whole then, as at once.
                    let mut probe = [0u8; 1];
                    if file.read_at(&mut probe, len as u64)? == 0 {
                        return Ok(data);
                    }
                }
                // It shrank meanwhile: read it whole below.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
                Err(e) => return Err(e),
            }
        }
    }
    #[cfg(not(unix))]
    let _ = (threads, parallel);
    std::fs::read(path)
}
