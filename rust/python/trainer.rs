//! The BPE trainer (`BpeTrainer`); the algorithm lives in rust/train*.

use std::path::PathBuf;

use pyo3::exceptions::{
    PyFileNotFoundError, PyIsADirectoryError, PyKeyboardInterrupt, PyOSError, PyPermissionError, PyRuntimeError,
    PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use super::run_watched;
use crate::train::{Control, TrainError, Trainer, Utf8Errors, DEFAULT_CHUNK_SIZE};

fn to_pyerr(e: TrainError) -> PyErr {
    match e {
        TrainError::Io { path, err } => {
            let path = path.display().to_string();
            let errno = err.raw_os_error();
            let mut msg = err.to_string();
            if let Some(i) = msg.find(" (os error") {
                msg.truncate(i);
            }
            match err.kind() {
                std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err((errno.unwrap_or(2), msg, path)),
                std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err((errno.unwrap_or(13), msg, path)),
                std::io::ErrorKind::IsADirectory => PyIsADirectoryError::new_err((errno.unwrap_or(21), msg, path)),
                _ => PyOSError::new_err((errno.unwrap_or(5), msg, path)),
            }
        }
        TrainError::Cancelled => PyKeyboardInterrupt::new_err("training was cancelled"),
        e @ (TrainError::InvalidUtf8 { .. } | TrainError::InvalidInput(_) | TrainError::Pattern(_)) => {
            PyValueError::new_err(e.to_string())
        }
    }
}

/// One BPE training run: `count_files` / `count_texts` any number of times, then
/// `learn` once. Called by `ferrolm.bpe.trainer`; not a public API.
#[pyclass(name = "BpeTrainer", module = "ferrolm._core")]
pub struct PyBpeTrainer {
    inner: Option<Trainer>,
    ctl: Control,
}

impl PyBpeTrainer {
    /// Run `f` on the trainer on a watched worker thread. A trainer that failed is spent.
    fn run<T: Send>(
        &mut self,
        py: Python<'_>,
        progress: Option<&Bound<'_, PyAny>>,
        f: impl FnOnce(&mut Trainer, &Control) -> Result<T, TrainError> + Send,
    ) -> PyResult<T> {
        let mut trainer = self.inner.take().ok_or_else(|| {
            PyRuntimeError::new_err("this BpeTrainer failed or was interrupted earlier; make a new one")
        })?;
        let ctl = &self.ctl;
        let report = |_: Python<'_>| -> PyResult<()> {
            if let Some(cb) = progress {
                cb.call1(ctl.progress())?;
            }
            Ok(())
        };
        let (trainer, result) = run_watched(
            py,
            || ctl.cancel(),
            report,
            move || {
                let r = f(&mut trainer, ctl);
                (trainer, r)
            },
        )?;
        match result {
            Ok(v) => {
                self.inner = Some(trainer);
                Ok(v)
            }
            Err(e) => Err(to_pyerr(e)),
        }
    }
}

#[pymethods]
impl PyBpeTrainer {
    #[new]
    #[pyo3(signature = (special_tokens, pattern = "gpt2", num_threads = None, errors = "strict", chunk_size = None))]
    fn new(
        special_tokens: Vec<String>,
        pattern: &str,
        num_threads: Option<usize>,
        errors: &str,
        chunk_size: Option<usize>,
    ) -> PyResult<Self> {
        let errors: Utf8Errors = errors.parse().map_err(PyValueError::new_err)?;
        let t = Trainer::new(&special_tokens, pattern, num_threads, errors, chunk_size.unwrap_or(DEFAULT_CHUNK_SIZE))
            .map_err(to_pyerr)?;
        Ok(PyBpeTrainer { inner: Some(t), ctl: Control::default() })
    }

    /// Count the pre-tokens of these files (each its own text), read as the shard writer
    /// reads them: text, .gz/.zst, JSON Lines and Parquet, whose documents are in `field`.
    /// `progress(done, total)` is called with bytes.
    #[pyo3(signature = (paths, field = String::from("text"), progress = None))]
    fn count_files(
        &mut self,
        py: Python<'_>,
        paths: Vec<PathBuf>,
        field: String,
        progress: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        self.run(py, progress, move |t, ctl| t.count_files(&paths, &field, ctl))
    }

    /// Count part `i` of `n` of these files (byte ranges cut at special tokens, each its
    /// own text; other formats whole); returns the `(path, start, end)` ranges counted.
    #[pyo3(signature = (paths, i, n, field = String::from("text"), progress = None))]
    fn count_part(
        &mut self,
        py: Python<'_>,
        paths: Vec<PathBuf>,
        i: u64,
        n: u64,
        field: String,
        progress: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(PathBuf, u64, u64)>> {
        self.run(py, progress, move |t, ctl| t.count_part(&paths, &field, i, n, ctl))
    }

    /// Feed text to the text stream: everything fed until `finish_text` is one
    /// continuous text. `progress(done, total)` is called with bytes.
    #[pyo3(signature = (text, progress = None))]
    fn feed_text(&mut self, py: Python<'_>, text: String, progress: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        self.run(py, progress, move |t, ctl| t.feed_text(&text, ctl))
    }

    /// Count a batch of documents, each a text of its own: `data` a uint8 array of UTF-8,
    /// `offsets` an int64 array of n + 1 positions in it.
    #[pyo3(signature = (data, offsets, progress = None))]
    fn feed_documents(
        &mut self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        progress: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let batch = super::doc_batches::extract_batch(data, offsets)?;
        self.run(py, progress, move |t, ctl| t.feed_documents(&batch.data, &batch.ends, ctl))
    }

    /// End the text stream (count what is buffered).
    #[pyo3(signature = (progress = None))]
    fn finish_text(&mut self, py: Python<'_>, progress: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        self.run(py, progress, move |t, ctl| t.finish_text(ctl))
    }

    /// Learn up to `num_merges` merges; returns them as (bytes, bytes) pairs in order,
    /// and the vocab they make: id -> bytes for the 256 bytes, then one id per merge.
    /// `progress(done, total)` is called with merges.
    #[pyo3(signature = (num_merges, progress = None))]
    fn learn<'py>(
        &mut self,
        py: Python<'py>,
        num_merges: usize,
        progress: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyDict>)> {
        let merges = self.run(py, progress, move |t, ctl| t.learn(num_merges, ctl))?;
        // Built here rather than in Python (a Python loop over 32k merges takes ~15 ms),
        // with one bytes object per symbol: the vocab entries and the pairs share them.
        let mut objects: Vec<Option<Bound<'py, PyBytes>>> = vec![None; merges.num_symbols()];
        let mut object =
            |s: u32| objects[s as usize].get_or_insert_with(|| PyBytes::new(py, merges.symbol_bytes(s))).clone();
        let vocab = PyDict::new(py);
        for b in 0..=255u8 {
            vocab.set_item(b, object(b as u32))?;
        }
        let mut pairs = Vec::with_capacity(merges.len());
        for i in 0..merges.len() {
            let ((a, b), made) = merges.merge(i);
            vocab.set_item(256 + i, object(made))?;
            pairs.push((object(a), object(b)));
        }
        Ok((PyList::new(py, pairs)?, vocab))
    }

    /// Add the pre-token counts of a counts file (its checksum checked first); returns
    /// the file's JSON header.
    #[pyo3(signature = (path, progress = None))]
    fn add_counts_file(
        &mut self,
        py: Python<'_>,
        path: PathBuf,
        progress: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<String> {
        self.run(py, progress, move |t, _| t.add_counts_file(&path))
    }

    /// Write the counts (counted and added) to `path` with the JSON `header`, fsynced,
    /// instead of learning; returns the number of unique pre-tokens.
    #[pyo3(signature = (path, header, progress = None))]
    fn write_counts(
        &mut self,
        py: Python<'_>,
        path: PathBuf,
        header: String,
        progress: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        self.run(py, progress, move |t, _| t.write_counts(&path, &header))
    }

    /// Seconds per stage and sizes of the last run (for profiling).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(t) = &self.inner {
            let s = &t.stats;
            d.set_item("read_s", s.read_s)?;
            d.set_item("count_s", s.count_s)?;
            d.set_item("merge_tables_s", s.merge_tables_s)?;
            d.set_item("build_s", s.build_s)?;
            d.set_item("merge_s", s.merge_s)?;
            d.set_item("bytes", s.bytes)?;
            d.set_item("unique_pretokens", s.unique_pretokens)?;
            d.set_item("words", s.words)?;
            d.set_item("merges", s.merges)?;
        }
        Ok(d)
    }
}

/// The `(path, start, end)` byte ranges that `BpeTrainer.count_part(paths, i, n)` counts.
#[pyfunction]
#[pyo3(signature = (paths, special_tokens, i, n, field = String::from("text")))]
fn count_part_ranges(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    special_tokens: Vec<String>,
    i: u64,
    n: u64,
    field: String,
) -> PyResult<Vec<(PathBuf, u64, u64)>> {
    py.detach(|| crate::train::part_ranges(&paths, &field, &special_tokens, i, n)).map_err(to_pyerr)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBpeTrainer>()?;
    m.add_function(wrap_pyfunction!(count_part_ranges, m)?)
}
