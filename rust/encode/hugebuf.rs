//! Zero-initialized slot arrays for the lookup tables, on 2 MiB pages where the OS
//! allows (Linux transparent huge pages on request): the tables are read at random,
//! and with 4 KiB pages most lookups would also miss the TLB.
//!
//! On Linux, arrays of 1 MiB or more are their own anonymous mappings: fresh pages read
//! as zero without being written, and dropping an array gives its memory back to the
//! OS at once (through the allocator, large aligned blocks that come and go, as a
//! thread's piece table does when it is reset, can stay mapped and be counted in RSS).

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

const HUGE_PAGE: usize = 2 << 20;
/// Arrays at least this large are mapped directly (Linux).
#[cfg(target_os = "linux")]
const MAP_MIN: usize = 1 << 20;

/// Types for which all-zero bytes are a valid value.
///
/// # Safety
/// Implement only for plain-old-data types whose all-zero bit pattern is valid.
pub(crate) unsafe trait Zeroable {}

// SAFETY: integers; all zeros is 0.
unsafe impl Zeroable for u64 {}
unsafe impl Zeroable for std::sync::atomic::AtomicU32 {}

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

    #[cfg(target_os = "linux")]
    fn mapped(len: usize) -> bool {
        len * std::mem::size_of::<T>() >= MAP_MIN
    }

    /// `len` zeroed elements.
    pub(crate) fn new(len: usize) -> Self {
        let layout = Self::layout(len);
        #[cfg(target_os = "linux")]
        if Self::mapped(len) {
            return ZeroedBuf { ptr: map_zeroed(layout.size()).cast(), len };
        }
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) } as *mut T;
        let ptr = NonNull::new(raw).unwrap_or_else(|| handle_alloc_error(layout));
        ZeroedBuf { ptr, len }
    }
}

/// A private anonymous mapping of `size` bytes, 2 MiB aligned when at least that large
/// (so that it can be backed by huge pages), with huge pages requested.
#[cfg(target_os = "linux")]
fn map_zeroed(size: usize) -> NonNull<u8> {
    let fail = || -> ! { handle_alloc_error(Layout::from_size_align(size, HUGE_PAGE).expect("table too large")) };
    let align = if size >= HUGE_PAGE { HUGE_PAGE } else { 4096 };
    let size = size.next_multiple_of(4096);
    let total = size + align - 4096;
    // SAFETY: a fresh anonymous mapping; the unaligned head and tail of it are unmapped
    // again, which leaves exactly [start, start + size) mapped.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            fail();
        }
        let base = p as usize;
        let start = base.next_multiple_of(align);
        if start > base {
            libc::munmap(p, start - base);
        }
        let end = start + size;
        if base + total > end {
            libc::munmap(end as *mut libc::c_void, base + total - end);
        }
        if size >= HUGE_PAGE {
            // Advice only: failure leaves small pages.
            libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
        }
        NonNull::new(start as *mut u8).unwrap_or_else(|| fail())
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

impl<T: Zeroable> Drop for ZeroedBuf<T> {
    fn drop(&mut self) {
        let layout = Self::layout(self.len);
        #[cfg(target_os = "linux")]
        if Self::mapped(self.len) {
            // SAFETY: mapped in `map_zeroed` with this (page-rounded) size.
            unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, layout.size().next_multiple_of(4096)) };
            return;
        }
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr() as *mut u8, layout) }
    }
}

impl<T: Zeroable> Default for ZeroedBuf<T> {
    fn default() -> Self {
        ZeroedBuf::new(0)
    }
}
