//! Merging inside one piece: lowest priority first, leftmost first among equals.
//!
//! Short pieces: a linear scan over a small array (quadratic, but tiny and cache
//! friendly). Long pieces: a min-heap of (priority, position) over a doubly linked
//! list, with stale entries skipped on pop, so the cost is O(n log n).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{Encoder, NO_MERGE};

/// Pieces up to this many bytes use the linear scan.
const SMALL: usize = 48;
/// Pieces up to this many bytes (most of them) use arrays of this size: less to set up.
const SHORT: usize = 16;

pub(super) fn bpe(enc: &Encoder, piece: &[u8], out: &mut Vec<u32>) {
    match piece.len() {
        0 => {}
        1 => out.push(enc.byte_ids[piece[0] as usize]),
        n if n <= SHORT => bpe_small::<SHORT>(enc, piece, out),
        n if n <= SMALL => bpe_small::<SMALL>(enc, piece, out),
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
