//! Stopping a long encode from another thread (Ctrl-C in Python): work run under a flag
//! ([`under`]) checks it between batches of pieces ([`check`]) and, once it is set,
//! unwinds with [`Cancelled`], which `under` turns into an error. The unwinding is not a
//! panic: no message is printed, and it only happens between pieces, where the encoder's
//! tables are consistent. Parallel encodes carry the flag into their tasks ([`carried`]).

use std::cell::RefCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A cancelled encode's error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cancelled;

thread_local! {
    static FLAG: RefCell<Option<Arc<AtomicBool>>> = const { RefCell::new(None) };
}

/// Run `f` (encoding on this thread, or in tasks that it starts) so that setting `flag`
/// stops it: `Err(Cancelled)` then, soon after. A panic in `f` goes on unwinding.
pub fn under<R>(flag: Arc<AtomicBool>, f: impl FnOnce() -> R) -> Result<R, Cancelled> {
    match catch_unwind(AssertUnwindSafe(|| with(Some(flag), f))) {
        Ok(r) => Ok(r),
        Err(payload) if payload.is::<Cancelled>() => Err(Cancelled),
        Err(payload) => resume_unwind(payload),
    }
}

/// Unwind with `Cancelled` if this thread's work was asked to stop.
#[inline]
pub(crate) fn check() {
    let stop = FLAG.with(|f| f.borrow().as_ref().is_some_and(|a| a.load(Ordering::Relaxed)));
    if stop {
        resume_unwind(Box::new(Cancelled));
    }
}

/// `f` made to run under the flag of the thread that calls `carried` (for parallel tasks,
/// which run on other threads).
pub(crate) fn carried<A, R>(f: impl Fn(A) -> R + Sync) -> impl Fn(A) -> R + Sync {
    let flag = FLAG.with(|f| f.borrow().clone());
    move |a| with(flag.clone(), || f(a))
}

/// Run `f` with this thread's flag set to `flag`, then put the previous one back (also
/// when `f` unwinds).
fn with<R>(flag: Option<Arc<AtomicBool>>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Arc<AtomicBool>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            FLAG.with(|f| *f.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(FLAG.with(|f| f.replace(flag)));
    f()
}
