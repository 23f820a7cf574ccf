//! Stage 2: pre-tokenize in parallel and count unique pre-tokens (u64 counts).
//!
//! Each worker owns one table for the whole run (no locking, no sharing); pieces are
//! looked up as byte slices borrowed from the chunk and copied only the first time
//! a worker sees them. The tables are merged once, at the end.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use crate::pretokenize::PreTokenizer;

use super::read::safe_text_cut;
use super::{Control, TrainError};

/// Unique pre-tokens (their bytes) and how often each occurs.
pub type PieceCounts = HashMap<Box<[u8]>, u64, FxBuildHasher>;

/// What to do with bytes that are not UTF-8.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Utf8Errors {
    Strict,
    Replace,
}

/// Add one piece to a table.
#[inline]
pub fn add_piece(map: &mut PieceCounts, piece: &[u8], n: u64) {
    if let Some(c) = map.get_mut(piece) {
        *c += n;
    } else {
        map.insert(piece.into(), n);
    }
}

/// Pre-tokenize one span of text (no special tokens inside) into `map`.
#[inline]
pub fn count_text(pre: &PreTokenizer, text: &str, map: &mut PieceCounts) {
    pre.for_each_piece(text, |p| add_piece(map, p.as_bytes(), 1));
}

/// A span of text free of special tokens, with its offset in its source (for errors).
#[derive(Clone, Copy)]
pub struct Segment<'a> {
    pub offset: u64,
    pub bytes: &'a [u8],
}

/// Split long segments at exact text cuts (built-in patterns only), so a chunk made of
/// one huge document still spreads over the workers.
fn split_long_segments<'a>(segs: &mut Vec<Segment<'a>>, piece: usize) {
    if !segs.iter().any(|s| s.bytes.len() > 2 * piece) {
        return;
    }
    let mut out = Vec::with_capacity(segs.len() + 16);
    for seg in segs.iter() {
        let mut rest = *seg;
        while rest.bytes.len() > 2 * piece {
            // Cut in [piece, 2 * piece] if possible, else leave it long.
            match safe_text_cut(rest.bytes, piece, 2 * piece) {
                Some(c) => {
                    out.push(Segment { offset: rest.offset, bytes: &rest.bytes[..c] });
                    rest = Segment { offset: rest.offset + c as u64, bytes: &rest.bytes[c..] };
                }
                None => break,
            }
        }
        out.push(rest);
    }
    *segs = out;
}

/// The parallel counting engine: one table per worker.
pub struct Counter {
    pub tables: Vec<Mutex<PieceCounts>>,
}

impl Counter {
    pub fn new(workers: usize) -> Self {
        Counter { tables: (0..workers.max(1)).map(|_| Mutex::new(PieceCounts::default())).collect() }
    }

    /// Pre-tokenize and count `segs` on the pool's workers.
    /// `source` names the input in error messages.
    #[allow(clippy::too_many_arguments)]
    pub fn count_segments(
        &self,
        pool: &rayon::ThreadPool,
        pre: &PreTokenizer,
        builtin: bool,
        errors: Utf8Errors,
        mut segs: Vec<Segment<'_>>,
        source: &str,
        ctl: &Control,
    ) -> Result<(), TrainError> {
        let workers = self.tables.len();
        let total: usize = segs.iter().map(|s| s.bytes.len()).sum();
        // Enough tasks to balance the load, big enough that scheduling costs nothing.
        let task_bytes = (total / (workers * 8)).clamp(1 << 16, 4 << 20);
        if builtin {
            split_long_segments(&mut segs, task_bytes);
        }
        // Tasks: contiguous runs of segments of about task_bytes, as (first, end, bytes).
        let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
        let (mut first, mut bytes) = (0, 0);
        for (i, s) in segs.iter().enumerate() {
            bytes += s.bytes.len();
            if bytes >= task_bytes || i + 1 == segs.len() {
                tasks.push((first, i + 1, bytes));
                first = i + 1;
                bytes = 0;
            }
        }
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        // Offset of the first invalid UTF-8 byte any worker found.
        let bad_utf8: Mutex<Option<u64>> = Mutex::new(None);
        let segs = &segs;
        let tasks = &tasks;
        pool.scope(|scope| {
            for table in &self.tables {
                let next = &next;
                let bad_utf8 = &bad_utf8;
                let stop = &stop;
                scope.spawn(move |_| {
                    let mut map = table.lock().unwrap();
                    loop {
                        if ctl.is_cancelled() || stop.load(Ordering::Relaxed) {
                            return;
                        }
                        // Tasks are taken in order, and a task once taken is finished, so
                        // the smallest bad offset found is the first in the source.
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(first, end, bytes)) = tasks.get(i) else { return };
                        for seg in &segs[first..end] {
                            match std::str::from_utf8(seg.bytes) {
                                Ok(text) => count_text(pre, text, &mut map),
                                Err(err) => match errors {
                                    Utf8Errors::Replace => {
                                        count_text(pre, &String::from_utf8_lossy(seg.bytes), &mut map)
                                    }
                                    Utf8Errors::Strict => {
                                        let at = seg.offset + err.valid_up_to() as u64;
                                        let mut bad = bad_utf8.lock().unwrap();
                                        if bad.map_or(true, |b| at < b) {
                                            *bad = Some(at);
                                        }
                                        stop.store(true, Ordering::Relaxed);
                                        return;
                                    }
                                },
                            }
                        }
                        ctl.add_done(bytes as u64);
                    }
                });
            }
        });
        if let Some(offset) = bad_utf8.into_inner().unwrap() {
            return Err(TrainError::InvalidUtf8 { source: source.to_string(), offset });
        }
        if ctl.is_cancelled() {
            return Err(TrainError::Cancelled);
        }
        Ok(())
    }

    /// Merge the workers' tables into one (the largest absorbs the others).
    pub fn into_counts(self) -> PieceCounts {
        let mut tables: Vec<PieceCounts> = self.tables.into_iter().map(|m| m.into_inner().unwrap()).collect();
        tables.sort_by_key(|t| std::cmp::Reverse(t.len()));
        let mut it = tables.into_iter();
        let mut total = it.next().unwrap_or_default();
        for t in it {
            total.reserve(t.len() / 2);
            for (k, v) in t {
                *total.entry(k).or_insert(0) += v;
            }
        }
        total
    }
}
