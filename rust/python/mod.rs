//! The PyO3 binding (`ferrolm._core`): converts types and releases the GIL around heavy
//! calls. No algorithm lives here; one file per area of the core:
//!
//! - `tokenizer`: the compiled encoder (`Encoder`, `StreamEncoder`), with `arrays` for
//!   its numpy outputs;
//! - `trainer`: the BPE trainer (`BpeTrainer`);
//! - `shards`: the shard writer (`encode_shard`, `shard_part_range`);
//! - `vocab_files`: fast readers of vocab.json and merges.txt;
//! - `pretokenize`: the pre-tokenizer, for tests against Python's `regex`;
//! - `watch`: long encodes that Ctrl-C stops, numpy's first load, the fault test hooks.
//!
//! This file registers them and holds what they share: [`type_name`] for error messages
//! and [`run_watched`], the one way a long job runs while Ctrl-C and progress callbacks
//! are served.

use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

mod arrays;
mod doc_batches;
mod pretokenize;
mod shards;
mod tokenizer;
mod trainer;
mod vocab_files;
mod watch;

/// The version of the compiled core.
#[pyfunction]
fn version() -> &'static str {
    crate::VERSION
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    pretokenize::register(m)?;
    doc_batches::register(m)?;
    tokenizer::register(m)?;
    trainer::register(m)?;
    shards::register(m)?;
    vocab_files::register(m)?;
    watch::register(m)?;
    Ok(())
}

/// The name of `obj`'s type, for error messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// How often the waiting thread of [`run_watched`] takes the GIL to check for Ctrl-C and
/// report progress.
const POLL: Duration = Duration::from_millis(50);

/// Whether a watched job is over, and a way to wait for it.
type Finished = (Mutex<bool>, Condvar);

/// Marks the job over when dropped: when it returns and when it unwinds alike (a panic
/// that left the flag unset kept the waiting thread waiting for ever).
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

/// Run `job` on a worker thread with the GIL released. Every [`POLL`] this thread takes
/// the GIL to check for signals and to run `poll` (which reports progress); on Ctrl-C or
/// an error from `poll` it calls `cancel`, waits for the job to stop and raises that
/// error. When the job ends, `poll` runs once more. A panic in the job is a RuntimeError
/// that quotes it.
fn run_watched<T: Send>(
    py: Python<'_>,
    cancel: impl Fn(),
    mut poll: impl FnMut(Python<'_>) -> PyResult<()>,
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
            if let Err(e) = py.check_signals().and_then(|_| poll(py)) {
                cancel();
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
            None => out.and_then(|v| poll(py).map(|_| v)),
        }
    })
}
