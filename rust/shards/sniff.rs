//! What an input holds, from its first bytes: compressed streams and binary formats by
//! their magic numbers, JSON Lines by its first record. Names alone mislead: a JSON Lines
//! file named `.json` (what `datasets`' `to_json` writes) or a Parquet file given as text
//! would otherwise be encoded as plain text or fail with a bare UTF-8 error.

use std::fs::File;
use std::io::{self, Read};

use super::input::{decoded, Compression, Format, InputSpec, BOM};
use super::ShardError;

/// Bytes of (decompressed) content looked at.
const SNIFF: usize = 64 << 10;

/// Formats recognised by their magic number that the shard writer does not read, with
/// what to do instead.
const UNSUPPORTED: &[(&[u8], &str, &str)] = &[
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it (xz -d) or recompress it with zstd or gzip"),
    (b"BZh", "bzip2-compressed", "decompress it (bunzip2) or recompress it with zstd or gzip"),
    (b"\x04\x22\x4d\x18", "LZ4-compressed", "decompress it (lz4 -d) or recompress it with zstd or gzip"),
    (b"PK\x03\x04", "a ZIP archive", "extract it and pass the files inside"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", "extract it and pass the files inside"),
    (b"ARROW1", "an Arrow IPC file", "write it as Parquet or JSON Lines"),
    (b"\x89HDF", "an HDF5 file", "export its text as Parquet, JSON Lines or plain text"),
];

const PARQUET_MAGIC: &[u8] = b"PAR1";

fn has_ext(name: &str, exts: &[&str]) -> bool {
    exts.iter().any(|e| name.ends_with(e))
}

/// Refine `spec` (named by its extension, see `InputSpec::detect`) by its content: the
/// compression by magic number, Parquet by magic number, JSON Lines by its first record
/// (unless the format was given). Formats it cannot read are an error naming them.
pub(crate) fn sniff(spec: &InputSpec, field: &str) -> Result<InputSpec, ShardError> {
    let mut spec = spec.clone();
    if spec.path.as_os_str().is_empty() {
        return Ok(spec); // documents from the caller, no file
    }
    let head = read_head(&spec, Compression::None)?;
    let name = spec.path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    if head.starts_with(PARQUET_MAGIC) || has_ext(&name, &[".parquet", ".pq"]) {
        spec.format = Format::Docs;
        spec.compression = Compression::None;
        return Ok(spec);
    }
    if let Some((_, what, fix)) = UNSUPPORTED.iter().find(|(m, _, _)| head.starts_with(m)) {
        return Err(unsupported(&spec, what, fix));
    }
    if has_ext(&name, &[".xz", ".bz2", ".lz4", ".zip", ".7z", ".tar", ".arrow", ".feather"]) {
        return Err(unsupported(&spec, "an archive or compressed format ferrolm does not read", "convert it first"));
    }
    spec.compression = match head.as_slice() {
        [0x1f, 0x8b, ..] => Compression::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd, ..] => Compression::Zstd,
        _ if spec.compression != Compression::None => {
            return Err(ShardError::Corrupt {
                path: spec.path.clone(),
                format: spec.compression.name(),
                raw_offset: 0,
                source: io::Error::new(io::ErrorKind::InvalidData, "no header: the file is not compressed this way"),
            });
        }
        _ => Compression::None,
    };
    if !spec.format_given && spec.format == Format::Text {
        let text = if spec.compression == Compression::None { head } else { read_head(&spec, spec.compression)? };
        spec.format = text_format(&spec, &name, &text, field)?;
    }
    Ok(spec)
}

fn unsupported(spec: &InputSpec, what: &str, fix: &str) -> ShardError {
    ShardError::Invalid(format!("{}: {what}, which ferrolm does not read; {fix}", spec.path.display()))
}

/// JSON Lines when the first line is a JSON object (with the document field, for names
/// that do not say `.json`); an error for a `.json` file holding one JSON document.
fn text_format(spec: &InputSpec, name: &str, head: &[u8], field: &str) -> Result<Format, ShardError> {
    let head = head.strip_prefix(BOM).unwrap_or(head);
    let start = head.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(head.len());
    let json_name =
        has_ext(name.trim_end_matches(".gz").trim_end_matches(".zst").trim_end_matches(".zstd"), &[".json"]);
    let first = &head[start..];
    if json_name && first.first() == Some(&b'[') {
        return Err(ShardError::Invalid(format!(
            "{}: a JSON array, not JSON Lines (one object per line); write it with lines=True \
             (datasets' to_json does by default) or as Parquet",
            spec.path.display()
        )));
    }
    if first.first() != Some(&b'{') {
        return Ok(Format::Text);
    }
    if json_name {
        return Ok(Format::Jsonl);
    }
    let line = match memchr::memchr(b'\n', first) {
        Some(p) => &first[..p],
        None if head.len() < SNIFF => first,
        None => return Ok(Format::Text), // a first line too long to judge: keep the name's word
    };
    let is_record = std::str::from_utf8(line).ok().is_some_and(|l| super::jsonl::field(l, field).is_ok());
    Ok(if is_record { Format::Jsonl } else { Format::Text })
}

/// Up to `SNIFF` bytes from the start of the file, decompressed with `compression`.
fn read_head(spec: &InputSpec, compression: Compression) -> Result<Vec<u8>, ShardError> {
    let file = File::open(&spec.path).map_err(|e| ShardError::io(&spec.path, "reading input", e))?;
    let mut reader = decoded(&InputSpec { compression, ..spec.clone() }, file)?;
    let mut head = Vec::with_capacity(SNIFF);
    // A corrupt stream is reported by the reader proper, with its offset.
    match reader.by_ref().take(SNIFF as u64).read_to_end(&mut head) {
        Ok(_) => Ok(head),
        Err(e) if compression != Compression::None && e.kind() != io::ErrorKind::NotFound => Ok(head),
        Err(e) => Err(ShardError::io(&spec.path, "reading input", e)),
    }
}
