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

// ===================================================================================
// BPE trainer (section owned by the trainer; algorithm in rust/train.rs)
// ===================================================================================

mod trainer_binding {
    use std::path::PathBuf;
    use std::sync::{Condvar, Mutex};
    use std::time::Duration;

    use pyo3::exceptions::{
        PyFileNotFoundError, PyIsADirectoryError, PyKeyboardInterrupt, PyOSError, PyPermissionError,
        PyRuntimeError, PyValueError,
    };
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyDict};

    use crate::train::{Control, TrainError, Trainer, Utf8Errors, DEFAULT_CHUNK_SIZE};

    /// How often the waiting thread takes the GIL to check for Ctrl-C and report progress.
    const POLL: Duration = Duration::from_millis(50);

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
                    std::io::ErrorKind::PermissionDenied => {
                        PyPermissionError::new_err((errno.unwrap_or(13), msg, path))
                    }
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

    /// Run `job` on a worker thread with the GIL released; every POLL, take the GIL to
    /// check for signals (Ctrl-C -> cancel the job, wait for it, re-raise) and to call
    /// `progress(done, total)`.
    fn run_watched<T: Send>(
        py: Python<'_>,
        ctl: &Control,
        progress: Option<&Bound<'_, PyAny>>,
        job: impl FnOnce() -> T + Send,
    ) -> PyResult<T> {
        let report = || -> PyResult<()> {
            if let Some(cb) = progress {
                let (done, total) = ctl.progress();
                cb.call1((done, total))?;
            }
            Ok(())
        };
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
                if let Err(e) = py.check_signals().and_then(|_| report()) {
                    ctl.cancel();
                    py.detach(|| wait(None));
                    pending = Some(e);
                    break;
                }
            }
            let out = match handle.join() {
                Ok(v) => v,
                Err(_) => return Err(PyRuntimeError::new_err("the BPE training thread panicked (a bug in ferrolm)")),
            };
            if let Some(e) = pending {
                return Err(e);
            }
            report()?;
            Ok(out)
        })
    }

    /// One BPE training run: `count_files` / `count_texts` any number of times, then
    /// `learn` once. Called by `ferrolm.bpe_trainer`; not a public API.
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
            let mut trainer = self
                .inner
                .take()
                .ok_or_else(|| PyRuntimeError::new_err("this BpeTrainer failed or was interrupted earlier; make a new one"))?;
            let ctl = &self.ctl;
            let (trainer, result) = run_watched(py, ctl, progress, move || {
                let r = f(&mut trainer, ctl);
                (trainer, r)
            })?;
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
            let errors = match errors {
                "strict" => Utf8Errors::Strict,
                "replace" => Utf8Errors::Replace,
                other => {
                    return Err(PyValueError::new_err(format!("errors must be \"strict\" or \"replace\", got {other:?}")))
                }
            };
            let t = Trainer::new(&special_tokens, pattern, num_threads, errors, chunk_size.unwrap_or(DEFAULT_CHUNK_SIZE))
                .map_err(to_pyerr)?;
            Ok(PyBpeTrainer { inner: Some(t), ctl: Control::default() })
        }

        /// Count the pre-tokens of these files (each its own text). `progress(done, total)`
        /// is called with bytes.
        #[pyo3(signature = (paths, progress = None))]
        fn count_files(
            &mut self,
            py: Python<'_>,
            paths: Vec<PathBuf>,
            progress: Option<&Bound<'_, PyAny>>,
        ) -> PyResult<()> {
            self.run(py, progress, move |t, ctl| t.count_files(&paths, ctl))
        }

        /// Count the pre-tokens of these strings (each its own text).
        #[pyo3(signature = (texts, progress = None))]
        fn count_texts(
            &mut self,
            py: Python<'_>,
            texts: Vec<String>,
            progress: Option<&Bound<'_, PyAny>>,
        ) -> PyResult<()> {
            self.run(py, progress, move |t, ctl| t.count_texts(&texts, ctl))
        }

        /// Learn up to `num_merges` merges; returns them as (bytes, bytes) pairs in order.
        /// `progress(done, total)` is called with merges.
        #[pyo3(signature = (num_merges, progress = None))]
        fn learn<'py>(
            &mut self,
            py: Python<'py>,
            num_merges: usize,
            progress: Option<&Bound<'py, PyAny>>,
        ) -> PyResult<Vec<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
            let merges = self.run(py, progress, move |t, ctl| t.learn(num_merges, ctl))?;
            Ok(merges.iter().map(|(a, b)| (PyBytes::new(py, a), PyBytes::new(py, b))).collect())
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
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(pretokenize, m)?)?;
    m.add_class::<trainer_binding::PyBpeTrainer>()?; // BPE trainer
    Ok(())
}
