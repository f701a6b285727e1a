//! The prefix-cache events a backend publishes, in vLLM's shape (`KVEventBatch` of
//! `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, `vllm/distributed/kv_events.py`):
//! what a backend with a prefix cache tells ([`super::PrefixCacheBlocks`] says what it holds),
//! and what the frontends publish (ZeroMQ) without knowing which backend told it.

use serde::Serialize;

/// Where a block lives, as the events name it (vLLM's `medium`).
pub const MEDIUM: &str = "CPU";

/// The block size vLLM uses by default.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// One change of the blocks held, as vLLM's `KVCacheEvent`s encode it (a map whose `type` is
/// the event's class name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    /// Blocks now held: consecutive blocks of one prompt, after `parent_block_hash`.
    BlockStored {
        /// The blocks' hashes, in order.
        block_hashes: Vec<u64>,
        /// The block before the first of them (`None`: they start the prompt).
        parent_block_hash: Option<u64>,
        /// Their tokens, `block_size` per block.
        token_ids: Vec<i64>,
        /// Tokens per block.
        block_size: usize,
        /// The LoRA adapter the blocks were computed with: an id unique to its load (vLLM's
        /// `lora_int_id`); `None` for the base model.
        lora_id: Option<u64>,
        /// Where the blocks are ([`MEDIUM`]).
        medium: Option<&'static str>,
        /// That adapter's name (also in each block's hash, as vLLM's); `None` for the base
        /// model.
        lora_name: Option<String>,
    },
    /// Blocks no longer held.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<u64>,
        /// Where they were ([`MEDIUM`]).
        medium: Option<&'static str>,
    },
    /// Every block is gone.
    AllBlocksCleared {},
}

/// Events of one step, as vLLM's `KVEventBatch`: when (seconds since the epoch) and what.
#[derive(Debug, Clone, Serialize)]
pub struct KvEventBatch {
    /// When the events happened.
    pub ts: f64,
    /// What happened, in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank (the publisher says 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_parallel_rank: Option<u32>,
}

impl KvEventBatch {
    /// A batch of `events` stamped now.
    pub fn now(events: Vec<KvEvent>) -> Self {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Self {
            ts,
            events,
            data_parallel_rank: None,
        }
    }
}

/// Where a model's event batches go (the frontends' publisher).
pub type KvEventSink = std::sync::Arc<dyn Fn(KvEventBatch) + Send + Sync>;

/// What a generation model publishes its cache's events with.
#[derive(Clone)]
pub struct KvEvents {
    /// Tokens per block.
    pub block_size: usize,
    /// Where the events go.
    pub sink: KvEventSink,
}

impl std::fmt::Debug for KvEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEvents")
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}
