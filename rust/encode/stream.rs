//! Streaming encode: text arrives in chunks; ids leave as soon as they are final.
//!
//! A piece is final once the text after it can no longer change it. Special tokens
//! are final when their start lies at least `max_special_len` bytes before the end of
//! the buffer (no longer special can then start at or before them). A pre-token is
//! final when the piece after it ends before the end of the known text: the built-in
//! patterns decide a piece by looking at most one character past the next boundary
//! (GPT-2's `\s+(?!\S)`, o200k's contractions `'re`), so such a piece cannot change.
//!
//! So streamed ids equal the ids of the whole text, and the buffer holds only the
//! unfinished tail (plus up to 64 KiB waiting to be processed in one go).

use super::Encoder;

/// Text is processed once this much is buffered (amortizes tiny chunks).
const MIN_BATCH: usize = 1 << 16;

impl Encoder {
    /// Encode the longest prefix of `text` whose ids cannot change when more text is
    /// appended; return its length in bytes (a char boundary).
    pub fn encode_stable_prefix(&self, text: &str, allow_special: bool, out: &mut Vec<u32>) -> usize {
        let live = &mut self.live.load();
        {
            let total = text.len();
            let mut pos = 0;
            let mut limit = total;
            if allow_special && !self.specials.is_empty() {
                let m = self.specials.max_len();
                let safe = total.saturating_sub(m - 1);
                limit = safe;
                for (s, e, id) in self.specials.find_iter(text.as_bytes()) {
                    if s + m > total {
                        break;
                    }
                    self.encode_span(&text[pos..s], live, out, &mut |_: &mut Vec<u32>| {});
                    out.push(id);
                    pos = e;
                }
            }
            while limit > pos && !text.is_char_boundary(limit) {
                limit -= 1;
            }
            if limit <= pos {
                return pos;
            }
            let span = &text[pos..limit];
            let base = span.as_ptr() as usize;
            let end = span.len();
            // The oldest piece not yet emitted.
            let mut held: Option<&str> = None;
            let mut keep_from = end; // relative start of the first piece not emitted
            let mut any = false;
            self.pretok.for_each_piece(span, |piece| {
                let p_start = piece.as_ptr() as usize - base;
                let p_end = p_start + piece.len();
                if let Some(h) = held {
                    if p_end < end {
                        self.encode_piece(h.as_bytes(), self.current(live), out);
                    } else {
                        // `piece` touches the end of the known text: neither is final.
                        return;
                    }
                }
                held = Some(piece);
                keep_from = p_start;
                any = true;
            });
            if !any {
                return pos;
            }
            // `held` is the first piece not emitted; everything before it is done.
            if let Some(h) = held {
                keep_from = h.as_ptr() as usize - base;
            }
            pos + keep_from
        }
    }
}

/// Incremental encoder state: feed chunks with [`StreamEncoder::push`], then call
/// [`StreamEncoder::finish`]. The ids equal those of encoding the concatenation.
#[derive(Debug, Clone)]
pub struct StreamEncoder {
    buf: String,
    allow_special: bool,
    next_at: usize,
}

impl StreamEncoder {
    pub fn new(allow_special: bool) -> Self {
        StreamEncoder { buf: String::new(), allow_special, next_at: MIN_BATCH }
    }

    /// Bytes buffered and not yet encoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Add `chunk`; append the ids that became final to `out`.
    pub fn push(&mut self, enc: &Encoder, chunk: &str, out: &mut Vec<u32>) {
        self.buf.push_str(chunk);
        if self.buf.len() < self.next_at {
            return;
        }
        let done = enc.encode_stable_prefix(&self.buf, self.allow_special, out);
        self.buf.drain(..done);
        // When a long unfinished piece stays buffered, wait for it to double before
        // looking again, so that total work stays linear.
        self.next_at = MIN_BATCH.max(self.buf.len() * 2);
        if self.buf.capacity() > 4 * self.next_at {
            self.buf.shrink_to(self.next_at);
        }
    }

    /// Encode what is left; the state is then empty and may be reused.
    pub fn finish(&mut self, enc: &Encoder, out: &mut Vec<u32>) {
        enc.encode_into(&self.buf, self.allow_special, out);
        self.buf.clear();
        self.buf.shrink_to(MIN_BATCH);
        self.next_at = MIN_BATCH;
    }
}
