//! Triton's response cache, in memory (`--cache-config local,size=N`) or in a Redis that
//! several servers share (`--cache-config redis,…`, [`super::redis_cache`]): a model whose
//! configuration says `response_cache { enable: true }` answers a request it has answered
//! before from the cache, without running. Entries are keyed by a SHA-256 of the model, its
//! version, the request's inputs (name, datatype, shape, bytes) and the outputs it asks for
//! (with a class count, if any), and of the caller's tenant, so that a tenant never gets another
//! tenant's answer. The least recently used answers go first when the cache is over its size;
//! an answer larger than the whole cache is not kept.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex, PoisonError,
    },
};

use crate::inference::{InferRequest, InferResponse};

pub use super::cache_key::Key;

/// The response cache shared by the models that enable it.
#[derive(Debug)]
pub struct ResponseCache {
    store: Store,
}

#[derive(Debug)]
enum Store {
    Local(LocalCache),
    Redis(Arc<super::redis_cache::RedisCache>),
}

impl ResponseCache {
    /// An in-memory cache of at most `max_bytes` of answers.
    pub fn local(max_bytes: usize) -> Self {
        Self {
            store: Store::Local(LocalCache::new(max_bytes)),
        }
    }

    /// A cache kept in Redis.
    pub fn redis(cache: Arc<super::redis_cache::RedisCache>) -> Self {
        Self {
            store: Store::Redis(cache),
        }
    }

    /// The in-memory cache, when that is the store.
    pub fn as_local(&self) -> Option<&LocalCache> {
        match &self.store {
            Store::Local(l) => Some(l),
            Store::Redis(_) => None,
        }
    }

    /// The key of `request` to `model` version `version` for `tenants` (their names, or none).
    pub fn key(model: &str, version: i64, request: &InferRequest, tenants: &[String]) -> Key {
        super::cache_key::key(model, version, request, tenants)
    }

    /// The answer cached under `key`, if any. A store that cannot answer (a Redis that is
    /// down) gives `None`: a miss, never an error.
    pub async fn get(&self, key: &Key) -> Option<InferResponse> {
        match &self.store {
            Store::Local(l) => l.get(key),
            Store::Redis(r) => r.get(key).await,
        }
    }

    /// Keeps `response` under `key`; Redis stores it in the background, so the answer is not
    /// held back for it.
    pub fn insert(&self, key: Key, response: &InferResponse) {
        match &self.store {
            Store::Local(l) => l.insert(key, response),
            Store::Redis(r) => r.store(key, response),
        }
    }
}

/// The in-memory cache: least recently used answers go first.
#[derive(Debug)]
pub struct LocalCache {
    max_bytes: usize,
    inner: Mutex<Inner>,
    /// Answers removed to make room.
    pub evictions: AtomicU64,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<Key, Entry>,
    /// Least recently used first.
    order: BTreeMap<u64, Key>,
    tick: u64,
    bytes: usize,
}

#[derive(Debug)]
struct Entry {
    response: InferResponse,
    bytes: usize,
    used: u64,
}

impl LocalCache {
    /// A cache holding at most `max_bytes` of answers.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            inner: Mutex::new(Inner::default()),
            evictions: AtomicU64::new(0),
        }
    }

    /// Its size limit in bytes.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Bytes of answers held now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Nothing panics while the lock is held.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The answer cached under `key`, if any (renewed as the most recently used).
    pub fn get(&self, key: &Key) -> Option<InferResponse> {
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        let entry = inner.entries.get_mut(key)?;
        let previous = std::mem::replace(&mut entry.used, tick);
        let response = entry.response.clone();
        inner.order.remove(&previous);
        inner.order.insert(tick, *key);
        Some(response)
    }

    /// Keeps `response` under `key`, removing the least recently used answers until it fits;
    /// an answer larger than the cache is not kept.
    pub fn insert(&self, key: Key, response: &InferResponse) {
        let bytes = size_of(response);
        if bytes > self.max_bytes {
            return;
        }
        let mut inner = self.lock();
        if let Some(old) = inner.entries.remove(&key) {
            inner.order.remove(&old.used);
            inner.bytes -= old.bytes;
        }
        while inner.bytes + bytes > self.max_bytes {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            if let Some(gone) = inner.entries.remove(&oldest) {
                inner.bytes -= gone.bytes;
                self.evictions.fetch_add(1, Relaxed);
            }
        }
        inner.tick += 1;
        let used = inner.tick;
        inner.order.insert(used, key);
        inner.bytes += bytes;
        inner.entries.insert(
            key,
            Entry {
                response: response.clone(),
                bytes,
                used,
            },
        );
    }

    /// Answers held now.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether it holds no answer.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What an answer costs the cache: its tensors' bytes, names and shapes.
fn size_of(response: &InferResponse) -> usize {
    response
        .outputs
        .iter()
        .map(|t| t.data.len() + t.name.len() + 8 * t.shape.len() + 64)
        .sum::<usize>()
        + response.model_name.len()
        + 128
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{DataType, Tensor};

    fn request(value: u8) -> InferRequest {
        InferRequest {
            model_name: "m".into(),
            inputs: vec![Tensor {
                name: "x".into(),
                datatype: DataType::Uint8,
                shape: vec![1],
                data: vec![value].into(),
            }],
            ..Default::default()
        }
    }

    fn answer(bytes: usize) -> InferResponse {
        InferResponse {
            model_name: "m".into(),
            model_version: 1,
            id: String::new(),
            parameters: Default::default(),
            outputs: vec![Tensor {
                name: "y".into(),
                datatype: DataType::Uint8,
                shape: vec![bytes as i64],
                data: vec![0; bytes].into(),
            }],
        }
    }

    #[test]
    fn keys_tell_inputs_versions_and_tenants_apart() {
        let k =
            |v, version, tenants: &[String]| ResponseCache::key("m", version, &request(v), tenants);
        assert_eq!(k(1, 1, &[]), k(1, 1, &[]));
        assert_ne!(k(1, 1, &[]), k(2, 1, &[]));
        assert_ne!(k(1, 1, &[]), k(1, 2, &[]));
        assert_ne!(k(1, 1, &["a".into()]), k(1, 1, &["b".into()]));
        assert_ne!(k(1, 1, &[]), k(1, 1, &["a".into()]));
    }

    #[test]
    fn the_least_recently_used_answers_go_first_and_oversized_ones_are_not_kept() {
        let one = size_of(&answer(1000));
        let cache = LocalCache::new(2 * one + 10);
        let key = |v| ResponseCache::key("m", 1, &request(v), &[]);
        cache.insert(key(1), &answer(1000));
        cache.insert(key(2), &answer(1000));
        // 1 is used again, so 2 is the least recently used when 3 comes.
        assert!(cache.get(&key(1)).is_some());
        cache.insert(key(3), &answer(1000));
        assert!(cache.get(&key(2)).is_none());
        assert!(cache.get(&key(1)).is_some() && cache.get(&key(3)).is_some());
        assert_eq!(cache.evictions.load(Relaxed), 1);
        assert!(cache.bytes() <= cache.max_bytes());
        cache.insert(key(4), &answer(10_000));
        assert!(cache.get(&key(4)).is_none());
        assert_eq!(cache.len(), 2);
    }
}
