//! The pre-tokenizer on its own, for differential and exhaustive tests against the
//! reference and tiktoken, and the Unicode version of its classes.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::pretokenize::{Builtin, PreTokenizer};

/// Pre-tokenize `text` with a named or custom pattern; returns the pieces.
#[pyfunction]
#[pyo3(signature = (text, pattern = "gpt2"))]
fn pretokenize(py: Python<'_>, text: &str, pattern: &str) -> PyResult<Vec<String>> {
    let pre = PreTokenizer::new(pattern).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let pieces = py.detach(|| pre.pieces(text).into_iter().map(str::to_owned).collect());
    Ok(pieces)
}

/// The regex source of a built-in pattern name ("gpt2", "cl100k", "o200k"); a test
/// checks it equals ferrolm.patterns.
#[pyfunction]
fn pattern_source(name: &str) -> PyResult<&'static str> {
    Builtin::by_name(name)
        .map(|b| b.source())
        .ok_or_else(|| PyValueError::new_err(format!("unknown built-in pattern name: {name:?}")))
}

/// For each char of `text`, the bit flags of the pre-tokenizer's Unicode classes
/// (see `pretokenize::char_class_flags`), as bytes: one flag byte per char.
#[pyfunction]
fn _char_classes(text: &str) -> Vec<u8> {
    text.chars().map(crate::pretokenize::char_class_flags).collect()
}

/// The Unicode version of the built-in patterns' character classes (fixed per release,
/// whatever Python packages are installed); tokenizer records keep it.
#[pyfunction]
fn unicode_version() -> &'static str {
    crate::pretokenize::unicode_version()
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(unicode_version, m)?)?;
    m.add_function(wrap_pyfunction!(pretokenize, m)?)?;
    m.add_function(wrap_pyfunction!(pattern_source, m)?)?;
    m.add_function(wrap_pyfunction!(_char_classes, m)?)?;
    Ok(())
}
