//! The process's worker threads: one rayon pool per thread count, made on first use
//! and kept, so that calls do not pay for starting threads. Nothing in ferrolm runs on
//! rayon's global pool.
//!
//! Fork safety. A child made by `fork()` (multiprocessing's default start method on
//! Linux, PyTorch DataLoader workers) has only the thread that forked: a pool inherited
//! from the parent would hand work to threads that do not exist and wait forever. The
//! pools hang off one registry, which a fork handler detaches in the child (an atomic
//! store, safe at that point); the child's first parallel call then builds new pools.
//! The parent's registry is leaked in the child, never locked or dropped there, so a
//! lock held by one of the parent's threads at the moment of the fork cannot block it.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, Once};

use rayon::ThreadPool;

/// How many threads a parallel call uses: `None` or `Some(0)` for the default
/// ([`default_threads`]), `Some(n)` for `n`.
pub type ThreadCount = Option<usize>;

type Registry = Mutex<Vec<(usize, Arc<ThreadPool>)>>;

/// The most threads one call may ask for. More is surely a mistake (the trainer's
/// per-worker count tables alone would take gigabytes), and the OS would refuse threads
/// only after thousands were started.
pub const MAX_THREADS: usize = 1024;

/// Pools kept at once, most recently used first. A program that tries many thread
/// counts would otherwise keep every pool, and its threads, for good.
const KEPT_POOLS: usize = 4;

/// The current process's registry; null until first used, and again in a forked child.
static REGISTRY: AtomicPtr<Registry> = AtomicPtr::new(std::ptr::null_mut());

/// The number of threads used when none is asked for: `RAYON_NUM_THREADS` when set to
/// a positive number (as rayon reads it), else the CPUs this process may run on (at most
/// [`MAX_THREADS`]).
pub fn default_threads() -> usize {
    if let Some(n) = std::env::var("RAYON_NUM_THREADS").ok().and_then(|v| v.trim().parse::<usize>().ok()) {
        if n > 0 {
            return n;
        }
    }
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_THREADS)
}

/// The thread count a [`ThreadCount`] stands for.
pub fn resolve(threads: ThreadCount) -> usize {
    match threads {
        None | Some(0) => default_threads(),
        Some(n) => n,
    }
}

fn registry() -> &'static Registry {
    static AT_FORK: Once = Once::new();
    AT_FORK.call_once(|| {
        #[cfg(unix)]
        {
            extern "C" fn detach_in_child() {
                REGISTRY.store(std::ptr::null_mut(), Ordering::SeqCst);
            }
            // SAFETY: registers a handler that only stores to an atomic. If registration
            // fails (ENOMEM), pools are not fork safe, as with rayon's own.
            unsafe { libc::pthread_atfork(None, None, Some(detach_in_child)) };
        }
    });
    let current = REGISTRY.load(Ordering::Acquire);
    if !current.is_null() {
        // SAFETY: a registry, once published, is never freed (see the module doc).
        return unsafe { &*current };
    }
    let fresh = Box::into_raw(Box::new(Registry::default()));
    match REGISTRY.compare_exchange(std::ptr::null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: just published; never freed.
        Ok(_) => unsafe { &*fresh },
        Err(other) => {
            // SAFETY: `fresh` was never shared; `other` is published and never freed.
            drop(unsafe { Box::from_raw(fresh) });
            unsafe { &*other }
        }
    }
}

/// The thread count a [`ThreadCount`] stands for, or why it is refused (more than
/// [`MAX_THREADS`]).
pub fn checked(threads: ThreadCount) -> Result<usize, String> {
    let n = resolve(threads).max(1);
    if n > MAX_THREADS {
        return Err(over_limit(n, matches!(threads, None | Some(0))));
    }
    Ok(n)
}

/// The error for `n` threads; `by_default`: no count was asked for, so `n` came from
/// `RAYON_NUM_THREADS` (the CPU count is capped).
fn over_limit(n: usize, by_default: bool) -> String {
    if by_default {
        format!("RAYON_NUM_THREADS={n} is over ferrolm's limit of {MAX_THREADS} threads")
    } else {
        format!("a thread count of {n} is over the limit of {MAX_THREADS}")
    }
}

/// The pool of `threads` threads (built on first use, then shared), or why it cannot be
/// had: too many threads asked for, or the operating system would not start them.
pub fn try_pool(threads: ThreadCount) -> Result<Arc<ThreadPool>, String> {
    let n = checked(threads)?;
    let mut pools = registry().lock().unwrap_or_else(|e| e.into_inner());
    pool_of(&mut pools, n)
}

/// The pool of `n` threads in `pools` (most recently used first), built if missing;
/// only the [`KEPT_POOLS`] most recently used stay in the list.
fn pool_of(pools: &mut Vec<(usize, Arc<ThreadPool>)>, n: usize) -> Result<Arc<ThreadPool>, String> {
    if let Some(i) = pools.iter().position(|(k, _)| *k == n) {
        let entry = pools.remove(i);
        let p = entry.1.clone();
        pools.insert(0, entry);
        return Ok(p);
    }
    let p = rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("ferrolm-{i}"))
        .build()
        .map_err(|e| format!("cannot start {n} worker threads: {e}"))?;
    let p = Arc::new(p);
    pools.insert(0, (n, p.clone()));
    // A dropped pool's threads exit once the calls still holding it are done.
    pools.truncate(KEPT_POOLS);
    Ok(p)
}

/// [`try_pool`], panicking when the threads cannot be started.
pub fn pool(threads: ThreadCount) -> Arc<ThreadPool> {
    try_pool(threads).unwrap_or_else(|e| panic!("{e}"))
}

/// Run `f` on the pool of `threads` threads: its rayon calls (`par_iter`, `scope`,
/// `join`) use that pool.
pub fn install<R: Send>(threads: ThreadCount, f: impl FnOnce() -> R + Send) -> R {
    pool(threads).install(f)
}

/// Drop `value` on a short-lived thread of its own, so that the caller does not wait
/// for it: freeing a large structure made of many allocations (the trainer's pair
/// index) takes milliseconds that would otherwise be serial.
pub fn drop_in_background<T: Send + 'static>(value: T) {
    // If no thread can be started, the closure, and with it `value`, is dropped here.
    let _ = std::thread::Builder::new().name("ferrolm-free".into()).spawn(move || drop(value));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_shared_per_thread_count() {
        let a = pool(Some(2));
        let b = pool(Some(2));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.current_num_threads(), 2);
        assert_eq!(install(Some(3), rayon::current_num_threads), 3);
        assert_eq!(resolve(Some(0)), default_threads());
    }

    #[test]
    fn background_drops_happen() {
        struct Flag(Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        drop_in_background(Flag(dropped.clone()));
        let t = std::time::Instant::now();
        while !dropped.load(Ordering::SeqCst) {
            assert!(t.elapsed().as_secs() < 10, "never dropped");
            std::thread::yield_now();
        }
    }

    #[test]
    fn few_pools_are_kept_and_absurd_counts_are_refused() {
        // A registry of its own: the process's is shared with the other tests.
        let mut pools = Vec::new();
        let held = pool_of(&mut pools, 1).unwrap();
        let again = pool_of(&mut pools, 1).unwrap();
        assert!(Arc::ptr_eq(&held, &again));
        for n in 2..2 + KEPT_POOLS {
            assert_eq!(pool_of(&mut pools, n).unwrap().current_num_threads(), n);
        }
        assert_eq!(pools.len(), KEPT_POOLS);
        assert!(!pools.iter().any(|(_, p)| Arc::ptr_eq(p, &held)), "the least recently used pool was kept");
        // A pool dropped from the list still works for whoever holds it.
        assert_eq!(held.install(rayon::current_num_threads), 1);
        // Using a pool makes it the most recent: it outlives a newer one.
        let second = pool_of(&mut pools, 2).unwrap();
        pool_of(&mut pools, 9).unwrap();
        assert!(pools.iter().any(|(_, p)| Arc::ptr_eq(p, &second)));
        let err = try_pool(Some(MAX_THREADS + 1)).expect_err("refused");
        assert!(err.contains("over the limit"), "{err}");
        assert_eq!(checked(Some(MAX_THREADS)), Ok(MAX_THREADS));
        // A default that came from RAYON_NUM_THREADS says so.
        assert!(over_limit(5000, true).starts_with("RAYON_NUM_THREADS=5000"));
    }

    #[cfg(unix)]
    #[test]
    fn a_forked_child_gets_new_pools() {
        use rayon::prelude::*;
        // The parent's pool has live threads; the child's work must not wait on them.
        let sum = |t| install(Some(t), || (0..10_000u64).into_par_iter().sum::<u64>());
        assert_eq!(sum(2), 49_995_000);
        // SAFETY: the child only computes, then leaves with _exit (no destructors, no
        // test-harness state touched).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            unsafe { libc::alarm(10) }; // a hang kills the child: the test then fails
            let ok = sum(2) == 49_995_000;
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child made above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status}");
    }
}
