//! The shard writer (`ferrolm encode`); the pipeline lives in rust/shards*.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pyo3::exceptions::{
    PyFileNotFoundError, PyKeyboardInterrupt, PyOSError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyDict, PyList};

use super::doc_batches::PyDocSource;
use super::run_watched;
use super::tokenizer::PyEncoder;
use crate::shards::{self, EncodeJob, Format, InputSpec, Progress, ShardError, ShardOptions};

pub(super) fn shard_err(e: ShardError) -> PyErr {
    let msg = e.to_string();
    match &e {
        ShardError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            PyFileNotFoundError::new_err(msg)
        }
        ShardError::Io { source, .. } => match source.raw_os_error() {
            Some(errno) => PyOSError::new_err((errno, msg)),
            None => PyOSError::new_err(msg),
        },
        ShardError::Interrupted => PyKeyboardInterrupt::new_err(msg),
        ShardError::Panic(_) => PyRuntimeError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}

/// Encode input files into `out_bin` (written as `out_bin + ".partial"`, resumable
/// through `P.progress.json`). Returns a dict describing the result; the caller
/// renames the partial file and writes the sidecar. `options`: the fields of
/// `ShardOptions` by name. `progress(raw_done, raw_total, tokens, documents)` is called
/// with the GIL held when chunks were written since its last call, at most every
/// `progress_interval` seconds (and with the last chunk's figures); Ctrl-C or an exception
/// from it stops the job cleanly after its current chunk (what was written is committed
/// for a rerun to resume).
#[pyfunction]
#[pyo3(signature = (encoder, inputs, out_bin, *, dtype, progress = None, progress_interval = 0.1, docs = None, **options))]
#[allow(clippy::too_many_arguments)]
fn encode_shard<'py>(
    py: Python<'py>,
    encoder: &Bound<'py, PyEncoder>,
    inputs: Vec<PathBuf>,
    out_bin: PathBuf,
    dtype: &str,
    progress: Option<Py<PyAny>>,
    progress_interval: f64,
    docs: Option<Py<PyAny>>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = shard_options(dtype, options)?;
    let job = EncodeJob::new(inputs, out_bin, opts);
    let enc = encoder.get().shared();
    let stop = AtomicBool::new(false);
    let latest: Mutex<Option<Progress>> = Mutex::new(None);
    let report = progress_reporter(progress, progress_interval, &latest);
    let mut source = docs.map(|obj| PyDocSource { obj, error: None });
    let result = run_watched(
        py,
        || stop.store(true, Ordering::Relaxed),
        report,
        || {
            let src = source.as_mut().map(|s| s as &mut dyn shards::DocSource);
            shards::encode_to_shard_with(&job, &*enc, src, |p| {
                *latest.lock().unwrap_or_else(|e| e.into_inner()) = Some(*p);
                !stop.load(Ordering::Relaxed)
            })
        },
    )?;
    // An exception from the document reader stopped the job: raise it.
    if let (Err(ShardError::Interrupted), Some(e)) = (&result, source.and_then(|s| s.error)) {
        return Err(e);
    }
    summary_dict(py, result.map_err(shard_err)?)
}

/// `ShardOptions` from `encode_shard`'s keyword arguments (their names are its fields';
/// `input_format` by name, `commit_interval` in seconds).
fn shard_options(dtype: &str, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<ShardOptions> {
    let mut o = ShardOptions::new(dtype.parse().map_err(PyValueError::new_err)?);
    for (key, value) in kwargs.into_iter().flatten() {
        let key: PyBackedStr = key.extract()?;
        match &*key {
            "eos" => o.eos = value.extract()?,
            "jsonl_field" => o.jsonl_field = value.extract()?,
            "input_format" => {
                let name: Option<PyBackedStr> = value.extract()?;
                o.input_format = Format::given(name.as_deref()).map_err(PyValueError::new_err)?;
            }
            "errors" => o.errors = value.extract::<PyBackedStr>()?.parse().map_err(PyValueError::new_err)?,
            "chunk_size" => o.chunk_size = value.extract()?,
            "threads" => o.threads = value.extract()?,
            "window" => o.window = value.extract()?,
            "part" => o.part = value.extract()?,
            "newline_cuts" => o.newline_cuts = value.extract()?,
            "params" => o.params = value.extract()?,
            "commit_interval" => {
                o.commit_interval = Duration::try_from_secs_f64(value.extract()?)
                    .map_err(|_| PyValueError::new_err("commit_interval must be a non-negative number of seconds"))?
            }
            "hash" => o.hash = value.extract()?,
            other => {
                return Err(PyTypeError::new_err(format!(
                    "encode_shard() got an unexpected keyword argument '{other}'"
                )))
            }
        }
    }
    Ok(o)
}

/// The summary of a finished job as the dict Python reads.
fn summary_dict(py: Python<'_>, summary: shards::Summary) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_tokens", summary.num_tokens)?;
    d.set_item("num_documents", summary.num_documents)?;
    d.set_item("dtype", summary.dtype.name())?;
    d.set_item("byte_range", (summary.byte_range.0, summary.byte_range.1))?;
    d.set_item("resumed_tokens", summary.resumed_tokens)?;
    d.set_item("text_bytes", summary.text_bytes)?;
    d.set_item("restart_reason", summary.restart_reason)?;
    d.set_item("partial_path", summary.partial_path)?;
    let records = PyList::empty(py);
    for r in summary.inputs {
        let rd = PyDict::new(py);
        rd.set_item("path", r.path)?;
        rd.set_item("bytes", r.bytes)?;
        rd.set_item("sha256", r.sha256)?;
        rd.set_item("range", (r.range.0, r.range.1))?;
        rd.set_item("uncompressed_bytes", r.uncompressed_bytes)?;
        records.append(rd)?;
    }
    d.set_item("inputs", records)?;
    Ok(d)
}

/// The `poll` of `run_watched` for `encode_shard`: calls `progress` with the figures the
/// job stored in `latest` since its last call, at most every `interval` seconds (at once
/// for the last chunk, which consumed all the input).
fn progress_reporter<'a>(
    progress: Option<Py<PyAny>>,
    interval: f64,
    latest: &'a Mutex<Option<Progress>>,
) -> impl FnMut(Python<'_>) -> PyResult<()> + 'a {
    let interval = Duration::from_secs_f64(interval.max(0.0));
    let mut last = Instant::now() - interval;
    let mut unreported: Option<Progress> = None;
    move |py| {
        if let Some(p) = latest.lock().unwrap_or_else(|e| e.into_inner()).take() {
            unreported = Some(p);
        }
        let Some(p) = unreported else { return Ok(()) };
        if last.elapsed() < interval && p.raw_done < p.raw_total {
            return Ok(());
        }
        unreported = None;
        last = Instant::now();
        if let Some(cb) = &progress {
            cb.call1(py, (p.raw_done, p.raw_total, p.tokens, p.documents))?;
        }
        Ok(())
    }
}

/// The byte range `(start, end)` of the concatenated inputs that part `i` of `n` covers.
#[pyfunction]
#[pyo3(signature = (inputs, i, n, *, eos = None, input_format = None, newline_cuts = true))]
fn shard_part_range(
    py: Python<'_>,
    inputs: Vec<PathBuf>,
    i: u64,
    n: u64,
    eos: Option<String>,
    input_format: Option<&str>,
    newline_cuts: bool,
) -> PyResult<(u64, u64)> {
    let format = Format::given(input_format).map_err(PyValueError::new_err)?;
    if n == 0 || i >= n {
        return Err(PyValueError::new_err(format!("part {i}/{n}: need 0 <= I < N")));
    }
    let specs: Vec<InputSpec> = inputs.into_iter().map(|p| InputSpec::detect(p, format)).collect();
    py.detach(|| {
        let sizes = specs
            .iter()
            .map(|s| std::fs::metadata(&s.path).map(|m| m.len()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ShardError::Invalid(e.to_string()))?;
        let sep = crate::specials::SpecialMatcher::new(eos.into_iter().map(|s| (s, 0)).collect());
        shards::part_range(&specs, &sizes, i, n, &sep, newline_cuts)
    })
    .map_err(shard_err)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(encode_shard, m)?)?;
    m.add_function(wrap_pyfunction!(shard_part_range, m)?)?;
    Ok(())
}
