//! Tests of the shard pipeline with injected encoders. The main one maps each
//! pre-token piece to an id derived from its bytes, so any chunk cut that changed the
//! pre-tokenization would change the output.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;
use crate::pretokenize::PreTokenizer;

const EOT: &str = "<|endoftext|>";
const EOT_ID: u32 = 50_000;

/// Special-aware encoder: `<|endoftext|>` → EOT_ID; other text cut by the pattern, each
/// piece → a hash of its bytes below 50,000.
struct PieceEncoder {
    pre: PreTokenizer,
}

impl PieceEncoder {
    fn new(pattern: &str) -> Self {
        PieceEncoder { pre: PreTokenizer::new(pattern).unwrap() }
    }
    fn ordinary(&self, text: &str, out: &mut Vec<u32>) {
        self.pre.for_each_piece(text, |p| {
            let mut h: u32 = 2166136261;
            for &b in p.as_bytes() {
                h = (h ^ b as u32).wrapping_mul(16777619);
            }
            out.push(h % 50_000);
        });
    }
}

impl TextEncoder for PieceEncoder {
    fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut rest = text;
        while let Some(p) = rest.find(EOT) {
            self.ordinary(&rest[..p], out);
            out.push(EOT_ID);
            rest = &rest[p + EOT.len()..];
        }
        self.ordinary(rest, out);
    }
    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        self.ordinary(text, out)
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "ferrolm-shards-test-{}-{}-{name}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    fn write(&self, name: &str, data: &[u8]) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, data).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A small deterministic pseudo-random generator (no extra dependency).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Text with the awkward bits: runs of spaces and newlines, punctuation before newlines,
/// digits, contractions, non-ASCII letters, CRLF, tabs.
fn random_doc(rng: &mut Rng, words: usize) -> String {
    const PARTS: &[&str] = &[
        "the",
        "cat",
        "Ünïcode",
        "数据",
        "it's",
        "we'll",
        "123",
        "45678",
        ".",
        "!!",
        "?",
        "\n",
        "\n\n",
        "  ",
        " ",
        "\t",
        "\r\n",
        "...\n",
        "x",
        "Hello",
        "naïve",
        "—",
        ":)",
        "\n  \n",
        "don't",
        "ÉCOLE",
        "a1b2",
        "\u{00a0}",
    ];
    let mut s = String::new();
    for _ in 0..words {
        s.push_str(PARTS[rng.below(PARTS.len() as u64) as usize]);
        if rng.below(3) > 0 {
            s.push(' ');
        }
    }
    s
}

fn corpus(seed: u64, docs: usize) -> String {
    let mut rng = Rng(seed);
    let mut s = String::new();
    for _ in 0..docs {
        let n = 5 + rng.below(200) as usize;
        s.push_str(&random_doc(&mut rng, n));
        s.push('\n');
        s.push_str(EOT);
        s.push('\n');
    }
    s
}

fn job(dir: &TempDir, inputs: &[PathBuf], out: &str) -> EncodeJob {
    let opts = ShardOptions {
        eos: Some((EOT.to_string(), EOT_ID)),
        chunk_size: 4096,
        threads: 2,
        params: "test".into(),
        // fsync per chunk is slow on this disk; the resume test commits every chunk.
        commit_interval: Duration::from_secs(3600),
        ..ShardOptions::new(Dtype::U16)
    };
    EncodeJob::new(inputs.to_vec(), dir.path(out), opts)
}

fn run(job: &EncodeJob, enc: &dyn TextEncoder) -> Result<(Summary, Vec<u32>), ShardError> {
    let s = encode_to_shard(job, enc, |_| true)?;
    Ok((s.clone(), read_ids(&s.partial_path, job.opts.dtype)))
}

fn read_ids(path: &Path, dtype: Dtype) -> Vec<u32> {
    let bytes = std::fs::read(path).unwrap();
    match dtype {
        Dtype::U16 => bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect(),
        Dtype::U32 => bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    }
}

fn whole(enc: &dyn TextEncoder, text: &str) -> Vec<u32> {
    let mut v = Vec::new();
    enc.encode(text, &mut v);
    v
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(data).iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn options_come_by_name_and_inputs_from_paths() {
    assert_eq!("uint32".parse::<Dtype>(), Ok(Dtype::U32));
    assert_eq!("int8".parse::<Dtype>().unwrap_err(), "dtype must be uint16 or uint32, got \"int8\"");
    assert_eq!(Format::given(None), Ok(None));
    assert_eq!(Format::given(Some("auto")), Ok(None));
    assert_eq!(Format::given(Some("jsonl")), Ok(Some(Format::Jsonl)));
    assert!(Format::given(Some("csv")).unwrap_err().contains("auto, text or jsonl, got \"csv\""));
    let opts = ShardOptions { input_format: Some(Format::Text), ..ShardOptions::new(Dtype::U16) };
    let paths = vec![PathBuf::new(), PathBuf::from("a.jsonl.gz"), PathBuf::from("b.parquet")];
    let job = EncodeJob::new(paths, PathBuf::from("o.bin"), opts.clone());
    let kinds: Vec<_> = job.inputs.iter().map(|s| (s.format, s.compression, s.format_given)).collect();
    assert_eq!(
        kinds,
        [
            (Format::Docs, Compression::None, true),
            (Format::Text, Compression::Gzip, true),
            (Format::Text, Compression::None, true)
        ]
    );
    let guessed =
        EncodeJob::new(vec![PathBuf::from("a.jsonl.gz")], PathBuf::from("o.bin"), ShardOptions::new(Dtype::U16));
    assert_eq!((guessed.inputs[0].format, guessed.inputs[0].format_given), (Format::Jsonl, false));
}

#[test]
fn output_equals_whole_text_encoding_for_any_chunk_size_and_threads() {
    let dir = TempDir::new("chunks");
    let text = corpus(1, 300);
    let input = dir.write("in.txt", text.as_bytes());
    let enc = PieceEncoder::new("gpt2");
    let expected = whole(&enc, &text);
    assert_eq!(expected.iter().filter(|&&t| t == EOT_ID).count(), 300);
    for (chunk_size, threads, window) in [(64, 1, 0), (100, 2, 0), (4096, 3, 1), (1 << 20, 2, 0), (777, 4, 3)] {
        let mut j = job(&dir, std::slice::from_ref(&input), &format!("out-{chunk_size}-{threads}.bin"));
        j.opts.chunk_size = chunk_size;
        j.opts.threads = threads;
        j.opts.window = window;
        let (s, ids) = run(&j, &enc).unwrap();
        assert_eq!(ids, expected, "chunk_size {chunk_size} threads {threads}");
        assert_eq!(s.num_tokens, expected.len() as u64);
        assert_eq!(s.num_documents, 300);
        assert_eq!(s.inputs.len(), 1);
        assert_eq!(s.inputs[0].sha256.as_deref().unwrap(), sha256_hex(text.as_bytes()));
        assert_eq!(s.inputs[0].bytes, text.len() as u64);
    }
}

#[test]
fn newline_cuts_are_exact_for_builtin_patterns() {
    // One long document without any separator: only newline cuts are possible.
    let dir = TempDir::new("newline");
    let mut rng = Rng(7);
    let mut text = String::new();
    for _ in 0..400 {
        let n = 3 + rng.below(40) as usize;
        text.push_str(&random_doc(&mut rng, n));
        text.push_str(["x\ny", ".\nA", "a\n\nb", " \n c", "!\n'", "1\n2"][rng.below(6) as usize]);
    }
    text.push_str("end.");
    let input = dir.write("long.txt", text.as_bytes());
    for pattern in ["gpt2", "cl100k", "o200k"] {
        let enc = PieceEncoder::new(pattern);
        let mut expected = whole(&enc, &text);
        expected.push(EOT_ID); // the unterminated last document gets its eos
        for chunk_size in [16, 200, 5000] {
            let mut j = job(&dir, std::slice::from_ref(&input), &format!("nl-{pattern}-{chunk_size}.bin"));
            j.opts.chunk_size = chunk_size;
            let (_, ids) = run(&j, &enc).unwrap();
            assert_eq!(ids, expected, "pattern {pattern} chunk {chunk_size}");
        }
    }
}

#[test]
fn a_document_longer_than_the_chunk_grows_the_chunk_when_no_cut_is_allowed() {
    let dir = TempDir::new("grow");
    let text = format!("{}{EOT}\nshort{EOT}\n", "word \n\n ".repeat(5000));
    let input = dir.write("in.txt", text.as_bytes());
    let enc = PieceEncoder::new("gpt2");
    let mut j = job(&dir, &[input], "out.bin");
    j.opts.chunk_size = 100;
    j.opts.newline_cuts = false;
    let (s, ids) = run(&j, &enc).unwrap();
    assert_eq!(ids, whole(&enc, &text));
    assert_eq!(s.num_documents, 2);
}

#[test]
fn unterminated_last_document_gets_an_eos_but_whitespace_tail_does_not() {
    let dir = TempDir::new("tail");
    let enc = PieceEncoder::new("gpt2");
    let a = dir.write("a.txt", format!("one{EOT}\ntwo").as_bytes());
    let b = dir.write("b.txt", format!("three{EOT}\n\n").as_bytes());
    let c = dir.write("c.txt", b"");
    let (s, ids) = run(&job(&dir, &[a, c, b], "out.bin"), &enc).unwrap();
    let mut expected = whole(&enc, &format!("one{EOT}\ntwo"));
    expected.push(EOT_ID);
    expected.extend(whole(&enc, &format!("three{EOT}\n\n")));
    assert_eq!(ids, expected);
    assert_eq!(s.num_documents, 3);
    assert_eq!(s.inputs.len(), 3);
    assert_eq!(s.inputs[1].sha256.as_deref().unwrap(), sha256_hex(b""));
    // Without hashing: the same ids, no sha256.
    let mut j = job(&dir, &[dir.path("a.txt"), dir.path("c.txt"), dir.path("b.txt")], "nohash.bin");
    j.opts.hash = false;
    let (s, ids2) = run(&j, &enc).unwrap();
    assert_eq!(ids2, expected);
    assert!(s.inputs.iter().all(|r| r.sha256.is_none()));
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

#[test]
fn gzip_and_zstd_inputs_give_the_plain_output_and_hash_the_compressed_bytes() {
    let dir = TempDir::new("compressed");
    let text = corpus(3, 200);
    let enc = PieceEncoder::new("gpt2");
    let plain = dir.write("in.txt", text.as_bytes());
    // Two gzip members concatenated (as `cat a.gz b.gz`): MultiGzDecoder reads both.
    let half = text.len() / 2;
    let mut gz = gzip(&text.as_bytes()[..half]);
    gz.extend(gzip(&text.as_bytes()[half..]));
    let gz_path = dir.write("in.txt.gz", &gz);
    let zst = zstd::encode_all(text.as_bytes(), 3).unwrap();
    let zst_path = dir.write("in.txt.zst", &zst);
    let (_, expected) = run(&job(&dir, &[plain], "plain.bin"), &enc).unwrap();
    for (path, raw) in [(gz_path, gz.clone()), (zst_path, zst.clone())] {
        let out = format!("{}.bin", path.file_name().unwrap().to_string_lossy());
        let (s, ids) = run(&job(&dir, std::slice::from_ref(&path), &out), &enc).unwrap();
        assert_eq!(ids, expected, "{}", path.display());
        assert_eq!(s.inputs[0].sha256.as_deref().unwrap(), sha256_hex(&raw));
        assert_eq!(s.inputs[0].bytes, raw.len() as u64);
        assert_eq!(s.inputs[0].uncompressed_bytes, Some(text.len() as u64));
    }
}

#[test]
fn corrupt_and_truncated_gzip_are_errors_naming_the_file() {
    let dir = TempDir::new("corrupt");
    let enc = PieceEncoder::new("gpt2");
    let gz = gzip(corpus(4, 50).as_bytes());
    let mut corrupt = gz.clone();
    for b in &mut corrupt[20..60] {
        *b ^= 0x5a;
    }
    let truncated = &gz[..gz.len() / 2];
    for (name, data) in [("corrupt.txt.gz", &corrupt[..]), ("truncated.txt.gz", truncated), ("notgz.txt.gz", b"hello")]
    {
        let p = dir.write(name, data);
        let err = run(&job(&dir, &[p], "out.bin"), &enc).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, ShardError::Corrupt { .. }), "{name}: {msg}");
        assert!(msg.contains(name) && msg.contains("gzip"), "{msg}");
    }
}

#[test]
fn missing_input_is_an_error_before_anything_is_written() {
    let dir = TempDir::new("missing");
    let j = job(&dir, &[dir.path("nope.txt")], "out.bin");
    let err = run(&j, &PieceEncoder::new("gpt2")).unwrap_err();
    assert!(err.to_string().contains("nope.txt") && err.to_string().contains("not found"), "{err}");
    assert!(!j.partial_path().exists());
}

#[test]
fn invalid_utf8_is_an_error_with_offset_or_replaced() {
    let dir = TempDir::new("utf8");
    let enc = PieceEncoder::new("gpt2");
    let mut data = corpus(5, 40).into_bytes();
    let bad_at = data.len() / 2;
    // Put the bad byte right after an ASCII byte, so it is not inside a multi-byte character.
    let bad_at = (bad_at..data.len()).find(|&i| data[i - 1].is_ascii() && data[i].is_ascii()).unwrap();
    data[bad_at] = 0xff;
    let p = dir.write("bad.txt", &data);
    let mut j = job(&dir, std::slice::from_ref(&p), "out.bin");
    j.opts.chunk_size = 256;
    let err = run(&j, &enc).unwrap_err();
    match &err {
        ShardError::Utf8 { offset, .. } => assert_eq!(*offset, bad_at as u64),
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains(&format!("offset {bad_at}")));
    // Bad input leaves no partial output or journal behind.
    assert!(!j.partial_path().exists() && !j.journal_path().exists());
    j.opts.errors = Utf8Errors::Replace;
    j.out_bin = dir.path("replaced.bin");
    let (_, ids) = run(&j, &enc).unwrap();
    assert_eq!(ids, whole(&enc, &String::from_utf8_lossy(&data)));
}

#[test]
fn jsonl_documents_are_encoded_as_ordinary_text_each_followed_by_eos() {
    let dir = TempDir::new("jsonl");
    let enc = PieceEncoder::new("gpt2");
    let docs = ["first doc", "second\n\"quoted\" <|endoftext|> inside", "third é"];
    let mut data = String::new();
    for (i, d) in docs.iter().enumerate() {
        data.push_str(&serde_json::json!({"id": i, "text": d}).to_string());
        data.push_str(if i == 1 { "\r\n\n" } else { "\n" });
    }
    let p = dir.write("docs.jsonl", data.as_bytes());
    let (s, ids) = run(&job(&dir, &[p], "out.bin"), &enc).unwrap();
    let mut expected = Vec::new();
    for d in docs {
        enc.encode_ordinary(d, &mut expected);
        expected.push(EOT_ID);
    }
    assert_eq!(ids, expected);
    assert_eq!(s.num_documents, 3);

    let bad = dir.write("bad.jsonl", b"{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
    let err = run(&job(&dir, &[bad], "bad.bin"), &enc).unwrap_err();
    assert!(err.to_string().contains("bad.jsonl:2:") && err.to_string().contains("\"text\""), "{err}");
}

#[test]
fn token_ids_that_do_not_fit_the_dtype_are_an_error() {
    let dir = TempDir::new("dtype");
    let p = dir.write("in.txt", b"abc");
    let big = |t: &str, out: &mut Vec<u32>| out.extend(t.bytes().map(|b| 70_000 + b as u32));
    let j = job(&dir, &[p], "out.bin");
    let err = run(&j, &big).unwrap_err();
    assert!(err.to_string().contains("70097") && err.to_string().contains("uint16"), "{err}");
    let mut j32 = j.clone();
    j32.opts.dtype = Dtype::U32;
    j32.opts.eos = None;
    let (_, ids) = run(&j32, &big).unwrap();
    assert_eq!(ids, vec![70_097, 70_098, 70_099]);
}

#[test]
fn an_interrupted_run_resumes_to_the_same_bytes() {
    let dir = TempDir::new("resume");
    let text = corpus(9, 400);
    let input = dir.write("in.txt", text.as_bytes());
    let enc = PieceEncoder::new("gpt2");
    let mut j = job(&dir, &[input], "out.bin");
    j.opts.chunk_size = 1000;
    j.opts.commit_interval = Duration::ZERO;
    let reference = {
        let mut r = j.clone();
        r.out_bin = dir.path("ref.bin");
        run(&r, &enc).unwrap().1
    };
    for stop_after in [1usize, 5, 17] {
        let _ = std::fs::remove_file(j.journal_path());
        let mut calls = 0;
        let err = encode_to_shard(&j, &enc, |_| {
            calls += 1;
            calls < stop_after
        })
        .unwrap_err();
        assert!(matches!(err, ShardError::Interrupted));
        // What a kill -9 after the last commit leaves: junk after the committed tokens.
        let mut f = std::fs::OpenOptions::new().append(true).open(j.partial_path()).unwrap();
        f.write_all(&[0xAB; 999]).unwrap();
        drop(f);
        let s = encode_to_shard(&j, &enc, |_| true).unwrap();
        assert!(s.resumed_tokens > 0, "stop_after {stop_after}");
        assert_eq!(read_ids(&s.partial_path, j.opts.dtype), reference, "stop_after {stop_after}");
        assert_eq!(s.inputs[0].sha256.as_deref().unwrap(), sha256_hex(text.as_bytes()));
        // Running again once complete returns the recorded summary without re-encoding.
        let again = encode_to_shard(&j, &enc, |_| panic!("no work expected")).unwrap();
        assert_eq!(again.num_tokens, s.num_tokens);
        assert_eq!(again.inputs[0].sha256, s.inputs[0].sha256);
    }
    // A journal with other parameters is not resumed.
    let _ = std::fs::remove_file(j.journal_path());
    let mut calls = 0;
    let _ = encode_to_shard(&j, &enc, |_| {
        calls += 1;
        calls < 3
    });
    let mut other = j.clone();
    other.opts.params = "other".into();
    let s = encode_to_shard(&other, &enc, |_| true).unwrap();
    assert_eq!(s.resumed_tokens, 0);
    assert!(s.restart_reason.is_some());
    assert_eq!(read_ids(&s.partial_path, j.opts.dtype), reference);
}

#[test]
fn parts_tile_the_inputs_and_concatenate_to_the_whole() {
    let dir = TempDir::new("parts");
    let enc = PieceEncoder::new("gpt2");
    let a = dir.write("a.txt", corpus(11, 120).as_bytes());
    let b = dir.write("b.txt.gz", &gzip(corpus(12, 60).as_bytes()));
    let mut jl = String::new();
    for i in 0..50 {
        jl.push_str(&serde_json::json!({"text": format!("json doc {i}\n")}).to_string());
        jl.push('\n');
    }
    let c = dir.write("c.jsonl", jl.as_bytes());
    let d = dir.write("d.txt", b"no separator at all\nin this\nfile");
    let inputs = vec![a, b, c, d];
    let (_, whole_ids) = run(&job(&dir, &inputs, "whole.bin"), &enc).unwrap();
    for n in [1u64, 2, 3, 7, 40] {
        let mut cat = Vec::new();
        let mut prev_end = 0;
        for i in 0..n {
            let mut j = job(&dir, &inputs, &format!("p{i}of{n}.bin"));
            j.opts.part = Some((i, n));
            j.opts.chunk_size = 500;
            let (s, ids) = run(&j, &enc).unwrap();
            assert_eq!(s.byte_range.0, prev_end, "part {i}/{n}");
            prev_end = s.byte_range.1;
            cat.extend(ids);
        }
        let total: u64 = inputs.iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
        assert_eq!(prev_end, total);
        assert_eq!(cat, whole_ids, "n = {n}");
    }
}

fn docs_job(dir: &TempDir, inputs: usize, out: &str) -> EncodeJob {
    let mut j = job(dir, &[], out);
    j.inputs = (0..inputs).map(|_| InputSpec::documents()).collect();
    j
}

/// The documents of a `corpus` text (its whitespace after the last separator is none).
fn split_docs(text: &str) -> Vec<String> {
    let mut docs: Vec<String> = text.split(EOT).map(str::to_string).collect();
    assert!(docs.pop().unwrap().trim().is_empty());
    docs
}

#[test]
fn documents_from_a_source_encode_as_the_same_documents_in_a_text_file() {
    let dir = TempDir::new("docs");
    let enc = PieceEncoder::new("gpt2");
    let (a, b) = (split_docs(&corpus(21, 120)), split_docs(&corpus(22, 80)));
    let text = |docs: &[String]| docs.join(EOT) + EOT;
    let files = [dir.write("a.txt", text(&a).as_bytes()), dir.write("b.txt", text(&b).as_bytes())];
    let (_, reference) = run(&job(&dir, &files, "ref.bin"), &enc).unwrap();
    for (threads, chunk_size, batch) in [(1, 1, 1), (2, 700, 7), (3, 1 << 20, 1000)] {
        let mut j = docs_job(&dir, 2, "docs.bin");
        (j.opts.threads, j.opts.chunk_size) = (threads, chunk_size);
        let mut src = VecSource::new(vec![a.clone(), b.clone()], batch);
        let s = encode_to_shard_with(&j, &enc, Some(&mut src), |_| true).unwrap();
        assert!(read_ids(&s.partial_path, j.opts.dtype) == reference, "threads {threads} chunk {chunk_size}");
        assert_eq!(s.num_documents, 200);
        std::fs::remove_file(j.journal_path()).unwrap();
    }
}

#[test]
fn documents_resume_after_an_interruption_and_need_a_source() {
    let dir = TempDir::new("docs-resume");
    let enc = PieceEncoder::new("gpt2");
    let docs = split_docs(&corpus(23, 300));
    let mut j = docs_job(&dir, 1, "out.bin");
    (j.opts.chunk_size, j.opts.commit_interval) = (500, Duration::ZERO);
    let mut src = VecSource::new(vec![docs.clone()], 10);
    let reference = {
        let mut r = j.clone();
        r.out_bin = dir.path("ref.bin");
        read_ids(&encode_to_shard_with(&r, &enc, Some(&mut src), |_| true).unwrap().partial_path, j.opts.dtype)
    };
    let mut calls = 0;
    let mut src = VecSource::new(vec![docs.clone()], 10);
    let err = encode_to_shard_with(&j, &enc, Some(&mut src), |_| {
        calls += 1;
        calls < 9
    })
    .unwrap_err();
    assert!(matches!(err, ShardError::Interrupted));
    let mut src = VecSource::new(vec![docs], 10);
    let s = encode_to_shard_with(&j, &enc, Some(&mut src), |_| true).unwrap();
    assert!(s.resumed_tokens > 0 && s.restart_reason.is_none());
    assert!(read_ids(&s.partial_path, j.opts.dtype) == reference);
    // A file named and marked as Parquet that is not is an error naming it.
    let parquet = dir.write("x.parquet", b"PAR1 not really");
    let err = run(&job(&dir, &[parquet], "p.bin"), &enc).unwrap_err().to_string();
    assert!(err.contains("x.parquet") && err.contains("Parquet"), "{err}");
}

/// Run `j` and stop it (as Ctrl-C does) at its progress report after `written` chunks.
/// The first report waits a moment: a Parquet input's hash runs on a thread of its own and
/// no journal is committed before it is known, so a stop that came first (a loaded
/// machine) would leave nothing to resume.
fn interrupt_after(j: &EncodeJob, enc: &dyn TextEncoder, written: usize) -> ShardError {
    let mut calls = 0;
    encode_to_shard(j, enc, |_| {
        calls += 1;
        if calls == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        calls <= written
    })
    .unwrap_err()
}

/// A Parquet file of one optional UTF-8 column `text` (a `None` is a null), written by
/// the `parquet` crate, `per_group` rows per row group.
fn write_parquet(path: &Path, docs: &[Option<String>], per_group: usize, codec: ::parquet::basic::Compression) {
    use ::parquet::data_type::{ByteArray, ByteArrayType};
    use ::parquet::file::properties::WriterProperties;
    use ::parquet::file::writer::SerializedFileWriter;
    use std::sync::Arc;
    let schema = Arc::new(
        ::parquet::schema::parser::parse_message_type("message m { required int64 id; optional binary text (UTF8); }")
            .unwrap(),
    );
    let props = Arc::new(WriterProperties::builder().set_compression(codec).set_data_page_size_limit(4096).build());
    let mut w = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props).unwrap();
    for (g, group) in docs.chunks(per_group).enumerate() {
        let mut rg = w.next_row_group().unwrap();
        let ids: Vec<i64> = (0..group.len() as i64).map(|i| (g * per_group) as i64 + i).collect();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<::parquet::data_type::Int64Type>().write_batch(&ids, None, None).unwrap();
        col.close().unwrap();
        let values: Vec<ByteArray> = group.iter().flatten().map(|d| ByteArray::from(d.as_str())).collect();
        let defs: Vec<i16> = group.iter().map(|d| d.is_some() as i16).collect();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>().write_batch(&values, Some(&defs), None).unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

#[test]
fn parquet_files_encode_as_the_same_documents_in_a_text_file_and_resume() {
    use ::parquet::basic::{Compression as Codec, ZstdLevel};
    let dir = TempDir::new("parquet");
    let enc = PieceEncoder::new("gpt2");
    let docs = split_docs(&corpus(25, 600));
    let (_, reference) =
        run(&job(&dir, &[dir.write("d.txt", (docs.join(EOT) + EOT).as_bytes())], "ref.bin"), &enc).unwrap();
    // Nulls are no document.
    let rows: Vec<Option<String>> = docs
        .iter()
        .enumerate()
        .flat_map(|(i, d)| [Some(d.clone())].into_iter().chain((i % 50 == 0).then_some(None)))
        .collect();
    for (codec, threads, chunk_size) in
        [(Codec::UNCOMPRESSED, 1, 1 << 20), (Codec::SNAPPY, 2, 700), (Codec::ZSTD(ZstdLevel::default()), 3, 1)]
    {
        let path = dir.path("d.parquet");
        write_parquet(&path, &rows, 97, codec);
        let mut j = job(&dir, std::slice::from_ref(&path), "p.bin");
        (j.opts.threads, j.opts.chunk_size) = (threads, chunk_size);
        let (s, ids) = run(&j, &enc).unwrap();
        assert!(ids == reference, "{codec:?}");
        assert_eq!(s.num_documents, docs.len() as u64);
        std::fs::remove_file(j.journal_path()).unwrap();
    }
    // Killed part way (a progress callback that stops it), then resumed: the same bytes.
    let path = dir.path("d.parquet");
    let mut j = job(&dir, std::slice::from_ref(&path), "r.bin");
    (j.opts.chunk_size, j.opts.commit_interval) = (500, Duration::ZERO);
    assert!(matches!(interrupt_after(&j, &enc, 20), ShardError::Interrupted));
    let s = encode_to_shard(&j, &enc, |_| true).unwrap();
    assert!(s.resumed_tokens > 0 && s.restart_reason.is_none());
    assert!(read_ids(&s.partial_path, j.opts.dtype) == reference);
    // A column that is not there, or not text, is named.
    let mut j = job(&dir, std::slice::from_ref(&path), "c.bin");
    j.opts.jsonl_field = "body".into();
    let err = run(&j, &enc).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("no column 'body'") && err.contains("id, text"), "{err}");
    j.opts.jsonl_field = "id".into();
    let err = run(&j, &enc).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("INT64, not a string column"), "{err}");
}

#[test]
fn an_input_edited_in_place_is_not_resumed_into_a_mixed_shard() {
    let dir = TempDir::new("edited");
    let enc = PieceEncoder::new("gpt2");
    let text = corpus(24, 400);
    let input = dir.write("in.txt", text.as_bytes());
    let mut j = job(&dir, std::slice::from_ref(&input), "out.bin");
    (j.opts.chunk_size, j.opts.commit_interval) = (1000, Duration::ZERO);
    interrupt_after(&j, &enc, 9);
    // Same size, same parameters (the caller's record of size and time), new first word.
    let edited = text.replacen(|c: char| c.is_ascii_lowercase(), "Q", 1);
    assert_eq!(edited.len(), text.len());
    std::fs::write(&input, edited.as_bytes()).unwrap();
    let s = encode_to_shard(&j, &enc, |_| true).unwrap();
    assert_eq!(s.resumed_tokens, 0);
    assert!(s.restart_reason.as_deref().unwrap().contains("content differs"), "{:?}", s.restart_reason);
    let mut fresh = j.clone();
    fresh.out_bin = dir.path("fresh.bin");
    assert!(read_ids(&s.partial_path, j.opts.dtype) == run(&fresh, &enc).unwrap().1);
}

#[test]
fn formats_are_recognised_by_content_and_unsupported_ones_named() {
    let dir = TempDir::new("sniff");
    let enc = PieceEncoder::new("gpt2");
    let lines = "{\"text\": \"hello there\"}\n{\"text\": \"bye\", \"id\": 2}\n";
    let (_, want) = run(&job(&dir, &[dir.write("a.jsonl", lines.as_bytes())], "want.bin"), &enc).unwrap();
    for name in ["records.json", "records.txt", "records"] {
        let (_, got) = run(&job(&dir, &[dir.write(name, lines.as_bytes())], "got.bin"), &enc).unwrap();
        assert_eq!(got, want, "{name}");
        std::fs::remove_file(dir.path("got.progress.json")).unwrap();
    }
    let gz = dir.write("records.json.gz", &gzip(lines.as_bytes()));
    assert_eq!(run(&job(&dir, &[gz], "gz.bin"), &enc).unwrap().1, want);
    // An object on the first line without the document field stays text for other names.
    let other = "{\"a\": 1} is how the config starts\n";
    let (_, ids) = run(&job(&dir, &[dir.write("notes.txt", other.as_bytes())], "n.bin"), &enc).unwrap();
    assert_eq!(ids.len(), whole(&enc, other).len() + 1);
    for (name, data, says) in [
        ("a.txt.xz", &b"\xfd7zXZ\x00\x00rest"[..], "xz"),
        ("data.bin", b"\xfd7zXZ\x00\x00rest", "xz"),
        ("b.bz2", b"BZh91AY&SY", "bzip2"),
        ("c.zip", b"PK\x03\x04....", "ZIP"),
        ("arr.json", b"[{\"text\": \"a\"}]", "JSON array"),
    ] {
        let err = run(&job(&dir, &[dir.write(name, data)], "x.bin"), &enc).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains(says), "{name}: {err}");
    }
}
