//! The compiled encoder (`Encoder`, `StreamEncoder`); the algorithms live in rust/encode*.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use numpy::PyArray1;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

use super::arrays::{ids_to_array, parts_for_itemsize, split_groups, Parts};
use super::type_name;
use crate::encode::{BatchIds, EncodeError, Encoder, StreamEncoder};

fn encode_err(e: EncodeError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

#[cfg(unix)]
extern "C" {
    // In CPython's ABI since 3.3 (and in the limited API since 3.10): the str's UTF-8
    // form, kept in the str object (the text itself for ASCII strs; converted once per
    // str otherwise). PyO3's abi3-py39 path encodes to a new bytes object and copies
    // it on every call. Not used on Windows, where an abi3 module may only import the
    // functions of the stable ABI of the oldest Python it supports.
    fn PyUnicode_AsUTF8AndSize(
        unicode: *mut pyo3::ffi::PyObject,
        size: *mut pyo3::ffi::Py_ssize_t,
    ) -> *const std::os::raw::c_char;
}

/// The UTF-8 of a Python str, borrowed from it where possible; TypeError for other
/// types (`what` names the caller in the message), UnicodeEncodeError for lone
/// surrogates (the Python side then repairs the text as tiktoken does).
fn text_of<'a>(obj: &'a Bound<'_, PyAny>, what: impl FnOnce() -> String) -> PyResult<Cow<'a, str>> {
    let s = match obj.cast::<PyString>() {
        Ok(s) => s,
        Err(_) => return Err(PyTypeError::new_err(format!("{} expects str, got {}", what(), type_name(obj)))),
    };
    #[cfg(unix)]
    {
        let mut size: pyo3::ffi::Py_ssize_t = 0;
        // SAFETY: `s` is a str. The buffer returned belongs to the str object, which
        // `obj` keeps alive for 'a, and CPython makes it valid UTF-8.
        unsafe {
            let p = PyUnicode_AsUTF8AndSize(s.as_ptr(), &mut size);
            if p.is_null() {
                return Err(PyErr::fetch(obj.py()));
            }
            let bytes = std::slice::from_raw_parts(p as *const u8, size as usize);
            Ok(Cow::Borrowed(std::str::from_utf8_unchecked(bytes)))
        }
    }
    #[cfg(not(unix))]
    s.to_cow()
}

/// Texts shorter than this are encoded without releasing the GIL (releasing and
/// taking it back costs more than encoding them).
const DETACH_MIN: usize = 1 << 14;

/// The items of an `encode_batch` argument (any iterable of str, but not a str).
fn batch_items<'py>(texts: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyAny>>> {
    if texts.cast::<PyString>().is_ok() {
        return Err(PyTypeError::new_err("encode_batch() expects a list of str, got a str"));
    }
    texts.try_iter()?.collect()
}

/// The UTF-8 of each item (borrowed where possible) and their total length in bytes.
fn batch_texts<'a>(objs: &'a [Bound<'_, PyAny>]) -> PyResult<(Vec<Cow<'a, str>>, usize)> {
    let mut strs = Vec::with_capacity(objs.len());
    let mut total = 0;
    for (i, o) in objs.iter().enumerate() {
        let s = text_of(o, || format!("encode_batch() item {i}:"))?;
        total += s.len();
        strs.push(s);
    }
    Ok((strs, total))
}

/// Run `f` with the GIL released, unless the input (`n` bytes) is small.
fn run_detached<T: pyo3::marker::Ungil>(py: Python<'_>, n: usize, f: impl FnOnce() -> T + pyo3::marker::Ungil) -> T {
    if n < DETACH_MIN {
        f()
    } else {
        py.detach(f)
    }
}

/// `run_detached` for an encode that Ctrl-C may stop half way (see `watch::interruptible`).
fn run_encode<T: Send>(py: Python<'_>, n: usize, f: impl FnOnce() -> T + Send) -> PyResult<T> {
    if n < DETACH_MIN {
        Ok(f())
    } else {
        super::watch::interruptible(py, n, f)
    }
}

fn bytes_of(obj: &Bound<'_, PyAny>, what: &dyn Fn() -> String) -> PyResult<Vec<u8>> {
    match obj.cast::<PyBytes>() {
        Ok(b) => Ok(b.as_bytes().to_vec()),
        Err(_) => Err(PyTypeError::new_err(format!("{} must be bytes, got {}", what(), type_name(obj)))),
    }
}

/// One Python int per id, made once per encoder: a list of ids then costs one
/// reference-count increment and one store per id, and a kept list holds 8 bytes per
/// id instead of a new int object each (measured faster when results are kept).
type Ints = Arc<Vec<Py<PyAny>>>;

fn make_ints(py: Python<'_>, n: usize) -> PyResult<Ints> {
    let mut ints = Vec::with_capacity(n);
    for i in 0..n {
        ints.push((i as u64).into_pyobject(py)?.into_any().unbind());
    }
    Ok(Arc::new(ints))
}

/// A list of the ints of `ids`, filled through the C API directly.
fn to_list<'py>(py: Python<'py>, ints: &Ints, ids: &[u32]) -> PyResult<Bound<'py, PyList>> {
    fill_list(py, ints, ids, None)
}

/// Ids between two checks for signals in `to_list_interruptible`: a few milliseconds.
const LIST_CHECK_EVERY: usize = 1 << 20;

/// `to_list` that Ctrl-C stops half way with KeyboardInterrupt (the partial list is
/// dropped). Filling lists of tens of millions of ids takes as long as encoding them, with
/// the GIL held; without checks a Ctrl-C would wait for the end. `since_check` counts the
/// ids filled since the last check, across the lists of one call.
fn to_list_interruptible<'py>(
    py: Python<'py>,
    ints: &Ints,
    ids: &[u32],
    since_check: &mut usize,
) -> PyResult<Bound<'py, PyList>> {
    fill_list(py, ints, ids, Some(since_check))
}

fn fill_list<'py>(
    py: Python<'py>,
    ints: &Ints,
    ids: &[u32],
    mut since_check: Option<&mut usize>,
) -> PyResult<Bound<'py, PyList>> {
    let n = ids.len() as pyo3::ffi::Py_ssize_t;
    // SAFETY: a new list of length n (its slots NULL, which its deallocation skips) owned
    // by `list` from here on, so an early return drops it; slots 0..n are filled with new
    // references (PyList_SetItem steals them); ids come from the encoder, so they index `ints`.
    unsafe {
        let raw = pyo3::ffi::PyList_New(n);
        if raw.is_null() {
            return Err(PyErr::fetch(py));
        }
        let list = Bound::from_owned_ptr(py, raw);
        let mut i: pyo3::ffi::Py_ssize_t = 0;
        for chunk in ids.chunks(LIST_CHECK_EVERY) {
            if let Some(count) = since_check.as_deref_mut() {
                *count += chunk.len();
                if *count >= LIST_CHECK_EVERY {
                    *count = 0;
                    py.check_signals()?;
                }
            }
            for &id in chunk {
                let o = ints[id as usize].as_ptr();
                pyo3::ffi::Py_IncRef(o);
                pyo3::ffi::PyList_SetItem(raw, i, o);
                i += 1;
            }
        }
        Ok(list.cast_into_unchecked())
    }
}

/// Make sure the worker pool of `threads` threads can be had before any work starts:
/// a count over the limit is a ValueError, threads the OS will not start a
/// RuntimeError (not a panic in the middle of a parallel call).
fn ready_pool(threads: crate::threads::ThreadCount) -> PyResult<()> {
    crate::threads::checked(threads).map_err(PyValueError::new_err)?;
    crate::threads::try_pool(threads).map(|_| ()).map_err(PyRuntimeError::new_err)
}

thread_local! {
    /// Ids of a small text encoded on the calling thread (no allocation per call).
    static SCRATCH: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Run `f` with this thread's empty scratch vector (a fresh one if it is in use).
fn with_scratch<R>(f: impl FnOnce(&mut Vec<u32>) -> R) -> R {
    let mut f = Some(f);
    let r = SCRATCH.try_with(|cell| {
        let mut v = cell.try_borrow_mut().ok()?;
        v.clear();
        Some((f.take().unwrap())(&mut v))
    });
    match r {
        Ok(Some(r)) => r,
        _ => (f.take().unwrap())(&mut Vec::new()),
    }
}

/// ferrolm's compiled encoder; `ferrolm.Tokenizer` wraps it.
#[pyclass(frozen, name = "Encoder", module = "ferrolm._core")]
pub struct PyEncoder {
    inner: Arc<Encoder>,
    ints: Ints,
}

impl PyEncoder {
    fn check_itemsize(&self, itemsize: usize) -> PyResult<()> {
        match itemsize {
            4 => Ok(()),
            2 if self.inner.vocab_size() <= 1 << 16 => Ok(()),
            2 => Err(PyValueError::new_err(format!(
                "vocab_size {} does not fit in uint16; use uint32",
                self.inner.vocab_size()
            ))),
            _ => Err(PyValueError::new_err(format!("itemsize must be 2 or 4, got {itemsize}"))),
        }
    }
}

#[pymethods]
impl PyEncoder {
    /// Encoder(vocab: dict[int, bytes], merges: list[tuple[bytes, bytes]], special_tokens: list[str], pattern: str)
    #[new]
    #[pyo3(signature = (vocab, merges, special_tokens, pattern = "gpt2"))]
    fn new(
        py: Python<'_>,
        vocab: &Bound<'_, PyAny>,
        merges: &Bound<'_, PyAny>,
        special_tokens: &Bound<'_, PyAny>,
        pattern: &str,
    ) -> PyResult<Self> {
        let vocab = vocab
            .cast::<PyDict>()
            .map_err(|_| PyTypeError::new_err(format!("vocab must be a dict[int, bytes], got {}", type_name(vocab))))?;
        let mut v: Vec<(u64, Vec<u8>)> = Vec::with_capacity(vocab.len());
        for (k, b) in vocab.iter() {
            if k.cast::<pyo3::types::PyInt>().is_err() || k.cast::<pyo3::types::PyBool>().is_ok() {
                return Err(PyTypeError::new_err(format!("vocab keys must be int ids, got {}", type_name(&k))));
            }
            let id: u64 = match k.extract::<u64>() {
                Ok(i) if i < u32::MAX as u64 => i,
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "invalid vocab: id {} is out of range (ids must be in [0, 2^32 - 1))",
                        k.repr()?
                    )))
                }
            };
            v.push((id, bytes_of(&b, &|| format!("vocab[{id}]"))?));
        }
        let mut m: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        for (i, item) in merges.try_iter()?.enumerate() {
            let item = item?;
            let pair = item.cast::<PyTuple>().ok().filter(|t| t.len() == 2).ok_or_else(|| {
                PyTypeError::new_err(format!("merges[{i}] must be a tuple (bytes, bytes), got {}", type_name(&item)))
            })?;
            let a = bytes_of(&pair.get_item(0)?, &|| format!("merges[{i}][0]"))?;
            let b = bytes_of(&pair.get_item(1)?, &|| format!("merges[{i}][1]"))?;
            m.push((a, b));
        }
        let mut specials: Vec<String> = Vec::new();
        for (i, s) in special_tokens.try_iter()?.enumerate() {
            let s = s?;
            let t = s
                .cast::<PyString>()
                .map_err(|_| PyTypeError::new_err(format!("special_tokens[{i}] must be str, got {}", type_name(&s))))?;
            specials.push(t.to_cow()?.into_owned());
        }
        let pattern = pattern.to_owned();
        let enc = py
            .detach(move || {
                let enc = Encoder::new(v, m, specials, &pattern);
                // The inputs and tables built on the way were many small allocations:
                // give the pages they leave free back to the OS.
                #[cfg(all(target_os = "linux", target_env = "gnu"))]
                // SAFETY: plain libc call.
                unsafe {
                    libc::malloc_trim(0);
                }
                enc
            })
            .map_err(encode_err)?;
        let ints = make_ints(py, enc.vocab_size())?;
        Ok(PyEncoder { inner: Arc::new(enc), ints })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    #[getter]
    fn num_merges(&self) -> usize {
        self.inner.num_merges()
    }

    #[getter]
    fn pattern(&self) -> &str {
        self.inner.pattern()
    }

    /// {id: token bytes} for every id, special tokens included (the vocab given, plus
    /// the special tokens appended to it), in id order.
    fn vocab<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for id in 0..self.inner.vocab_size() as u32 {
            if let Some(b) = self.inner.token_bytes(id) {
                d.set_item(&self.ints[id as usize], PyBytes::new(py, b))?;
            }
        }
        Ok(d)
    }

    /// [(left bytes, right bytes)] in rank order, as given.
    fn merges<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let side = |id: u32| PyBytes::new(py, self.inner.token_bytes(id).expect("merge sides are tokens"));
        let items: Vec<Bound<'py, PyTuple>> = self
            .inner
            .merge_ids()
            .iter()
            .map(|&(a, b)| PyTuple::new(py, [side(a), side(b)]))
            .collect::<PyResult<_>>()?;
        PyList::new(py, items)
    }

    /// The tokenizer fingerprint of this vocab and these merges with `specials` and the
    /// pattern source `pattern` (`vocab_files::fingerprint`).
    fn fingerprint(&self, py: Python<'_>, specials: Vec<String>, pattern: &str) -> String {
        let inner = &self.inner;
        py.detach(|| {
            let vocab = (0..inner.vocab_size() as u32).filter_map(|id| Some((id, inner.token_bytes(id)?)));
            let side = |id: u32| inner.token_bytes(id).expect("merge sides are tokens");
            let merges = inner.merge_ids().iter().map(|&(a, b)| (side(a), side(b)));
            crate::vocab_files::fingerprint(vocab, merges, &specials, pattern)
        })
    }

    /// Ids of the tokens that merging their own bytes does not make
    /// (`Encoder::tokens_not_made_by_merges`).
    fn tokens_not_made_by_merges(&self, py: Python<'_>) -> Vec<u32> {
        let inner = &self.inner;
        py.detach(|| inner.tokens_not_made_by_merges())
    }

    /// [(token, id)] in the order given (ids of appended tokens included).
    #[getter]
    fn special_tokens(&self) -> Vec<(String, u32)> {
        self.inner.special_tokens().to_vec()
    }

    /// Token ids of `text` as a list.
    #[pyo3(signature = (text, allow_special = true))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        text: &Bound<'py, PyAny>,
        allow_special: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let s = text_of(text, || "encode()".into())?;
        if s.len() < DETACH_MIN {
            return with_scratch(|ids| {
                self.inner.encode_into(&s, allow_special, ids);
                to_list(py, &self.ints, ids)
            });
        }
        let ids = super::watch::interruptible(py, s.len(), || self.inner.encode(&s, allow_special))?;
        to_list_interruptible(py, &self.ints, &ids, &mut 0)
    }

    /// Token ids of `text` as a numpy array of uint16 (itemsize 2) or uint32 (4);
    /// `num_threads` other than 1 encodes large texts in parallel.
    #[pyo3(signature = (text, allow_special = true, itemsize = 4, num_threads = None))]
    fn encode_to_array<'py>(
        &self,
        py: Python<'py>,
        text: &Bound<'py, PyAny>,
        allow_special: bool,
        itemsize: usize,
        num_threads: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.check_itemsize(itemsize)?;
        super::watch::numpy_ready(py)?;
        let s = text_of(text, || "encode_to_numpy()".into())?;
        if s.len() < DETACH_MIN {
            return with_scratch(|ids| {
                self.inner.encode_into(&s, allow_special, ids);
                ids_to_array(py, ids, itemsize)
            });
        }
        ready_pool(num_threads)?;
        let enc = &self.inner;
        let parts = super::watch::interruptible(py, s.len(), || {
            parts_for_itemsize!(itemsize, enc.encode_parallel_parts(&s, allow_special, num_threads))
        })?;
        parts.into_array(py, num_threads)
    }

    /// Read a UTF-8 file (invalid bytes replaced by U+FFFD) and encode it whole,
    /// in parallel; ids as in encode_to_array. A large valid file is mapped, not
    /// copied (`map_text_file`).
    #[pyo3(signature = (path, allow_special = true, itemsize = 4, num_threads = None))]
    fn encode_file<'py>(
        &self,
        py: Python<'py>,
        path: std::path::PathBuf,
        allow_special: bool,
        itemsize: usize,
        num_threads: Option<usize>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.check_itemsize(itemsize)?;
        super::watch::numpy_ready(py)?;
        ready_pool(num_threads)?;
        let enc = &self.inner;
        // Watched whatever its size (files are large as a rule).
        let parts = super::watch::interruptible(py, usize::MAX, || -> std::io::Result<Parts> {
            let text = crate::encode::map_text_file(&path, num_threads)?;
            Ok(parts_for_itemsize!(itemsize, enc.encode_parallel_parts(&text, allow_special, num_threads)))
        })??;
        parts.into_array(py, num_threads)
    }

    /// Encode each text (in parallel over texts); a list of lists.
    #[pyo3(signature = (texts, allow_special = true, num_threads = None))]
    fn encode_batch<'py>(
        &self,
        py: Python<'py>,
        texts: &Bound<'py, PyAny>,
        allow_special: bool,
        num_threads: Option<usize>,
    ) -> PyResult<Bound<'py, PyList>> {
        ready_pool(num_threads)?;
        let objs = batch_items(texts)?;
        let (strs, total) = batch_texts(&objs)?;
        let groups = run_encode(py, total, || self.inner.encode_batch_grouped(&strs, allow_special, num_threads))?;
        let mut lists: Vec<Bound<'py, PyList>> = Vec::with_capacity(strs.len());
        let mut since_check = 0;
        for ids in groups.iter().flat_map(BatchIds::texts) {
            lists.push(to_list_interruptible(py, &self.ints, ids, &mut since_check)?);
        }
        PyList::new(py, lists)
    }

    /// Encode each text (in parallel over texts) into one flat numpy array of ids
    /// (uint16 for `itemsize` 2, uint32 for 4) and an int64 array of `len(texts) + 1`
    /// offsets: text i has ids[offsets[i]:offsets[i + 1]].
    #[pyo3(signature = (texts, allow_special = true, itemsize = 4, num_threads = None))]
    fn encode_batch_to_arrays<'py>(
        &self,
        py: Python<'py>,
        texts: &Bound<'py, PyAny>,
        allow_special: bool,
        itemsize: usize,
        num_threads: Option<usize>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyArray1<i64>>)> {
        self.check_itemsize(itemsize)?;
        super::watch::numpy_ready(py)?;
        ready_pool(num_threads)?;
        let objs = batch_items(texts)?;
        let (strs, total) = batch_texts(&objs)?;
        let enc = &self.inner;
        let (parts, offsets) = run_encode(py, total, || {
            let mut offsets = Vec::with_capacity(strs.len() + 1);
            offsets.push(0i64);
            let parts = parts_for_itemsize!(
                itemsize,
                split_groups(enc.encode_batch_grouped(&strs, allow_special, num_threads), &mut offsets)
            );
            (parts, offsets)
        })?;
        let ids = parts.into_array(py, num_threads)?;
        Ok((ids, PyArray1::from_vec(py, offsets)))
    }

    /// The concatenated bytes of `ids` (a sequence of ints); ValueError for an id
    /// not in the vocabulary.
    fn decode_bytes<'py>(&self, py: Python<'py>, ids: Vec<i64>) -> PyResult<Bound<'py, PyBytes>> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in &ids {
            let b = if (0..u32::MAX as i64).contains(&id) { self.inner.token_bytes(id as u32) } else { None };
            match b {
                Some(b) => out.extend_from_slice(b),
                None => {
                    return Err(PyValueError::new_err(format!(
                        "token id {id} is not in the vocabulary (vocab_size {})",
                        self.inner.vocab_size()
                    )))
                }
            }
        }
        Ok(PyBytes::new(py, &out))
    }

    /// decode_bytes for ids given as little-endian uint32 bytes (from numpy).
    fn decode_bytes_u32le<'py>(&self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        if !data.len().is_multiple_of(4) {
            return Err(PyValueError::new_err("uint32 buffer length is not a multiple of 4"));
        }
        let ids: Vec<u32> = data.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let out = self.inner.decode_bytes(&ids).map_err(encode_err)?;
        Ok(PyBytes::new(py, &out))
    }

    /// The bytes of one token (None when the id is not in the vocabulary).
    fn token_bytes<'py>(&self, py: Python<'py>, id: i64) -> Option<Bound<'py, PyBytes>> {
        if !(0..u32::MAX as i64).contains(&id) {
            return None;
        }
        self.inner.token_bytes(id as u32).map(|b| PyBytes::new(py, b))
    }

    /// A streaming encoder: feed(chunk) returns the ids that became final, finish()
    /// the rest; together they equal encode() of the concatenation.
    #[pyo3(signature = (allow_special = true))]
    fn stream(&self, allow_special: bool) -> PyStreamEncoder {
        PyStreamEncoder {
            enc: self.inner.clone(),
            ints: self.ints.clone(),
            state: Mutex::new(StreamEncoder::new(allow_special)),
        }
    }
}

/// Incremental encoding state (see Encoder.stream).
#[pyclass(frozen, name = "StreamEncoder", module = "ferrolm._core")]
pub struct PyStreamEncoder {
    enc: Arc<Encoder>,
    ints: Ints,
    state: Mutex<StreamEncoder>,
}

#[pymethods]
impl PyStreamEncoder {
    fn feed<'py>(&self, py: Python<'py>, chunk: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        let s = text_of(chunk, || "encode_iterable()".into())?;
        // Not stopped by Ctrl-C half way: the stream's state would be lost with it.
        let ids = run_detached(py, s.len(), || {
            let mut out = Vec::new();
            self.state.lock().unwrap_or_else(|e| e.into_inner()).push(&self.enc, &s, &mut out);
            out
        });
        to_list(py, &self.ints, &ids)
    }

    fn finish<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ids = py.detach(|| {
            let mut out = Vec::new();
            self.state.lock().unwrap_or_else(|e| e.into_inner()).finish(&self.enc, &mut out);
            out
        });
        to_list(py, &self.ints, &ids)
    }

    /// Bytes buffered and not yet encoded.
    #[getter]
    fn buffered(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).buffered()
    }
}

// The shard writer encodes with this same compiled encoder.
impl PyEncoder {
    pub(crate) fn shared(&self) -> Arc<Encoder> {
        self.inner.clone()
    }
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEncoder>()?;
    m.add_class::<PyStreamEncoder>()?;
    Ok(())
}
