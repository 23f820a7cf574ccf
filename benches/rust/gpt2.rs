//! GPT-2's vocab and merges files -> an `Encoder` (shared by the Rust benches).

use ferrolm::encode::Encoder;

/// GPT-2's byte-to-unicode map, inverted.
fn unicode_to_byte() -> std::collections::HashMap<char, u8> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut map = std::collections::HashMap::new();
    let mut extra = 0;
    for b in 0..256u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        map.insert(char::from_u32(c).unwrap(), b as u8);
    }
    map
}

pub fn load(vocab: &str, merges: &str) -> Encoder {
    let u2b = unicode_to_byte();
    let tok = |s: &str| -> Vec<u8> { s.chars().map(|c| u2b[&c]).collect() };
    let v: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(vocab).unwrap()).unwrap();
    let vocab: Vec<(u64, Vec<u8>)> = v
        .iter()
        .map(|(k, id)| {
            let bytes = if k == "<|endoftext|>" { k.as_bytes().to_vec() } else { tok(k) };
            (id.as_u64().unwrap(), bytes)
        })
        .collect();
    let merges: Vec<(Vec<u8>, Vec<u8>)> = std::fs::read_to_string(merges)
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with("#version"))
        .map(|l| {
            let (a, b) = l.split_once(' ').unwrap();
            (tok(a), tok(b))
        })
        .collect();
    Encoder::new(vocab, merges, vec!["<|endoftext|>".into()], "gpt2").unwrap()
}
