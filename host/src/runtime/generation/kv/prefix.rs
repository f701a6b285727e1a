//! Prefix caching: the key/value cache of recent prompts, kept after their prefill so that a
//! later prompt that begins with the same tokens (a system prompt, a few-shot block, the same
//! document) prefills only the tokens after the shared part.
//!
//! Entries are whole prompts' caches; any prefix of an entry is reusable (a decoder's cache of
//! a token depends only on the tokens before it). A lookup compares token ids exactly, so a hit
//! is never a collision. Entries live in a namespace: the tenant's name when the model keeps
//! tenants apart (`prefix_cache_scope: tenant`, the default), one shared namespace otherwise,
//! so by default a tenant's timing can only reveal its own earlier prompts. The budget is in
//! tokens (`prefix_cache_max_tokens`), shared fairly among the namespaces that hold entries:
//! a namespace at or over its share makes room by dropping its own least recently used
//! entries, never another's, so one tenant can neither evict another's prompts nor, by
//! watching its own entries go, learn when another tenant is busy.

use std::sync::Arc;

use super::events::{BlockIndex, KvEvent};

/// The fewest shared tokens worth reusing (below this a prefill is cheap anyway).
pub const MIN_PREFIX_TOKENS: usize = 32;

/// A cached prompt's keys and values: per cache tensor (`past_key_values.{i}.key|value`
/// order) `[kv_heads, tokens, head_dim]`, in the cache's element type.
#[derive(Debug)]
pub enum Values {
    /// A growing (Optimum-layout) FP32 cache.
    F32(Vec<Vec<f32>>),
    /// A shared-buffer FP16 cache.
    F16(Vec<Vec<half::f16>>),
}

/// One prompt's cache.
#[derive(Debug)]
pub struct Entry {
    namespace: String,
    tokens: Vec<i64>,
    /// Its keys and values.
    pub values: Values,
}

impl Entry {
    /// Tokens it holds.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// A prompt's hit: the entry and how many of its leading tokens the prompt shares.
#[derive(Debug, Clone)]
pub struct Hit {
    /// The entry.
    pub entry: Arc<Entry>,
    /// Shared tokens (at least [`MIN_PREFIX_TOKENS`], always fewer than the prompt's).
    pub tokens: usize,
}

/// The cache of one model.
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    /// Entries with when each was last used.
    entries: Vec<(Arc<Entry>, u64)>,
    used: usize,
    clock: u64,
    /// The entries as blocks, when their changes are published ([`super::events`]).
    blocks: Option<BlockIndex>,
    /// Changes of the blocks not taken yet.
    events: Vec<KvEvent>,
}

impl PrefixCache {
    /// A cache of at most `capacity` tokens (0: off).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: Vec::new(),
            used: 0,
            clock: 0,
            blocks: None,
            events: Vec::new(),
        }
    }

    /// Tells every change of the entries as blocks of `block_size` tokens
    /// ([`Self::take_events`]).
    pub fn with_block_events(mut self, block_size: usize) -> Self {
        self.blocks = Some(BlockIndex::new(block_size));
        self
    }

    /// The changes of the blocks since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// The blocks held (their hashes, increasing) and tokens per block, when told.
    pub fn blocks(&self) -> Option<(usize, Vec<u64>)> {
        self.blocks.as_ref().map(|b| (b.block_size(), b.blocks()))
    }

    /// Drops every entry (and tells it).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.used = 0;
        if let Some(blocks) = &mut self.blocks {
            blocks.clear(&mut self.events);
        }
    }

    /// Whether it caches anything.
    pub fn enabled(&self) -> bool {
        self.capacity >= MIN_PREFIX_TOKENS
    }

    /// Tokens held.
    pub fn used_tokens(&self) -> usize {
        self.used
    }

    /// The longest cached prefix of `prompt` in `namespace` (leaving at least one prompt
    /// token to run, whose logits give the first generated token).
    pub fn lookup(&mut self, namespace: &str, prompt: &[i64]) -> Option<Hit> {
        let most = prompt.len().saturating_sub(1);
        let mut best: Option<(usize, usize)> = None;
        for (i, (e, _)) in self.entries.iter().enumerate() {
            if e.namespace != namespace {
                continue;
            }
            let shared = e
                .tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
                .min(most);
            if shared >= MIN_PREFIX_TOKENS && best.is_none_or(|(_, b)| shared > b) {
                best = Some((i, shared));
            }
        }
        let (i, tokens) = best?;
        self.clock += 1;
        let (entry, last_used) = &mut self.entries[i];
        *last_used = self.clock;
        Some(Hit {
            entry: entry.clone(),
            tokens,
        })
    }

    /// Whether storing `prompt` would add anything (an entry does not already begin with it).
    pub fn wants(&self, namespace: &str, prompt: &[i64]) -> bool {
        self.enabled()
            && prompt.len() >= MIN_PREFIX_TOKENS
            && prompt.len() <= self.capacity
            && !self
                .entries
                .iter()
                .any(|(e, _)| e.namespace == namespace && e.tokens.starts_with(prompt))
    }

    /// Tokens `namespace` holds.
    fn held_by(&self, namespace: &str) -> usize {
        (self.entries.iter())
            .filter(|(e, _)| e.namespace == namespace)
            .map(|(e, _)| e.len())
            .sum()
    }

    /// Each namespace's share of the budget: the budget divided by the namespaces that hold
    /// entries, `namespace` counted.
    fn share(&self, namespace: &str) -> usize {
        let mut names: Vec<&str> = self
            .entries
            .iter()
            .map(|(e, _)| e.namespace.as_str())
            .collect();
        names.push(namespace);
        names.sort_unstable();
        names.dedup();
        self.capacity / names.len()
    }

    /// The least recently used entry to drop to make room for `namespace`: its own while it
    /// is at or over its share, else one of the namespace most over its share.
    fn victim(&self, namespace: &str, adding: usize) -> Option<usize> {
        let share = self.share(namespace);
        // Within a namespace, an entry whose beginning another entry also holds (one turn of
        // several on the same system prompt) goes first, least recently used first: dropping
        // it keeps every cached beginning reachable, as a block cache keeps the shared blocks
        // that every turn touches.
        let oldest_of = |name: &str| {
            let own =
                || (self.entries.iter().enumerate()).filter(move |(_, (e, _))| e.namespace == name);
            let redundant = |i: usize, e: &Entry| {
                own().any(|(j, (other, _))| {
                    j != i
                        && e.tokens
                            .iter()
                            .zip(&other.tokens)
                            .take_while(|(a, b)| a == b)
                            .count()
                            >= MIN_PREFIX_TOKENS
                })
            };
            own()
                .filter(|(i, (e, _))| redundant(*i, e))
                .min_by_key(|(_, (_, last_used))| *last_used)
                .or_else(|| own().min_by_key(|(_, (_, last_used))| *last_used))
                .map(|(i, _)| i)
        };
        if self.held_by(namespace) + adding > share {
            return oldest_of(namespace);
        }
        let mut names: Vec<&str> = self
            .entries
            .iter()
            .map(|(e, _)| e.namespace.as_str())
            .collect();
        names.sort_unstable();
        names.dedup();
        let most_over = names
            .into_iter()
            .map(|name| (self.held_by(name), name))
            .filter(|(held, _)| *held > share)
            .max_by_key(|(held, _)| *held)?;
        oldest_of(most_over.1)
    }

    /// Keeps `prompt`'s cache; entries it extends are dropped, then least recently used ones
    /// (see `PrefixCache::victim`) until it fits. A prompt longer than its namespace's share
    /// is not kept.
    pub fn insert(&mut self, namespace: &str, prompt: &[i64], values: Values) {
        if !self.wants(namespace, prompt) {
            return;
        }
        let mut used = self.used;
        let mut dropped = Vec::new();
        self.entries.retain(|(e, _)| {
            let extended = e.namespace == namespace && prompt.starts_with(&e.tokens);
            if extended {
                used -= e.len();
                dropped.push(e.clone());
            }
            !extended
        });
        self.used = used;
        let kept = self.make_room(namespace, prompt.len(), &mut dropped);
        if kept {
            self.clock += 1;
            self.used += prompt.len();
            let entry = Entry {
                namespace: namespace.to_owned(),
                tokens: prompt.to_vec(),
                values,
            };
            self.entries.push((Arc::new(entry), self.clock));
        }
        // The new entry's blocks first, so that those it shares with an entry it replaces
        // are not told as removed and stored again.
        if let Some(blocks) = &mut self.blocks {
            if kept {
                blocks.add(namespace, prompt, &mut self.events);
            }
            for gone in dropped {
                blocks.remove(&gone.namespace, &gone.tokens, &mut self.events);
            }
        }
    }

    /// Drops entries until `adding` tokens of `namespace` fit; whether they do.
    fn make_room(&mut self, namespace: &str, adding: usize, dropped: &mut Vec<Arc<Entry>>) -> bool {
        if adding > self.share(namespace) {
            return false;
        }
        while self.used + adding > self.capacity {
            let Some(oldest) = self.victim(namespace, adding) else {
                return false;
            };
            let (gone, _) = self.entries.swap_remove(oldest);
            self.used -= gone.len();
            dropped.push(gone);
        }
        true
    }
}

/// The first `tokens` columns of an entry's tensor `[heads, len, head_dim]`, as
/// `[1, heads, tokens, head_dim]` values.
pub fn leading(data: &[f32], heads: usize, len: usize, head_dim: usize, tokens: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(heads * tokens * head_dim);
    for h in 0..heads {
        let start = h * len * head_dim;
        out.extend_from_slice(&data[start..start + tokens * head_dim]);
    }
    out
}

/// Row `row`'s last `tokens` columns of a tensor `[rows, heads, columns, head_dim]`, as
/// `[heads, tokens, head_dim]` values.
pub fn trailing(
    data: &[f32],
    row: usize,
    heads: usize,
    columns: usize,
    head_dim: usize,
    tokens: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(heads * tokens * head_dim);
    for h in 0..heads {
        let start = ((row * heads + h) * columns + columns - tokens) * head_dim;
        out.extend_from_slice(&data[start..start + tokens * head_dim]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(n: usize, first: i64) -> Vec<i64> {
        (0..n as i64).map(|i| i + first).collect()
    }

    #[test]
    fn the_longest_shared_prefix_in_the_namespace_is_found() {
        let mut cache = PrefixCache::new(1000);
        let a = prompt(100, 0);
        cache.insert("t1", &a, Values::F32(vec![]));
        // A prompt sharing 60 tokens, then different.
        let mut b = prompt(60, 0);
        b.extend(prompt(10, 500));
        assert_eq!(cache.lookup("t1", &b).map(|h| h.tokens), Some(60));
        // Another tenant sees nothing.
        assert!(cache.lookup("t2", &b).is_none());
        // The same prompt again: all but its last token.
        assert_eq!(cache.lookup("t1", &a).map(|h| h.tokens), Some(99));
        // Too short a share is no hit.
        let mut c = prompt(10, 0);
        c.extend(prompt(50, 900));
        assert!(cache.lookup("t1", &c).is_none());
    }

    #[test]
    fn extending_replaces_and_the_budget_evicts_the_least_recently_used() {
        let mut cache = PrefixCache::new(250);
        cache.insert("", &prompt(50, 0), Values::F32(vec![]));
        cache.insert("", &prompt(100, 0), Values::F32(vec![]));
        assert_eq!(cache.used_tokens(), 100);
        // Already covered: nothing added.
        assert!(!cache.wants("", &prompt(80, 0)));
        cache.insert("", &prompt(100, 1000), Values::F32(vec![]));
        cache.lookup("", &prompt(100, 0));
        cache.insert("", &prompt(100, 2000), Values::F32(vec![]));
        // 300 > 250: the entry at 1000 (not used since) went.
        assert_eq!(cache.used_tokens(), 200);
        assert!(cache.lookup("", &prompt(100, 1000)).is_none());
        assert!(cache.lookup("", &prompt(100, 0)).is_some());
        // Off, or longer than the budget: nothing kept.
        assert!(!PrefixCache::new(0).wants("", &prompt(50, 0)));
        assert!(!cache.wants("", &prompt(300, 5000)));
    }

    #[test]
    fn a_turn_whose_system_prompt_another_entry_holds_goes_before_the_last_holder() {
        let turn = |system: i64, question: i64| {
            let mut p = prompt(90, system);
            p.extend(prompt(10, question));
            p
        };
        // Room for three entries: one turn on system prompt B, then two on A, used since.
        let mut cache = PrefixCache::new(300);
        cache.insert("", &turn(1000, 700), Values::F32(vec![]));
        cache.insert("", &turn(0, 500), Values::F32(vec![]));
        cache.insert("", &turn(0, 600), Values::F32(vec![]));
        cache.lookup("", &turn(0, 500));
        cache.lookup("", &turn(0, 600));
        // A third turn on A: B's only entry is the least recently used, but an A turn goes.
        cache.insert("", &turn(0, 800), Values::F32(vec![]));
        assert_eq!(
            cache.lookup("", &turn(1000, 900)).map(|h| h.tokens),
            Some(90)
        );
        assert_eq!(cache.lookup("", &turn(0, 900)).map(|h| h.tokens), Some(90));
        // The A turn used longest ago is the one that went.
        assert_eq!(cache.lookup("", &turn(0, 500)).map(|h| h.tokens), Some(90));
        assert_eq!(cache.lookup("", &turn(0, 600)).map(|h| h.tokens), Some(99));
    }

    #[test]
    fn each_tenant_keeps_its_share_of_the_budget() {
        let mut cache = PrefixCache::new(400);
        // Tenant a alone may use all of it.
        for i in 0..4 {
            cache.insert("a", &prompt(100, i * 1000), Values::F32(vec![]));
        }
        assert_eq!(cache.held_by("a"), 400);
        // b arrives: a is over its half, so a's oldest go, not b's.
        cache.insert("b", &prompt(100, 50_000), Values::F32(vec![]));
        cache.insert("b", &prompt(100, 60_000), Values::F32(vec![]));
        assert_eq!((cache.held_by("a"), cache.held_by("b")), (200, 200));
        assert!(cache.lookup("a", &prompt(100, 0)).is_none());
        // a's flood of new prompts now only turns over a's own half.
        for i in 10..30 {
            cache.insert("a", &prompt(100, i * 1000), Values::F32(vec![]));
        }
        assert_eq!(cache.held_by("b"), 200);
        assert!(cache.lookup("b", &prompt(100, 50_000)).is_some());
        assert!(cache.lookup("b", &prompt(100, 60_000)).is_some());
        // A prompt longer than a tenant's share is not kept.
        assert!(cache.wants("c", &prompt(150, 90_000)));
        cache.insert("c", &prompt(150, 90_000), Values::F32(vec![]));
        assert_eq!(cache.held_by("c"), 0);
    }

    #[test]
    fn the_blocks_told_are_the_blocks_held() {
        let mut cache = PrefixCache::new(250).with_block_events(16);
        let mut held = std::collections::HashSet::new();
        let mut replay = |cache: &mut PrefixCache| {
            for event in cache.take_events() {
                match event {
                    KvEvent::BlockStored { block_hashes, .. } => {
                        for h in block_hashes {
                            assert!(held.insert(h), "stored twice");
                        }
                    }
                    KvEvent::BlockRemoved { block_hashes, .. } => {
                        for h in block_hashes {
                            assert!(held.remove(&h), "removed but not held");
                        }
                    }
                    KvEvent::AllBlocksCleared {} => held.clear(),
                }
            }
            let mut sorted: Vec<u64> = held.iter().copied().collect();
            sorted.sort_unstable();
            assert_eq!(Some(sorted), cache.blocks().map(|(_, b)| b));
        };
        cache.insert("", &prompt(50, 0), Values::F32(vec![]));
        replay(&mut cache);
        // Extends it: the shared blocks stay, the new ones are stored.
        cache.insert("", &prompt(100, 0), Values::F32(vec![]));
        replay(&mut cache);
        cache.insert("", &prompt(100, 1000), Values::F32(vec![]));
        replay(&mut cache);
        // Evicts the least recently used.
        cache.insert("", &prompt(100, 2000), Values::F32(vec![]));
        replay(&mut cache);
        cache.insert("b", &prompt(100, 2000), Values::F32(vec![]));
        replay(&mut cache);
        cache.clear();
        replay(&mut cache);
        assert_eq!(cache.blocks().map(|(_, b)| b.len()), Some(0));
    }

    #[test]
    fn columns_are_cut_per_head() {
        // 2 heads, 3 columns, head_dim 1.
        let entry = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(leading(&entry, 2, 3, 1, 2), [1.0, 2.0, 4.0, 5.0]);
        // 2 rows, 2 heads, 3 columns, head_dim 1: row 1's last 2.
        let batch = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(trailing(&batch, 1, 2, 3, 1, 2), [2.0, 3.0, 5.0, 6.0]);
    }
}
