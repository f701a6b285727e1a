//! vLLM's KV-cache events over ZeroMQ (`--kv-events-config`, vLLM's flag and JSON): each
//! batch of a generation model's prefix-cache events
//! ([`crate::runtime::capabilities::kv_events`]) is msgpack-encoded and published on a PUB
//! socket as vLLM's `ZmqEventPublisher` frames it — `[topic, sequence number (8 bytes, big
//! endian), payload]` — so that llm-d's KV-cache indexer, NVIDIA Dynamo's relay or any
//! subscriber written for vLLM can follow which prompts a replica holds.
//!
//! As vLLM: an endpoint with `*`, `::`, `ipc://` or `inproc://` is bound, any other is
//! connected to (the subscriber binds). Batches wait in a queue of `max_queue_size`; when it is
//! full a batch is dropped and logged (a subscriber sees the gap in the sequence numbers).

use std::collections::VecDeque;

use serde::Deserialize;
use zeromq::{Socket, SocketRecv, SocketSend};

use crate::{
    error::{Error, Result},
    runtime::capabilities::kv_events::{KvEventBatch, KvEventSink, KvEvents, DEFAULT_BLOCK_SIZE},
};

/// vLLM's `KVEventsConfig`, as its `--kv-events-config` JSON gives it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Publish the events at all.
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// `"zmq"` (or `"null"`: the default, ZeroMQ once events are enabled).
    #[serde(default = "null_publisher")]
    pub publisher: String,
    /// The PUB socket's address.
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// A ROUTER address where subscribers ask for missed batches (by sequence number).
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    /// ZeroMQ's high-water mark (accepted; the socket's own buffering applies).
    #[serde(default = "default_hwm")]
    pub hwm: usize,
    /// Batches waiting to be sent at most.
    #[serde(default = "default_queue")]
    pub max_queue_size: usize,
    /// The topic frame of every message.
    #[serde(default)]
    pub topic: String,
}

fn null_publisher() -> String {
    "null".into()
}
fn default_endpoint() -> String {
    "tcp://*:5557".into()
}
fn default_buffer_steps() -> usize {
    10_000
}
fn default_hwm() -> usize {
    100_000
}
fn default_queue() -> usize {
    100_000
}

impl KvEventsConfig {
    /// The configuration of `--kv-events-config` (JSON, as vLLM takes it); `None` when events
    /// are not enabled.
    pub fn parse(json: &str) -> Result<Option<Self>> {
        let config: Self = serde_json::from_str(json)
            .map_err(|e| Error::invalid(format!("--kv-events-config: {e}")))?;
        if !config.enable_kv_cache_events {
            return Ok(None);
        }
        if !matches!(config.publisher.as_str(), "zmq" | "null") {
            return Err(Error::invalid(format!(
                "--kv-events-config: publisher '{}' is not available (use \"zmq\")",
                config.publisher
            )));
        }
        if config.max_queue_size == 0 {
            return Err(Error::invalid(
                "--kv-events-config: max_queue_size must be at least 1",
            ));
        }
        Ok(Some(config))
    }
}

/// Whether vLLM binds `endpoint` (else it connects to it).
fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// The end-of-replay marker: sequence number -1.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Starts the publisher on the current async runtime: what generation models publish with
/// (`block_size` tokens per block).
pub async fn start(config: &KvEventsConfig, block_size: usize) -> Result<KvEvents> {
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = config.endpoint.replace("tcp://*:", "tcp://0.0.0.0:");
    if binds(&config.endpoint) {
        publisher.bind(&endpoint).await.map_err(|e| {
            Error::invalid(format!(
                "--kv-events-config: cannot bind '{}': {e}",
                config.endpoint
            ))
        })?;
    }
    let mut replay = match &config.replay_endpoint {
        Some(at) => {
            let mut router = zeromq::RouterSocket::new();
            router
                .bind(&at.replace("tcp://*:", "tcp://0.0.0.0:"))
                .await
                .map_err(|e| {
                    Error::invalid(format!("--kv-events-config: cannot bind '{at}': {e}"))
                })?;
            Some(router)
        }
        None => None,
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel::<KvEventBatch>(config.max_queue_size);
    let topic = bytes::Bytes::from(config.topic.clone().into_bytes());
    let connect_to = (!binds(&config.endpoint)).then(|| endpoint.clone());
    let keep = config.buffer_steps;
    tokio::spawn(async move {
        if let Some(at) = connect_to {
            if let Err(e) = publisher.connect(&at).await {
                tracing::warn!(endpoint = %at, "KV events: cannot connect: {e}");
                return;
            }
        }
        let mut sent: VecDeque<(u64, bytes::Bytes)> = VecDeque::new();
        let mut seq: u64 = 0;
        loop {
            let batch = match &mut replay {
                Some(router) => tokio::select! {
                    batch = rx.recv() => batch,
                    asked = router.recv() => {
                        if let Ok(asked) = asked {
                            serve_replay(router, asked, &sent).await;
                        }
                        continue;
                    }
                },
                None => rx.recv().await,
            };
            let Some(mut batch) = batch else {
                return;
            };
            batch.data_parallel_rank = Some(0);
            let payload = match rmp_serde::to_vec_named(&batch) {
                Ok(p) => bytes::Bytes::from(p),
                Err(e) => {
                    tracing::warn!("KV events: cannot encode a batch: {e}");
                    continue;
                }
            };
            let mut message = zeromq::ZmqMessage::from(topic.clone());
            message.push_back(bytes::Bytes::copy_from_slice(&seq.to_be_bytes()));
            message.push_back(payload.clone());
            if let Err(e) = publisher.send(message).await {
                tracing::debug!("KV events: a batch was not sent: {e}");
            }
            if keep > 0 {
                if sent.len() == keep {
                    sent.pop_front();
                }
                sent.push_back((seq, payload));
            }
            seq += 1;
        }
    });
    let sink: KvEventSink = std::sync::Arc::new(move |batch| {
        if tx.try_send(batch).is_err() {
            tracing::warn!("KV events: the queue is full (max_queue_size): a batch was dropped");
        }
    });
    Ok(KvEvents {
        block_size: if block_size == 0 {
            DEFAULT_BLOCK_SIZE
        } else {
            block_size
        },
        sink,
    })
}

/// Answers a replay request `[identity, "", start (8 bytes, big endian)]` with every kept
/// batch from `start` on, then the end marker, as vLLM's publisher does.
async fn serve_replay(
    router: &mut zeromq::RouterSocket,
    asked: zeromq::ZmqMessage,
    sent: &VecDeque<(u64, bytes::Bytes)>,
) {
    let frames = asked.into_vec();
    let [identity, _, start] = frames.as_slice() else {
        tracing::debug!("KV events: a replay request of {} frames", frames.len());
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()).map(u64::from_be_bytes) else {
        return;
    };
    let reply = |seq: &[u8], payload: bytes::Bytes| {
        let mut m = zeromq::ZmqMessage::from(identity.clone());
        m.push_back(bytes::Bytes::new());
        m.push_back(bytes::Bytes::copy_from_slice(seq));
        m.push_back(payload);
        m
    };
    for (seq, payload) in sent.iter().filter(|(seq, _)| *seq >= start) {
        if router
            .send(reply(&seq.to_be_bytes(), payload.clone()))
            .await
            .is_err()
        {
            return;
        }
    }
    let _ = router.send(reply(&END_SEQ, bytes::Bytes::new())).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_s_config_is_read_and_unknown_fields_are_named() {
        let on = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (on.endpoint.as_str(), on.topic.as_str()),
            ("tcp://*:5557", "kv")
        );
        assert!(binds(&on.endpoint) && !binds("tcp://127.0.0.1:5557"));
        assert!(KvEventsConfig::parse(r#"{"publisher": "zmq"}"#)
            .unwrap()
            .is_none());
        let e = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "endpont": "x"}"#)
            .unwrap_err();
        assert!(e.message.contains("endpont"), "{}", e.message);
        let e = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#)
            .unwrap_err();
        assert!(e.message.contains("kafka"), "{}", e.message);
    }
}
