//! Documents handed over in batches: one UTF-8 data buffer and Arrow-style offsets (n + 1
//! int64 boundaries), so no Python code runs per document. Python's iterables come in
//! this form (`text_batches`), and `ParquetDocs` hands Parquet text columns out in it.

use std::path::PathBuf;
use std::sync::{Mutex, PoisonError, TryLockError};

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::shards::shard_err;
use crate::shards::{DocBatch, DocSource, ParquetDocs, ShardError, PARQUET_BATCH_BYTES};

/// `(data, offsets)`: a uint8 array of UTF-8 text and an int64 array of n + 1 offsets
/// into it (numpy arrays: the abi3 build has no buffer protocol).
pub fn extract_batch(data: &Bound<'_, PyAny>, offsets: &Bound<'_, PyAny>) -> PyResult<DocBatch> {
    let data: PyReadonlyArray1<u8> = data.extract()?;
    let offsets: PyReadonlyArray1<i64> = offsets.extract()?;
    DocBatch::from_offsets(data.as_slice()?, offsets.as_slice()?).map_err(PyValueError::new_err)
}

/// A Python object with `open(i) -> int | None` (start input `i`, return its number of
/// documents when known) and `next_batch() -> (data, offsets) | None`, as a `DocSource`.
/// A Python exception is kept in `error` and the job stops as interrupted (what was
/// written stays resumable); the caller raises it.
pub struct PyDocSource {
    pub obj: Py<PyAny>,
    pub error: Option<PyErr>,
}

impl PyDocSource {
    fn fail(&mut self, e: PyErr) -> ShardError {
        self.error = Some(e);
        ShardError::Interrupted
    }
}

impl DocSource for PyDocSource {
    fn open(&mut self, file: usize) -> Result<Option<u64>, ShardError> {
        let r = Python::attach(|py| self.obj.call_method1(py, "open", (file,))?.extract::<Option<u64>>(py));
        r.map_err(|e| self.fail(e))
    }

    fn next_batch(&mut self, batch: &mut DocBatch) -> Result<bool, ShardError> {
        let r = Python::attach(|py| -> PyResult<bool> {
            let got = self.obj.call_method0(py, "next_batch")?;
            if got.is_none(py) {
                return Ok(false);
            }
            let (data, offsets): (Bound<'_, PyAny>, Bound<'_, PyAny>) = got.extract(py)?;
            let data: PyReadonlyArray1<u8> = data.extract()?;
            let offsets: PyReadonlyArray1<i64> = offsets.extract()?;
            batch.fill_from_offsets(data.as_slice()?, offsets.as_slice()?).map_err(PyValueError::new_err)?;
            Ok(true)
        });
        r.map_err(|e| self.fail(e))
    }
}

/// `ParquetDocs(path, column="text", batch_bytes=1 MiB)`: the documents of a Parquet
/// file's text column, read by the core a batch at a time with the GIL released.
#[pyclass(name = "ParquetDocs", module = "ferrolm._core")]
pub struct PyParquetDocs {
    // The decoder's page reader is Send but not Sync.
    inner: Mutex<(ParquetDocs, DocBatch)>,
}

#[pymethods]
impl PyParquetDocs {
    #[new]
    #[pyo3(signature = (path, column = "text", batch_bytes = PARQUET_BATCH_BYTES))]
    fn new(py: Python<'_>, path: PathBuf, column: &str, batch_bytes: usize) -> PyResult<Self> {
        let inner = py.detach(|| ParquetDocs::open(&path, column, batch_bytes)).map_err(shard_err)?;
        Ok(PyParquetDocs { inner: Mutex::new((inner, DocBatch::default())) })
    }

    /// Rows in the file (nulls, which are no document, included).
    #[getter]
    fn num_rows(&self) -> u64 {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).0.num_rows()
    }

    /// The next batch as `(data, offsets)` (uint8 UTF-8 text, int64 n + 1 offsets), or
    /// `None` at the end of the file.
    #[allow(clippy::type_complexity)]
    fn next_batch<'py>(
        &mut self,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, PyArray1<u8>>, Bound<'py, PyArray1<i64>>)>> {
        // Waiting for the lock with the GIL held could deadlock with its holder.
        let mut guard = match self.inner.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                return Err(PyRuntimeError::new_err("ParquetDocs.next_batch called from two threads at once"))
            }
        };
        let (docs, batch) = &mut *guard;
        if !py.detach(|| docs.next_batch(batch)).map_err(shard_err)? {
            return Ok(None);
        }
        let mut offsets = Vec::with_capacity(batch.ends.len() + 1);
        offsets.push(0i64);
        offsets.extend(batch.ends.iter().map(|&e| e as i64));
        Ok(Some((PyArray1::from_slice(py, &batch.data), PyArray1::from_vec(py, offsets))))
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyParquetDocs>()
}
