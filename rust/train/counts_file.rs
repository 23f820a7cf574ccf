//! Pre-token counts files: the counting half of training written down, so that the
//! counts of many parts (machines, jobs, Ray tasks) can be added up and trained from,
//! giving the merges of one run over all their inputs.
//!
//! Layout (integers little-endian; LEB128 = unsigned base-128 varint):
//!
//! ```text
//! magic     16 bytes  b"ferrolm-counts\n\0"
//! version   u32       FORMAT_VERSION
//! header    u32 length, then that many bytes of UTF-8 JSON (pattern, special tokens,
//!           Unicode version, ...: written and checked by the Python side)
//! entries   u64 count n, then n entries in increasing byte order of the piece:
//!           LEB128 length, the piece's bytes, LEB128 count
//! sha256    32 bytes, over everything before it
//! ```
//!
//! The entries are sorted, so a file depends only on the counts (not on threads or hash
//! order). Reading checks the checksum over the whole file before adding anything.

use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::Path;

use sha2::{Digest, Sha256};

use super::count::PieceCounts;
use super::TrainError;

pub const MAGIC: &[u8; 16] = b"ferrolm-counts\n\0";
pub const FORMAT_VERSION: u32 = 1;
/// A header larger than this is not a header (a damaged length field).
const MAX_HEADER: u32 = 1 << 24;

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn write_leb128(w: &mut impl Write, mut v: u64) -> io::Result<()> {
    let mut buf = [0u8; 10];
    let mut n = 0;
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            buf[n] = byte;
            n += 1;
            break;
        }
        buf[n] = byte | 0x80;
        n += 1;
    }
    w.write_all(&buf[..n])
}

/// Write `counts` (flushed) with `header` to `path` (created or truncated) and fsync it.
/// Returns the number of entries.
pub fn write(path: &Path, header: &str, counts: &PieceCounts) -> io::Result<u64> {
    // The pieces side by side in one buffer, sorted through an index into it.
    let mut bytes = Vec::new();
    let mut index: Vec<(usize, u32, u64)> = Vec::with_capacity(counts.len());
    counts.for_each(|piece, n| {
        index.push((bytes.len(), piece.len() as u32, n));
        bytes.extend_from_slice(piece);
    });
    let piece = |&(at, len, _): &(usize, u32, u64)| &bytes[at..at + len as usize];
    index.sort_unstable_by(|a, b| piece(a).cmp(piece(b)));

    let file = File::create(path)?;
    let mut w = Hashing { inner: BufWriter::with_capacity(1 << 20, file), hash: Sha256::new() };
    w.write_all(MAGIC)?;
    w.write_all(&FORMAT_VERSION.to_le_bytes())?;
    let header_len = u32::try_from(header.len()).ok().filter(|&n| n <= MAX_HEADER);
    let header_len = header_len.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "header too large"))?;
    w.write_all(&header_len.to_le_bytes())?;
    w.write_all(header.as_bytes())?;
    w.write_all(&(index.len() as u64).to_le_bytes())?;
    for e in &index {
        write_leb128(&mut w, e.1 as u64)?;
        w.write_all(piece(e))?;
        write_leb128(&mut w, e.2)?;
    }
    let digest = w.hash.finalize();
    let mut inner = w.inner;
    inner.write_all(&digest)?;
    let file = inner.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(index.len() as u64)
}

/// A reader that hashes what passes through it and counts the bytes.
struct Reading<R> {
    inner: R,
    hash: Option<Sha256>,
}

impl<R: Read> Read for Reading<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(h) = &mut self.hash {
            h.update(&buf[..n]);
        }
        Ok(n)
    }
}

fn read_leb128(r: &mut impl Read) -> io::Result<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let mut b = [0u8; 1];
        r.read_exact(&mut b)?;
        v |= ((b[0] & 0x7f) as u64) << shift;
        if b[0] & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(io::Error::new(io::ErrorKind::InvalidData, "a varint longer than 64 bits"))
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Read the parts before the entries: checks magic and version, returns the header.
fn read_head(r: &mut impl Read, path: &Path) -> Result<String, TrainError> {
    let bad = |what: &str| TrainError::InvalidInput(format!("{}: {what}", path.display()));
    let io_err = |err| TrainError::Io { path: path.to_path_buf(), err };
    let mut magic = [0u8; 16];
    match r.read_exact(&mut magic) {
        Ok(()) if &magic == MAGIC => {}
        Ok(()) | Err(_) => return Err(bad("not a ferrolm pre-token counts file")),
    }
    let version = read_u32(r).map_err(io_err)?;
    if version != FORMAT_VERSION {
        return Err(bad(&format!(
            "counts file format version {version}, but this ferrolm reads version {FORMAT_VERSION}"
        )));
    }
    let len = read_u32(r).map_err(io_err)?;
    if len > MAX_HEADER {
        return Err(bad("damaged (header length out of range)"));
    }
    let mut header = vec![0u8; len as usize];
    r.read_exact(&mut header).map_err(|_| bad("cut short (in the header)"))?;
    String::from_utf8(header).map_err(|_| bad("damaged (header is not UTF-8)"))
}

/// Check `path`'s checksum over the whole file; returns its header.
pub fn verify(path: &Path) -> Result<String, TrainError> {
    let io_err = |err| TrainError::Io { path: path.to_path_buf(), err };
    let file = File::open(path).map_err(io_err)?;
    let size = file.metadata().map_err(io_err)?.len();
    if size < 16 + 4 + 4 + 8 + 32 {
        return Err(TrainError::InvalidInput(format!(
            "{}: not a ferrolm pre-token counts file (too short)",
            path.display()
        )));
    }
    let mut r = Reading { inner: BufReader::with_capacity(1 << 20, file), hash: Some(Sha256::new()) };
    let header = read_head(&mut r, path)?;
    // A damaged length can claim more header than the file has room for beside the rest.
    let body = size.checked_sub(32 + 8 + 16 + 4 + 4 + header.len() as u64).map(|b| b + 8).ok_or_else(|| {
        TrainError::InvalidInput(format!(
            "{}: damaged (header length {} does not fit the file's {size} bytes)",
            path.display(),
            header.len()
        ))
    })?;
    io::copy(&mut (&mut r).take(body), &mut io::sink()).map_err(io_err)?;
    let digest = r.hash.take().unwrap().finalize();
    let mut stored = [0u8; 32];
    r.read_exact(&mut stored).map_err(io_err)?;
    if digest.as_slice() != stored {
        return Err(TrainError::InvalidInput(format!(
            "{}: checksum mismatch: the counts file is damaged or was cut short",
            path.display()
        )));
    }
    Ok(header)
}

/// Verify `path`, then add its counts to `into`; returns its header.
pub fn read(path: &Path, into: &mut PieceCounts) -> Result<String, TrainError> {
    let header = verify(path)?;
    let bad = |what: &str| TrainError::InvalidInput(format!("{}: damaged ({what})", path.display()));
    let io_err = |err| TrainError::Io { path: path.to_path_buf(), err };
    let file = File::open(path).map_err(io_err)?;
    let mut r = Reading { inner: BufReader::with_capacity(1 << 20, file), hash: None };
    read_head(&mut r, path)?;
    let mut n = [0u8; 8];
    r.read_exact(&mut n).map_err(|_| bad("no entry count"))?;
    let mut piece = Vec::new();
    for _ in 0..u64::from_le_bytes(n) {
        let len = read_leb128(&mut r).map_err(|_| bad("entry length"))?;
        if len == 0 || len > u32::MAX as u64 {
            return Err(bad("entry length out of range"));
        }
        piece.resize(len as usize, 0);
        r.read_exact(&mut piece).map_err(|_| bad("entry cut short"))?;
        let count = read_leb128(&mut r).map_err(|_| bad("entry count"))?;
        into.add(&piece, count);
    }
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(&[u8], u64)]) -> PieceCounts {
        let mut t = PieceCounts::default();
        for &(p, n) in pairs {
            t.add(p, n);
        }
        t
    }

    fn sorted(t: &PieceCounts) -> Vec<(Vec<u8>, u64)> {
        let mut v = Vec::new();
        t.for_each(|p, n| v.push((p.to_vec(), n)));
        v.sort();
        v
    }

    #[test]
    fn round_trip_adds_up_and_checks_the_checksum() {
        let dir = std::env::temp_dir().join(format!("ferrolm-counts-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let long = vec![b'x'; 40];
        let a = table(&[(b" the", 3), (b"cat", 1), (&long, 2)]);
        let path = dir.join("a.counts");
        assert_eq!(write(&path, "{\"k\": 1}", &a).unwrap(), 3);
        let mut into = table(&[(b"cat", 5)]);
        assert_eq!(read(&path, &mut into).unwrap(), "{\"k\": 1}");
        assert_eq!(sorted(&into), vec![(b" the".to_vec(), 3), (b"cat".to_vec(), 6), (long.clone(), 2)]);
        // One flipped bit anywhere is refused before anything is added.
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let mut untouched = PieceCounts::default();
        let err = read(&path, &mut untouched).unwrap_err().to_string();
        assert!(err.contains("checksum mismatch"), "{err}");
        assert!(untouched.is_empty());
        std::fs::write(&path, b"not a counts file at all, but long enough to be one").unwrap();
        let err = read(&path, &mut untouched).unwrap_err().to_string();
        assert!(err.contains("not a ferrolm pre-token counts file"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_damaged_header_length_is_refused_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("ferrolm-counts-len-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.counts");
        // A file whose checksum starts with an ASCII byte: a header length reaching one byte
        // into the checksum then reads as UTF-8 and must still be refused.
        let good = (0..)
            .find_map(|k| {
                write(&path, &format!("{{\"k\": {k}}}"), &table(&[(b" the", 3), (b"cat", 1)])).unwrap();
                let bytes = std::fs::read(&path).unwrap();
                (bytes[bytes.len() - 32] < 0x80).then_some(bytes)
            })
            .unwrap();
        let n = u32::from_le_bytes(good[20..24].try_into().unwrap());
        let size = good.len() as u32;
        // Longer (into the entries, into the checksum), shorter, zero, past the end, beyond any header.
        for bad in [n + 9, size - 55, n - 3, 0, size - 30, size + 5, u32::MAX] {
            let mut bytes = good.clone();
            bytes[20..24].copy_from_slice(&bad.to_le_bytes());
            std::fs::write(&path, &bytes).unwrap();
            let err = verify(&path).unwrap_err().to_string();
            assert!(err.contains(&path.display().to_string()), "{bad}: {err}");
            assert!(err.contains("damaged") || err.contains("cut short") || err.contains("checksum"), "{bad}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn leb128_round_trips() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut buf = Vec::new();
            write_leb128(&mut buf, v).unwrap();
            assert_eq!(read_leb128(&mut buf.as_slice()).unwrap(), v);
        }
    }
}
