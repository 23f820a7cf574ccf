//! Byte-level BPE encoding: text -> token ids, exactly as tiktoken (GPT-2 vocab) and
//! ferrolm's reference tokenizer compute them, as fast as we know how.
//!
//! Per encode call:
//! 1. special tokens split the text (Aho-Corasick, leftmost-longest), unless they are
//!    treated as text;
//! 2. each span between them is cut into pieces by the pre-tokenizer
//!    ([`crate::pretokenize::PreTokenizer`]);
//! 3. each piece becomes ids:
//!    * "the vocab is the cache": a piece whose bytes are a token is that token
//!      (one hash lookup; most pieces of real text end here);
//!    * otherwise the encoder's piece table (bytes -> ids), shared by all threads,
//!      holds the pieces merged before;
//!    * otherwise merges are applied by rank, lowest first, leftmost first among
//!      equals: a linear scan for short pieces, a heap over a linked list for long
//!      ones, a bucket per rank for huge ones (so `"a" * 16_000_000` stays linear).
//!
//! The public Rust API ([`Encoder`], [`StreamEncoder`]) has no PyO3 types; the shard
//! writer and the binding (`python/`) build on it.

mod bpe;
mod build;
mod cache;
pub mod cancel;
mod hugebuf;
mod pairs;
mod parallel;
mod stream;

use std::fmt;
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};

use rustc_hash::FxHashSet;

use crate::pretokenize::{PatternError, PreTokenizer, MAX_BATCH};

use crate::specials::SpecialMatcher;
pub use parallel::{map_text_file, read_text_file, BatchIds, FileText, IdElem, ThreadCount};
pub use stream::StreamEncoder;

/// Why an [`Encoder`] could not be built, or an id could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeError {
    /// The vocabulary is malformed (missing byte, id too large, duplicate bytes ...).
    Vocab(String),
    /// A merge refers to a token the vocabulary does not have.
    Merges(String),
    /// Special tokens are malformed (empty, duplicated).
    Specials(String),
    /// The pre-tokenization pattern does not compile.
    Pattern(String),
    /// An id passed to decode is not in the vocabulary.
    IdOutOfRange { id: u64, vocab_size: u64 },
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EncodeError::Vocab(m) => write!(f, "invalid vocab: {m}"),
            EncodeError::Merges(m) => write!(f, "invalid merges: {m}"),
            EncodeError::Specials(m) => write!(f, "invalid special tokens: {m}"),
            EncodeError::Pattern(m) => write!(f, "{m}"),
            EncodeError::IdOutOfRange { id, vocab_size } => {
                write!(f, "token id {id} is not in the vocabulary (vocab_size {vocab_size})")
            }
        }
    }
}

impl std::error::Error for EncodeError {}

impl From<PatternError> for EncodeError {
    fn from(e: PatternError) -> Self {
        EncodeError::Pattern(e.to_string())
    }
}

use pairs::NO_MERGE;

/// Ids are `u32`; the vocabulary may be sparse but not absurdly so (the decode
/// table is dense).
const MAX_SPARSE_SLACK: u64 = 1 << 22;

/// `Encoder::encode_drained` hands over ids once it holds at least this many (16 KiB).
const DRAIN_IDS: usize = 4096;

/// A thread's hold on an encoder's current piece table.
type TableGuard = Guard<Arc<cache::SharedTable>>;

fn show(b: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(b))
}

/// A byte-level BPE encoder: vocab, merges, special tokens and pre-tokenizer.
///
/// `Send + Sync`: share one behind an `Arc` between threads; they share its piece table.
pub struct Encoder {
    /// Decode table: bytes of id `i` are `arena[start[i]..start[i] + len[i]]`;
    /// `len[i] == u32::MAX` for ids absent from a sparse vocab.
    arena: Vec<u8>,
    start: Vec<u64>,
    len: Vec<u32>,
    /// The id of each single byte.
    byte_ids: [u32; 256],
    /// (left << 32 | right) -> (rank << 32 | merged id).
    pairs: pairs::PairTable,
    /// Bytes -> id for every ordinary token: a pre-token found here is that single
    /// token. The encoding threads share a copy that also caches merged pieces (`live`).
    base: cache::PieceTable,
    /// The table lookups go to: the base plus merged pieces. Replaced when it outgrows
    /// its slots or side storage (see `cache::SharedTable`).
    live: ArcSwap<cache::SharedTable>,
    specials: SpecialMatcher,
    pretok: PreTokenizer,
    /// The merges as given, (left id, right id) in rank order (duplicates kept).
    merge_ids: Vec<(u32, u32)>,
    /// Every merge ranks after those that make its sides (see `bpe::merges_rise`).
    merges_rise: bool,
}

impl fmt::Debug for Encoder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Encoder")
            .field("vocab_size", &self.vocab_size())
            .field("merges", &self.merge_ids.len())
            .field("specials", &self.specials.tokens())
            .field("pattern", &self.pretok.pattern())
            .finish()
    }
}

impl Encoder {
    /// Build an encoder.
    ///
    /// * `vocab`: (id, token bytes); ids are the ids `encode` returns (a vocab built
    ///   elsewhere, e.g. GPT-2's, keeps its own ids). Every single byte must be a token.
    /// * `merges`: (left, right) in rank order; both sides and their concatenation
    ///   must be tokens.
    /// * `specials`: looked up by their UTF-8 bytes in the vocab; appended after the
    ///   largest id when absent.
    ///
    /// When several ids carry the same bytes, the smallest is the one encoding produces.
    /// * `pattern`: "gpt2", "cl100k", "o200k" or a regex.
    pub fn new(
        vocab: Vec<(u64, Vec<u8>)>,
        merges: Vec<(Vec<u8>, Vec<u8>)>,
        specials: Vec<String>,
        pattern: &str,
    ) -> Result<Encoder, EncodeError> {
        let pretok = PreTokenizer::new(pattern)?;
        let size = build::table_size(&vocab, specials.len())?;
        let mut decode = build::decode_table(&vocab, size)?;
        let by_bytes = build::ids_by_bytes(&decode, vocab.len());
        let (special_ids, appended) = build::special_ids(&specials, &by_bytes, size)?;
        // The ids a byte or a merge makes (a special token among them is also a piece).
        let mut produced: FxHashSet<u32> = FxHashSet::default();
        let byte_ids = build::byte_ids(&by_bytes, &mut produced)?;
        let mut merges = build::merge_table(&merges, &by_bytes, &mut produced)?;
        merges.pairs.index_bytes(&byte_ids);
        let base = build::piece_table(&by_bytes, &special_ids, &produced, vocab.len());
        drop(by_bytes);
        let merges_rise = bpe::merges_rise(&merges.in_effect, size);
        // Appended specials extend the decode table.
        for (s, id) in &appended {
            debug_assert_eq!(*id as usize, decode.len.len());
            decode.start.push(decode.arena.len() as u64);
            decode.len.push(s.len() as u32);
            decode.arena.extend_from_slice(s.as_bytes());
        }
        Ok(Encoder {
            live: ArcSwap::from_pointee(cache::SharedTable::from_base(&base, cache::TableLimits::for_base(&base))),
            arena: decode.arena,
            start: decode.start,
            len: decode.len,
            byte_ids,
            pairs: merges.pairs,
            base,
            specials: SpecialMatcher::new(special_ids),
            pretok,
            merge_ids: merges.merge_ids,
            merges_rise,
        })
    }

    /// One more than the largest id (specials included).
    pub fn vocab_size(&self) -> usize {
        self.len.len()
    }

    /// The number of merges.
    pub fn num_merges(&self) -> usize {
        self.merge_ids.len()
    }

    /// The merges as given, as (left id, right id) in rank order; the bytes of each side
    /// are [`Encoder::token_bytes`] of its id.
    pub fn merge_ids(&self) -> &[(u32, u32)] {
        &self.merge_ids
    }

    /// Special tokens and their ids, in the order given.
    pub fn special_tokens(&self) -> &[(String, u32)] {
        self.specials.tokens()
    }

    /// The regex source of the pre-tokenizer.
    pub fn pattern(&self) -> &str {
        self.pretok.pattern()
    }

    /// The bytes of token `id`, or None when the vocab has no such id.
    #[inline]
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let i = id as usize;
        let l = *self.len.get(i)?;
        if l == u32::MAX {
            return None;
        }
        let s = self.start[i] as usize;
        Some(&self.arena[s..s + l as usize])
    }

    /// Encode `text`. With `allow_special`, special tokens in the text are their ids
    /// and hard boundaries; without, they are ordinary text.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 4 + 4);
        self.encode_into(text, allow_special, &mut out);
        out
    }

    /// Encode `text` treating special tokens as text.
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        self.encode(text, false)
    }

    /// Encode `text`, appending the ids to `out`.
    pub fn encode_into(&self, text: &str, allow_special: bool, out: &mut Vec<u32>) {
        self.encode_with(text, allow_special, &mut self.live.load(), out, &mut |_: &mut Vec<u32>| {});
    }

    /// Encode `text`, handing its ids to `drain` a few thousand at a time (and the rest at
    /// the end) through `buf`, which stays small enough to stay in the CPU cache: for
    /// callers that store ids in another form (u16 arrays) without a u32 copy of all of
    /// them first. `buf` is cleared first and left empty.
    pub fn encode_drained(&self, text: &str, allow_special: bool, buf: &mut Vec<u32>, mut drain: impl FnMut(&[u32])) {
        buf.clear();
        let mut flush = |b: &mut Vec<u32>| {
            if b.len() >= DRAIN_IDS {
                drain(b);
                b.clear();
            }
        };
        self.encode_with(text, allow_special, &mut self.live.load(), buf, &mut flush);
        if !buf.is_empty() {
            drain(buf);
            buf.clear();
        }
    }

    /// `flush(out)` runs after each batch of pieces (see `encode_drained`).
    fn encode_with(
        &self,
        text: &str,
        allow_special: bool,
        held: &mut TableGuard,
        out: &mut Vec<u32>,
        flush: &mut impl FnMut(&mut Vec<u32>),
    ) {
        if allow_special && !self.specials.is_empty() {
            let mut pos = 0;
            for (s, e, id) in self.specials.find_iter(text.as_bytes()) {
                self.encode_span(&text[pos..s], held, out, flush);
                out.push(id);
                pos = e;
            }
            self.encode_span(&text[pos..], held, out, flush);
        } else {
            self.encode_span(text, held, out, flush);
        }
    }

    /// Encode text that holds no special token boundaries.
    fn encode_span(
        &self,
        text: &str,
        held: &mut TableGuard,
        out: &mut Vec<u32>,
        flush: &mut impl FnMut(&mut Vec<u32>),
    ) {
        crate::fault::check(crate::fault::Site::Encode);
        if text.is_empty() {
            return;
        }
        let bytes = text.as_bytes();
        self.pretok.for_each_piece_batch(text, |bounds| {
            cancel::check();
            self.encode_bounds(bytes, bounds, self.current(held), out);
            flush(out);
        });
    }

    /// The table held, after moving to the encoder's current one if it was replaced.
    #[inline(always)]
    fn current<'g>(&self, held: &'g mut TableGuard) -> &'g cache::SharedTable {
        if held.retired() {
            *held = self.live.load();
        }
        held
    }

    /// Encode consecutive pieces `text[bounds[k]..bounds[k + 1]]` (fewer than
    /// `MAX_BATCH`); their lookups are started together so that their cache misses
    /// overlap.
    #[inline]
    fn encode_bounds(&self, text: &[u8], bounds: &[usize], table: &cache::SharedTable, out: &mut Vec<u32>) {
        let n = bounds.len().saturating_sub(1);
        debug_assert!(n < MAX_BATCH);
        // Only the first n are written and read (no 4 KiB of zeros per batch).
        let mut slots = [std::mem::MaybeUninit::<cache::Probe>::uninit(); MAX_BATCH];
        // The table's address and mask in registers (see `HomeView`).
        let view = table.home_view();
        for (p, w) in slots.iter_mut().zip(bounds.windows(2)) {
            view.prefetch(p.write(cache::Probe::at(text, w[0], w[1] - w[0])));
        }
        // SAFETY: the first n slots were written just above.
        let probes: &[cache::Probe] = unsafe { std::slice::from_raw_parts(slots.as_ptr().cast(), n) };
        // Pieces found in their home line are written straight into `out`'s spare room
        // (3 ids each at most), with the table's address and the output position kept in
        // registers; any other piece leaves that loop for the general lookup.
        let mut i = 0;
        while i < n {
            out.reserve(3 * (n - i));
            let dst = out.as_mut_ptr();
            let mut len = out.len();
            while i < n {
                // SAFETY: the table outlives this call, and the reserve leaves room for
                // 3 ids for each piece left.
                let k = unsafe { view.emit_home(&probes[i], dst.add(len)) };
                if k == 0 {
                    break;
                }
                len += k;
                i += 1;
            }
            // SAFETY: the ids up to `len` were written above.
            unsafe { out.set_len(len) };
            if i == n {
                break;
            }
            let piece = &text[bounds[i]..bounds[i + 1]];
            if !table.emit(&probes[i], piece, out) {
                self.encode_miss(piece, table, out);
            }
            i += 1;
        }
    }

    /// Encode consecutive pieces (see `encode_bounds`).
    #[cfg(test)]
    fn encode_pieces(&self, pieces: &[&[u8]], table: &cache::SharedTable, out: &mut Vec<u32>) {
        let mut probes = [cache::Probe::default(); MAX_BATCH];
        let view = table.home_view();
        for (p, piece) in probes.iter_mut().zip(pieces) {
            *p = cache::Probe::of(piece);
            view.prefetch(p);
        }
        for (p, piece) in probes.iter().zip(pieces) {
            if !table.emit(p, piece, out) {
                self.encode_miss(piece, table, out);
            }
        }
    }

    /// Encode one piece.
    #[inline]
    pub(crate) fn encode_piece(&self, piece: &[u8], table: &cache::SharedTable, out: &mut Vec<u32>) {
        if !table.emit(&cache::Probe::of(piece), piece, out) {
            self.encode_miss(piece, table, out);
        }
    }

    /// A piece not in the table: merges, then remember it.
    #[inline(never)]
    fn encode_miss(&self, piece: &[u8], table: &cache::SharedTable, out: &mut Vec<u32>) {
        let at = out.len();
        self.bpe(piece, out);
        if let Some(why) = table.insert(piece, &out[at..]) {
            self.replace_table(table, why);
        }
    }

    /// Bound the piece table to `max_slots` slots and `max_side` bytes (tests of the
    /// replacements): it starts again from the base.
    #[cfg(test)]
    fn set_table_limits(&self, max_slots: usize, max_side: usize) {
        let limits = cache::TableLimits { max_slots: max_slots.max(self.base.slots_len()), max_side };
        self.live.store(Arc::new(cache::SharedTable::from_base(&self.base, limits)));
    }

    /// Put a replacement for `old` in place (unless another thread is already at it);
    /// threads move to it at their next batch of pieces.
    #[cold]
    fn replace_table(&self, old: &cache::SharedTable, why: cache::Outgrown) {
        if old.claim_replacement() {
            self.live.store(Arc::new(old.replacement(why, &self.base)));
            old.retire();
        }
    }

    /// The id of a piece that is a single ordinary token.
    #[cfg(test)]
    pub(crate) fn whole_token(&self, piece: &[u8]) -> Option<u32> {
        // A piece held with one id is a token: merges that end in one token start from
        // a piece that is that token, which the base holds.
        let mut ids = Vec::new();
        let held = self.live.load();
        (held.emit(&cache::Probe::of(piece), piece, &mut ids) && ids.len() == 1).then(|| ids[0])
    }

    /// (priority << 32 | merged id) of merging `left` and `right`, or NO_MERGE.
    #[inline(always)]
    fn pair(&self, left: u32, right: u32) -> u64 {
        self.pairs.get(left, right)
    }

    /// Apply merges to one piece (not found whole in the vocab); append its ids.
    pub(crate) fn bpe(&self, piece: &[u8], out: &mut Vec<u32>) {
        bpe::bpe(self, piece, out)
    }

    /// The merges of one pre-token, ignoring the vocab and the piece table: what
    /// encoding a piece seen for the first time costs (for benchmarks). Appends its ids.
    pub fn merge_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        self.bpe(piece, out)
    }

    /// The ids of the tokens that merging their own bytes does not make, in id order.
    ///
    /// Plain BPE (merges only, no whole-piece lookup, as HF tokenizers' `ignore_merges:
    /// false`) never outputs them: a token made inside a longer piece is made by the same
    /// merges as from its bytes alone. Single bytes are always made.
    pub fn tokens_not_made_by_merges(&self) -> Vec<u32> {
        let mut unmade = Vec::new();
        let mut ids = Vec::new();
        for id in 0..self.vocab_size() as u32 {
            if let Some(bytes) = self.token_bytes(id).filter(|b| b.len() > 1) {
                ids.clear();
                self.merge_piece(bytes, &mut ids);
                if ids.as_slice() != [id] {
                    unmade.push(id);
                }
            }
        }
        unmade
    }

    /// Concatenated bytes of `ids`; an id not in the vocab is an error.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        self.decode_bytes_into(ids, &mut out)?;
        Ok(out)
    }

    /// Append the bytes of `ids` to `out`.
    pub fn decode_bytes_into(&self, ids: &[u32], out: &mut Vec<u8>) -> Result<(), EncodeError> {
        for &id in ids {
            match self.token_bytes(id) {
                Some(b) => out.extend_from_slice(b),
                None => return Err(EncodeError::IdOutOfRange { id: id as u64, vocab_size: self.vocab_size() as u64 }),
            }
        }
        Ok(())
    }

    /// Decode to text, invalid UTF-8 replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, EncodeError> {
        let bytes = self.decode_bytes(ids)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// Encode many documents, in parallel over documents (see [`ThreadCount`]); the
    /// result is the same for any thread count.
    pub fn encode_batch<S: AsRef<str> + Sync>(
        &self,
        texts: &[S],
        allow_special: bool,
        threads: ThreadCount,
    ) -> Vec<Vec<u32>> {
        parallel::encode_batch(self, texts, allow_special, threads)
    }

    /// Encode many documents like [`Encoder::encode_batch`], their ids back to back in a
    /// few contiguous groups (one per parallel task; one when serial) instead of one
    /// vector per document: no allocation per document. Ids are stored as `T` (u16 only
    /// when every id of the vocabulary fits).
    pub fn encode_batch_grouped<T: IdElem, S: AsRef<str> + Sync>(
        &self,
        texts: &[S],
        allow_special: bool,
        threads: ThreadCount,
    ) -> Vec<BatchIds<T>> {
        parallel::encode_batch_grouped(self, texts, allow_special, threads)
    }

    /// [`Encoder::encode_parallel`] without the final concatenation: the ids of
    /// consecutive parts of `text` (one part when it is encoded on one thread), stored as
    /// `T` (u16 only when every id of the vocabulary fits).
    pub fn encode_parallel_parts<T: IdElem>(
        &self,
        text: &str,
        allow_special: bool,
        threads: ThreadCount,
    ) -> Vec<Vec<T>> {
        parallel::encode_parallel_parts(self, text, allow_special, threads)
    }

    /// Encode one large text on several threads: it is cut where the result cannot
    /// change (at special tokens, and for the built-in patterns before a space that
    /// follows a non-space ASCII character), the parts are encoded in parallel and
    /// concatenated. Same ids as [`Encoder::encode`].
    pub fn encode_parallel(&self, text: &str, allow_special: bool, threads: ThreadCount) -> Vec<u32> {
        parallel::encode_parallel(self, text, allow_special, threads)
    }

    /// Positions in `text` where it may be cut without changing its ids (besides the
    /// ends); about every `every` bytes. Used by the parallel encoders and shard writers.
    pub fn safe_cuts(&self, text: &str, allow_special: bool, every: usize) -> Vec<usize> {
        parallel::safe_cuts(self, text, allow_special, every)
    }
}

#[cfg(test)]
mod tests;
