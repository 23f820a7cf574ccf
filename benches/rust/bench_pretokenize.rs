//! Throughput of the pre-tokenizer: hand-written scanners vs fancy-regex on the same
//! patterns, one thread.
//!
//!     cargo run --release --example bench_pretokenize -- [--max-mb N] [--runs R] [--json] FILE...
//!
//! Each file is cut to its first N MiB (at a newline; default: whole file). Before
//! timing, the scanner's piece ranges are checked equal to fancy-regex's. Reports the
//! median MB/s (10^6 bytes per second) of R runs (default 5) after a warm-up run.

use std::hint::black_box;
use std::time::Instant;

use ferrolm::pretokenize::PreTokenizer;

struct Args {
    max_mb: Option<f64>,
    runs: usize,
    json: bool,
    no_regex: bool,
    patterns: Vec<String>,
    files: Vec<String>,
}

fn parse_args() -> Args {
    let mut args = Args {
        max_mb: None,
        runs: 5,
        json: false,
        no_regex: false,
        patterns: vec!["gpt2".into(), "cl100k".into(), "o200k".into()],
        files: vec![],
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--max-mb" => args.max_mb = Some(it.next().expect("--max-mb N").parse().expect("a number")),
            "--runs" => args.runs = it.next().expect("--runs R").parse().expect("an integer"),
            "--json" => args.json = true,
            "--no-regex" => args.no_regex = true,
            "--patterns" => args.patterns = it.next().expect("--patterns a,b").split(',').map(String::from).collect(),
            "-h" | "--help" => {
                eprintln!("usage: bench_pretokenize [--max-mb N] [--runs R] [--json] [--no-regex] [--patterns gpt2,cl100k,o200k] FILE...");
                std::process::exit(0);
            }
            _ => args.files.push(a),
        }
    }
    if args.files.is_empty() {
        eprintln!("no input files (see --help)");
        std::process::exit(2);
    }
    args
}

/// The first `max_mb` MiB of `data`, extended to just after the next newline.
fn cut(data: &[u8], max_mb: Option<f64>) -> &[u8] {
    let Some(mb) = max_mb else { return data };
    let n = ((mb * 1048576.0) as usize).min(data.len());
    match data[n..].iter().position(|&b| b == b'\n') {
        Some(k) => &data[..n + k + 1],
        None => data,
    }
}

/// (piece count, a hash of all piece ranges)
fn fingerprint(pre: &PreTokenizer, text: &str) -> (usize, u64) {
    let mut count = 0usize;
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    pre.for_each_piece_range(text, |s, e| {
        count += 1;
        h = (h ^ s as u64).wrapping_mul(0x100_0000_01b3);
        h = (h ^ e as u64).wrapping_mul(0x100_0000_01b3);
    });
    (count, h)
}

/// This thread's CPU time in seconds (on a busy machine wall time overstates).
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// MB/s of `runs` timed passes (after one warm-up) of `pre` over `text`, where each
/// piece goes through a light consumer (count and summed lengths).
fn throughput(pre: &PreTokenizer, text: &str, runs: usize) -> Rate {
    let pass = || {
        let mut count = 0usize;
        let mut total = 0usize;
        pre.for_each_piece(black_box(text), |p| {
            count += 1;
            total += p.len();
        });
        black_box((count, total));
    };
    pass();
    let (mut wall, mut cpu): (Vec<f64>, Vec<f64>) = (0..runs.max(1))
        .map(|_| {
            let (t, c) = (Instant::now(), thread_cpu_s());
            pass();
            let (dt, dc) = (t.elapsed().as_secs_f64(), thread_cpu_s() - c);
            (text.len() as f64 / dt / 1e6, text.len() as f64 / dc / 1e6)
        })
        .unzip();
    wall.sort_by(|a, b| a.partial_cmp(b).unwrap());
    cpu.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Rate { wall: wall[wall.len() / 2], cpu: cpu[cpu.len() / 2], best: wall[wall.len() - 1] }
}

/// MB/s: the medians by wall-clock and by thread CPU time, and the best run's wall-clock.
#[derive(Clone, Copy)]
struct Rate {
    wall: f64,
    cpu: f64,
    best: f64,
}

fn main() {
    let args = parse_args();
    let mut rows = Vec::new();
    for path in &args.files {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {path}: {e}"));
        let text = String::from_utf8_lossy(cut(&data, args.max_mb)).into_owned();
        let name = std::path::Path::new(path).file_name().unwrap().to_string_lossy().into_owned();
        for pattern in &args.patterns {
            let scanner = PreTokenizer::new(pattern).expect("pattern");
            assert!(scanner.is_builtin(), "{pattern} is not a built-in pattern");
            let (pieces, h) = fingerprint(&scanner, &text);
            let scan_mbs = throughput(&scanner, &text, args.runs);
            let mut regex_mbs = None;
            let mut same = None;
            if !args.no_regex {
                let regex = PreTokenizer::new_regex(pattern).expect("pattern");
                same = Some(fingerprint(&regex, &text) == (pieces, h));
                regex_mbs = Some(throughput(&regex, &text, args.runs.min(3)));
            }
            rows.push((name.clone(), text.len(), pattern.clone(), pieces, same, scan_mbs, regex_mbs));
        }
    }
    if args.json {
        let items: Vec<String> = rows
            .iter()
            .map(|(file, bytes, pattern, pieces, same, scan, regex)| {
                let opt = |x: Option<f64>| x.map_or("null".to_string(), |v| format!("{v:.1}"));
                format!(
                    "{{\"file\": \"{file}\", \"bytes\": {bytes}, \"pattern\": \"{pattern}\", \"pieces\": {pieces}, \
                     \"same_as_fancy_regex\": {}, \"scanner_mbs\": {:.1}, \"scanner_cpu_mbs\": {:.1}, \
                     \"scanner_best_mbs\": {:.1}, \"fancy_regex_mbs\": {}, \"fancy_regex_cpu_mbs\": {}}}",
                    same.map_or("null".to_string(), |s| s.to_string()),
                    scan.wall,
                    scan.cpu,
                    scan.best,
                    opt(regex.map(|r| r.wall)),
                    opt(regex.map(|r| r.cpu)),
                )
            })
            .collect();
        println!("[{}]", items.join(",\n "));
    } else {
        println!("MB/s: median wall-clock (median thread CPU time) [best run]; ratio by CPU time");
        println!("| file | MB | pattern | pieces | scanner MB/s | fancy-regex MB/s | ratio | same pieces |");
        println!("|---|---:|---|---:|---:|---:|---:|---|");
        for (file, bytes, pattern, pieces, same, scan, regex) in rows {
            let (r, ratio) = match regex {
                Some(r) => (format!("{:.1} ({:.1})", r.wall, r.cpu), format!("{:.1}x", scan.cpu / r.cpu)),
                None => ("-".into(), "-".into()),
            };
            let same = same.map_or("-".to_string(), |s| if s { "yes".into() } else { "NO".into() });
            println!(
                "| {file} | {:.1} | {pattern} | {pieces} | {:.0} ({:.0}) [{:.0}] | {r} | {ratio} | {same} |",
                bytes as f64 / 1e6,
                scan.wall,
                scan.cpu,
                scan.best,
            );
        }
    }
}
