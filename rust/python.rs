//! The PyO3 binding: converts types and releases the GIL around heavy calls.
//! No algorithm lives here.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::pretokenize::PreTokenizer;

mod doc_batches;

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

// ============================================================================
// Encoder and Tokenizer core (issue 4; branch `encoder`).
// Type conversion and GIL release only; the algorithms live in rust/encode*.
// ============================================================================

mod encoder_bindings {
    use std::borrow::Cow;
    use std::mem::MaybeUninit;
    use std::sync::{Arc, Mutex};

    use numpy::{PyArray1, PyArrayMethods};
    use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

    use crate::encode::{BatchIds, EncodeError, Encoder, StreamEncoder};

    fn encode_err(e: EncodeError) -> PyErr {
        PyValueError::new_err(e.to_string())
    }

    fn type_name(obj: &Bound<'_, PyAny>) -> String {
        obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
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
    fn run_detached<T: pyo3::marker::Ungil>(
        py: Python<'_>,
        n: usize,
        f: impl FnOnce() -> T + pyo3::marker::Ungil,
    ) -> T {
        if n < DETACH_MIN {
            f()
        } else {
            py.detach(f)
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
        let n = ids.len() as pyo3::ffi::Py_ssize_t;
        // SAFETY: a new list of length n is filled at indices 0..n with new references
        // (PyList_SetItem steals them); ids come from the encoder, so they index `ints`.
        unsafe {
            let list = pyo3::ffi::PyList_New(n);
            if list.is_null() {
                return Err(PyErr::fetch(py));
            }
            for (i, &id) in ids.iter().enumerate() {
                let o = ints[id as usize].as_ptr();
                pyo3::ffi::Py_IncRef(o);
                pyo3::ffi::PyList_SetItem(list, i as pyo3::ffi::Py_ssize_t, o);
            }
            Ok(Bound::from_owned_ptr(py, list).cast_into_unchecked())
        }
    }

    /// Make sure the worker pool of `threads` threads can be had before any work starts:
    /// a count over the limit is a ValueError, threads the OS will not start a
    /// RuntimeError (not a panic in the middle of a parallel call).
    fn ready_pool(threads: crate::threads::ThreadCount) -> PyResult<()> {
        crate::threads::checked(threads).map_err(PyValueError::new_err)?;
        crate::threads::try_pool(threads).map(|_| ()).map_err(PyRuntimeError::new_err)
    }

    /// `ids` as one new numpy array: uint16 (itemsize 2, which the caller checked the
    /// vocab fits) or uint32 (4). Made by numpy's C API, not zeroed (the ids overwrite all
    /// of it).
    fn ids_to_array<'py>(py: Python<'py>, ids: &[u32], itemsize: usize) -> PyResult<Bound<'py, PyAny>> {
        if itemsize == 2 {
            new_filled_array(py, &[ids], |id| id as u16, None)
        } else {
            new_filled_array(py, &[ids], |id| id, None)
        }
    }

    /// Arrays of at least this many bytes are filled with the GIL released.
    const DETACH_FILL: usize = 1 << 19;

    /// The ids of consecutive `parts` (already in the array's element type) as one numpy
    /// array: a single part becomes the array without a copy.
    fn vecs_to_array<'py, T: numpy::Element + Copy + Send + Sync>(
        py: Python<'py>,
        mut parts: Vec<Vec<T>>,
        threads: crate::threads::ThreadCount,
    ) -> PyResult<Bound<'py, PyAny>> {
        if parts.len() == 1 {
            let mut v = parts.pop().unwrap_or_default();
            // The array keeps the vector's allocation: not much more than it needs.
            if v.capacity() > v.len() + v.len() / 4 + 1024 {
                v.shrink_to_fit();
            }
            return Ok(PyArray1::from_vec(py, v).into_any());
        }
        let slices: Vec<&[T]> = parts.iter().map(Vec::as_slice).collect();
        let parallel = (threads != Some(1) && slices.len() > 1).then_some(threads);
        new_filled_array(py, &slices, |id| id, parallel)
    }

    /// Ids of consecutive parts of an encoding, as stored in the array to be made: u16
    /// ids (itemsize 2) are written once as u16, with no u32 copy of them all first.
    enum Parts {
        U16(Vec<Vec<u16>>),
        U32(Vec<Vec<u32>>),
    }

    /// `Parts` of the element type of `itemsize` (2: u16, else u32) from `$ids`, an
    /// expression whose id type is inferred from the variant.
    macro_rules! parts_for_itemsize {
        ($itemsize:expr, $ids:expr) => {
            if $itemsize == 2 {
                Parts::U16($ids)
            } else {
                Parts::U32($ids)
            }
        };
    }

    impl Parts {
        fn into_array<'py>(self, py: Python<'py>, threads: crate::threads::ThreadCount) -> PyResult<Bound<'py, PyAny>> {
            match self {
                Parts::U16(p) => vecs_to_array(py, p, threads),
                Parts::U32(p) => vecs_to_array(py, p, threads),
            }
        }
    }

    /// The groups' ids, with the offsets of their texts appended to `offsets` (which
    /// starts with 0).
    fn split_groups<T>(groups: Vec<BatchIds<T>>, offsets: &mut Vec<i64>) -> Vec<Vec<T>> {
        let mut base = *offsets.last().unwrap_or(&0);
        groups
            .into_iter()
            .map(|g| {
                offsets.extend(g.ends.iter().map(|&end| base + end as i64));
                base += g.ids.len() as i64;
                g.ids
            })
            .collect()
    }

    /// A new 1-d array of the ids of `parts`, converted by `conv`.
    fn new_filled_array<'py, S: Copy + Sync, T: numpy::Element + Send>(
        py: Python<'py>,
        parts: &[&[S]],
        conv: impl Fn(S) -> T + Sync + Send + Copy,
        parallel: Option<crate::threads::ThreadCount>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = parts.iter().map(|p| p.len()).sum::<usize>();
        // SAFETY: a new, contiguous 1-d array of `n` elements, all written below before
        // Python can see it.
        let array = unsafe { PyArray1::<T>::new(py, n, false) };
        if n > 0 {
            // SAFETY: the array is new, so nothing else can see or resize it; its `n`
            // elements are uninitialized (written, never read, here).
            let dst: &mut [MaybeUninit<T>] = unsafe { std::slice::from_raw_parts_mut(array.data().cast(), n) };
            if n * std::mem::size_of::<T>() >= DETACH_FILL {
                py.detach(|| write_parts(dst, parts, conv, parallel));
            } else {
                write_parts(dst, parts, conv, parallel);
            }
        }
        Ok(array.into_any())
    }

    /// The ids of consecutive `parts`, converted by `conv`, into `dst`, which holds exactly
    /// that many: on this thread, or part by part on the pool of `Some(threads)`.
    fn write_parts<S: Copy + Sync, T: Send>(
        dst: &mut [MaybeUninit<T>],
        parts: &[&[S]],
        conv: impl Fn(S) -> T + Sync + Copy,
        parallel: Option<crate::threads::ThreadCount>,
    ) {
        use rayon::prelude::*;
        let mut rest = dst;
        let pieces = parts.iter().map(move |p| {
            let (d, tail) = std::mem::take(&mut rest).split_at_mut(p.len());
            rest = tail;
            (d, *p)
        });
        let write = |(d, p): (&mut [MaybeUninit<T>], &[S])| {
            for (d, &id) in d.iter_mut().zip(p) {
                d.write(conv(id));
            }
        };
        match parallel {
            None => pieces.for_each(write),
            Some(threads) => {
                let pieces: Vec<_> = pieces.collect();
                crate::threads::install(threads, || pieces.into_par_iter().for_each(write))
            }
        }
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
            let vocab = vocab.cast::<PyDict>().map_err(|_| {
                PyTypeError::new_err(format!("vocab must be a dict[int, bytes], got {}", type_name(vocab)))
            })?;
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
                    PyTypeError::new_err(format!(
                        "merges[{i}] must be a tuple (bytes, bytes), got {}",
                        type_name(&item)
                    ))
                })?;
                let a = bytes_of(&pair.get_item(0)?, &|| format!("merges[{i}][0]"))?;
                let b = bytes_of(&pair.get_item(1)?, &|| format!("merges[{i}][1]"))?;
                m.push((a, b));
            }
            let mut specials: Vec<String> = Vec::new();
            for (i, s) in special_tokens.try_iter()?.enumerate() {
                let s = s?;
                let t = s.cast::<PyString>().map_err(|_| {
                    PyTypeError::new_err(format!("special_tokens[{i}] must be str, got {}", type_name(&s)))
                })?;
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
            let ids = py.detach(|| self.inner.encode(&s, allow_special));
            to_list(py, &self.ints, &ids)
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
            let s = text_of(text, || "encode_to_numpy()".into())?;
            if s.len() < DETACH_MIN {
                return with_scratch(|ids| {
                    self.inner.encode_into(&s, allow_special, ids);
                    ids_to_array(py, ids, itemsize)
                });
            }
            ready_pool(num_threads)?;
            let enc = &self.inner;
            let parts =
                py.detach(|| parts_for_itemsize!(itemsize, enc.encode_parallel_parts(&s, allow_special, num_threads)));
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
            ready_pool(num_threads)?;
            let enc = &self.inner;
            let parts = py.detach(|| -> std::io::Result<Parts> {
                let text = crate::encode::map_text_file(&path, num_threads)?;
                Ok(parts_for_itemsize!(itemsize, enc.encode_parallel_parts(&text, allow_special, num_threads)))
            })?;
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
            let groups = run_detached(py, total, || self.inner.encode_batch_grouped(&strs, allow_special, num_threads));
            let mut lists: Vec<Bound<'py, PyList>> = Vec::with_capacity(strs.len());
            for ids in groups.iter().flat_map(BatchIds::texts) {
                lists.push(to_list(py, &self.ints, ids)?);
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
            ready_pool(num_threads)?;
            let objs = batch_items(texts)?;
            let (strs, total) = batch_texts(&objs)?;
            let enc = &self.inner;
            let (parts, offsets) = run_detached(py, total, || {
                let mut offsets = Vec::with_capacity(strs.len() + 1);
                offsets.push(0i64);
                let parts = parts_for_itemsize!(
                    itemsize,
                    split_groups(enc.encode_batch_grouped(&strs, allow_special, num_threads), &mut offsets)
                );
                (parts, offsets)
            });
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
            if data.len() % 4 != 0 {
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

    // For the shards section: the shard writer encodes with this same compiled encoder.
    impl PyEncoder {
        pub(crate) fn shared(&self) -> Arc<Encoder> {
            self.inner.clone()
        }
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_class::<PyEncoder>()?;
        m.add_class::<PyStreamEncoder>()?;
        Ok(())
    }
}
// ====================== end of the encoder section ==========================

// ============================================================================
// Shard writer: `ferrolm encode` (issue 5; branch `shards`).
// Type conversion, GIL release and Ctrl-C only; the pipeline lives in rust/shards*.
// ============================================================================

mod shards_bindings {
    use std::path::PathBuf;
    use std::time::{Duration, Instant};

    use pyo3::exceptions::{PyFileNotFoundError, PyKeyboardInterrupt, PyOSError, PyValueError};
    use pyo3::prelude::*;
    use pyo3::types::{PyDict, PyList};

    use super::encoder_bindings::PyEncoder;
    use crate::shards::{self, Dtype, EncodeJob, Format, InputSpec, ShardError, Utf8Errors};

    fn shard_err(e: ShardError) -> PyErr {
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
            _ => PyValueError::new_err(msg),
        }
    }

    /// Encode input files into `out_bin` (written as `out_bin + ".partial"`, resumable
    /// through `P.progress.json`). Returns a dict describing the result; the caller
    /// renames the partial file and writes the sidecar. `progress(raw_done, raw_total,
    /// tokens, documents)` is called with the GIL held after a written chunk, at most every
    /// `progress_interval` seconds; signals are checked after every chunk, so Ctrl-C stops
    /// the job cleanly (what was written is committed for a rerun to resume).
    #[pyfunction]
    #[pyo3(signature = (
        encoder, inputs, out_bin, *, dtype, eos = None, jsonl_field = "text", input_format = None,
        errors = "strict", chunk_size = 1 << 20, threads = 0, window = 0, part = None,
        newline_cuts = true, params = String::new(), commit_interval = 5.0, progress = None,
        progress_interval = 0.1, hash = true, docs = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn encode_shard<'py>(
        py: Python<'py>,
        encoder: &Bound<'py, PyEncoder>,
        inputs: Vec<PathBuf>,
        out_bin: PathBuf,
        dtype: &str,
        eos: Option<(String, u32)>,
        jsonl_field: &str,
        input_format: Option<&str>,
        errors: &str,
        chunk_size: usize,
        threads: usize,
        window: usize,
        part: Option<(u64, u64)>,
        newline_cuts: bool,
        params: String,
        commit_interval: f64,
        progress: Option<Py<PyAny>>,
        progress_interval: f64,
        hash: bool,
        docs: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let dtype = Dtype::parse(dtype)
            .ok_or_else(|| PyValueError::new_err(format!("dtype must be uint16 or uint32, got {dtype:?}")))?;
        let format = match input_format {
            None | Some("auto") => None,
            Some("text") => Some(Format::Text),
            Some("jsonl") => Some(Format::Jsonl),
            Some(other) => {
                return Err(PyValueError::new_err(format!("input format must be auto, text or jsonl, got {other:?}")))
            }
        };
        let errors = match errors {
            "strict" => Utf8Errors::Strict,
            "replace" => Utf8Errors::Replace,
            other => return Err(PyValueError::new_err(format!("errors must be strict or replace, got {other:?}"))),
        };
        if !(commit_interval >= 0.0 && commit_interval.is_finite()) {
            return Err(PyValueError::new_err("commit_interval must be a non-negative number of seconds"));
        }
        let job = EncodeJob {
            // An empty path: the documents of `docs` with no file behind them.
            inputs: inputs
                .into_iter()
                .map(|p| if p.as_os_str().is_empty() { InputSpec::documents() } else { InputSpec::detect(p, format) })
                .collect(),
            out_bin,
            dtype,
            eos,
            jsonl_field: jsonl_field.to_string(),
            errors,
            chunk_size,
            threads,
            window,
            part,
            newline_cuts,
            params,
            commit_interval: Duration::from_secs_f64(commit_interval),
            hash,
        };
        let enc = encoder.get().shared();
        let interval = Duration::from_secs_f64(progress_interval.max(0.0));
        let mut last = Instant::now() - interval;
        let mut stopped: Option<PyErr> = None;
        let mut source = docs.map(|obj| super::doc_batches::PyDocSource { obj, error: None });
        let result = py.detach(|| {
            let src = source.as_mut().map(|s| s as &mut dyn shards::DocSource);
            shards::encode_to_shard_with(&job, &*enc, src, |p| {
                // After every written chunk: Ctrl-C; at most every `interval`: the callback.
                let report = last.elapsed() >= interval || p.raw_done >= p.raw_total;
                Python::attach(|py| {
                    if let Err(e) = py.check_signals() {
                        stopped = Some(e);
                        return false;
                    }
                    if let (true, Some(cb)) = (report, &progress) {
                        last = Instant::now();
                        if let Err(e) = cb.call1(py, (p.raw_done, p.raw_total, p.tokens, p.documents)) {
                            stopped = Some(e);
                            return false;
                        }
                    }
                    true
                })
            })
        });
        let summary = match result {
            Ok(s) => s,
            Err(ShardError::Interrupted) if stopped.is_some() => return Err(stopped.unwrap()),
            Err(ShardError::Interrupted) if source.as_ref().is_some_and(|s| s.error.is_some()) => {
                return Err(source.unwrap().error.unwrap())
            }
            Err(e) => return Err(shard_err(e)),
        };
        let d = PyDict::new(py);
        d.set_item("num_tokens", summary.num_tokens)?;
        d.set_item("num_documents", summary.num_documents)?;
        d.set_item("dtype", summary.dtype.name())?;
        d.set_item("byte_range", (summary.byte_range.0, summary.byte_range.1))?;
        d.set_item("resumed_tokens", summary.resumed_tokens)?;
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
        let format = match input_format {
            Some("jsonl") => Some(Format::Jsonl),
            Some("text") => Some(Format::Text),
            _ => None,
        };
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
            shards::part_range(&specs, &sizes, i, n, eos.as_deref(), newline_cuts)
        })
        .map_err(shard_err)
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_function(wrap_pyfunction!(encode_shard, m)?)?;
        m.add_function(wrap_pyfunction!(shard_part_range, m)?)?;
        Ok(())
    }
}
// ====================== end of the shards section ===========================

// ===================================================================================
// BPE trainer (section owned by the trainer; algorithm in rust/train.rs)
// ===================================================================================

mod trainer_binding {
    use std::path::PathBuf;
    use std::sync::{Condvar, Mutex};
    use std::time::Duration;

    use pyo3::exceptions::{
        PyFileNotFoundError, PyIsADirectoryError, PyKeyboardInterrupt, PyOSError, PyPermissionError, PyRuntimeError,
        PyValueError,
    };
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyDict, PyList};

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
            let mut trainer = self.inner.take().ok_or_else(|| {
                PyRuntimeError::new_err("this BpeTrainer failed or was interrupted earlier; make a new one")
            })?;
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
                    return Err(PyValueError::new_err(format!(
                        "errors must be \"strict\" or \"replace\", got {other:?}"
                    )))
                }
            };
            let t =
                Trainer::new(&special_tokens, pattern, num_threads, errors, chunk_size.unwrap_or(DEFAULT_CHUNK_SIZE))
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

        /// Feed text to the text stream: everything fed until `finish_text` is one
        /// continuous text. `progress(done, total)` is called with bytes.
        #[pyo3(signature = (text, progress = None))]
        fn feed_text(&mut self, py: Python<'_>, text: String, progress: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
            self.run(py, progress, move |t, ctl| t.feed_text(&text, ctl))
        }

        /// Count a batch of documents, each a text of its own: `data` a bytes-like UTF-8
        /// buffer, `offsets` an int64 array of n + 1 positions in it.
        #[pyo3(signature = (data, offsets, progress = None))]
        fn feed_documents(
            &mut self,
            py: Python<'_>,
            data: &Bound<'_, PyAny>,
            offsets: &Bound<'_, PyAny>,
            progress: Option<&Bound<'_, PyAny>>,
        ) -> PyResult<()> {
            let batch = super::doc_batches::extract_batch(data, offsets)?;
            self.run(py, progress, move |t, ctl| t.feed_documents(&batch.data, &batch.ends, ctl))
        }

        /// End the text stream (count what is buffered).
        #[pyo3(signature = (progress = None))]
        fn finish_text(&mut self, py: Python<'_>, progress: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
            self.run(py, progress, move |t, ctl| t.finish_text(ctl))
        }

        /// Learn up to `num_merges` merges; returns them as (bytes, bytes) pairs in order,
        /// and the vocab they make: id -> bytes for the 256 bytes, then one id per merge.
        /// `progress(done, total)` is called with merges.
        #[pyo3(signature = (num_merges, progress = None))]
        fn learn<'py>(
            &mut self,
            py: Python<'py>,
            num_merges: usize,
            progress: Option<&Bound<'py, PyAny>>,
        ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyDict>)> {
            let merges = self.run(py, progress, move |t, ctl| t.learn(num_merges, ctl))?;
            // Built here rather than in Python (a Python loop over 32k merges takes ~15 ms),
            // with one bytes object per symbol: the vocab entries and the pairs share them.
            let mut objects: Vec<Option<Bound<'py, PyBytes>>> = vec![None; merges.num_symbols()];
            let mut object =
                |s: u32| objects[s as usize].get_or_insert_with(|| PyBytes::new(py, merges.symbol_bytes(s))).clone();
            let vocab = PyDict::new(py);
            for b in 0..=255u8 {
                vocab.set_item(b, object(b as u32))?;
            }
            let mut pairs = Vec::with_capacity(merges.len());
            for i in 0..merges.len() {
                let ((a, b), made) = merges.merge(i);
                vocab.set_item(256 + i, object(made))?;
                pairs.push((object(a), object(b)));
            }
            Ok((PyList::new(py, pairs)?, vocab))
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

// ---- tokenizer files (owner: vocab_files) ----

mod vocab_files_bindings {
    use pyo3::prelude::*;
    use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

    /// vocab.json's text as {id: token bytes}, or None when ferrolm.tokenizer_files must
    /// read it (and report what is wrong).
    #[pyfunction]
    fn read_vocab_json<'py>(
        py: Python<'py>,
        text: &str,
        specials: Vec<String>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(items) = py.detach(|| crate::vocab_files::read_vocab_json(text, &specials)) else { return Ok(None) };
        let d = PyDict::new(py);
        for (id, bytes) in items {
            d.set_item(id, PyBytes::new(py, &bytes))?;
        }
        Ok(Some(d))
    }

    /// merges.txt's text as [(left bytes, right bytes)], or None when
    /// ferrolm.tokenizer_files must read it (and report what is wrong).
    #[pyfunction]
    fn read_merges_txt<'py>(py: Python<'py>, text: &str) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(merges) = py.detach(|| crate::vocab_files::read_merges_txt(text)) else { return Ok(None) };
        let items = merges
            .iter()
            .map(|(a, b)| PyTuple::new(py, [PyBytes::new(py, a), PyBytes::new(py, b)]))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Some(PyList::new(py, items)?))
    }

    pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add_function(wrap_pyfunction!(read_vocab_json, m)?)?;
        m.add_function(wrap_pyfunction!(read_merges_txt, m)?)?;
        Ok(())
    }
}

// ---- pre-tokenizer debug bindings (owner: pretokenize) ----

/// The regex source of a built-in pattern name ("gpt2", "cl100k", "o200k"); a test
/// checks it equals ferrolm.patterns.
#[pyfunction]
fn pattern_source(name: &str) -> PyResult<&'static str> {
    crate::pretokenize::Builtin::by_name(name)
        .map(|b| b.source())
        .ok_or_else(|| PyValueError::new_err(format!("unknown built-in pattern name: {name:?}")))
}

/// For each char of `text`, the bit flags of the pre-tokenizer's Unicode classes
/// (see `pretokenize::char_class_flags`), as bytes: one flag byte per char. For
/// exhaustive tests against `regex`.
#[pyfunction]
fn _char_classes(text: &str) -> Vec<u8> {
    text.chars().map(crate::pretokenize::char_class_flags).collect()
}

// ---- end of pre-tokenizer debug bindings ----

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(pretokenize, m)?)?;
    encoder_bindings::register(m)?; // encoder section
    shards_bindings::register(m)?; // shards section
    m.add_class::<trainer_binding::PyBpeTrainer>()?; // BPE trainer
    m.add_function(wrap_pyfunction!(pattern_source, m)?)?;
    m.add_function(wrap_pyfunction!(_char_classes, m)?)?;
    vocab_files_bindings::register(m)?; // tokenizer files
    Ok(())
}
