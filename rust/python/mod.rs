//! The PyO3 binding (`ferrolm._core`): converts types and releases the GIL around heavy
//! calls. No algorithm lives here; one file per area of the core:
//!
//! - `tokenizer`: the compiled encoder (`Encoder`, `StreamEncoder`), with `arrays` for
//!   its numpy outputs;
//! - `trainer`: the BPE trainer (`BpeTrainer`);
//! - `shards`: the shard writer (`encode_shard`, `shard_part_range`);
//! - `vocab_files`: fast readers of vocab.json and merges.txt;
//! - `pretokenize`: the pre-tokenizer, for tests against Python's `regex`.
//!
//! This file registers them and holds what they share: [`type_name`] for error messages
//! and [`run_watched`], the one way a long job runs while Ctrl-C and progress callbacks
//! are served.

use std::sync::{Condvar, Mutex};
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

/// The version of the compiled core.
#[pyfunction]
fn version() -> &'static str {
    crate::VERSION
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    pretokenize::register(m)?;
    tokenizer::register(m)?;
    trainer::register(m)?;
    shards::register(m)?;
    vocab_files::register(m)?;
    Ok(())
}

/// The name of `obj`'s type, for error messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// How often the waiting thread of [`run_watched`] takes the GIL to check for Ctrl-C and
/// report progress.
const POLL: Duration = Duration::from_millis(50);

/// Run `job` on a worker thread with the GIL released. Every [`POLL`] this thread takes
/// the GIL to check for signals and to run `poll` (which reports progress); on Ctrl-C or
/// an error from `poll` it calls `cancel`, waits for the job to stop and raises that
/// error. When the job ends, `poll` runs once more.
fn run_watched<T: Send>(
    py: Python<'_>,
    cancel: impl Fn(),
    mut poll: impl FnMut(Python<'_>) -> PyResult<()>,
    job: impl FnOnce() -> T + Send,
) -> PyResult<T> {
    let finished = (Mutex::new(false), Condvar::new());
    std::thread::scope(|s| {
        let handle = s.spawn(|| {
            let out = job();
            *finished.0.lock().unwrap() = true;
            finished.1.notify_all();
            out
        });
        let wait = |timeout: Option<Duration>| {
            let mut done = finished.0.lock().unwrap();
            while !*done {
                match timeout {
                    Some(t) => {
                        let (d, r) = finished.1.wait_timeout(done, t).unwrap();
                        done = d;
                        if r.timed_out() {
                            break;
                        }
                    }
                    None => done = finished.1.wait(done).unwrap(),
                }
            }
            *done
        };
        let mut pending: Option<PyErr> = None;
        loop {
            if py.detach(|| wait(Some(POLL))) {
                break;
            }
            if let Err(e) = py.check_signals().and_then(|_| poll(py)) {
                cancel();
                py.detach(|| wait(None));
                pending = Some(e);
                break;
            }
        }
        let out = match handle.join() {
            Ok(v) => v,
            Err(_) => return Err(PyRuntimeError::new_err("a ferrolm worker thread panicked (a bug in ferrolm)")),
        };
        if let Some(e) = pending {
            return Err(e);
        }
        poll(py)?;
        Ok(out)
    })
}
