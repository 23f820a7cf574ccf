//! Zero-initialized slot arrays for the lookup tables, on 2 MiB pages where the OS
//! allows (Linux transparent huge pages on request): the tables are read at random,
//! and with 4 KiB pages most lookups would also miss the TLB.

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

const HUGE_PAGE: usize = 2 << 20;

/// Types for which all-zero bytes are a valid value.
///
/// # Safety
/// Implement only for plain-old-data types whose all-zero bit pattern is valid.
pub(crate) unsafe trait Zeroable: Copy {}

pub(crate) struct ZeroedBuf<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the buffer owns plain data; access follows Rust's usual &/&mut rules.
unsafe impl<T: Zeroable + Send> Send for ZeroedBuf<T> {}
unsafe impl<T: Zeroable + Sync> Sync for ZeroedBuf<T> {}

impl<T: Zeroable> ZeroedBuf<T> {
    fn layout(len: usize) -> Layout {
        let size = (len * std::mem::size_of::<T>()).max(1);
        let align = if size >= HUGE_PAGE { HUGE_PAGE } else { std::mem::align_of::<T>().max(64) };
        Layout::from_size_align(size, align).expect("table too large")
    }

    /// `len` zeroed elements.
    pub(crate) fn new(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) } as *mut T;
        let ptr = NonNull::new(raw).unwrap_or_else(|| handle_alloc_error(layout));
        #[cfg(target_os = "linux")]
        if layout.size() >= HUGE_PAGE {
            // SAFETY: advice on memory we own; failure is harmless (small pages stay).
            unsafe {
                libc::madvise(raw as *mut libc::c_void, layout.size(), libc::MADV_HUGEPAGE);
            }
        }
        ZeroedBuf { ptr, len }
    }
}

impl<T: Zeroable> Deref for ZeroedBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: ptr points to len initialized (zeroed or written) elements.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> DerefMut for ZeroedBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and &mut self is unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> Clone for ZeroedBuf<T> {
    fn clone(&self) -> Self {
        let mut b = ZeroedBuf::new(self.len);
        b.copy_from_slice(self);
        b
    }
}

impl<T: Zeroable> Drop for ZeroedBuf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr() as *mut u8, Self::layout(self.len)) }
    }
}

impl<T: Zeroable> Default for ZeroedBuf<T> {
    fn default() -> Self {
        ZeroedBuf::new(0)
    }
}
