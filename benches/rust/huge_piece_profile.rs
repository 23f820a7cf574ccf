//! Where one huge pre-token's encode time goes (no Python):
//!
//!     cargo run --release --example huge_piece_profile -- VOCAB_JSON MERGES_TXT [MB...]
//!
//! Per text ("a" * n, "1" * n, pseudo-random letters): the pre-tokenizer alone, the
//! merges alone (`Encoder::merge_piece`) and a whole `encode` with a fresh encoder.

#[path = "gpt2.rs"]
mod gpt2;

use std::time::Instant;

fn secs(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64()
}

fn letters(n: usize) -> String {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (b'a' + (x % 26) as u8) as char
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sizes: Vec<usize> = args[2..].iter().map(|s| s.parse().unwrap()).collect();
    let sizes = if sizes.is_empty() { vec![1, 4, 16] } else { sizes };
    let pretok = ferrolm::pretokenize::PreTokenizer::new("gpt2").unwrap();
    println!("text      MB   pretokenize    merges    encode   (seconds)");
    for &mb in &sizes {
        let n = mb * 1_000_000;
        for (name, text) in [("a", "a".repeat(n)), ("1", "1".repeat(n)), ("letters", letters(n))] {
            let enc = gpt2::load(&args[0], &args[1]);
            let mut pieces = 0;
            let p = secs(|| pretok.for_each_piece_range(&text, |_, _| pieces += 1));
            let mut ids = Vec::new();
            let m = secs(|| enc.merge_piece(text.as_bytes(), &mut ids));
            let e = secs(|| drop(enc.encode(&text, true)));
            println!("{name:<8} {mb:>3} {p:>12.3} {m:>9.3} {e:>9.3}   ({pieces} pieces)");
        }
    }
}
