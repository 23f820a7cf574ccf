//! The PyO3 binding: converts types and releases the GIL around heavy calls.
//! No algorithm lives here.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::pretokenize::PreTokenizer;

/// The version of the compiled core.
#[pyfunction]
fn version() -> &'static str {
    crate::VERSION
}

/// Pre-tokenize `text` with a named or custom pattern; returns the pieces.
/// Exposed for differential tests against Python's `regex` module.
#[pyfunction]
#[pyo3(signature = (text, pattern = "gpt2"))]
fn pretokenize(py: Python<'_>, text: &str, pattern: &str) -> PyResult<Vec<String>> {
    let pre = PreTokenizer::new(pattern).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let pieces = py.detach(|| pre.pieces(text).into_iter().map(str::to_owned).collect());
    Ok(pieces)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(pretokenize, m)?)?;
    Ok(())
}
