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

use hashbrown::hash_map::Entry;
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
#[cfg(target_arch = "x86_64")]
mod vector;
mod words;

use deltas::Deltas;
use heap::PairHeap;
use pairs::{PairStats, Pairs, WordList};
use rewrite::{rewrite_share, SharedWords};
pub use symbols::Merges;
use symbols::Tokens;
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

/// Count all pairs of `words` afresh and track those of count `floor` or more, where
/// `floor` is `want`, lowered to the greatest count if need be (so that the best pair is
/// always tracked and the merge loop makes progress). Returns the floor used.
fn recount(words: &Words, ids: &[u32], tokens: &Tokens, want: i64, bytes_only: bool) -> (Pairs, PairHeap, i64) {
    let mut pairs = Pairs::build(words, ids, rayon::current_num_threads(), bytes_only);
    let max = pairs.shards.iter().flat_map(|m| m.values().map(|p| p.count)).max().unwrap_or(0);
    let floor = want.min(max).max(1);
    prune(&mut pairs, floor);
    let heap = rebuild_heap(&pairs, tokens);
    (pairs, heap, floor)
}

/// After a merge into `x` whose bytes an earlier merge already made: pairs with `x` may
/// have had untracked occurrences before this merge, which its deltas do not show. Count
/// every pair with `x` exactly from the words and track those of count `floor` or more
/// (replacing what is tracked of them). Pairs without `x` only lost occurrences.
fn rescan_symbol(
    words: &Words,
    ids: &[u32],
    x: u32,
    floor: i64,
    pairs: &mut Pairs,
    heap: &mut PairHeap,
    tokens: &Tokens,
) {
    let mut found: FxMap<u64, PairStats> = FxMap::default();
    for &w in ids {
        let s = words.symbols(w);
        if !s.contains(&x) {
            continue;
        }
        let c = words.count(w);
        for i in 0..s.len() - 1 {
            if s[i] == x || s[i + 1] == x {
                let e =
                    found.entry(pack(s[i], s[i + 1])).or_insert_with(|| PairStats { count: 0, words: WordList::new() });
                e.count += c;
                if e.words.last() != Some(&w) {
                    e.words.push(w);
                }
            }
        }
    }
    for (key, st) in found {
        if st.count >= floor {
            heap.push(tokens, (st.count, key));
            pairs.shard(key).insert(key, st);
        } else {
            pairs.shard(key).remove(&key);
        }
    }
}

/// Forget the pairs whose count is below `floor`.
fn prune(pairs: &mut Pairs, floor: i64) {
    if floor > 1 {
        for m in pairs.shards.iter_mut() {
            m.retain(|_, p| p.count >= floor);
        }
    }
}

fn rebuild_heap(pairs: &Pairs, tokens: &Tokens) -> PairHeap {
    let mut heap = PairHeap { v: pairs.shards.iter().flat_map(|m| m.iter().map(|(&k, p)| (p.count, k))).collect() };
    heap.heapify(tokens);
    heap
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

    // Pair counts and the pair -> words index.
    let ids = words.take_ids();
    // Pairs of a smaller count are not tracked (see "Pruning" above).
    let (mut pairs, mut heap, mut floor) = recount(&words, &ids, &tokens, 1, true);
    times.floor = floor;
    let mut history: Vec<i64> = Vec::with_capacity(num_merges);
    times.build_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();

    let workers = rayon::current_num_threads().max(1);
    let mut deltas: Vec<Deltas> = (0..workers).map(|_| Deltas::default()).collect();
    // Word-id ranges of the workers: equal shares of the words array.
    let total = words.data.len() as u64;
    let bounds: Vec<u32> = (0..=workers).map(|t| (total * t as u64 / workers as u64) as u32).collect();
    while merged.len() < num_merges {
        if ctl.is_cancelled() {
            return Err(TrainError::Cancelled);
        }
        // The best pair: the top entry once it matches the pair's current count. A top
        // entry whose pair has fewer occurrences now takes that count and sinks; one whose
        // pair is gone (or has a newer entry with a higher count) is dropped.
        let best = loop {
            match heap.peek() {
                Some((cnt, key)) => match pairs.get(key) {
                    Some(p) if p.count == cnt => {
                        debug_assert!(cnt >= floor);
                        heap.pop(&tokens);
                        break Some(key);
                    }
                    Some(p) if p.count < cnt => heap.lower_top(&tokens, p.count),
                    _ => {
                        heap.pop(&tokens);
                    }
                },
                None if floor > 1 => {
                    // No tracked pair is left, but untracked ones may be: recount them all
                    // under a lower floor (the last stretch of merges under none).
                    let want = if num_merges - merged.len() < pruning.after {
                        1
                    } else {
                        (*history.last().unwrap_or(&0) as f64 / (2.0 * pruning.margin)) as i64
                    };
                    (pairs, heap, floor) = recount(&words, &ids, &tokens, want, false);
                    times.recounts += 1;
                }
                None => break None,
            }
        };
        let Some(best) = best else { break };
        let (a, b) = unpack(best);
        let stats = pairs.shard(best).remove(&best).expect("popped pair is present");
        history.push(stats.count);

        merged.push((a, b));
        let (x, known_bytes) = tokens.join(a, b);
        made.push(x);

        // Rewrite each affected word in one pass, recording count changes.
        for d in deltas.iter_mut() {
            d.begin(a, b, x, tokens.bytes.len());
        }
        let shared = SharedWords { ptr: words.data.as_mut_ptr(), len: words.data.len() };
        let list = &stats.words;
        if workers > 1 && list.len() >= parallel_list {
            let bounds = &bounds;
            rayon::scope(|scope| {
                for (t, d) in deltas.iter_mut().enumerate() {
                    scope.spawn(move |_| {
                        // SAFETY: the word-id ranges of the workers are disjoint, and a
                        // worker's first record starts after the last record of the one
                        // before ends.
                        unsafe { rewrite_share(shared, list, bounds[t], bounds[t + 1], a, b, x, d) };
                    });
                }
            });
            let (first, rest) = deltas.split_at_mut(1);
            for d in rest {
                first[0].absorb(d);
            }
        } else {
            // SAFETY: this thread alone touches the words.
            unsafe { rewrite_share(shared, list, 0, NONE, a, b, x, &mut deltas[0]) };
        }
        drop(stats);

        // Apply the changes; pairs whose count rose get a fresh heap entry.
        let d0 = &mut deltas[0];
        for &(key, ref d) in d0.entries.iter() {
            let (ka, kb) = unpack(key);
            if !known_bytes && (ka == x || kb == x) {
                // A pair of a new symbol is new: no lookup needed, and below the floor it
                // is not tracked at all.
                debug_assert!(pairs.get(key).is_none());
                if d.count >= floor.max(1) {
                    let mut list = WordList::with_capacity(d.n as usize);
                    list.extend(d0.words(d.head));
                    pairs.shard(key).insert(key, PairStats { count: d.count, words: list });
                    heap.push(&tokens, (d.count, key));
                }
                continue;
            }
            match pairs.shard(key).entry(key) {
                Entry::Occupied(mut e) => {
                    let p = e.get_mut();
                    p.count += d.count;
                    debug_assert!(p.count >= 0);
                    if p.count <= 0 || (p.count < floor && d.count <= 0) {
                        e.remove();
                    } else {
                        p.words.reserve(d.n as usize);
                        p.words.extend(d0.words(d.head));
                        if d.count > 0 {
                            heap.push(&tokens, (p.count, key));
                        }
                    }
                }
                Entry::Vacant(v) => {
                    debug_assert!(d.count >= 0 || floor > 1);
                    if d.count >= floor.max(1) {
                        let mut list = WordList::with_capacity(d.n as usize);
                        list.extend(d0.words(d.head));
                        v.insert(PairStats { count: d.count, words: list });
                        heap.push(&tokens, (d.count, key));
                    }
                }
            }
        }
        d0.clear();
        if (known_bytes || pruning.rescan_all) && floor > 1 {
            // An untracked pair with `x` may have gained occurrences: count them exactly.
            rescan_symbol(&words, &ids, x, floor, &mut pairs, &mut heap, &tokens);
            times.rescans += 1;
        }
        if merged.len() == pruning.after && num_merges >= 4 * pruning.after {
            floor = ((predict_last_count(&history, num_merges) / pruning.margin) as i64).max(1);
            prune(&mut pairs, floor);
            heap = rebuild_heap(&pairs, &tokens);
            times.floor = floor;
        }
        ctl.set_done(merged.len() as u64);
    }
    times.merge_s = t1.elapsed().as_secs_f64();
    // Freeing the pair index (a list per pair) and the words takes ~10 ms for 74 MB of
    // text, more for larger corpora: the caller need not wait for it.
    crate::threads::drop_in_background((words, pairs, heap, tokens.by_bytes));
    Ok(Merges { symbols: tokens.bytes, pairs: merged, made })
}
