//! What the shard pipeline itself costs, apart from the encoder (no Python involved).
//!
//!     cargo run --release --example bench_shards_pipeline -- FILE [VOCAB_JSON MERGES_TXT] [THREADS]
//!
//! Rows: the pipeline with an encoder that emits nothing (read + sha256 + UTF-8 check +
//! ordered hand-off), with a trivial encoder (one id per 4 bytes: conversion and writes),
//! the real BPE encoder called directly on the whole text in memory (one thread, no I/O),
//! and the pipeline with that encoder on 1 and on THREADS threads. Wall and CPU seconds
//! (getrusage of the process), median of 3.
//!
//! Each thread count runs on ferrolm's shared pool of that size (rust/threads.rs), whose
//! threads keep their piece caches from one run to the next: after the first run, both
//! thread counts encode with warm caches. For cold numbers use `benches/bench_shards.py`
//! (a new process per run).

#[path = "gpt2.rs"]
mod gpt2;

use std::path::PathBuf;
use std::time::Instant;

use ferrolm::shards::{encode_to_shard, Dtype, EncodeJob, ShardOptions, TextEncoder};

fn cpu_seconds() -> f64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

fn job(input: &str, threads: usize) -> EncodeJob {
    let out = std::env::temp_dir().join(format!("ferrolm-bench-pipeline-{}.bin", std::process::id()));
    let opts = ShardOptions {
        eos: Some(("<|endoftext|>".into(), 50256)),
        chunk_size: 4 << 20,
        threads,
        params: format!(
            "bench {}",
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
        ),
        ..ShardOptions::new(Dtype::U16)
    };
    EncodeJob::new(vec![PathBuf::from(input)], out, opts)
}

fn measure(label: &str, bytes: u64, mut f: impl FnMut()) {
    let mut runs = Vec::new();
    for _ in 0..3 {
        let (w0, c0) = (Instant::now(), cpu_seconds());
        f();
        runs.push((w0.elapsed().as_secs_f64(), cpu_seconds() - c0));
    }
    runs.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
    let (wall, cpu) = runs[1];
    println!(
        "{label:<48} {wall:7.3} s wall {:8.0} MB/s   {cpu:7.3} s CPU {:8.0} MB/CPU-s",
        bytes as f64 / 1e6 / wall,
        bytes as f64 / 1e6 / cpu
    );
}

fn run_pipeline<E: TextEncoder + ?Sized>(input: &str, threads: usize, enc: &E) {
    let j = job(input, threads);
    let s = encode_to_shard(&j, enc, |_| true).expect("encode");
    let _ = std::fs::remove_file(&s.partial_path);
    let _ = std::fs::remove_file(j.journal_path());
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let input = args.first().expect("usage: bench_shards_pipeline FILE [VOCAB MERGES] [THREADS]").clone();
    let bytes = std::fs::metadata(&input).unwrap().len();
    let threads: usize = args.get(3).and_then(|t| t.parse().ok()).unwrap_or(2);
    println!("{input}: {:.1} MB, pipeline threads {threads}", bytes as f64 / 1e6);

    let nothing = |_: &str, _: &mut Vec<u32>| {};
    measure("pipeline, encoder emits nothing (1 thread)", bytes, || run_pipeline(&input, 1, &nothing));
    let trivial = |t: &str, out: &mut Vec<u32>| out.extend(t.as_bytes().chunks(4).map(|c| c[0] as u32));
    measure("pipeline, one id per 4 bytes (1 thread)", bytes, || run_pipeline(&input, 1, &trivial));

    if args.len() >= 3 {
        let enc = gpt2::load(&args[1], &args[2]);
        // FERROLM_BENCH_PIPELINE_ONLY: skip the in-memory row (it holds the whole text).
        if std::env::var_os("FERROLM_BENCH_PIPELINE_ONLY").is_none() {
            let text = std::fs::read_to_string(&input).unwrap();
            let mut ids = Vec::new();
            enc.encode_into(&text, true, &mut ids); // warm the piece caches like the pipeline's threads
            measure("Encoder::encode_into, whole text in memory", bytes, || {
                ids.clear();
                enc.encode_into(&text, true, &mut ids);
            });
        }
        measure("pipeline with the GPT-2 encoder, 1 thread", bytes, || run_pipeline(&input, 1, &enc));
        measure(&format!("pipeline with the GPT-2 encoder, {threads} threads"), bytes, || {
            run_pipeline(&input, threads, &enc)
        });
    }
}
