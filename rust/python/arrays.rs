//! Encodings as numpy arrays, made with numpy's C API and filled in place (in
//! parallel for large ones).

use std::mem::MaybeUninit;

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;

use crate::encode::BatchIds;
use crate::threads::ThreadCount;

/// `ids` as one new numpy array: uint16 (itemsize 2, which the caller checked the
/// vocab fits) or uint32 (4). Made by numpy's C API, not zeroed (the ids overwrite all
/// of it).
pub(super) fn ids_to_array<'py>(py: Python<'py>, ids: &[u32], itemsize: usize) -> PyResult<Bound<'py, PyAny>> {
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
    threads: ThreadCount,
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
pub(super) enum Parts {
    U16(Vec<Vec<u16>>),
    U32(Vec<Vec<u32>>),
}

/// `Parts` of the element type of `itemsize` (2: u16, else u32) from `$ids`, an
/// expression whose id type is inferred from the variant.
macro_rules! parts_for_itemsize {
    ($itemsize:expr, $ids:expr) => {
        if $itemsize == 2 {
            $crate::python::arrays::Parts::U16($ids)
        } else {
            $crate::python::arrays::Parts::U32($ids)
        }
    };
}
pub(super) use parts_for_itemsize;

impl Parts {
    pub(super) fn into_array<'py>(self, py: Python<'py>, threads: ThreadCount) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Parts::U16(p) => vecs_to_array(py, p, threads),
            Parts::U32(p) => vecs_to_array(py, p, threads),
        }
    }
}

/// The groups' ids, with the offsets of their texts appended to `offsets` (which
/// starts with 0).
pub(super) fn split_groups<T>(groups: Vec<BatchIds<T>>, offsets: &mut Vec<i64>) -> Vec<Vec<T>> {
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
    parallel: Option<ThreadCount>,
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
    parallel: Option<ThreadCount>,
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
