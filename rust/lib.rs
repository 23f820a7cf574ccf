//! ferrolm's Rust core: everything whose cost grows with the corpus.
//!
//! The core has no PyO3 types; `python/` (behind the `python` feature) only
//! converts types and releases the GIL, so `cargo test` needs no Python.

mod buffers;
mod chunks;
pub mod cut;
pub mod encode;
pub mod fault;
pub mod pretokenize;
pub mod shards;
pub mod specials;
pub mod threads;
pub mod train;
pub mod unicode_classes;
mod unicode_tables;
mod utf8;
pub mod vocab_files;

#[cfg(feature = "python")]
mod python;

/// The crate version, shared with the Python package (maturin reads Cargo.toml).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
