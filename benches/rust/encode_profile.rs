//! Where the encoder's time goes, one thread, no Python (for perf):
//!
//!     cargo run --profile fast --example encode_profile -- FILE VOCAB_JSON MERGES_TXT [REPS]
//!
//! Rows: the pre-tokenizer alone; `Encoder::encode_into` once per document (documents
//! split on <|endoftext|>) with a fresh encoder (cold piece caches, one pass), then warm
//! (best of REPS runs after a warm-up); one vector per document kept (as a batch call
//! without grouping would); the whole text in one call.
//!
//! A fifth argument picks one measurement instead: `cold` (REPS cold passes, each with a
//! fresh encoder: for perf on first-seen pieces), `cold-threads` (the whole text with a
//! fresh encoder on 1 and on 2 threads: wall and process CPU seconds), `merge` (the
//! merges alone of every unique pre-token, REPS times: nanoseconds per piece).

#[path = "gpt2.rs"]
mod gpt2;

use std::time::Instant;

fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Seconds to encode `docs` once with a fresh encoder: each piece not in the vocab is
/// merged the first time it is seen (as in a CLI run over a corpus).
fn cold_pass(vocab: &str, merges: &str, docs: &[&str]) -> f64 {
    let cold = gpt2::load(vocab, merges);
    let mut ids = Vec::new();
    let t0 = Instant::now();
    for d in docs {
        ids.clear();
        cold.encode_into(d, true, &mut ids);
    }
    t0.elapsed().as_secs_f64()
}

fn cpu_s() -> f64 {
    // SAFETY: getrusage fills the struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 * 1e-6;
    t(u.ru_utime) + t(u.ru_stime)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, vocab, merges] = [&args[0], &args[1], &args[2]];
    let reps: usize = args.get(3).and_then(|r| r.parse().ok()).unwrap_or(5);
    let text = std::fs::read_to_string(input).unwrap();
    let docs: Vec<&str> = text.split("<|endoftext|>").filter(|d| !d.is_empty()).collect();
    let mb = text.len() as f64 / 1e6;
    if args.get(4).map(String::as_str) == Some("cold") {
        // Only cold passes (a fresh encoder each), for profiling first-seen pieces.
        for _ in 0..reps {
            println!("cold pass {:7.1} MB/s", mb / cold_pass(vocab, merges, &docs));
        }
        return;
    }
    if args.get(4).map(String::as_str) == Some("merge") {
        let enc = gpt2::load(vocab, merges);
        let pre = ferrolm::pretokenize::PreTokenizer::new("gpt2").unwrap();
        let mut seen = std::collections::HashSet::new();
        let mut pieces: Vec<&str> = Vec::new();
        for d in &docs {
            pre.for_each_piece_range(d, |s, e| {
                if seen.insert(&d[s..e]) {
                    pieces.push(&d[s..e]);
                }
            });
        }
        let mut out = Vec::new();
        for _ in 0..reps {
            let t = Instant::now();
            for p in &pieces {
                out.clear();
                enc.merge_piece(p.as_bytes(), &mut out);
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / pieces.len() as f64;
            println!("merges of {} unique pieces: {ns:.1} ns per piece", pieces.len());
        }
        return;
    }
    if args.get(4).map(String::as_str) == Some("cold-threads") {
        // Whole text, parallel, fresh encoder each time: wall and process CPU, 1 vs 2 threads.
        for _ in 0..reps {
            for th in [1usize, 2] {
                let cold = gpt2::load(vocab, merges);
                let c0 = cpu_s();
                let t0 = Instant::now();
                let parts = cold.encode_parallel_parts::<u32>(&text, true, Some(th));
                let wall = t0.elapsed().as_secs_f64();
                std::hint::black_box(parts);
                println!("{th} thread(s): wall {wall:.3} s, cpu {:.3} s", cpu_s() - c0);
            }
        }
        return;
    }
    let enc = gpt2::load(vocab, merges);
    let pre = ferrolm::pretokenize::PreTokenizer::new("gpt2").unwrap();
    let mut pieces = 0usize;
    let t = best(reps, || {
        pieces = 0;
        for d in &docs {
            pre.for_each_piece_range(d, |_, _| pieces += 1);
        }
    });
    println!("pre-tokenizer only      {:7.1} MB/s  ({pieces} pieces)", mb / t);
    let t = best(reps, || {
        pieces = 0;
        for d in &docs {
            pre.for_each_piece_batch(d, |b| pieces += b.len() - 1);
        }
    });
    println!("pre-tokenizer, batches  {:7.1} MB/s  ({pieces} pieces)", mb / t);
    let mut ids = Vec::new();
    println!("encode_into per document, cold caches {:7.1} MB/s", mb / cold_pass(vocab, merges, &docs));
    let t = best(reps, || {
        for d in &docs {
            ids.clear();
            enc.encode_into(d, true, &mut ids);
        }
    });
    println!("encode_into per document {:7.1} MB/s  ({} documents)", mb / t, docs.len());
    let t = best(reps, || {
        let all: Vec<Vec<u32>> = docs.iter().map(|d| enc.encode(d, true)).collect();
        std::hint::black_box(all);
    });
    println!("encode per document, kept {:7.1} MB/s", mb / t);
    let t = best(reps, || {
        std::hint::black_box(enc.encode_batch_grouped::<u32, _>(&docs, true, Some(1)));
    });
    println!("batch, one thread, u32  {:7.1} MB/s", mb / t);
    let t = best(reps, || {
        std::hint::black_box(enc.encode_batch_grouped::<u16, _>(&docs, true, Some(1)));
    });
    println!("batch, one thread, u16  {:7.1} MB/s", mb / t);
    let t = best(reps, || {
        ids.clear();
        enc.encode_into(&text, true, &mut ids);
    });
    println!("encode_into, whole text  {:7.1} MB/s  ({} ids)", mb / t, ids.len());
}
