//! Byte buffers kept for reuse between chunks of one long job (the trainer's reader, the
//! shard writer's reader and output). Memory the process has not touched before costs a
//! page fault per 4 KiB page on first use (several microseconds each on a virtual
//! machine): a job needs only a few buffers at a time, so it faults them in once rather
//! than once per chunk or per file.

use std::sync::Mutex;

/// Free buffers, shared by the threads of one job.
#[derive(Default)]
pub(crate) struct BufferPool(Mutex<Vec<Vec<u8>>>);

/// Buffers kept at most; more would only be memory nobody uses.
const KEPT: usize = 64;

impl BufferPool {
    /// A buffer to fill (empty if none is free). Buffers keep their length, so reuse
    /// zeroes nothing.
    pub(crate) fn take(&self) -> Vec<u8> {
        self.0.lock().map(|mut v| v.pop()).ok().flatten().unwrap_or_default()
    }

    /// Give a buffer back for reuse.
    pub(crate) fn put(&self, buf: Vec<u8>) {
        if let Ok(mut v) = self.0.lock() {
            if v.len() < KEPT {
                v.push(buf);
            }
        }
    }

    /// Buffers free now (tests).
    #[cfg(test)]
    pub(crate) fn free(&self) -> usize {
        self.0.lock().map(|v| v.len()).unwrap_or(0)
    }
}
