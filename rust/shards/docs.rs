//! Inputs whose documents come from the caller in batches rather than from bytes this
//! module parses: Parquet files (the caller decodes row groups with its Parquet reader
//! and hands over each text column as one data buffer plus offsets) and in-memory
//! iterables of strings. Each document is encoded as ordinary text and followed by the
//! end-of-text id, as a JSON Lines record is.

use super::ShardError;

/// A batch of documents: document `i` is `data[ends[i - 1]..ends[i]]` (`ends[-1]` = 0).
#[derive(Debug, Default, Clone)]
pub struct DocBatch {
    pub data: Vec<u8>,
    pub ends: Vec<usize>,
}

impl DocBatch {
    pub fn len(&self) -> usize {
        self.ends.len()
    }
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
    pub fn start(&self, i: usize) -> usize {
        if i == 0 {
            0
        } else {
            self.ends[i - 1]
        }
    }
    /// A batch copied from `offsets` (Arrow's layout: n + 1 increasing positions into
    /// `data`) and the bytes they cover.
    pub fn from_offsets(data: &[u8], offsets: &[i64]) -> Result<DocBatch, String> {
        let mut batch = DocBatch::default();
        batch.fill_from_offsets(data, offsets)?;
        Ok(batch)
    }

    /// Replace the batch with a copy of `offsets` and `data` (as in `from_offsets`),
    /// reusing its buffers: a fresh buffer per batch costs a page fault per page, more
    /// than the copy itself. Left empty on error.
    pub fn fill_from_offsets(&mut self, data: &[u8], offsets: &[i64]) -> Result<(), String> {
        self.data.clear();
        self.ends.clear();
        let bad = || "document offsets are not increasing within the data".to_string();
        let base = *offsets.first().unwrap_or(&0);
        if base < 0 {
            return Err(bad());
        }
        let mut prev = base;
        for &o in offsets.iter().skip(1) {
            if o < prev || o as u64 > data.len() as u64 {
                self.ends.clear();
                return Err(bad());
            }
            self.ends.push((o - base) as usize);
            prev = o;
        }
        self.data.extend_from_slice(&data[base as usize..prev as usize]);
        Ok(())
    }
}

/// An error naming the first document of `batch` that is not UTF-8 (`before`: documents
/// of `path` before the batch), if there is one.
pub fn check_documents_utf8(path: &std::path::Path, batch: &DocBatch, before: u64) -> Result<(), ShardError> {
    if crate::utf8::to_str(&batch.data).is_ok() {
        return Ok(());
    }
    for i in 0..batch.len() {
        if let Err(e) = crate::utf8::to_str(&batch.data[batch.start(i)..batch.ends[i]]) {
            return Err(not_utf8(path, before + i as u64, e.valid_up_to()));
        }
    }
    Ok(())
}

/// Document `index` of `path` is not UTF-8 from byte `at` of it.
pub(crate) fn not_utf8(path: &std::path::Path, index: u64, at: usize) -> ShardError {
    ShardError::Invalid(format!(
        "{}: document {index} is not valid UTF-8 (at byte {at} of it; pass errors=\"replace\" or \
         --errors replace to substitute U+FFFD)",
        path.display()
    ))
}

/// The caller's reader of `Format::Docs` inputs. Used on the thread that runs the job.
pub trait DocSource {
    /// Start reading input `file` (an index into `EncodeJob::inputs`) from its first
    /// document; returns how many documents it holds, when known (for progress).
    fn open(&mut self, file: usize) -> Result<Option<u64>, ShardError>;
    /// Fill `batch` with the next documents of the open input, in order; `false` at its end.
    fn next_batch(&mut self, batch: &mut DocBatch) -> Result<bool, ShardError>;
}

/// Documents held in memory, one `Vec` per input (tests, and callers that have them all).
pub struct VecSource {
    pub inputs: Vec<Vec<String>>,
    pub batch_docs: usize,
    cur: Option<(usize, usize)>,
}

impl VecSource {
    pub fn new(inputs: Vec<Vec<String>>, batch_docs: usize) -> Self {
        VecSource { inputs, batch_docs: batch_docs.max(1), cur: None }
    }
}

impl DocSource for VecSource {
    fn open(&mut self, file: usize) -> Result<Option<u64>, ShardError> {
        let docs =
            self.inputs.get(file).ok_or_else(|| ShardError::Invalid(format!("no documents for input {file}")))?;
        self.cur = Some((file, 0));
        Ok(Some(docs.len() as u64))
    }
    fn next_batch(&mut self, batch: &mut DocBatch) -> Result<bool, ShardError> {
        let Some((file, pos)) = self.cur else { return Ok(false) };
        let docs = &self.inputs[file];
        if pos >= docs.len() {
            return Ok(false);
        }
        let end = (pos + self.batch_docs).min(docs.len());
        batch.data.clear();
        batch.ends.clear();
        for d in &docs[pos..end] {
            batch.data.extend_from_slice(d.as_bytes());
            batch.ends.push(batch.data.len());
        }
        self.cur = Some((file, end));
        Ok(true)
    }
}
