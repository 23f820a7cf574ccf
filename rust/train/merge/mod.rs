//! Stages 3 and 4: build words and pair counts, then merge.
//!
//! * Words are the unique pre-tokens as symbol sequences in one flat array; a merge
//!   rewrites a word in place (it only gets shorter), in one left-to-right pass; where
//!   the CPU has AVX-512F or AVX2 (`Simd::detected`), a word of up to 16 symbols (nearly
//!   all) is searched with vector compares and, with one occurrence, rewritten by masked
//!   stores (`vector`).
//! * `pairs` maps each adjacent symbol pair to its weighted count and the list of
//!   words that contain it. Lists are append-only and may hold stale or repeated
//!   word ids (deduplicated lazily); every word that contains the pair is in it.
//! * A max-heap orders pairs by (count, bytes of left, bytes of right), so among
//!   equal counts the lexicographically greatest pair wins. Entries are invalidated
//!   lazily: a popped entry whose count is no longer current is re-pushed or dropped.
//! * Symbols are identified by their bytes: if a merge produces bytes that some
//!   earlier merge already produced, both merges yield the same symbol, as in a
//!   trainer that keeps pre-tokens as tuples of bytes.
//! * Pruning. A pair's count never rises after the merge that creates it: the pairs a
//!   merge gains all contain its new symbol, and every other pair only loses
//!   occurrences. So a pair created with a count below `floor` stays below it, and
//!   while the best tracked pair has a count of at least `floor`, untracked pairs can
//!   neither win nor tie: they need no entry, no heap slot and no word list.
//!   Invariant: every untracked pair counts less than `floor`; tracked counts are
//!   exact. After the first merges, `floor` is set from the counts seen so far,
//!   extrapolated to the last merge with a safety margin. When no tracked pair is
//!   left, all pairs are recounted from the words (exactly) and the floor is lowered to
//!   at most the greatest count. The one exception to "never rises", a merge whose
//!   bytes an earlier merge already made (its symbol is not new, so pairs with it may
//!   have had untracked occurrences), is followed by an exact rescan of that symbol's
//!   pairs. Most pairs a merge creates are rare, so this keeps the pair table and the
//!   heap small. The merges are the same as without pruning.
//!
//! Files: `words` (the flat word array), `pairs` (the pair table), `symbols` (symbol
//! bytes and the learned merges), `heap`, `deltas` (one merge's count changes),
//! `rewrite` and `vector` (the word rewrites), and here the merge loop and its pruning.

use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use super::{Control, TrainError};

mod deltas;
mod heap;
mod pairs;
mod rewrite;
mod symbols;
#[cfg(test)]
mod tests;
mod tracked;
#[cfg(target_arch = "x86_64")]
mod vector;
mod words;

use rewrite::Rewriter;
pub use symbols::Merges;
use symbols::Tokens;
use tracked::Tracked;
pub use words::Words;

type FxMap<K, V> = HashMap<K, V, FxBuildHasher>;

/// A pair of symbols as one key (left in the high half).
#[inline]
fn pack(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

#[inline]
fn unpack(p: u64) -> (u32, u32) {
    ((p >> 32) as u32, p as u32)
}

/// No word, no entry (the end of a chain).
const NONE: u32 = u32::MAX;

/// Lists at least this long are rewritten by all workers, each on its range of word ids.
const PARALLEL_LIST: usize = 4096;

/// Timings of the merge stages, in seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct MergeTimes {
    pub build_s: f64,
    pub merge_s: f64,
    /// The pruning floor first chosen (1: no pruning), and how many exact recounts
    /// were needed.
    pub floor: i64,
    pub recounts: u32,
    /// Merges whose bytes an earlier merge already made, under a floor (each rescans
    /// the words for the pairs of the merged symbol).
    pub rescans: u32,
}

/// When and how much to prune (see the module docs).
#[derive(Clone, Copy, Debug)]
struct Pruning {
    /// Merges done before the first estimate (no pruning for shorter runs).
    after: usize,
    /// The floor is the predicted count of the last merge divided by this.
    margin: f64,
    /// Rescan the pairs of every merged symbol under a floor, not only of those whose
    /// bytes were made before (for tests: such merges are rare, and a rescan must
    /// change nothing).
    rescan_all: bool,
}

/// The floor is estimated early: until then every rare pair a merge makes gets a word
/// list and a heap entry (estimating after 1,000 merges, those first merges took half
/// of the merge time on the 74 MB webtext; after 100, the merge stage is 10-15 % faster
/// there and up to 40 % on Chinese). An estimate from fewer merges is rougher, so a run
/// now and then needs one exact recount; the merges are the same either way.
const PRUNING: Pruning = Pruning { after: 100, margin: 4.0, rescan_all: false };

/// Predicted count of merge `total` from the counts of the merges so far (a power law
/// fitted to the last three quarters of them).
fn predict_last_count(history: &[i64], total: usize) -> f64 {
    let k = history.len();
    let (c_lo, c_hi) = (history[k / 4] as f64, history[k - 1] as f64);
    let alpha = (c_lo / c_hi).ln() / ((k as f64) / (k / 4 + 1) as f64).ln();
    c_hi * (total as f64 / k as f64).powf(-alpha.max(0.0))
}

/// Learn up to `num_merges` merges from `words`. Returns the merges as byte pairs, in order.
/// Stops early when no pair is left. Memory is sized by the merges the words allow
/// (`Words::max_merges`), not by the request, which may be any number.
pub fn learn_merges(
    words: Words,
    num_merges: usize,
    ctl: &Control,
    times: &mut MergeTimes,
) -> Result<Merges, TrainError> {
    crate::fault::check(crate::fault::Site::TrainMerge);
    let num_merges = num_merges.min(words.max_merges());
    ctl.set_total(num_merges as u64);
    learn_merges_with(words, num_merges, ctl, times, PARALLEL_LIST, PRUNING)
}

/// `learn_merges`, rewriting the words of lists of at least `parallel_list` entries on all
/// the workers of the current rayon pool.
fn learn_merges_with(
    mut words: Words,
    num_merges: usize,
    ctl: &Control,
    times: &mut MergeTimes,
    parallel_list: usize,
    pruning: Pruning,
) -> Result<Merges, TrainError> {
    let t0 = std::time::Instant::now();
    let mut tokens = Tokens::new();
    if num_merges == 0 || words.is_empty() {
        return Ok(Merges { symbols: tokens.bytes, pairs: Vec::new(), made: Vec::new() });
    }
    // The merges as symbol pairs, and the symbol each makes.
    let mut merged: Vec<(u32, u32)> = Vec::with_capacity(num_merges);
    let mut made: Vec<u32> = Vec::with_capacity(num_merges);

    // 1. Pair counts and the pair -> words index, of every pair at first.
    let ids = words.take_ids();
    let mut tracked = Tracked::recount(&words, &ids, &tokens, 1, true);
    times.floor = tracked.floor;
    let mut history: Vec<i64> = Vec::with_capacity(num_merges);
    times.build_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();

    let mut rewriter = Rewriter::new(&words, parallel_list);
    while merged.len() < num_merges {
        if ctl.is_cancelled() {
            return Err(TrainError::Cancelled);
        }
        // 2. The best pair; when no tracked pair is left but untracked ones may be,
        //    recount them all under a lower floor (the last stretch of merges under none).
        let best = loop {
            if let Some(key) = tracked.pop_best(&tokens) {
                break Some(key);
            }
            if tracked.floor <= 1 {
                break None;
            }
            let want = if num_merges - merged.len() < pruning.after {
                1
            } else {
                (*history.last().unwrap_or(&0) as f64 / (2.0 * pruning.margin)) as i64
            };
            tracked = Tracked::recount(&words, &ids, &tokens, want, false);
            times.recounts += 1;
        };
        let Some(best) = best else { break };
        let (a, b) = unpack(best);
        let stats = tracked.pairs.shard(best).remove(&best).expect("popped pair is present");
        history.push(stats.count);
        merged.push((a, b));
        let (x, known_bytes) = tokens.join(a, b);
        made.push(x);

        // 3. Rewrite each word of the pair in one pass, recording count changes; 4. apply them.
        let deltas = rewriter.rewrite(&mut words, &stats.words, a, b, x, tokens.bytes.len());
        drop(stats);
        tracked.apply(deltas, &tokens, x, known_bytes);

        // 5. Pruning: an exact rescan after a merge into known bytes, and the first floor.
        if (known_bytes || pruning.rescan_all) && tracked.floor > 1 {
            tracked.rescan_symbol(&words, &ids, x, &tokens);
            times.rescans += 1;
        }
        if merged.len() == pruning.after && num_merges >= 4 * pruning.after {
            tracked.raise_floor(((predict_last_count(&history, num_merges) / pruning.margin) as i64).max(1), &tokens);
            times.floor = tracked.floor;
        }
        ctl.set_done(merged.len() as u64);
    }
    times.merge_s = t1.elapsed().as_secs_f64();
    // Freeing the pair index (a list per pair) and the words takes ~10 ms for 74 MB of
    // text, more for larger corpora: the caller need not wait for it.
    crate::threads::drop_in_background((words, tracked, tokens.by_bytes));
    Ok(Merges { symbols: tokens.bytes, pairs: merged, made })
}
