//! Long calls on a worker thread, watched from the calling thread: Ctrl-C stops them
//! promptly, and a panic in them comes back as a Python exception. Also numpy's C API
//! loaded where an interrupted import can be reported, and the test hooks that inject
//! panics (`crate::fault`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::encode::cancel;

/// How often the calling thread takes the GIL to check for Ctrl-C and report progress.
const POLL: Duration = Duration::from_millis(50);

/// Encodes of at least this many bytes run watched (see `interruptible`): shorter ones
/// are over in a few milliseconds.
pub(crate) const WATCH_MIN: usize = 1 << 20;

/// Whether the job is over, and a way to wait for it.
type Finished = (Mutex<bool>, Condvar);

/// Marks the job over when dropped: when it returns and when it unwinds alike.
struct Over<'a>(&'a Finished);

impl Drop for Over<'_> {
    fn drop(&mut self) {
        *self.0 .0.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.0 .1.notify_all();
    }
}

/// Wait until the job is over, or `timeout` passes; returns whether it is over.
fn wait(finished: &Finished, timeout: Option<Duration>) -> bool {
    let mut over = finished.0.lock().unwrap_or_else(PoisonError::into_inner);
    while !*over {
        match timeout {
            Some(t) => {
                let (o, r) = finished.1.wait_timeout(over, t).unwrap_or_else(PoisonError::into_inner);
                over = o;
                if r.timed_out() {
                    break;
                }
            }
            None => over = finished.1.wait(over).unwrap_or_else(PoisonError::into_inner),
        }
    }
    *over
}

/// Run `job` on a worker thread with the GIL released; every POLL, take the GIL to check
/// for signals and to call `progress`. On Ctrl-C (or an error from `progress`): `stop()`,
/// wait for the job to end, and return that error. A panic in the job is a RuntimeError
/// that quotes it.
pub(crate) fn watch<T: Send>(
    py: Python<'_>,
    stop: &(dyn Fn() + Sync),
    mut progress: impl FnMut() -> PyResult<()>,
    job: impl FnOnce() -> T + Send,
) -> PyResult<T> {
    let finished: Finished = (Mutex::new(false), Condvar::new());
    std::thread::scope(|s| {
        let handle = s.spawn(|| {
            let _over = Over(&finished);
            job()
        });
        let mut pending: Option<PyErr> = None;
        while !py.detach(|| wait(&finished, Some(POLL))) {
            if let Err(e) = py.check_signals().and_then(|_| progress()) {
                stop();
                py.detach(|| wait(&finished, None));
                pending = Some(e);
                break;
            }
        }
        let out = handle.join().map_err(|p| {
            PyRuntimeError::new_err(format!(
                "internal error in ferrolm's core (a bug): a worker thread panicked: {}",
                crate::shards::panic_message(&p)
            ))
        });
        match pending {
            Some(e) => Err(e),
            None => out.and_then(|v| progress().map(|_| v)),
        }
    })
}

/// Run an encode `job` over `n` bytes of text with the GIL released; when it is large,
/// on a watched worker thread, so that Ctrl-C stops it between batches of pieces (and
/// raises KeyboardInterrupt) instead of after it.
pub(crate) fn interruptible<T: Send>(py: Python<'_>, n: usize, job: impl FnOnce() -> T + Send) -> PyResult<T> {
    if n < WATCH_MIN {
        return Ok(py.detach(job));
    }
    let flag = Arc::new(AtomicBool::new(false));
    let stop = || flag.store(true, Ordering::Relaxed);
    let worker_flag = flag.clone();
    watch(py, &stop, || Ok(()), move || cancel::under(worker_flag, job))?
        .map_err(|cancel::Cancelled| PyKeyboardInterrupt::new_err("encoding was interrupted"))
}

/// Load numpy's C API now, where an exception raised by numpy's import (Ctrl-C while it
/// loads) comes back as itself: rust-numpy loads it on first use, and turns such an error
/// into a panic ("Failed to access NumPy array API capsule"). Cheap after the first call.
pub(crate) fn numpy_ready(py: Python<'_>) -> PyResult<()> {
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
