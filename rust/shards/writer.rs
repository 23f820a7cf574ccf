//! The output side: the partial token file and the progress journal that makes a run
//! resumable.
//!
//! Invariant: the journal's token count never exceeds what is durably in the partial
//! file, because the data is fsynced before each journal commit, and the journal is
//! replaced atomically (temporary file, fsync, rename). On resume the partial file is
//! truncated to exactly the journal's token count, dropping whatever a killed run wrote
//! after its last commit.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::{EncodeJob, InputRecord, ShardError, Summary};

pub(crate) struct PartialWriter {
    file: File,
    path: PathBuf,
    /// Bytes written by this writer, and how many of them were handed to the OS's
    /// write-back (see `start_writeback`).
    written: u64,
    writeback_from: u64,
    /// Whether the file's directory entry still has to be made durable (a fresh file):
    /// done with the first `sync`, so that a run does not start with a wait on the disk.
    /// A crash before that loses nothing: no journal has counted the file's tokens yet.
    dir_unsynced: bool,
}

/// Output is handed to write-back in pieces of this size while encoding goes on.
const WRITEBACK_STEP: u64 = 4 << 20;

/// Test hook: fail writes with ENOSPC once this many bytes were written by this process
/// (`FERROLM_TEST_FAIL_WRITE_AFTER`), to exercise the disk-full path without a full disk.
fn fail_after() -> Option<u64> {
    std::env::var("FERROLM_TEST_FAIL_WRITE_AFTER").ok()?.parse().ok()
}

impl PartialWriter {
    /// Open `path` for writing: truncated to empty (`fresh`) or to `keep` bytes (resume).
    pub fn open(path: &Path, keep: u64, fresh: bool) -> Result<Self, ShardError> {
        let err = |e| ShardError::io(path, "creating", e);
        let mut file = if fresh {
            File::create(path).map_err(err)?
        } else {
            OpenOptions::new().write(true).open(path).map_err(err)?
        };
        file.set_len(if fresh { 0 } else { keep }).map_err(|e| ShardError::io(path, "truncating", e))?;
        file.seek(SeekFrom::End(0)).map_err(|e| ShardError::io(path, "writing", e))?;
        let start = if fresh { 0 } else { keep };
        Ok(PartialWriter { file, path: path.to_path_buf(), written: start, writeback_from: start, dir_unsynced: fresh })
    }

    pub fn write(&mut self, bytes: &[u8]) -> Result<(), ShardError> {
        if let Some(limit) = fail_after() {
            let pos = self.file.stream_position().unwrap_or(0);
            if pos + bytes.len() as u64 > limit {
                return Err(ShardError::io(&self.path, "writing", io::Error::from_raw_os_error(28)));
            }
        }
        self.file.write_all(bytes).map_err(|e| ShardError::io(&self.path, "writing", e))?;
        self.written += bytes.len() as u64;
        if self.written - self.writeback_from >= WRITEBACK_STEP {
            self.start_writeback();
        }
        Ok(())
    }

    /// Start writing what was written so far to disk, without waiting for it. The
    /// final `sync` then waits only for the last pieces: the data reaches the disk
    /// while encoding goes on instead of in one serial wait at the end (Linux; a hint
    /// elsewhere, so a no-op).
    fn start_writeback(&mut self) {
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let (from, len) = (self.writeback_from, self.written - self.writeback_from);
            // SAFETY: a plain syscall on an open descriptor; failure only loses the hint.
            unsafe {
                libc::sync_file_range(self.file.as_raw_fd(), from as i64, len as i64, libc::SYNC_FILE_RANGE_WRITE);
            }
        }
        self.writeback_from = self.written;
    }

    pub fn sync(&mut self) -> Result<(), ShardError> {
        self.file.sync_data().map_err(|e| ShardError::io(&self.path, "syncing", e))?;
        if std::mem::take(&mut self.dir_unsynced) {
            sync_dir(&self.path);
        }
        Ok(())
    }
}

/// Make a rename or a creation in `path`'s directory durable (best effort).
pub(crate) fn sync_dir(path: &Path) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

const JOURNAL_FORMAT: &str = "ferrolm-encode-progress";

#[derive(Debug, Clone)]
pub(crate) struct Journal {
    pub params: String,
    /// Input position after the last written chunk: (file index, logical offset).
    pub next_file: usize,
    pub next_offset: u64,
    pub tokens: u64,
    pub documents: u64,
    pub complete: bool,
    pub summary: Option<Value>,
    /// Resume digest of the inputs read up to `next_file`/`next_offset` (see `reader.rs`).
    pub digest: Option<String>,
}

impl Journal {
    /// The journal of a run that starts from the beginning.
    pub fn fresh(params: &str) -> Journal {
        Journal {
            params: params.to_string(),
            next_file: 0,
            next_offset: 0,
            tokens: 0,
            documents: 0,
            complete: false,
            summary: None,
            digest: None,
        }
    }

    /// `Ok(None)` if there is no journal, `Err(why)` if there is one we cannot use.
    pub fn read(path: &Path) -> Result<Option<Journal>, String> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read the progress journal {}: {e}", path.display())),
        };
        let bad = || format!("the progress journal {} is unreadable", path.display());
        let v: Value = serde_json::from_str(&text).map_err(|_| bad())?;
        if v.get("format").and_then(Value::as_str) != Some(JOURNAL_FORMAT) {
            return Err(bad());
        }
        let u = |k: &str| v.get(k).and_then(Value::as_u64).ok_or_else(bad);
        Ok(Some(Journal {
            params: v.get("params").and_then(Value::as_str).ok_or_else(bad)?.to_string(),
            next_file: u("next_file")? as usize,
            next_offset: u("next_offset")?,
            tokens: u("tokens")?,
            documents: u("documents")?,
            complete: v.get("complete").and_then(Value::as_bool).unwrap_or(false),
            summary: v.get("summary").cloned().filter(|s| !s.is_null()),
            digest: v.get("digest").and_then(Value::as_str).map(str::to_string),
        }))
    }

    /// Whether this journal can be resumed by a job with these parameters.
    pub fn check(&self, params: &str, partial: &Path, out_bin: &Path, itemsize: u64) -> Result<(), String> {
        if self.params != params {
            return Err("the command's options, tokenizer or inputs differ from the interrupted run's".into());
        }
        // A completed run whose partial file was already renamed to the final name.
        let partial = if self.complete && !partial.exists() { out_bin } else { partial };
        let len = match std::fs::metadata(partial) {
            Ok(m) => m.len(),
            Err(_) => return Err(format!("the partial output {} is missing", partial.display())),
        };
        let need = self.tokens * itemsize;
        if len < need || (self.complete && len != need) {
            return Err(format!(
                "the partial output {} holds {len} bytes, the journal expects {need}",
                partial.display()
            ));
        }
        Ok(())
    }

    pub fn write(&self, path: &Path) -> Result<(), ShardError> {
        let v = json!({
            "format": JOURNAL_FORMAT,
            "version": 1,
            "params": self.params,
            "next_file": self.next_file,
            "next_offset": self.next_offset,
            "tokens": self.tokens,
            "documents": self.documents,
            "complete": self.complete,
            "summary": self.summary,
            "digest": self.digest,
        });
        let mut tmp = path.as_os_str().to_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let result = (|| -> io::Result<()> {
            let mut f = File::create(&tmp)?;
            f.write_all(serde_json::to_string_pretty(&v).unwrap_or_default().as_bytes())?;
            f.write_all(b"\n")?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(ShardError::io(path, "writing the progress journal", e));
        }
        Ok(())
    }

    /// The summary a completed run recorded, if the journal has a valid one.
    pub fn summary(&self, job: &EncodeJob, partial: &Path) -> Option<Summary> {
        let s = self.summary.as_ref()?;
        let u = |v: &Value| v.as_u64();
        let pair = |v: &Value| Some((u(v.get(0)?)?, u(v.get(1)?)?));
        let inputs = s
            .get("inputs")?
            .as_array()?
            .iter()
            .map(|r| {
                Some(InputRecord {
                    path: PathBuf::from(r.get("path")?.as_str()?),
                    bytes: u(r.get("bytes")?)?,
                    sha256: r.get("sha256")?.as_str().map(str::to_string),
                    range: pair(r.get("range")?)?,
                    uncompressed_bytes: r.get("uncompressed_bytes").and_then(Value::as_u64),
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Summary {
            num_tokens: self.tokens,
            num_documents: self.documents,
            dtype: job.opts.dtype,
            inputs,
            byte_range: pair(s.get("byte_range")?)?,
            resumed_tokens: self.tokens,
            restart_reason: None,
            text_bytes: 0,
            partial_path: partial.to_path_buf(),
        })
    }
}

pub(crate) fn summary_to_json(s: &Summary) -> Value {
    json!({
        "inputs": s.inputs.iter().map(|r| json!({
            "path": r.path.to_string_lossy(),
            "bytes": r.bytes,
            "sha256": r.sha256,
            "range": [r.range.0, r.range.1],
            "uncompressed_bytes": r.uncompressed_bytes,
        })).collect::<Vec<_>>(),
        "byte_range": [s.byte_range.0, s.byte_range.1],
    })
}
