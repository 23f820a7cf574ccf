//! Stages 3 and 4: build words and pair counts, then merge.
//!
//! * Words are the unique pre-tokens as symbol sequences in one flat array; a merge
//!   rewrites a word in place (it only gets shorter), in one left-to-right pass.
//! * `pairs` maps each adjacent symbol pair to its weighted count and the list of
//!   words that contain it. Lists are append-only and may hold stale or repeated
//!   word ids (deduplicated lazily); every word that contains the pair is in it.
//! * A max-heap orders pairs by (count, bytes of left, bytes of right), so among
//!   equal counts the lexicographically greatest pair wins. Entries are invalidated
//!   lazily: a popped entry whose count is no longer current is re-pushed or dropped.
//! * Symbols are identified by their bytes: if a merge produces bytes that some
//!   earlier merge already produced, both merges yield the same symbol, as in a
//!   trainer that keeps pre-tokens as tuples of bytes.

use hashbrown::hash_map::Entry;
use hashbrown::HashMap;
use rustc_hash::FxBuildHasher;

use super::{Control, TrainError};

type FxMap<K, V> = HashMap<K, V, FxBuildHasher>;

#[inline]
fn pack(a: u32, b: u32) -> u64 {
    ((a as u64) << 32) | b as u64
}

#[inline]
fn unpack(p: u64) -> (u32, u32) {
    ((p >> 32) as u32, p as u32)
}

/// The unique pre-tokens of a corpus as symbol sequences, with their counts.
/// Pre-tokens of a single byte have no pair and are not stored.
#[derive(Default)]
pub struct Words {
    syms: Vec<u32>,
    start: Vec<usize>,
    len: Vec<u32>,
    count: Vec<i64>,
}

impl Words {
    pub fn with_capacity(words: usize, bytes: usize) -> Self {
        Words {
            syms: Vec::with_capacity(bytes),
            start: Vec::with_capacity(words),
            len: Vec::with_capacity(words),
            count: Vec::with_capacity(words),
        }
    }

    pub fn push(&mut self, bytes: &[u8], count: u64) {
        if bytes.len() < 2 || count == 0 {
            return;
        }
        self.start.push(self.syms.len());
        self.len.push(bytes.len() as u32);
        self.count.push(count as i64);
        self.syms.extend(bytes.iter().map(|&b| b as u32));
    }

    pub fn len(&self) -> usize {
        self.start.len()
    }

    pub fn is_empty(&self) -> bool {
        self.start.is_empty()
    }

    /// Symbols of word `w`.
    pub fn symbols(&self, w: usize) -> &[u32] {
        &self.syms[self.start[w]..self.start[w] + self.len[w] as usize]
    }
}

struct PairStats {
    count: i64,
    words: Vec<u32>,
}

/// A binary max-heap of (count, pair) whose order breaks count ties by the pairs' bytes.
struct PairHeap {
    v: Vec<(i64, u64)>,
}

impl PairHeap {
    #[inline]
    fn greater(tokens: &[Box<[u8]>], x: (i64, u64), y: (i64, u64)) -> bool {
        if x.0 != y.0 {
            return x.0 > y.0;
        }
        let (xa, xb) = unpack(x.1);
        let (ya, yb) = unpack(y.1);
        match tokens[xa as usize].cmp(&tokens[ya as usize]) {
            std::cmp::Ordering::Equal => tokens[xb as usize] > tokens[yb as usize],
            o => o == std::cmp::Ordering::Greater,
        }
    }

    fn heapify(&mut self, tokens: &[Box<[u8]>]) {
        for i in (0..self.v.len() / 2).rev() {
            self.sift_down(tokens, i);
        }
    }

    fn push(&mut self, tokens: &[Box<[u8]>], e: (i64, u64)) {
        self.v.push(e);
        let mut i = self.v.len() - 1;
        while i > 0 {
            let parent = (i - 1) / 2;
            if Self::greater(tokens, self.v[i], self.v[parent]) {
                self.v.swap(i, parent);
                i = parent;
            } else {
                break;
            }
        }
    }

    fn pop(&mut self, tokens: &[Box<[u8]>]) -> Option<(i64, u64)> {
        if self.v.is_empty() {
            return None;
        }
        let top = self.v.swap_remove(0);
        if !self.v.is_empty() {
            self.sift_down(tokens, 0);
        }
        Some(top)
    }

    fn sift_down(&mut self, tokens: &[Box<[u8]>], mut i: usize) {
        let n = self.v.len();
        loop {
            let l = 2 * i + 1;
            if l >= n {
                break;
            }
            let r = l + 1;
            let c = if r < n && Self::greater(tokens, self.v[r], self.v[l]) { r } else { l };
            if Self::greater(tokens, self.v[c], self.v[i]) {
                self.v.swap(c, i);
                i = c;
            } else {
                break;
            }
        }
    }
}

/// Per-merge accumulation of count changes and of words that gained a pair.
#[derive(Default)]
struct Delta {
    count: i64,
    words: Vec<u32>,
}

/// Timings of the merge stages, in seconds.
#[derive(Clone, Copy, Debug, Default)]
pub struct MergeTimes {
    pub build_s: f64,
    pub merge_s: f64,
}

/// Learn up to `num_merges` merges from `words`. Returns the merges as byte pairs, in order.
/// Stops early when no pair is left.
pub fn learn_merges(
    mut words: Words,
    num_merges: usize,
    ctl: &Control,
    times: &mut MergeTimes,
) -> Result<Vec<(Vec<u8>, Vec<u8>)>, TrainError> {
    let t0 = std::time::Instant::now();
    let mut merges = Vec::with_capacity(num_merges);
    if num_merges == 0 || words.is_empty() {
        return Ok(merges);
    }
    let mut tokens: Vec<Box<[u8]>> = (0..=255u8).map(|b| vec![b].into_boxed_slice()).collect();
    let mut sym_of: FxMap<Box<[u8]>, u32> = FxMap::default();

    // Pair counts and the pair -> words index.
    let mut pairs: FxMap<u64, PairStats> = FxMap::default();
    for w in 0..words.len() {
        let c = words.count[w];
        let s = words.symbols(w);
        for i in 0..s.len() - 1 {
            let e = pairs.entry(pack(s[i], s[i + 1])).or_insert_with(|| PairStats { count: 0, words: Vec::new() });
            e.count += c;
            if e.words.last() != Some(&(w as u32)) {
                e.words.push(w as u32);
            }
        }
    }
    let mut heap = PairHeap { v: pairs.iter().map(|(&k, p)| (p.count, k)).collect() };
    heap.heapify(&tokens);
    times.build_s = t0.elapsed().as_secs_f64();
    let t1 = std::time::Instant::now();

    let mut delta: FxMap<u64, Delta> = FxMap::default();
    while merges.len() < num_merges {
        if ctl.is_cancelled() {
            return Err(TrainError::Cancelled);
        }
        // The best pair: pop until an entry matches the pair's current count.
        let best = loop {
            let Some((cnt, key)) = heap.pop(&tokens) else { break None };
            match pairs.get(&key) {
                Some(p) if p.count == cnt => break Some(key),
                Some(p) if p.count < cnt => heap.push(&tokens, (p.count, key)),
                _ => {}
            }
        };
        let Some(best) = best else { break };
        let (a, b) = unpack(best);
        let stats = pairs.remove(&best).expect("popped pair is present");

        let mut joined = Vec::with_capacity(tokens[a as usize].len() + tokens[b as usize].len());
        joined.extend_from_slice(&tokens[a as usize]);
        joined.extend_from_slice(&tokens[b as usize]);
        merges.push((tokens[a as usize].to_vec(), tokens[b as usize].to_vec()));
        let x = match sym_of.get(joined.as_slice()) {
            Some(&x) => x,
            None => {
                let x = tokens.len() as u32;
                let boxed = joined.into_boxed_slice();
                sym_of.insert(boxed.clone(), x);
                tokens.push(boxed);
                x
            }
        };

        // Rewrite each affected word in one pass, recording count changes.
        let mut add = |key: u64, d: i64, w: Option<u32>| {
            if key == best {
                return;
            }
            let e = delta.entry(key).or_default();
            e.count += d;
            if let Some(w) = w {
                if e.words.last() != Some(&w) {
                    e.words.push(w);
                }
            }
        };
        let mut last_w = u32::MAX;
        for &w in &stats.words {
            if w == last_w {
                continue;
            }
            last_w = w;
            let wi = w as usize;
            let c = words.count[wi];
            let st = words.start[wi];
            let n = words.len[wi] as usize;
            let s = &mut words.syms[st..st + n];
            let mut i = 0;
            let mut j = 0;
            while i < n {
                if i + 1 < n && s[i] == a && s[i + 1] == b {
                    if j > 0 {
                        let l = s[j - 1];
                        add(pack(l, a), -c, None);
                        add(pack(l, x), c, Some(w));
                    }
                    if i + 2 < n {
                        let r = s[i + 2];
                        add(pack(b, r), -c, None);
                        add(pack(x, r), c, Some(w));
                    }
                    s[j] = x;
                    j += 1;
                    i += 2;
                } else {
                    s[j] = s[i];
                    j += 1;
                    i += 1;
                }
            }
            words.len[wi] = j as u32;
        }
        drop(stats);

        // Apply the changes; pairs whose count rose get a fresh heap entry.
        for (key, d) in delta.drain() {
            match pairs.entry(key) {
                Entry::Occupied(mut e) => {
                    let p = e.get_mut();
                    p.count += d.count;
                    debug_assert!(p.count >= 0);
                    if p.count <= 0 {
                        e.remove();
                    } else {
                        if p.words.is_empty() {
                            p.words = d.words;
                        } else {
                            p.words.extend_from_slice(&d.words);
                        }
                        if d.count > 0 {
                            heap.push(&tokens, (p.count, key));
                        }
                    }
                }
                Entry::Vacant(v) => {
                    debug_assert!(d.count >= 0);
                    if d.count > 0 {
                        v.insert(PairStats { count: d.count, words: d.words });
                        heap.push(&tokens, (d.count, key));
                    }
                }
            }
        }
        ctl.set_done(merges.len() as u64);
    }
    times.merge_s = t1.elapsed().as_secs_f64();
    Ok(merges)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn train(corpus: &[(&str, u64)], n: usize) -> Vec<(String, String)> {
        let mut words = Words::default();
        for (w, c) in corpus {
            words.push(w.as_bytes(), *c);
        }
        let ctl = Control::default();
        let mut t = MergeTimes::default();
        learn_merges(words, n, &ctl, &mut t)
            .unwrap()
            .into_iter()
            .map(|(a, b)| (String::from_utf8(a).unwrap(), String::from_utf8(b).unwrap()))
            .collect()
    }

    fn m(a: &str, b: &str) -> (String, String) {
        (a.to_string(), b.to_string())
    }

    #[test]
    fn ties_go_to_the_lexicographically_greatest_pair() {
        // "ab", "cd", "ba" all count 3: ("c","d") > ("b","a") > ("a","b").
        let got = train(&[("ab", 3), ("cd", 3), ("ba", 3)], 3);
        assert_eq!(got, vec![m("c", "d"), m("b", "a"), m("a", "b")]);
    }

    #[test]
    fn ties_compare_left_bytes_first_then_right() {
        // ("a","z") vs ("b","a"): left bytes decide; ("b","a") wins though "z" > "a".
        let got = train(&[("az", 2), ("ba", 2)], 1);
        assert_eq!(got, vec![m("b", "a")]);
        // Equal left bytes: the right bytes decide.
        let got = train(&[("ac", 2), ("ab", 2)], 1);
        assert_eq!(got, vec![m("a", "c")]);
        // A longer left token beats its own prefix: ("ab","x") > ("a","z").
        let got = train(&[("ab", 10), ("abx", 2), ("az", 2)], 3);
        assert_eq!(got, vec![m("a", "b"), m("ab", "x"), m("a", "z")]);
    }

    #[test]
    fn cs336_example() {
        // The worked example of the CS336 assignment (pre-tokens, whitespace split).
        let corpus = [("low", 5), ("lower", 2), ("widest", 3), ("newest", 6)];
        let got = train(&corpus, 6);
        let want = vec![m("s", "t"), m("e", "st"), m("o", "w"), m("l", "ow"), m("w", "est"), m("n", "e")];
        assert_eq!(got, want);
    }

    #[test]
    fn repeated_symbols_merge_left_to_right() {
        // "aaaa" -> "aa aa" -> "aaaa"; "aaa" -> "aa a".
        let got = train(&[("aaaa", 1), ("aaa", 1)], 3);
        assert_eq!(got[0], m("a", "a"));
        assert_eq!(got[1], m("aa", "aa"));
        // After the two merges: "aaaa" is one symbol, "aaa" is ("aa","a") count 1.
        assert_eq!(got[2], m("aa", "a"));
    }

    #[test]
    fn stops_when_no_pair_is_left() {
        let got = train(&[("ab", 1)], 10);
        assert_eq!(got, vec![m("a", "b")]);
    }

    #[test]
    fn same_bytes_from_two_merges_are_one_symbol() {
        // Brute-force check against a naive bytes-keyed trainer on small corpora.
        let corpora: Vec<Vec<(&str, u64)>> = vec![
            vec![("abc", 2), ("bcx", 3), ("abx", 2), ("xabc", 1), ("abcabc", 1)],
            vec![("abab", 3), ("baba", 2), ("aabb", 1), ("bbaa", 2), ("ab", 1)],
            vec![("hello", 4), ("yellow", 2), ("mellow", 3), ("low", 5), ("lowest", 1)],
        ];
        for corpus in corpora {
            let got = train(&corpus, 50);
            assert_eq!(got, naive(&corpus, 50));
        }
    }

    /// The obvious quadratic trainer: words as lists of byte strings.
    fn naive(corpus: &[(&str, u64)], n: usize) -> Vec<(String, String)> {
        let mut words: Vec<(Vec<String>, u64)> =
            corpus.iter().map(|(w, c)| (w.chars().map(|ch| ch.to_string()).collect(), *c)).collect();
        let mut out = vec![];
        for _ in 0..n {
            let mut counts: std::collections::BTreeMap<(String, String), u64> = Default::default();
            for (w, c) in &words {
                for p in w.windows(2) {
                    *counts.entry((p[0].clone(), p[1].clone())).or_default() += c;
                }
            }
            let Some(best) = counts.iter().max_by(|x, y| x.1.cmp(y.1).then(x.0.cmp(y.0))).map(|x| x.0.clone()) else {
                break;
            };
            for (w, _) in words.iter_mut() {
                let mut o = vec![];
                let mut i = 0;
                while i < w.len() {
                    if i + 1 < w.len() && w[i] == best.0 && w[i + 1] == best.1 {
                        o.push(format!("{}{}", best.0, best.1));
                        i += 2;
                    } else {
                        o.push(w[i].clone());
                        i += 1;
                    }
                }
                *w = o;
            }
            out.push(best);
        }
        out
    }
}
