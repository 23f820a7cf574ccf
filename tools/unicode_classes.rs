//! Print the regex engine's Unicode classes for tools/gen_unicode_tables.py, which
//! generates the scanners' tables and the reference's class definitions from them.
//!
//! Output: a line `unicode <version>`, then one line `<first> <last> <class>` (hex code
//! points, class number of `FINE_CLASSES`) per run of code points of one class other
//! than 0.
//!
//! Usage: cargo run --quiet --example unicode_classes

use std::io::Write;

use ferrolm::unicode_classes::{engine_classes, engine_unicode_version};

fn main() {
    let class = engine_classes();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    writeln!(out, "unicode {}", engine_unicode_version()).unwrap();
    let mut start = 0;
    for cp in 1..=class.len() {
        if cp == class.len() || class[cp] != class[start] {
            if class[start] != 0 {
                writeln!(out, "{:x} {:x} {}", start, cp - 1, class[start]).unwrap();
            }
            start = cp;
        }
    }
    out.flush().unwrap();
}
