//! Fast readers of vocab.json and merges.txt; `None` hands the file to the Python
//! reader, which reports what is wrong with it.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

/// vocab.json's text as {id: token bytes}, or None when ferrolm.bpe.files must
/// read it (and report what is wrong).
#[pyfunction]
fn read_vocab_json<'py>(py: Python<'py>, text: &str, specials: Vec<String>) -> PyResult<Option<Bound<'py, PyDict>>> {
    let Some(items) = py.detach(|| crate::vocab_files::read_vocab_json(text, &specials)) else { return Ok(None) };
    let d = PyDict::new(py);
    for (id, bytes) in items {
        d.set_item(id, PyBytes::new(py, &bytes))?;
    }
    Ok(Some(d))
}

/// merges.txt's text as [(left bytes, right bytes)], or None when
/// ferrolm.bpe.files must read it (and report what is wrong).
#[pyfunction]
fn read_merges_txt<'py>(py: Python<'py>, text: &str) -> PyResult<Option<Bound<'py, PyList>>> {
    let Some(merges) = py.detach(|| crate::vocab_files::read_merges_txt(text)) else { return Ok(None) };
    let items = merges
        .iter()
        .map(|(a, b)| PyTuple::new(py, [PyBytes::new(py, a), PyBytes::new(py, b)]))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(Some(PyList::new(py, items)?))
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_vocab_json, m)?)?;
    m.add_function(wrap_pyfunction!(read_merges_txt, m)?)?;
    Ok(())
}
