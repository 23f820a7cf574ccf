//! Documents handed over from Python in batches: a text column as one UTF-8 data buffer
//! and Arrow-style offsets (what pyarrow holds for a row group's string column), so no
//! Python code runs per document.

use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::shards::{DocBatch, DocSource, ShardError};

/// `(data, offsets)`: a uint8 array of UTF-8 text and an int64 array of n + 1 offsets
/// into it (numpy views of pyarrow's buffers: the abi3 build has no buffer protocol).
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
