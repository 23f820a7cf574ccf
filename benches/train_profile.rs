//! Profile the Rust BPE trainer's stages without Python.
//!
//!     cargo run --release --example train_profile -- VOCAB THREADS FILE... [--dump counts.bin | --load counts.bin]
//!
//! `--dump` saves the pre-token counts after counting; `--load` skips counting and
//! learns from saved counts (to profile the merge stages alone). `CHUNK_KB` in the
//! environment sets the read chunk size (default: the trainer's).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Instant;

use ferrolm::train::{Control, PieceCounts, Trainer, Utf8Errors, DEFAULT_CHUNK_SIZE};

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut dump = None;
    let mut load = None;
    if let Some(i) = args.iter().position(|a| a == "--dump") {
        dump = Some(PathBuf::from(args.remove(i + 1)));
        args.remove(i);
    }
    if let Some(i) = args.iter().position(|a| a == "--load") {
        load = Some(PathBuf::from(args.remove(i + 1)));
        args.remove(i);
    }
    let vocab: usize = args[0].parse().unwrap();
    let threads: usize = args[1].parse().unwrap();
    let files: Vec<PathBuf> = args[2..].iter().map(PathBuf::from).collect();
    let specials = vec!["<|endoftext|>".to_string()];
    let Some(num_merges) = vocab.checked_sub(256 + specials.len()) else {
        eprintln!("VOCAB must be at least {} (256 bytes and the special tokens)", 256 + specials.len());
        std::process::exit(2);
    };
    let ctl = Control::default();
    let t0 = Instant::now();
    let mut tr = Trainer::new(
        &specials,
        "gpt2",
        Some(threads),
        Utf8Errors::Strict,
        std::env::var("CHUNK_KB").ok().map(|v| v.parse::<usize>().unwrap() << 10).unwrap_or(DEFAULT_CHUNK_SIZE),
    )
    .unwrap();
    let counts = if let Some(p) = &load {
        read_counts(p)
    } else {
        tr.count_files(&files, "text", &ctl).unwrap();
        tr.take_counts().unwrap()
    };
    if let Some(p) = &dump {
        write_counts(p, &counts);
    }
    let merges = tr.learn_from_counts(counts, num_merges, &ctl).unwrap();
    let total = t0.elapsed().as_secs_f64();
    println!("{:?}", tr.stats);
    println!(
        "total {total:.3} s, {} merges, last {:?}",
        merges.len(),
        merges
            .iter()
            .last()
            .map(|(a, b)| (String::from_utf8_lossy(a).into_owned(), String::from_utf8_lossy(b).into_owned()))
    );
}

fn write_counts(p: &PathBuf, counts: &PieceCounts) {
    let mut f = std::io::BufWriter::new(std::fs::File::create(p).unwrap());
    counts.for_each(|k, v| {
        f.write_all(&(k.len() as u32).to_le_bytes()).unwrap();
        f.write_all(k).unwrap();
        f.write_all(&v.to_le_bytes()).unwrap();
    });
}

fn read_counts(p: &PathBuf) -> PieceCounts {
    let mut data = Vec::new();
    std::fs::File::open(p).unwrap().read_to_end(&mut data).unwrap();
    let mut counts = PieceCounts::default();
    let mut i = 0;
    while i < data.len() {
        let n = u32::from_le_bytes(data[i..i + 4].try_into().unwrap()) as usize;
        let k = &data[i + 4..i + 4 + n];
        let v = u64::from_le_bytes(data[i + 4 + n..i + 12 + n].try_into().unwrap());
        counts.add(k, v);
        i += 12 + n;
    }
    counts
}
