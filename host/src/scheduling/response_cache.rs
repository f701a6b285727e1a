//! Triton's response cache, in memory (`--cache-config local,size=N`) or in a Redis that
//! several servers share (`--cache-config redis,…`, [`super::redis_cache`]): a model whose
//! configuration says `response_cache { enable: true }` answers a request it has answered
//! before from the cache, without running. Entries are keyed by a SHA-256 of the model, its
//! version, what that version was loaded from, the request's inputs (name, datatype, shape,
//! bytes) and the outputs it asks for (with a class count, if any), and of the caller's tenant,
//! so that a tenant never gets another tenant's answer and a model loaded again from other
//! files never gets the old files' answers. The least recently used answers go first when the
//! cache is over its size, which counts everything an entry holds (outputs, parameters,
//! names); an answer larger than the whole cache is not kept; a model's answers in memory go
//! when it is loaded again or unloaded. An answer is served from the cache (and kept in it)
//! only if it is what the model's configuration says the model answers ([`fits`]): a Redis
//! that others can write cannot make the server answer anything else.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Arc, Mutex, PoisonError,
    },
};

use crate::{
    inference::{InferResponse, ParamValue},
    proto::inference::ModelConfig,
    tensor::DataType,
};

pub use super::cache_key::{key, Key};

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
    /// The model that answered (answers are dropped by model).
    model: String,
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
                model: response.model_name.clone(),
                response: response.clone(),
                bytes,
                used,
            },
        );
    }

    /// Drops every answer of `model` (it is loaded again, or unloaded).
    pub fn forget_model(&self, model: &str) {
        let mut inner = self.lock();
        let gone: Vec<(Key, u64, usize)> = inner
            .entries
            .iter()
            .filter(|(_, e)| e.model == model)
            .map(|(k, e)| (*k, e.used, e.bytes))
            .collect();
        for (key, used, bytes) in gone {
            inner.entries.remove(&key);
            inner.order.remove(&used);
            inner.bytes -= bytes;
        }
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

/// What an answer costs the cache: everything it holds (outputs' bytes, names and shapes,
/// parameters' names and values, the model's name and id) and a fixed overhead per part.
fn size_of(response: &InferResponse) -> usize {
    let outputs: usize = response
        .outputs
        .iter()
        .map(|t| t.data.len() + t.name.len() + 8 * t.shape.len() + 64)
        .sum();
    let parameters: usize = response
        .parameters
        .iter()
        .map(|(name, value)| {
            name.len()
                + 48
                + match value {
                    ParamValue::String(s) => s.len(),
                    _ => 8,
                }
        })
        .sum();
    outputs + parameters + response.model_name.len() + response.id.len() + 128
}

/// The largest dimension a kept answer may have (Triton's dims are 64-bit, but no tensor the
/// server answers has a dimension beyond this).
const MAX_DIM: i64 = i32::MAX as i64;

/// Whether `answer` is what a model of `config` answers to a request for `outputs` with
/// `batch_size` rows (`classes`: the outputs asked for as classifications): exactly those
/// outputs, once each, each of its configured datatype (BYTES when classified), its configured
/// dims behind the batch dimension (`-1` any size), its data the size its shape says; and
/// response parameters only from backends whose models set any (Python models, stages,
/// generation). `Err` says what does not fit.
pub fn fits(
    config: &ModelConfig,
    outputs: &[String],
    answer: &InferResponse,
    batch_size: usize,
    classes: &[(String, usize)],
) -> std::result::Result<(), String> {
    if answer.outputs.len() != outputs.len() {
        return Err(format!(
            "{} outputs where {} were asked for",
            answer.outputs.len(),
            outputs.len()
        ));
    }
    let batched = config.max_batch_size > 0;
    for (i, t) in answer.outputs.iter().enumerate() {
        let name = &t.name;
        if !outputs.contains(name) || answer.outputs[..i].iter().any(|o| o.name == *name) {
            return Err(format!(
                "output '{name}' was not asked for, or is there twice"
            ));
        }
        let declared = config
            .output
            .iter()
            .find(|o| o.name == *name)
            .ok_or_else(|| format!("the configuration has no output '{name}'"))?;
        let classified = classes.iter().any(|(n, _)| n == name);
        let datatype = if classified {
            Some(DataType::Bytes)
        } else {
            DataType::from_config_value(declared.data_type)
        };
        if Some(t.datatype) != datatype {
            return Err(format!(
                "output '{name}' is {} where the configuration says {}",
                t.datatype.wire_name(),
                datatype.map_or("another type", |d| d.wire_name())
            ));
        }
        if let Some(d) = t.shape.iter().find(|d| !(0..=MAX_DIM).contains(*d)) {
            return Err(format!("output '{name}' has a dimension of {d}"));
        }
        let dims = if batched {
            if t.shape.first() != Some(&(batch_size as i64)) {
                return Err(format!(
                    "output '{name}' has shape {:?} for a batch of {batch_size}",
                    t.shape
                ));
            }
            &t.shape[1..]
        } else {
            &t.shape[..]
        };
        let declared_dims_fit = dims.len() == declared.dims.len()
            && dims
                .iter()
                .zip(&declared.dims)
                .all(|(got, want)| *want < 0 || got == want);
        if !classified && !declared_dims_fit {
            return Err(format!(
                "output '{name}' has shape {:?} where the configuration says dims {:?}",
                t.shape, declared.dims
            ));
        }
        t.validate_size()
            .map_err(|e| format!("output '{name}': {}", e.message))?;
    }
    if !answer.parameters.is_empty()
        && crate::runtime::family(config) == crate::repository::config_fields::Family::Onnx
    {
        return Err("it carries response parameters, which this model's backend never sets".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inference::InferRequest;
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
            last: false,
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
        let k = |v, version, tenants: &[String]| key("m", version, &[0; 32], &request(v), tenants);
        assert_eq!(k(1, 1, &[]), k(1, 1, &[]));
        assert_ne!(k(1, 1, &[]), k(2, 1, &[]));
        assert_ne!(k(1, 1, &[]), k(1, 2, &[]));
        assert_ne!(k(1, 1, &["a".into()]), k(1, 1, &["b".into()]));
        assert_ne!(k(1, 1, &[]), k(1, 1, &["a".into()]));
        let loaded_again = key("m", 1, &[1; 32], &request(1), &[]);
        assert_ne!(k(1, 1, &[]), loaded_again);
    }

    #[test]
    fn parameters_count_against_the_size_and_a_model_is_forgotten() {
        let mut heavy = answer(10);
        heavy
            .parameters
            .insert("p".into(), ParamValue::String("x".repeat(1 << 20)));
        assert!(size_of(&heavy) > 1 << 20);
        let cache = LocalCache::new(1 << 20);
        cache.insert(key("m", 1, &[0; 32], &request(1), &[]), &heavy);
        assert!(
            cache.is_empty(),
            "an answer over the cache's size is not kept"
        );
        let key = key("m", 1, &[0; 32], &request(2), &[]);
        cache.insert(key, &answer(10));
        assert_eq!(cache.len(), 1);
        cache.forget_model("other");
        assert_eq!(cache.len(), 1);
        cache.forget_model("m");
        assert!(cache.is_empty() && cache.bytes() == 0 && cache.get(&key).is_none());
    }

    #[test]
    fn only_what_the_configuration_says_fits() {
        use crate::proto::inference::ModelOutput;
        let config = ModelConfig {
            name: "m".into(),
            max_batch_size: 8,
            output: vec![ModelOutput {
                name: "y".into(),
                data_type: DataType::Uint8.config_value(),
                dims: vec![-1],
                ..Default::default()
            }],
            ..Default::default()
        };
        let y = ["y".to_owned()];
        let mut good = answer(4);
        good.outputs[0].shape = vec![1, 4];
        assert_eq!(fits(&config, &y, &good, 1, &[]), Ok(()));
        assert!(fits(&config, &y, &good, 2, &[])
            .unwrap_err()
            .contains("batch of 2"));
        let mut evil = good.clone();
        evil.outputs[0].name = "EVIL".into();
        assert!(fits(&config, &y, &evil, 1, &[]).is_err());
        let mut typed = good.clone();
        typed.outputs[0].datatype = DataType::Bytes;
        assert!(fits(&config, &y, &typed, 1, &[])
            .unwrap_err()
            .contains("BYTES"));
        let mut huge = good.clone();
        huge.outputs[0].shape = vec![0, 1 << 62];
        huge.outputs[0].data = Default::default();
        assert!(fits(&config, &y, &huge, 1, &[]).is_err());
        let mut injected = good.clone();
        injected
            .parameters
            .insert("x".into(), ParamValue::String("y".into()));
        assert!(fits(&config, &y, &injected, 1, &[])
            .unwrap_err()
            .contains("parameters"));
        let mut twice = good.clone();
        twice.outputs.push(good.outputs[0].clone());
        assert!(fits(&config, &y, &twice, 1, &[]).is_err());
    }

    #[test]
    fn the_least_recently_used_answers_go_first_and_oversized_ones_are_not_kept() {
        let one = size_of(&answer(1000));
        let cache = LocalCache::new(2 * one + 10);
        let key_of = |v| key("m", 1, &[0; 32], &request(v), &[]);
        cache.insert(key_of(1), &answer(1000));
        cache.insert(key_of(2), &answer(1000));
        // 1 is used again, so 2 is the least recently used when 3 comes.
        assert!(cache.get(&key_of(1)).is_some());
        cache.insert(key_of(3), &answer(1000));
        assert!(cache.get(&key_of(2)).is_none());
        assert!(cache.get(&key_of(1)).is_some() && cache.get(&key_of(3)).is_some());
        assert_eq!(cache.evictions.load(Relaxed), 1);
        assert!(cache.bytes() <= cache.max_bytes());
        cache.insert(key_of(4), &answer(10_000));
        assert!(cache.get(&key_of(4)).is_none());
        assert_eq!(cache.len(), 2);
    }
}
