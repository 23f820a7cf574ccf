//! The max-heap that picks the next merge: by count, ties broken by the pairs' bytes.

use super::symbols::Tokens;
use super::unpack;

/// A binary max-heap of (count, pair) whose order breaks count ties by the pairs' bytes.
pub(super) struct PairHeap {
    pub(super) v: Vec<(i64, u64)>,
}

impl PairHeap {
    #[inline]
    pub(super) fn greater(tokens: &Tokens, x: (i64, u64), y: (i64, u64)) -> bool {
        if x.0 != y.0 {
            return x.0 > y.0;
        }
        let (xa, xb) = unpack(x.1);
        let (ya, yb) = unpack(y.1);
        tokens.cmp(xa, ya).then_with(|| tokens.cmp(xb, yb)) == std::cmp::Ordering::Greater
    }

    pub(super) fn heapify(&mut self, tokens: &Tokens) {
        for i in (0..self.v.len() / 2).rev() {
            self.sift_down(tokens, i);
        }
    }

    pub(super) fn push(&mut self, tokens: &Tokens, e: (i64, u64)) {
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

    /// The greatest entry, left in place.
    pub(super) fn peek(&self) -> Option<(i64, u64)> {
        self.v.first().copied()
    }

    /// Lower the count of the greatest entry to `count` (one sift, where a pop and a
    /// push would take two).
    pub(super) fn lower_top(&mut self, tokens: &Tokens, count: i64) {
        debug_assert!(count <= self.v[0].0);
        self.v[0].0 = count;
        self.sift_down(tokens, 0);
    }

    pub(super) fn pop(&mut self, tokens: &Tokens) -> Option<(i64, u64)> {
        if self.v.is_empty() {
            return None;
        }
        let top = self.v.swap_remove(0);
        if !self.v.is_empty() {
            self.sift_down(tokens, 0);
        }
        Some(top)
    }

    pub(super) fn sift_down(&mut self, tokens: &Tokens, mut i: usize) {
        let n = self.v.len();
        loop {
            let l = 2 * i + 1;
            if l >= n {
                break;
            }
            let r = l + 1;
            // The greater child, without a branch on which it is unless counts tie (a
            // coin flip the CPU would mispredict half the time).
            let c = if r < n {
                let (vr, vl) = (self.v[r], self.v[l]);
                let right = if vr.0 == vl.0 { Self::greater(tokens, vr, vl) } else { vr.0 > vl.0 };
                l + right as usize
            } else {
                l
            };
            if Self::greater(tokens, self.v[c], self.v[i]) {
                self.v.swap(c, i);
                i = c;
            } else {
                break;
            }
        }
    }
}
