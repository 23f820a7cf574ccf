//! Parquet inputs: the documents of one text column, decoded by the `parquet` crate a
//! batch of rows at a time straight into a [`DocBatch`] (no Arrow arrays, no Python).
//!
//! Memory stays flat: the crate reads one page at a time, and a batch holds about
//! `batch_bytes` of text. Rows are read in file order, row group after row group; a
//! null is no document. Every codec of the format but LZO is compiled in (snappy, gzip,
//! brotli, zstd, lz4 and lz4_raw), which is every codec pyarrow writes.

use std::fs::File;
use std::path::{Path, PathBuf};

use parquet::basic::{ConvertedType, LogicalType, Type as PhysicalType};
use parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use parquet::data_type::{ByteArray, ByteArrayType};
use parquet::file::reader::FileReader;
use parquet::file::serialized_reader::SerializedFileReader;

use super::docs::DocBatch;
use super::ShardError;

/// Text per batch: about one encoder chunk, so the batch is handed to the encoder whole.
pub const PARQUET_BATCH_BYTES: usize = 1 << 20;

/// The documents of one column of a Parquet file, in row order.
pub struct ParquetDocs {
    path: PathBuf,
    reader: SerializedFileReader<File>,
    column: usize,
    /// Text bytes per row: the file's uncompressed column size until rows are read, then
    /// what they held (a dictionary-encoded column's size says little about its text).
    row_bytes: f64,
    rows_seen: u64,
    bytes_seen: u64,
    batch_bytes: usize,
    next_group: usize,
    current: Option<ColumnReaderImpl<ByteArrayType>>,
    values: Vec<ByteArray>,
    levels: Vec<i16>,
}

impl ParquetDocs {
    /// Open `path` and find its text column `column`: a top-level column's name, or the
    /// dotted path of a column inside structs (`meta.text`).
    pub fn open(path: &Path, column: &str, batch_bytes: usize) -> Result<ParquetDocs, ShardError> {
        guarded(path, || Self::open_unguarded(path, column, batch_bytes))
    }

    fn open_unguarded(path: &Path, column: &str, batch_bytes: usize) -> Result<ParquetDocs, ShardError> {
        let file = File::open(path).map_err(|e| ShardError::io(path, "reading input", e))?;
        let reader = SerializedFileReader::new(file).map_err(|e| unreadable(path, e))?;
        let meta = reader.metadata();
        let schema = meta.file_metadata().schema_descr();
        let fields = schema.root_schema().get_fields();
        // A top-level column named with a dot wins over the path through a struct.
        let parts: Vec<String> = if fields.iter().any(|f| f.name() == column) {
            vec![column.to_string()]
        } else {
            column.split('.').map(str::to_string).collect()
        };
        let columns = schema.columns();
        let leaf = columns.iter().position(|c| c.path().parts() == parts.as_slice());
        let inside: Vec<String> = columns
            .iter()
            .filter(|c| c.path().parts().len() > parts.len() && c.path().parts().starts_with(&parts))
            .map(|c| c.path().string())
            .collect();
        if leaf.is_none() && inside.is_empty() {
            let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
            let mut shown = names.iter().take(12).copied().collect::<Vec<_>>().join(", ");
            if names.len() > 12 {
                shown.push_str(" ...");
            }
            return Err(ShardError::Invalid(format!(
                "{} has no column '{column}' (its columns: {shown}); choose one with --column \
                 (a column inside a struct by its dotted path, e.g. meta.text)",
                path.display()
            )));
        }
        let Some(index) = leaf.filter(|&i| columns[i].max_rep_level() == 0) else {
            let hint = if inside.is_empty() {
                String::new()
            } else {
                let shown: Vec<&str> = inside.iter().take(12).map(String::as_str).collect();
                format!(" (the columns inside it go by their dotted paths: {})", shown.join(", "))
            };
            return Err(ShardError::Invalid(format!(
                "column '{column}' of {} is nested (a list or struct), not a string column{hint}",
                path.display()
            )));
        };
        let desc = &schema.columns()[index];
        if let Some(kind) = not_text(desc.physical_type(), desc.logical_type_ref(), desc.converted_type()) {
            return Err(ShardError::Invalid(format!(
                "column '{column}' of {} is of type {kind}, not a string column",
                path.display()
            )));
        }
        let (rows, bytes) = meta
            .row_groups()
            .iter()
            .fold((0i64, 0i64), |(r, b), g| (r + g.num_rows(), b + g.column(index).uncompressed_size()));
        let row_bytes = if rows > 0 { (bytes as f64 / rows as f64).max(1.0) } else { 1024.0 };
        Ok(ParquetDocs {
            path: path.to_path_buf(),
            reader,
            column: index,
            row_bytes,
            rows_seen: 0,
            bytes_seen: 0,
            batch_bytes: batch_bytes.max(1),
            next_group: 0,
            current: None,
            values: Vec::new(),
            levels: Vec::new(),
        })
    }

    /// Rows in the file (documents, nulls included).
    pub fn num_rows(&self) -> u64 {
        self.reader.metadata().file_metadata().num_rows().max(0) as u64
    }

    /// Replace `batch` with the next documents (about `batch_bytes` of text, whole
    /// documents); `false`, with `batch` empty, at the end of the file.
    pub fn next_batch(&mut self, batch: &mut DocBatch) -> Result<bool, ShardError> {
        let path = self.path.clone();
        let r = guarded(&path, || self.fill(batch));
        if r.is_err() {
            // A file that failed once yields nothing more.
            batch.data.clear();
            batch.ends.clear();
            self.current = None;
            self.next_group = self.reader.num_row_groups();
        }
        r
    }

    fn fill(&mut self, batch: &mut DocBatch) -> Result<bool, ShardError> {
        batch.data.clear();
        batch.ends.clear();
        while batch.data.len() < self.batch_bytes {
            let Some(reader) = self.current.as_mut() else {
                if !self.open_next_group()? {
                    break;
                }
                continue;
            };
            // Rows for what the batch still lacks (a batch overshoots by about one row).
            let want = ((self.batch_bytes - batch.data.len()) as f64 / self.row_bytes).ceil();
            let first = self.rows_seen == 0;
            let want = (want as usize).clamp(1, if first { 256 } else { 1 << 16 });
            self.values.clear();
            self.levels.clear();
            let (rows, _, _) = reader
                .read_records(want, Some(&mut self.levels), None, &mut self.values)
                .map_err(|e| unreadable(&self.path, e))?;
            if rows == 0 {
                self.current = None;
                continue;
            }
            let before = batch.data.len();
            for v in &self.values {
                batch.data.extend_from_slice(v.data());
                batch.ends.push(batch.data.len());
            }
            self.rows_seen += rows as u64;
            self.bytes_seen += (batch.data.len() - before) as u64;
            self.row_bytes = (self.bytes_seen as f64 / self.rows_seen as f64).max(1.0);
        }
        Ok(!batch.is_empty())
    }

    fn open_next_group(&mut self) -> Result<bool, ShardError> {
        if self.next_group >= self.reader.num_row_groups() {
            return Ok(false);
        }
        let group = self.reader.get_row_group(self.next_group).map_err(|e| unreadable(&self.path, e))?;
        self.next_group += 1;
        match group.get_column_reader(self.column).map_err(|e| unreadable(&self.path, e))? {
            ColumnReader::ByteArrayColumnReader(r) => self.current = Some(r),
            _ => return Err(unreadable(&self.path, "the column's pages are not byte arrays")),
        }
        Ok(true)
    }
}

/// Why a column of these types is not text (`None`: it is). Byte arrays without a
/// logical type are taken as text, as some writers store strings so; the encoder checks
/// that each document is UTF-8.
fn not_text(physical: PhysicalType, logical: Option<&LogicalType>, converted: ConvertedType) -> Option<String> {
    if physical != PhysicalType::BYTE_ARRAY {
        return Some(physical.to_string());
    }
    match logical {
        None | Some(LogicalType::String | LogicalType::Enum | LogicalType::Json) => None,
        Some(other) => Some(format!("{other:?}")),
    }
    .or(match converted {
        ConvertedType::NONE | ConvertedType::UTF8 | ConvertedType::ENUM | ConvertedType::JSON => None,
        other => Some(other.to_string()),
    })
}

/// `f`, with a panic of the decoder (a malformed file it did not expect) as an error.
fn guarded<T>(path: &Path, f: impl FnOnce() -> Result<T, ShardError>) -> Result<T, ShardError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|p| Err(unreadable(path, crate::shards::panic_message(&p))))
}

fn unreadable(path: &Path, e: impl std::fmt::Display) -> ShardError {
    ShardError::Invalid(format!("{}: not a readable Parquet file ({e})", path.display()))
}
