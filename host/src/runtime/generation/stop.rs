//! Stop strings, matched on the text the tokens spell: the generation loop holds back tokens
//! that might begin a stop string, ends the sequence when one appears, and answers only the
//! tokens before it (a token that spells text both before a stop string and of it is dropped
//! whole: the answer ends at a token boundary).
//!
//! The text of each token comes from the model's `tokenizer.json` (Hugging Face `tokenizers`
//! format): byte-level BPE vocabularies (GPT-2, Llama 3, SmolLM) map characters back to bytes;
//! SentencePiece-style ones spell spaces as `▁` and raw bytes as `<0xNN>`. Special tokens spell
//! nothing.

use std::{collections::HashMap, path::Path, sync::Arc};

use crate::error::{Error, Result};

/// The bytes each token spells.
#[derive(Debug)]
pub struct TokenBytes(Vec<Vec<u8>>);

/// GPT-2's map from bytes to the printable characters byte-level vocabularies use.
fn byte_level_chars() -> HashMap<char, u8> {
    let mut printable: Vec<u32> = (u32::from(b'!')..=u32::from(b'~'))
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..=255u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    printable
        .into_iter()
        .zip(chars)
        .filter_map(|(b, c)| Some((char::from_u32(c)?, b as u8)))
        .collect()
}

impl TokenBytes {
    /// Reads `tokenizer.json`.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::invalid(format!("cannot read '{}': {e}", path.display())))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::invalid(format!("'{}' is not JSON: {e}", path.display())))?;
        let vocab = json
            .pointer("/model/vocab")
            .and_then(|v| v.as_object())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "'{}': no model.vocab object (a BPE or WordPiece tokenizer)",
                    path.display()
                ))
            })?;
        let byte_level = json
            .get("decoder")
            .is_some_and(|d| d.to_string().contains("\"ByteLevel\""));
        let chars = byte_level_chars();
        let size = vocab
            .values()
            .filter_map(|v| v.as_u64())
            .max()
            .map_or(0, |m| m as usize + 1);
        let mut bytes = vec![Vec::new(); size];
        for (token, id) in vocab {
            let Some(id) = id.as_u64().map(|i| i as usize) else {
                continue;
            };
            bytes[id] = if byte_level {
                token
                    .chars()
                    .map(|c| chars.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| token.as_bytes().to_vec())
            } else if let Some(hex) = token
                .strip_prefix("<0x")
                .and_then(|t| t.strip_suffix('>'))
                .filter(|h| h.len() == 2)
            {
                u8::from_str_radix(hex, 16).map_or_else(|_| token.as_bytes().to_vec(), |b| vec![b])
            } else {
                token.replace('\u{2581}', " ").into_bytes()
            };
        }
        if let Some(added) = json.get("added_tokens").and_then(|a| a.as_array()) {
            for t in added {
                let special = t.get("special").and_then(|s| s.as_bool()) == Some(true);
                if let (true, Some(id)) = (special, t.get("id").and_then(|i| i.as_u64())) {
                    if let Some(b) = bytes.get_mut(id as usize) {
                        b.clear();
                    }
                }
            }
        }
        Ok(Self(bytes))
    }

    /// What `token` spells (nothing for unknown ids).
    pub fn of(&self, token: u32) -> &[u8] {
        self.0.get(token as usize).map_or(&[], Vec::as_slice)
    }

    /// Every token with what it spells, by id.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &[u8])> {
        self.0
            .iter()
            .enumerate()
            .map(|(i, b)| (i as u32, b.as_slice()))
    }

    /// A vocabulary of the given spellings, by id (for tests).
    #[cfg(test)]
    pub fn from_spellings(spellings: &[&str]) -> Self {
        Self(spellings.iter().map(|s| s.as_bytes().to_vec()).collect())
    }

    /// Spells `token` as nothing, as special tokens are (for tests).
    #[cfg(test)]
    pub fn clear(&mut self, token: u32) {
        if let Some(b) = self.0.get_mut(token as usize) {
            b.clear();
        }
    }
}

/// What to do after a token.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Go on; these tokens may be answered now.
    Go(Vec<u32>),
    /// A stop string appeared: answer these tokens (those before it) and end.
    Stop(Vec<u32>),
}

/// One request's stop strings and the tokens held back.
#[derive(Debug)]
pub struct StopStrings {
    strings: Vec<Vec<u8>>,
    text: Arc<TokenBytes>,
    held: Vec<u32>,
    held_bytes: Vec<u8>,
}

impl StopStrings {
    /// Matches `strings` (non-empty ones) on the text of tokens.
    pub fn new(strings: Vec<String>, text: Arc<TokenBytes>) -> Self {
        Self {
            strings: strings
                .into_iter()
                .filter(|s| !s.is_empty())
                .map(String::into_bytes)
                .collect(),
            text,
            held: Vec::new(),
            held_bytes: Vec::new(),
        }
    }

    /// Takes the next token.
    pub fn push(&mut self, token: u32) -> Verdict {
        self.held.push(token);
        self.held_bytes.extend_from_slice(self.text.of(token));
        let found = self
            .strings
            .iter()
            .filter_map(|s| find(&self.held_bytes, s))
            .min();
        if let Some(at) = found {
            let before = self.release_upto(at);
            self.held.clear();
            self.held_bytes.clear();
            return Verdict::Stop(before);
        }
        // The longest end of the held text that could still grow into a stop string.
        let keep = self
            .strings
            .iter()
            .map(|s| {
                (1..s.len().min(self.held_bytes.len() + 1))
                    .rev()
                    .find(|&k| self.held_bytes.ends_with(&s[..k]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        Verdict::Go(self.release_upto(self.held_bytes.len() - keep))
    }

    /// The tokens held back, after `ready`, at the end of the sequence.
    pub fn flush(&mut self, mut ready: Vec<u32>) -> Vec<u32> {
        ready.append(&mut self.held);
        self.held_bytes.clear();
        ready
    }

    /// Releases the held tokens whose text ends at or before byte `limit` of the held text.
    fn release_upto(&mut self, limit: usize) -> Vec<u32> {
        let mut end = 0;
        let mut count = 0;
        for &t in &self.held {
            let next = end + self.text.of(t).len();
            if next > limit {
                break;
            }
            end = next;
            count += 1;
        }
        self.held_bytes.drain(..end);
        self.held.drain(..count).collect()
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text() -> Arc<TokenBytes> {
        Arc::new(TokenBytes(
            ["Hello", " wor", "ld", ".", "\n", "\n\n", "END", "x"]
                .iter()
                .map(|s| s.as_bytes().to_vec())
                .collect(),
        ))
    }

    #[test]
    fn a_stop_string_ends_at_the_token_before_it() {
        let mut s = StopStrings::new(vec!["world.".into()], text());
        assert_eq!(s.push(0), Verdict::Go(vec![0]));
        // " wor" might begin "world." after its space: held.
        assert_eq!(s.push(1), Verdict::Go(vec![]));
        assert_eq!(s.push(2), Verdict::Go(vec![]));
        assert_eq!(s.push(3), Verdict::Stop(vec![]));
    }

    #[test]
    fn held_tokens_go_out_once_they_cannot_start_a_stop_string() {
        let mut s = StopStrings::new(vec!["\n\n".into()], text());
        assert_eq!(s.push(4), Verdict::Go(vec![]));
        assert_eq!(s.push(7), Verdict::Go(vec![4, 7]));
        assert_eq!(s.push(0), Verdict::Go(vec![0]));
        assert_eq!(s.push(5), Verdict::Stop(vec![]));
        let mut s = StopStrings::new(vec!["END".into()], text());
        assert_eq!(s.push(0), Verdict::Go(vec![0]));
        assert_eq!(s.push(6), Verdict::Stop(vec![]));
        let mut s = StopStrings::new(vec!["\n\n".into()], text());
        assert_eq!(s.push(4), Verdict::Go(vec![]));
        assert_eq!(s.flush(vec![]), vec![4]);
    }

    #[test]
    fn byte_level_vocabularies_spell_their_bytes() {
        let map = byte_level_chars();
        assert_eq!(map.len(), 256);
        assert_eq!(map[&'\u{120}'], b' ');
        assert_eq!(map[&'\u{10a}'], b'\n');
        assert_eq!(map[&'a'], b'a');
    }
}
