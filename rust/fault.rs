//! Panics on request, for the tests of what a panic in the core leaves behind (the
//! Python binding must turn it into an exception and stay usable). Armed from Python
//! through the hidden `ferrolm._core._arm_panic`; each armed site panics once, the next
//! time it is reached. Unarmed, a check is one relaxed atomic load.

use std::sync::atomic::{AtomicU32, Ordering};

/// Where a panic can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Site {
    /// A trainer worker, counting pre-tokens.
    TrainCount = 1,
    /// The trainer's merge stage (on a worker of the trainer's pool).
    TrainMerge = 2,
    /// Encoding a span of text between special tokens (in any kind of encode call).
    Encode = 4,
    /// The shard writer's calling thread, after writing a chunk.
    ShardWrite = 8,
    /// Reached by this module's own test only.
    #[cfg(test)]
    Test = 1 << 30,
}

const SITES: [(&str, Site); 4] = [
    ("train-count", Site::TrainCount),
    ("train-merge", Site::TrainMerge),
    ("encode", Site::Encode),
    ("shard-write", Site::ShardWrite),
];

static ARMED: AtomicU32 = AtomicU32::new(0);

/// Arm the site named `name` (see `SITES`); an unknown name is an error that lists them.
pub fn arm(name: &str) -> Result<(), String> {
    match SITES.iter().find(|(n, _)| *n == name) {
        Some(&(_, site)) => {
            ARMED.fetch_or(site as u32, Ordering::SeqCst);
            Ok(())
        }
        None => Err(format!(
            "unknown fault site {name:?}; known: {}",
            SITES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// Disarm every site.
pub fn disarm() {
    ARMED.store(0, Ordering::SeqCst);
}

/// Panic here if `site` is armed (once: the site is disarmed as it fires).
#[inline(always)]
pub fn check(site: Site) {
    if ARMED.load(Ordering::Relaxed) & site as u32 != 0 {
        fire(site);
    }
}

#[cold]
#[inline(never)]
fn fire(site: Site) {
    if ARMED.fetch_and(!(site as u32), Ordering::SeqCst) & site as u32 != 0 {
        panic!("fault injected at {site:?} (a test hook)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_armed_site_panics_once() {
        // The real sites are reached by other tests running alongside: only the test site
        // is armed here.
        assert!(arm("nowhere").unwrap_err().contains("train-merge"));
        check(Site::Test);
        ARMED.fetch_or(Site::Test as u32, Ordering::SeqCst);
        let p = std::panic::catch_unwind(|| check(Site::Test)).unwrap_err();
        assert!(p.downcast_ref::<String>().unwrap().contains("Test"));
        check(Site::Test);
    }
}
