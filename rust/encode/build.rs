//! The stages of `Encoder::new`: check the ids, build the decode table, index the tokens
//! by their bytes, place the special tokens, then the byte, merge and piece tables.

use rustc_hash::{FxHashMap, FxHashSet};

use super::{cache, pairs, show, EncodeError, MAX_SPARSE_SLACK};

/// Bytes of id `i` are `arena[start[i]..start[i] + len[i]]`; `len[i] == u32::MAX` for
/// ids absent from a sparse vocab.
pub(super) struct DecodeTable {
    pub(super) arena: Vec<u8>,
    pub(super) start: Vec<u64>,
    pub(super) len: Vec<u32>,
}

/// The merge table and what the encoder keeps of the merges.
pub(super) struct MergeTable {
    /// (left << 32 | right) -> (rank << 32 | merged id).
    pub(super) pairs: pairs::PairTable,
    /// The merges as given, (left id, right id) in rank order (duplicates kept).
    pub(super) merge_ids: Vec<(u32, u32)>,
    /// (rank, left, right, merged) of the merges in effect (the first of repeats).
    pub(super) in_effect: Vec<(u32, u32, u32, u32)>,
}

/// 1. The size of the decode table (one more than the largest id), once the ids are
///    known to fit in 32 bits with `extra` more appended and not to be too sparse.
pub(super) fn table_size(vocab: &[(u64, Vec<u8>)], extra: usize) -> Result<usize, EncodeError> {
    if vocab.is_empty() {
        return Err(EncodeError::Vocab("the vocabulary is empty".into()));
    }
    let mut max_id = 0u64;
    for (id, _) in vocab {
        if *id > u32::MAX as u64 - 1 {
            return Err(EncodeError::Vocab(format!("id {id} does not fit in 32 bits (ids must be < 2^32 - 1)")));
        }
        max_id = max_id.max(*id);
    }
    if max_id + extra as u64 >= u32::MAX as u64 {
        return Err(EncodeError::Vocab("more than 2^32 - 1 ids".into()));
    }
    if max_id + 1 > (vocab.len() as u64).saturating_mul(4) + MAX_SPARSE_SLACK {
        return Err(EncodeError::Vocab(format!(
            "ids are too sparse: {} tokens but the largest id is {max_id}",
            vocab.len()
        )));
    }
    Ok((max_id + 1) as usize)
}

/// 2. The dense decode table of `size` ids; each id once, with non-empty bytes.
pub(super) fn decode_table(vocab: &[(u64, Vec<u8>)], size: usize) -> Result<DecodeTable, EncodeError> {
    let mut start = vec![0u64; size];
    let mut len = vec![u32::MAX; size];
    let mut arena = Vec::with_capacity(vocab.iter().map(|(_, b)| b.len()).sum());
    for (id, bytes) in vocab {
        let i = *id as usize;
        if len[i] != u32::MAX {
            return Err(EncodeError::Vocab(format!("id {id} appears twice")));
        }
        if bytes.is_empty() {
            return Err(EncodeError::Vocab(format!("id {id} has empty bytes")));
        }
        if bytes.len() >= u32::MAX as usize {
            return Err(EncodeError::Vocab(format!("id {id} is too long")));
        }
        start[i] = arena.len() as u64;
        len[i] = bytes.len() as u32;
        arena.extend_from_slice(bytes);
    }
    Ok(DecodeTable { arena, start, len })
}

/// 3. Bytes -> id; when several ids carry the same bytes the smallest wins (as in the
///    reference tokenizer).
pub(super) fn ids_by_bytes(t: &DecodeTable, tokens: usize) -> FxHashMap<&[u8], u32> {
    let mut by_bytes: FxHashMap<&[u8], u32> = FxHashMap::default();
    by_bytes.reserve(tokens);
    for id in 0..t.len.len() {
        if t.len[id] != u32::MAX {
            let s = t.start[id] as usize;
            by_bytes.entry(&t.arena[s..s + t.len[id] as usize]).or_insert(id as u32);
        }
    }
    by_bytes
}

/// 4. The id of each special token, in the order given: the token of its bytes, else
///    the next id after `size` (those are also returned as appended).
#[allow(clippy::type_complexity)] // (token, id) twice
pub(super) fn special_ids(
    specials: &[String],
    by_bytes: &FxHashMap<&[u8], u32>,
    size: usize,
) -> Result<(Vec<(String, u32)>, Vec<(String, u32)>), EncodeError> {
    let mut special_ids: Vec<(String, u32)> = Vec::with_capacity(specials.len());
    let mut next_id = size as u32;
    let mut appended: Vec<(String, u32)> = Vec::new();
    for s in specials {
        if s.is_empty() {
            return Err(EncodeError::Specials("a special token is the empty string".into()));
        }
        if special_ids.iter().any(|(t, _)| t == s) {
            return Err(EncodeError::Specials(format!("{s:?} is listed twice")));
        }
        let id = match by_bytes.get(s.as_bytes()) {
            Some(&id) => id,
            None => {
                let id = next_id;
                next_id += 1;
                appended.push((s.clone(), id));
                id
            }
        };
        special_ids.push((s.clone(), id));
    }
    Ok((special_ids, appended))
}

/// 5. The id of each single byte (all 256 must be tokens), added to `produced`.
pub(super) fn byte_ids(
    by_bytes: &FxHashMap<&[u8], u32>,
    produced: &mut FxHashSet<u32>,
) -> Result<[u32; 256], EncodeError> {
    let mut byte_ids = [0u32; 256];
    for (b, slot) in byte_ids.iter_mut().enumerate() {
        match by_bytes.get(&[b as u8][..]) {
            Some(&id) => {
                *slot = id;
                produced.insert(id);
            }
            None => {
                return Err(EncodeError::Vocab(format!(
                    "no token for the byte 0x{b:02x}: a byte-level vocab needs all 256 single bytes"
                )))
            }
        }
    }
    Ok(byte_ids)
}

/// 6. The merges as ids: both sides and their concatenation must be tokens; a repeated
///    merge keeps its first rank. The ids merges make are added to `produced`.
pub(super) fn merge_table(
    merges: &[(Vec<u8>, Vec<u8>)],
    by_bytes: &FxHashMap<&[u8], u32>,
    produced: &mut FxHashSet<u32>,
) -> Result<MergeTable, EncodeError> {
    if merges.len() >= u32::MAX as usize - 1 {
        return Err(EncodeError::Merges("more than 2^32 merges".into()));
    }
    let mut pairs = pairs::PairTable::with_capacity(merges.len());
    let mut joined = Vec::new();
    let mut merge_ids = Vec::with_capacity(merges.len());
    let mut in_effect = Vec::with_capacity(merges.len());
    for (rank, (a, b)) in merges.iter().enumerate() {
        let lookup = |t: &[u8], what: &str| -> Result<u32, EncodeError> {
            by_bytes.get(t).copied().ok_or_else(|| {
                EncodeError::Merges(format!(
                    "merge {rank} ({} {}): the {what} {} is not in the vocab",
                    show(a),
                    show(b),
                    show(t)
                ))
            })
        };
        let left = lookup(a, "left token")?;
        let right = lookup(b, "right token")?;
        joined.clear();
        joined.extend_from_slice(a);
        joined.extend_from_slice(b);
        let merged = lookup(&joined, "merged token")?;
        if pairs.insert_new(left, right, ((rank as u64) << 32) | merged as u64) {
            in_effect.push((rank as u32, left, right, merged));
        }
        merge_ids.push((left, right));
        produced.insert(merged);
    }
    Ok(MergeTable { pairs, merge_ids, in_effect })
}

/// 7. "The vocab is the cache": every token except the special tokens (unless a byte
///    or a merge also produces them), as tiktoken looks a piece up among its mergeable
///    ranks. For a trained vocab these are exactly the bytes and the merge results.
pub(super) fn piece_table(
    by_bytes: &FxHashMap<&[u8], u32>,
    special_ids: &[(String, u32)],
    produced: &FxHashSet<u32>,
    tokens: usize,
) -> cache::PieceTable {
    let mut table = cache::PieceTable::with_capacity(tokens);
    let special_only: FxHashSet<u32> =
        special_ids.iter().map(|&(_, id)| id).filter(|id| !produced.contains(id)).collect();
    for (bytes, &id) in by_bytes {
        if !special_only.contains(&id) {
            table.insert(bytes, id);
        }
    }
    table
}
