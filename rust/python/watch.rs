//! Long encodes on a watched worker thread (`super::run_watched`), so that Ctrl-C stops
//! them promptly; numpy's C API loaded where an interrupted import can be reported; and
//! the test hooks that inject panics (`crate::fault`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::encode::cancel;

/// Encodes of at least this many bytes run watched (see `interruptible`): shorter ones
/// are over in a few milliseconds.
pub(super) const WATCH_MIN: usize = 1 << 20;

/// Run an encode `job` over `n` bytes of text with the GIL released; when it is large,
/// on a watched worker thread, so that Ctrl-C stops it between batches of pieces (and
/// raises KeyboardInterrupt) instead of after it.
pub(super) fn interruptible<T: Send>(py: Python<'_>, n: usize, job: impl FnOnce() -> T + Send) -> PyResult<T> {
    if n < WATCH_MIN {
        return Ok(py.detach(job));
    }
    let flag = Arc::new(AtomicBool::new(false));
    let stop = || flag.store(true, Ordering::Relaxed);
    let worker_flag = flag.clone();
    super::run_watched(py, stop, |_| Ok(()), move || cancel::under(worker_flag, job))?
        .map_err(|cancel::Cancelled| PyKeyboardInterrupt::new_err("encoding was interrupted"))
}

/// Load numpy's C API now, where an exception raised by numpy's import (Ctrl-C while it
/// loads) comes back as itself: rust-numpy loads it on first use, and turns such an error
/// into a panic ("Failed to access NumPy array API capsule"). Cheap after the first call.
pub(super) fn numpy_ready(py: Python<'_>) -> PyResult<()> {
    static READY: AtomicBool = AtomicBool::new(false);
    if READY.load(Ordering::Acquire) {
        return Ok(());
    }
    // The imports rust-numpy makes, with their errors returned.
    let version = py.import("numpy")?.getattr("__version__")?;
    let major: u32 = py.import("numpy.lib")?.getattr("NumpyVersion")?.call1((version,))?.getattr("major")?.extract()?;
    let core = if major >= 2 { "numpy._core.multiarray" } else { "numpy.core.multiarray" };
    py.import(core)?.getattr("_ARRAY_API")?;
    py.check_signals()?;
    // rust-numpy's own first use now finds them imported. It still runs a few microseconds
    // of Python, where a Ctrl-C would be its panic: reported as the interrupt it is.
    let first_use = std::panic::catch_unwind(|| drop(numpy::PyArray1::<u8>::zeros(py, 0, false)));
    match first_use {
        Ok(()) => {
            READY.store(true, Ordering::Release);
            Ok(())
        }
        Err(p) => {
            let msg = crate::shards::panic_message(&p);
            if msg.contains("KeyboardInterrupt") {
                Err(PyKeyboardInterrupt::new_err("interrupted while numpy was loading"))
            } else {
                Err(PyRuntimeError::new_err(format!("numpy's C API could not be loaded: {msg}")))
            }
        }
    }
}

/// Test hook: make the core panic once at `site` (see `crate::fault`). Not a public API.
#[pyfunction]
fn _arm_panic(site: &str) -> PyResult<()> {
    crate::fault::arm(site).map_err(PyValueError::new_err)
}

/// Test hook: disarm every site armed by `_arm_panic`.
#[pyfunction]
fn _disarm_panics() {
    crate::fault::disarm()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_arm_panic, m)?)?;
    m.add_function(wrap_pyfunction!(_disarm_panics, m)?)?;
    Ok(())
}
