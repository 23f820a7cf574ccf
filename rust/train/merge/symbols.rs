//! The symbols of a training run (`Tokens`: their bytes, found by their bytes) and the
//! merges it learned (`Merges`).

use rustc_hash::FxBuildHasher;

/// The bytes of symbols `0..len()`, back to back in one array.
#[derive(Debug, Default)]
pub(super) struct SymbolBytes {
    pub(super) arena: Vec<u8>,
    /// Where each symbol's bytes end in `arena` (they start where the previous ends).
    pub(super) ends: Vec<usize>,
}

impl SymbolBytes {
    pub(super) fn len(&self) -> usize {
        self.ends.len()
    }

    #[inline]
    pub(super) fn range(&self, t: u32) -> std::ops::Range<usize> {
        let t = t as usize;
        (if t == 0 { 0 } else { self.ends[t - 1] })..self.ends[t]
    }

    #[inline]
    pub(super) fn get(&self, t: u32) -> &[u8] {
        &self.arena[self.range(t)]
    }

    /// The bytes after the last symbol's in `arena`, not yet a symbol.
    pub(super) fn pending(&self) -> &[u8] {
        &self.arena[self.ends.last().copied().unwrap_or(0)..]
    }
}

/// Learned merges, in order: each as the two symbols it joins and the symbol it makes,
/// with the bytes of every symbol. Symbols 0-255 are the bytes; a merge whose bytes no
/// earlier merge made adds the next symbol (one that did makes the same symbol again).
#[derive(Debug)]
pub struct Merges {
    pub(super) symbols: SymbolBytes,
    pub(super) pairs: Vec<(u32, u32)>,
    pub(super) made: Vec<u32>,
}

impl Merges {
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// The number of symbols (256 bytes and the distinct merge results).
    pub fn num_symbols(&self) -> usize {
        self.symbols.len()
    }

    /// The bytes of symbol `s` (< `num_symbols()`).
    pub fn symbol_bytes(&self, s: u32) -> &[u8] {
        self.symbols.get(s)
    }

    /// Merge `i`: the symbols it joins and the symbol it makes.
    pub fn merge(&self, i: usize) -> ((u32, u32), u32) {
        (self.pairs[i], self.made[i])
    }

    /// The merges as byte strings.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> + '_ {
        self.pairs.iter().map(|&(a, b)| (self.symbol_bytes(a), self.symbol_bytes(b)))
    }

    /// The merges as owned byte strings.
    pub fn to_vecs(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.iter().map(|(a, b)| (a.to_vec(), b.to_vec())).collect()
    }
}

/// The symbols of a training run: their bytes, an 8-byte big-endian prefix of each for
/// fast comparison, and an index of the symbols by their bytes. A merge adds at most
/// one symbol and allocates nothing (amortized).
pub(super) struct Tokens {
    pub(super) bytes: SymbolBytes,
    pub(super) prefix: Vec<u64>,
    /// Symbol ids, found by their bytes.
    pub(super) by_bytes: hashbrown::HashTable<u32>,
}

pub(super) fn bytes_hash(b: &[u8]) -> u64 {
    use std::hash::BuildHasher;
    FxBuildHasher.hash_one(b)
}

impl Tokens {
    pub(super) fn new() -> Self {
        let mut t = Tokens { bytes: SymbolBytes::default(), prefix: Vec::new(), by_bytes: hashbrown::HashTable::new() };
        for b in 0..=255u8 {
            t.bytes.arena.push(b);
            t.add_pending();
        }
        t
    }

    /// Make the pending bytes (see `SymbolBytes::pending`) a new symbol.
    pub(super) fn add_pending(&mut self) -> u32 {
        let new = self.bytes.pending();
        let mut p = [0u8; 8];
        let n = new.len().min(8);
        p[..n].copy_from_slice(&new[..n]);
        self.prefix.push(u64::from_be_bytes(p));
        let h = bytes_hash(new);
        let id = self.bytes.len() as u32;
        self.bytes.ends.push(self.bytes.arena.len());
        let bytes = &self.bytes;
        self.by_bytes.insert_unique(h, id, |&t| bytes_hash(bytes.get(t)));
        id
    }

    /// The symbol whose bytes are those of `a` then those of `b`, made if there is none
    /// yet, and whether it was there before.
    pub(super) fn join(&mut self, a: u32, b: u32) -> (u32, bool) {
        let start = self.bytes.arena.len();
        for t in [a, b] {
            let r = self.bytes.range(t);
            self.bytes.arena.extend_from_within(r);
        }
        let bytes = &self.bytes;
        let joined = bytes.pending();
        if let Some(&x) = self.by_bytes.find(bytes_hash(joined), |&t| bytes.get(t) == joined) {
            self.bytes.arena.truncate(start);
            return (x, true);
        }
        (self.add_pending(), false)
    }

    #[inline]
    pub(super) fn get(&self, t: u32) -> &[u8] {
        self.bytes.get(t)
    }

    /// Compare two symbols by their bytes. Differing prefixes order the byte strings the
    /// same way (zero padding only ties a string with its extension by zero bytes).
    #[inline]
    pub(super) fn cmp(&self, x: u32, y: u32) -> std::cmp::Ordering {
        if x == y {
            return std::cmp::Ordering::Equal;
        }
        match self.prefix[x as usize].cmp(&self.prefix[y as usize]) {
            std::cmp::Ordering::Equal => self.get(x).cmp(self.get(y)),
            o => o,
        }
    }
}
