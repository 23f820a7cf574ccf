//! Merging inside one piece: lowest priority first, leftmost first among equals.
//!
//! Short pieces: a linear scan over a small array (quadratic, but tiny and cache
//! friendly). Long pieces: a min-heap of (priority, position) over a doubly linked
//! list, with stale entries skipped on pop, so the cost is O(n log n). Huge pieces (at
//! least as many bytes as there are merges), when every merge ranks after the merges
//! that make its two sides: a bucket per rank, emptied in rank order, so the cost is
//! O(n + merges) (see `bpe_huge`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{Encoder, NO_MERGE};

/// Pieces up to this many bytes use the linear scan.
const SMALL: usize = 48;
/// Pieces up to this many bytes (most of them) use arrays of this size: less to set up.
const SHORT: usize = 16;
/// Pieces of at least this many bytes (and as many as there are merges) may use the
/// buckets: below it the heap's log factor costs less than setting up a bucket per rank.
const HUGE: usize = 4096;

pub(super) fn bpe(enc: &Encoder, piece: &[u8], out: &mut Vec<u32>) {
    match piece.len() {
        0 => {}
        1 => out.push(enc.byte_ids[piece[0] as usize]),
        n if n <= SHORT => bpe_small::<SHORT>(enc, piece, out),
        n if n <= SMALL => bpe_small::<SMALL>(enc, piece, out),
        n if enc.merges_rise && n >= HUGE.max(enc.merge_ids.len()) => bpe_huge(enc, piece, out),
        _ => bpe_large(enc, piece, out),
    }
}

/// The linear scan, for pieces of 2 to N bytes.
fn bpe_small<const N: usize>(enc: &Encoder, piece: &[u8], out: &mut Vec<u32>) {
    let mut ids = [0u32; N];
    // pv[i]: (priority << 32 | merged id) of merging ids[i] and ids[i + 1].
    let mut pv = [NO_MERGE; N];
    let mut n = piece.len();
    for (i, &b) in piece.iter().enumerate() {
        ids[i] = enc.byte_ids[b as usize];
    }
    for (v, w) in pv.iter_mut().zip(piece.windows(2)) {
        *v = enc.pairs.get_bytes(w[0], w[1]);
    }
    while n > 1 {
        let mut best = NO_MERGE;
        let mut at = 0;
        for (i, &v) in pv[..n - 1].iter().enumerate() {
            if v < best {
                best = v;
                at = i;
            }
        }
        if best == NO_MERGE {
            break;
        }
        ids[at] = best as u32;
        // Close the gap by hand: pieces are short, and a memmove call costs more than
        // the few elements it would move.
        for k in at + 1..n - 1 {
            ids[k] = ids[k + 1];
            pv[k - 1] = pv[k];
        }
        n -= 1;
        if at > 0 {
            pv[at - 1] = enc.pair(ids[at - 1], ids[at]);
        }
        if at + 1 < n {
            pv[at] = enc.pair(ids[at], ids[at + 1]);
        }
    }
    out.extend_from_slice(&ids[..n]);
}

const NONE: u32 = u32::MAX;
const DEAD: u32 = u32::MAX;

fn bpe_large(enc: &Encoder, piece: &[u8], out: &mut Vec<u32>) {
    let n = piece.len();
    assert!(n < u32::MAX as usize, "a piece of 4 GiB or more");
    let mut ids: Vec<u32> = piece.iter().map(|&b| enc.byte_ids[b as usize]).collect();
    let mut next: Vec<u32> = (1..=n as u32).map(|i| if i as usize == n { NONE } else { i }).collect();
    let mut prev: Vec<u32> = (0..n as u32).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
    let key = |v: u64, pos: u32| Reverse((v & !0xFFFF_FFFF) | pos as u64);
    let mut heap: BinaryHeap<Reverse<u64>> = BinaryHeap::with_capacity(n);
    for (i, w) in piece.windows(2).enumerate() {
        let v = enc.pairs.get_bytes(w[0], w[1]);
        if v != NO_MERGE {
            heap.push(key(v, i as u32));
        }
    }
    while let Some(Reverse(k)) = heap.pop() {
        let prio = k >> 32;
        let pos = (k & 0xFFFF_FFFF) as usize;
        if ids[pos] == DEAD {
            continue;
        }
        let nx = next[pos];
        if nx == NONE {
            continue;
        }
        let v = enc.pair(ids[pos], ids[nx as usize]);
        if v == NO_MERGE || v >> 32 != prio {
            continue; // stale
        }
        ids[pos] = v as u32;
        ids[nx as usize] = DEAD;
        let nn = next[nx as usize];
        next[pos] = nn;
        if nn != NONE {
            prev[nn as usize] = pos as u32;
            let w = enc.pair(ids[pos], ids[nn as usize]);
            if w != NO_MERGE {
                heap.push(key(w, pos as u32));
            }
        }
        let pp = prev[pos];
        if pp != NONE {
            let w = enc.pair(ids[pp as usize], ids[pos]);
            if w != NO_MERGE {
                heap.push(key(w, pp));
            }
        }
    }
    let mut i = 0u32;
    while i != NONE {
        out.push(ids[i as usize]);
        i = next[i as usize];
    }
}

/// Whether every merge ranks after every merge that produces its left or right side:
/// then a merge only makes pairs of a later rank, which `bpe_huge` relies on. True for
/// any merge list learned by BPE training (a merge joins tokens made before it).
/// `merges`: (left, right, merged) of each rank in effect, in rank order; `size`: one
/// more than the largest id.
pub(super) fn merges_rise(merges: &[(u32, u32, u32, u32)], size: usize) -> bool {
    // The last rank that produces each id (none: bytes and tokens no merge makes).
    let mut made_at = vec![None::<u32>; size];
    for &(rank, _, _, merged) in merges {
        made_at[merged as usize] = Some(rank);
    }
    merges.iter().all(|&(rank, left, right, _)| {
        made_at[left as usize].is_none_or(|r| r < rank) && made_at[right as usize].is_none_or(|r| r < rank)
    })
}

/// The merges of a huge piece in O(n + merges), given `merges_rise`: each rank has a
/// bucket (a circular doubly linked list) holding the positions whose pair with their
/// right neighbour merges at that rank, and ranks are emptied in order. A merge makes
/// pairs of later ranks only, so when a rank's turn comes its bucket holds every pair
/// it will ever merge, exactly as the heap would pop them. Their order within the
/// rank does not matter, except in runs of a pair (X, X), which merge from the run's
/// left end as the heap's leftmost-first order does (`merge_run`).
fn bpe_huge(enc: &Encoder, piece: &[u8], out: &mut Vec<u32>) {
    let mut b = Buckets::new(enc, piece);
    for rank in 0..enc.merge_ids.len() as u32 {
        if rank.is_multiple_of(1024) {
            super::cancel::check();
        }
        let head = b.head(rank);
        while b.next_in[head] != head as u32 {
            let p = b.next_in[head];
            b.merge_run(enc, p);
        }
    }
    let mut i = 0u32;
    while i != NONE {
        out.push(b.ids[i as usize]);
        i = b.next[i as usize];
    }
}

/// The state of `bpe_huge`. Positions are the piece's byte offsets; bucket links
/// (`next_in`, `prev_in`) also index one head node per rank, after the positions.
struct Buckets {
    ids: Vec<u32>,
    /// Neighbours in the piece (NONE at the ends).
    next: Vec<u32>,
    prev: Vec<u32>,
    /// Neighbours in a bucket; NONE when the position is in none.
    next_in: Vec<u32>,
    prev_in: Vec<u32>,
    n: usize,
}

impl Buckets {
    fn new(enc: &Encoder, piece: &[u8]) -> Buckets {
        let n = piece.len();
        let heads = enc.merge_ids.len();
        assert!(n + heads < NONE as usize, "a piece of 4 GiB or more");
        let mut next_in = vec![NONE; n + heads];
        let mut prev_in = vec![NONE; n + heads];
        for h in n..n + heads {
            (next_in[h], prev_in[h]) = (h as u32, h as u32);
        }
        let mut b = Buckets {
            ids: piece.iter().map(|&x| enc.byte_ids[x as usize]).collect(),
            next: (1..=n as u32).map(|i| if i as usize == n { NONE } else { i }).collect(),
            prev: (0..n as u32).map(|i| i.checked_sub(1).unwrap_or(NONE)).collect(),
            next_in,
            prev_in,
            n,
        };
        // Each bucket is filled back to front, so that it lists its positions in order.
        for (i, w) in piece.windows(2).enumerate().rev() {
            b.link(i as u32, enc.pairs.get_bytes(w[0], w[1]));
        }
        b
    }

    fn head(&self, rank: u32) -> usize {
        self.n + rank as usize
    }

    /// Put position `p` first in the bucket of `val` (a pair's value; none for NO_MERGE).
    fn link(&mut self, p: u32, val: u64) {
        if val == NO_MERGE {
            return;
        }
        let h = self.head((val >> 32) as u32);
        let first = self.next_in[h];
        (self.next_in[p as usize], self.prev_in[p as usize]) = (first, h as u32);
        self.prev_in[first as usize] = p;
        self.next_in[h] = p;
    }

    /// Take position `p` out of its bucket, if it is in one.
    fn unlink(&mut self, p: u32) {
        let (nx, pv) = (self.next_in[p as usize], self.prev_in[p as usize]);
        if nx == NONE {
            return;
        }
        self.next_in[pv as usize] = nx;
        self.prev_in[nx as usize] = pv;
        self.next_in[p as usize] = NONE;
    }

    /// Merge the pair at `p` (in a bucket, so it has a right neighbour), and, when both
    /// its sides are the same token, the whole run of that token it is in, pairwise from
    /// the run's left end.
    fn merge_run(&mut self, enc: &Encoder, p: u32) {
        let x = self.ids[p as usize];
        if self.ids[self.next[p as usize] as usize] != x {
            self.merge_at(enc, p);
            return;
        }
        let mut q = p;
        loop {
            let l = self.prev[q as usize];
            if l == NONE || self.ids[l as usize] != x {
                break;
            }
            q = l;
        }
        // Every position from q to p is in the run and merges in this loop.
        loop {
            let r = self.next[q as usize];
            if r == NONE || self.ids[q as usize] != x || self.ids[r as usize] != x {
                return;
            }
            self.merge_at(enc, q);
            q = self.next[q as usize];
            if q == NONE {
                return;
            }
        }
    }

    /// Merge the pair at `p` with its right neighbour, and file the new pairs on both
    /// sides of the merged token.
    fn merge_at(&mut self, enc: &Encoder, p: u32) {
        let pi = p as usize;
        let r = self.next[pi];
        let v = enc.pair(self.ids[pi], self.ids[r as usize]);
        debug_assert!(v != NO_MERGE);
        self.unlink(p);
        self.unlink(r);
        self.ids[pi] = v as u32;
        let rr = self.next[r as usize];
        self.next[pi] = rr;
        if rr != NONE {
            self.prev[rr as usize] = p;
            self.link(p, enc.pair(self.ids[pi], self.ids[rr as usize]));
        }
        let l = self.prev[pi];
        if l != NONE {
            self.unlink(l);
            self.link(l, enc.pair(self.ids[l as usize], self.ids[pi]));
        }
    }
}

#[cfg(test)]
pub(super) fn bpe_huge_for_test(enc: &Encoder, piece: &[u8]) -> Vec<u32> {
    let mut out = Vec::new();
    if piece.len() > 1 {
        assert!(enc.merges_rise);
        bpe_huge(enc, piece, &mut out);
    } else {
        bpe(enc, piece, &mut out);
    }
    out
}

#[cfg(test)]
pub(super) fn bpe_small_for_test(enc: &Encoder, piece: &[u8]) -> Vec<u32> {
    let mut out = Vec::new();
    if piece.len() <= SMALL && piece.len() > 1 {
        bpe_small::<SMALL>(enc, piece, &mut out);
    } else {
        bpe(enc, piece, &mut out);
    }
    out
}

#[cfg(test)]
pub(super) fn bpe_large_for_test(enc: &Encoder, piece: &[u8]) -> Vec<u32> {
    let mut out = Vec::new();
    if piece.len() > 1 {
        bpe_large(enc, piece, &mut out);
    } else {
        bpe(enc, piece, &mut out);
    }
    out
}
