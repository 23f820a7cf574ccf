//! Lookup tables on the hot path: the vocab ("bytes -> id" for every token BPE can
//! produce) and the per-thread piece cache ("bytes -> ids" for pieces that needed merges).

use std::cell::RefCell;

use rustc_hash::FxHashMap;

/// Pieces longer than this are not cached (they rarely repeat).
pub(crate) const MAX_CACHED_PIECE: usize = 128;
/// The cache is emptied when it holds this many pieces ...
const MAX_CACHED_PIECES: usize = 1 << 18;
/// ... or this many ids.
const MAX_CACHED_IDS: usize = 1 << 21;

/// Bytes -> id.
#[derive(Default)]
pub(crate) struct BytesMap {
    map: FxHashMap<Box<[u8]>, u32>,
}

impl BytesMap {
    pub(crate) fn insert(&mut self, key: &[u8], id: u32) {
        self.map.insert(key.into(), id);
    }

    #[inline(always)]
    pub(crate) fn get(&self, key: &[u8]) -> Option<u32> {
        self.map.get(key).copied()
    }
}

/// Piece bytes -> ids, for pieces that are not a single token.
pub(crate) struct PieceCache {
    owner: u64,
    map: FxHashMap<Box<[u8]>, (u32, u32)>,
    ids: Vec<u32>,
}

impl PieceCache {
    fn new(owner: u64) -> Self {
        PieceCache { owner, map: FxHashMap::default(), ids: Vec::new() }
    }

    fn reset(&mut self, owner: u64) {
        self.owner = owner;
        self.map.clear();
        self.ids.clear();
    }

    #[inline(always)]
    pub(crate) fn get(&self, piece: &[u8]) -> Option<&[u32]> {
        self.map.get(piece).map(|&(s, l)| &self.ids[s as usize..(s + l) as usize])
    }

    pub(crate) fn insert(&mut self, piece: &[u8], ids: &[u32]) {
        if self.map.len() >= MAX_CACHED_PIECES || self.ids.len() + ids.len() > MAX_CACHED_IDS {
            self.map.clear();
            self.ids.clear();
        }
        let s = self.ids.len() as u32;
        self.ids.extend_from_slice(ids);
        self.map.insert(piece.into(), (s, ids.len() as u32));
    }
}

thread_local! {
    static CACHE: RefCell<PieceCache> = RefCell::new(PieceCache::new(0));
}

/// Run `f` with this thread's piece cache for encoder `owner` (emptied when it last
/// served another encoder). Re-entrant calls get a fresh temporary cache.
pub(crate) fn with_cache<R>(owner: u64, f: impl FnOnce(&mut PieceCache) -> R) -> R {
    let mut f = Some(f);
    let done = CACHE.try_with(|cell| match cell.try_borrow_mut() {
        Ok(mut cache) => {
            if cache.owner != owner {
                cache.reset(owner);
            }
            Some((f.take().unwrap())(&mut cache))
        }
        Err(_) => None,
    });
    match done {
        Ok(Some(r)) => r,
        _ => (f.take().unwrap())(&mut PieceCache::new(owner)),
    }
}
