//! The prefix cache seen as vLLM's KV-cache blocks, for routers that place requests by cache
//! (llm-d's KV-cache indexer, NVIDIA Dynamo, Ray Serve's prefix-aware routing): each cached
//! prompt is cut into blocks of `block_size` tokens, each block named by a hash chained from
//! the block before it, and every change of the set of blocks held is told as vLLM's events —
//! `BlockStored` (new blocks, their parent, their tokens), `BlockRemoved` (blocks no entry holds
//! any more), `AllBlocksCleared` — in vLLM's `KVEventBatch` shape
//! (`vllm/distributed/kv_events.py`), published by the frontends (ZeroMQ).
//!
//! A block's hash follows vLLM's `sha256_cbor_64bit`: the low 64 bits of the SHA-256 of the
//! CBOR encoding of `(parent hash, token ids, extra keys)`; the first block's parent is `null`
//! and its extra keys are `[namespace]` when the cache keeps tenants apart (vLLM's
//! `cache_salt`), so that two tenants' equal prompts are different blocks. Only full blocks
//! are told (as vLLM caches only full blocks). Blocks shared by several entries (prompts with
//! a common beginning) are stored once and removed when the last of them goes.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

pub use crate::runtime::capabilities::kv_events::{
    KvEvent, KvEventBatch, KvEventSink, KvEvents, DEFAULT_BLOCK_SIZE, MEDIUM,
};

/// Appends CBOR's head of major type `major` with argument `value`.
fn cbor_head(out: &mut Vec<u8>, major: u8, value: u64) {
    let m = major << 5;
    if value < 24 {
        out.push(m | value as u8);
    } else if value <= u64::from(u8::MAX) {
        out.extend_from_slice(&[m | 24, value as u8]);
    } else if value <= u64::from(u16::MAX) {
        out.push(m | 25);
        out.extend_from_slice(&(value as u16).to_be_bytes());
    } else if value <= u64::from(u32::MAX) {
        out.push(m | 26);
        out.extend_from_slice(&(value as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&value.to_be_bytes());
    }
}

fn cbor_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        cbor_head(out, 0, v.unsigned_abs());
    } else {
        cbor_head(out, 1, (-1 - v).unsigned_abs());
    }
}

/// The cache scope of a prompt run with LoRA adapter `name` (loaded as `id`) for `tenant`'s
/// scope: its blocks are other blocks than the base model's, and their events name the
/// adapter ([`adapter_of`] reads it back).
pub fn scope_with_adapter(tenant: &str, id: u64, name: &str) -> String {
    format!("{tenant}{ADAPTER_MARK}{id} {name}")
}

/// Separates a scope's tenant from its adapter (adapter names have no NUL or space).
const ADAPTER_MARK: &str = "\u{0}lora ";

/// A scope's tenant part and its adapter (`id`, `name`), if it has one.
pub fn adapter_of(scope: &str) -> (&str, Option<(u64, &str)>) {
    let Some((tenant, adapter)) = scope.split_once(ADAPTER_MARK) else {
        return (scope, None);
    };
    let parsed = adapter
        .split_once(' ')
        .and_then(|(id, name)| Some((id.parse().ok()?, name)));
    (tenant, parsed)
}

/// The extra keys of a block, as vLLM's `generate_block_hash_extra_keys` makes them: the
/// adapter's name on every block (`lora_name`), then the tenant's scope on the first
/// (`cache_salt`).
fn extra_keys(scope: &str, first: bool) -> Vec<&str> {
    let (tenant, adapter) = adapter_of(scope);
    let mut keys: Vec<&str> = adapter.map(|(_, name)| name).into_iter().collect();
    if first && !tenant.is_empty() {
        keys.push(tenant);
    }
    keys
}

/// The hash of one block: the low 64 bits of SHA-256 over the CBOR of `[parent, tokens,
/// extra]` (`extra`: `null` when there are no extra keys).
pub fn block_hash(parent: Option<u64>, tokens: &[i64], extra: &[&str]) -> u64 {
    let mut cbor = Vec::with_capacity(16 + tokens.len() * 3);
    cbor_head(&mut cbor, 4, 3);
    match parent {
        Some(p) => cbor_head(&mut cbor, 0, p),
        None => cbor.push(0xf6),
    }
    cbor_head(&mut cbor, 4, tokens.len() as u64);
    for t in tokens {
        cbor_int(&mut cbor, *t);
    }
    if extra.is_empty() {
        cbor.push(0xf6);
    } else {
        cbor_head(&mut cbor, 4, extra.len() as u64);
        for key in extra {
            cbor_head(&mut cbor, 3, key.len() as u64);
            cbor.extend_from_slice(key.as_bytes());
        }
    }
    let digest = Sha256::digest(&cbor);
    let mut low = [0u8; 8];
    low.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(low)
}

/// The hashes of `tokens`' full blocks in `namespace` (empty: shared by all; perhaps with
/// an adapter: [`scope_with_adapter`]), in order.
pub fn chain(namespace: &str, tokens: &[i64], block_size: usize) -> Vec<u64> {
    let mut parent = None;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|block| {
            let hash = block_hash(parent, block, &extra_keys(namespace, parent.is_none()));
            parent = Some(hash);
            hash
        })
        .collect()
}

/// The blocks the prefix cache holds, counted by how many of its entries hold each.
#[derive(Debug)]
pub struct BlockIndex {
    block_size: usize,
    held: HashMap<u64, usize>,
}

impl BlockIndex {
    /// An empty index of blocks of `block_size` tokens.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            held: HashMap::new(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// An entry of `tokens` was kept: its blocks not held yet are told as stored (a
    /// `BlockStored` per run of new blocks).
    pub fn add(&mut self, namespace: &str, tokens: &[i64], events: &mut Vec<KvEvent>) {
        let size = self.block_size;
        let hashes = chain(namespace, tokens, size);
        let mut run: Option<(Option<u64>, Vec<u64>, Vec<i64>)> = None;
        let mut previous = None;
        for (i, hash) in hashes.iter().enumerate() {
            let count = self.held.entry(*hash).or_insert(0);
            *count += 1;
            if *count == 1 {
                let (_, blocks, ids) =
                    run.get_or_insert_with(|| (previous, Vec::new(), Vec::new()));
                blocks.push(*hash);
                ids.extend_from_slice(&tokens[i * size..(i + 1) * size]);
            } else if let Some(done) = run.take() {
                events.push(stored(done, size, namespace));
            }
            previous = Some(*hash);
        }
        if let Some(done) = run.take() {
            events.push(stored(done, size, namespace));
        }
    }

    /// An entry of `tokens` went: the blocks no entry holds any more are told as removed.
    pub fn remove(&mut self, namespace: &str, tokens: &[i64], events: &mut Vec<KvEvent>) {
        let mut gone = Vec::new();
        for hash in chain(namespace, tokens, self.block_size) {
            if let Some(count) = self.held.get_mut(&hash) {
                *count -= 1;
                if *count == 0 {
                    self.held.remove(&hash);
                    gone.push(hash);
                }
            }
        }
        if !gone.is_empty() {
            events.push(KvEvent::BlockRemoved {
                block_hashes: gone,
                medium: Some(MEDIUM),
            });
        }
    }

    /// Every block goes.
    pub fn clear(&mut self, events: &mut Vec<KvEvent>) {
        if !self.held.is_empty() {
            self.held.clear();
            events.push(KvEvent::AllBlocksCleared {});
        }
    }

    /// The hashes of the blocks held, in increasing order.
    pub fn blocks(&self) -> Vec<u64> {
        let mut all: Vec<u64> = self.held.keys().copied().collect();
        all.sort_unstable();
        all
    }
}

fn stored(
    (parent, block_hashes, token_ids): (Option<u64>, Vec<u64>, Vec<i64>),
    size: usize,
    namespace: &str,
) -> KvEvent {
    let adapter = adapter_of(namespace).1;
    KvEvent::BlockStored {
        block_hashes,
        parent_block_hash: parent,
        token_ids,
        block_size: size,
        lora_id: adapter.map(|(id, _)| id),
        medium: Some(MEDIUM),
        lora_name: adapter.map(|(_, name)| name.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: usize, first: i64) -> Vec<i64> {
        (0..n as i64).map(|i| i + first).collect()
    }

    #[test]
    fn the_hash_is_sha256_of_the_cbor_of_parent_tokens_and_extra_keys() {
        // cbor2.dumps([None, [1, 2, 300], None]) == 83 f6 83 01 02 19 01 2c f6
        let cbor = [0x83, 0xf6, 0x83, 0x01, 0x02, 0x19, 0x01, 0x2c, 0xf6];
        let digest = Sha256::digest(cbor);
        let low = u64::from_be_bytes(digest[24..].try_into().unwrap());
        assert_eq!(block_hash(None, &[1, 2, 300], &[]), low);
        // The namespace and the parent change it.
        assert_ne!(block_hash(None, &[1, 2, 300], &["a"]), low);
        assert_ne!(block_hash(Some(7), &[1, 2, 300], &[]), low);
        // cbor2.dumps([None, [1, 2, 300], ["sql", "t"]]): an adapter's name, then the salt.
        let cbor = [
            0x83, 0xf6, 0x83, 0x01, 0x02, 0x19, 0x01, 0x2c, 0x82, 0x63, b's', b'q', b'l', 0x61,
            b't',
        ];
        let digest = Sha256::digest(cbor);
        let with_both = u64::from_be_bytes(digest[24..].try_into().unwrap());
        assert_eq!(block_hash(None, &[1, 2, 300], &["sql", "t"]), with_both);
    }

    #[test]
    fn an_adapters_blocks_carry_its_name_in_every_hash_and_its_event() {
        let scope = scope_with_adapter("t", 42, "sql");
        assert_eq!(adapter_of(&scope), ("t", Some((42, "sql"))));
        assert_eq!(adapter_of("t"), ("t", None));
        let hashes = chain(&scope, &tokens(8, 0), 4);
        // As vLLM: the adapter's name on every block, the tenant's salt on the first only.
        assert_eq!(hashes[0], block_hash(None, &tokens(4, 0), &["sql", "t"]));
        assert_eq!(
            hashes[1],
            block_hash(Some(hashes[0]), &tokens(4, 4), &["sql"])
        );
        let mut index = BlockIndex::new(4);
        let mut events = Vec::new();
        index.add(&scope, &tokens(8, 0), &mut events);
        assert!(
            matches!(&events[..], [KvEvent::BlockStored { lora_id: Some(42), lora_name: Some(n), .. }] if n == "sql")
        );
        // The base model's equal prompt is other blocks.
        assert!(chain("t", &tokens(8, 0), 4)
            .iter()
            .all(|h| !hashes.contains(h)));
    }

    #[test]
    fn shared_blocks_are_stored_once_and_removed_with_their_last_entry() {
        let mut index = BlockIndex::new(4);
        let mut events = Vec::new();
        // 10 tokens: two full blocks (the last 2 tokens are not a block).
        let a = tokens(10, 0);
        index.add("", &a, &mut events);
        let hashes = chain("", &a, 4);
        assert_eq!(hashes.len(), 2);
        assert_eq!(
            events,
            [KvEvent::BlockStored {
                block_hashes: hashes.clone(),
                parent_block_hash: None,
                token_ids: tokens(8, 0),
                block_size: 4,
                lora_id: None,
                medium: Some(MEDIUM),
                lora_name: None,
            }]
        );
        // A prompt sharing the first block: only its new blocks, after that block.
        let mut b = tokens(4, 0);
        b.extend(tokens(8, 100));
        events.clear();
        index.add("", &b, &mut events);
        let b_hashes = chain("", &b, 4);
        assert_eq!(b_hashes[0], hashes[0]);
        assert!(
            matches!(&events[..], [KvEvent::BlockStored { block_hashes, parent_block_hash: Some(p), .. }]
            if block_hashes == &b_hashes[1..] && *p == hashes[0])
        );
        // Removing a: its second block goes, its first stays (b holds it).
        events.clear();
        index.remove("", &a, &mut events);
        assert_eq!(
            events,
            [KvEvent::BlockRemoved {
                block_hashes: vec![hashes[1]],
                medium: Some(MEDIUM)
            }]
        );
        let mut held = b_hashes.clone();
        held.sort_unstable();
        assert_eq!(index.blocks(), held);
        // Another tenant's equal prompt is other blocks.
        assert!(chain("t", &b, 4).iter().all(|h| !b_hashes.contains(h)));
    }

    #[test]
    fn events_encode_as_vllm_s_msgpack_maps() {
        let batch = KvEventBatch {
            data_parallel_rank: None,
            ts: 1.5,
            events: vec![KvEvent::BlockRemoved {
                block_hashes: vec![1, 2],
                medium: Some(MEDIUM),
            }],
        };
        let bytes = rmp_serde::to_vec_named(&batch).unwrap();
        let value: serde_json::Value = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(
            value,
            serde_json::json!({"ts": 1.5, "events": [
                {"type": "BlockRemoved", "block_hashes": [1, 2], "medium": "CPU"}]})
        );
    }
}
