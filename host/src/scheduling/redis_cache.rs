//! Triton's Redis response cache (`--cache-config redis,host=…,port=…`): answers kept in a Redis
//! that several servers share, so a request answered by one is a hit on the others. Options as
//! Triton's Redis cache names them; credentials may come from `TRITONCACHE_REDIS_USERNAME` /
//! `TRITONCACHE_REDIS_PASSWORD`. Redis is a helper, never a dependency of an answer: every call
//! is bounded by a timeout, a Redis that is down or slow makes lookups misses (and a stored
//! value that does not decode is a miss too), and the connection is made again in the
//! background, at most once a second.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use bytes::Bytes;
use redis::{aio::ConnectionManager, AsyncCommands};

use crate::{
    inference::{InferResponse, ParamValue, Parameters},
    tensor::{DataType, Tensor},
};

/// How long a call waits when the configuration gives no timeout (Triton's `0` waits forever;
/// here a request never waits on a Redis that went away).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// How often a lost connection is tried again.
const RECONNECT_EVERY: Duration = Duration::from_secs(1);

/// Answers being stored at once; past it an answer is not stored (the cache is a helper:
/// a slow Redis must not pile up copies of answers in the server's memory).
const STORES_IN_FLIGHT: usize = 64;

/// Prefix of the cache's keys in Redis.
const KEY_PREFIX: &str = "wasmtron:response:";

/// `--cache-config redis,<key>=<value>` settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// `host` (required).
    pub host: String,
    /// `port` (required).
    pub port: u16,
    /// `user` (default: Redis' `default` user).
    pub user: Option<String>,
    /// `password`.
    pub password: Option<String>,
    /// `db` (default 0).
    pub db: i64,
    /// `connect_timeout` in ms (0: `DEFAULT_TIMEOUT`).
    pub connect_timeout_ms: u64,
    /// `socket_timeout` in ms (0: `DEFAULT_TIMEOUT`).
    pub socket_timeout_ms: u64,
    /// `wait_timeout` in ms: the most a lookup waits for a connection (default 1000).
    pub wait_timeout_ms: u64,
    /// `tls_enabled=true`: TLS to Redis, checking its certificate against `cacert` (else the
    /// system's roots) for `host`.
    pub tls: bool,
    /// `cert` and `key`: the client's certificate and key (PEM files), for Redis servers that
    /// ask for one.
    pub client_cert: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// `cacert`: the certificates that sign the server's (a PEM file).
    pub ca_cert: Option<std::path::PathBuf>,
}

impl RedisSettings {
    /// Reads Triton's `redis` settings (`key=value` pairs, each from one `--cache-config`
    /// value); `env` gives `TRITONCACHE_REDIS_USERNAME` and `_PASSWORD`. Returns the settings
    /// and lines to log for settings without effect here; an unknown setting, a bad value or
    /// a missing host or port is refused by name.
    pub fn parse<'a>(
        pairs: impl IntoIterator<Item = &'a str>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(Self, Vec<String>), String> {
        let (mut host, mut port) = (None, None);
        let mut settings = Self {
            host: String::new(),
            port: 0,
            user: env("TRITONCACHE_REDIS_USERNAME"),
            password: env("TRITONCACHE_REDIS_PASSWORD"),
            db: 0,
            connect_timeout_ms: 0,
            socket_timeout_ms: 0,
            wait_timeout_ms: 1000,
            tls: false,
            client_cert: None,
            ca_cert: None,
        };
        let (mut cert, mut client_key) = (None, None);
        let mut notes = Vec::new();
        let number = |key: &str, v: &str| {
            v.trim()
                .parse::<u64>()
                .map_err(|_| format!("redis setting '{key}' must be a number, not '{v}'"))
        };
        for pair in pairs {
            let Some((key, value)) = pair.split_once('=') else {
                return Err(format!("redis setting '{pair}': expected <key>=<value>"));
            };
            match key.trim() {
                "host" => host = Some(value.trim().to_owned()),
                "port" => {
                    port = Some(value.trim().parse::<u16>().map_err(|_| {
                        format!("redis setting 'port' must be a port number, not '{value}'")
                    })?)
                }
                "user" => settings.user = Some(value.to_owned()),
                "password" => settings.password = Some(value.to_owned()),
                "db" => settings.db = number(key, value)? as i64,
                "connect_timeout" => settings.connect_timeout_ms = number(key, value)?,
                "socket_timeout" => settings.socket_timeout_ms = number(key, value)?,
                "wait_timeout" => settings.wait_timeout_ms = number(key, value)?,
                "pool_size" => {
                    number(key, value)?;
                    notes.push(
                        "--cache-config redis,pool_size has no effect here: one multiplexed \
                         connection carries every lookup"
                            .to_owned(),
                    );
                }
                "tls_enabled" => {
                    settings.tls = match value.trim() {
                        "true" | "1" | "on" => true,
                        "false" | "0" | "off" => false,
                        other => {
                            return Err(format!(
                                "redis setting 'tls_enabled' takes true or false, not '{other}'"
                            ))
                        }
                    }
                }
                "cert" => cert = Some(std::path::PathBuf::from(value.trim())),
                "key" => client_key = Some(std::path::PathBuf::from(value.trim())),
                "cacert" => settings.ca_cert = Some(value.trim().into()),
                "sni" => {
                    return Err(
                        "redis setting 'sni': the server name checked is the host's \
                                (give the name in host=)"
                            .into(),
                    )
                }
                other => {
                    return Err(format!(
                        "unknown redis setting '{other}' (host, port, user, password, db, \
                         connect_timeout, socket_timeout, pool_size, wait_timeout, \
                         tls_enabled, cert, key, cacert)"
                    ))
                }
            }
        }
        settings.client_cert = match (cert, client_key) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => return Err("redis settings 'cert' and 'key' go together".into()),
        };
        let tls_files = settings.client_cert.is_some() || settings.ca_cert.is_some();
        if tls_files && !settings.tls {
            return Err("redis settings 'cert', 'key' and 'cacert' need tls_enabled=true".into());
        }
        match (host.filter(|h| !h.is_empty()), port) {
            (Some(h), Some(p)) => {
                settings.host = h;
                settings.port = p;
                Ok((settings, notes))
            }
            _ => Err(
                "the redis cache needs host and port (--cache-config redis,host=<host> \
                      --cache-config redis,port=<port>)"
                    .into(),
            ),
        }
    }

    fn timeout(ms: u64) -> Duration {
        if ms == 0 {
            DEFAULT_TIMEOUT
        } else {
            Duration::from_millis(ms)
        }
    }
}

/// The connection, made when first needed and again after it is lost.
struct Connection {
    manager: Option<ConnectionManager>,
    last_try: Option<Instant>,
}

/// A response cache kept in Redis.
pub struct RedisCache {
    client: redis::Client,
    settings: RedisSettings,
    connection: tokio::sync::Mutex<Connection>,
    /// Calls that failed or timed out (each answered as a miss).
    errors: std::sync::atomic::AtomicU64,
    last_error: Mutex<Option<String>>,
    /// Answers being stored now ([`STORES_IN_FLIGHT`] at most).
    storing: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for RedisCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCache")
            .field("host", &self.settings.host)
            .field("port", &self.settings.port)
            .finish_non_exhaustive()
    }
}

impl RedisCache {
    /// A cache on the Redis `settings` name; nothing is connected yet.
    pub fn new(settings: RedisSettings) -> Result<Self, String> {
        let addr = if settings.tls {
            redis::ConnectionAddr::TcpTls {
                host: settings.host.clone(),
                port: settings.port,
                insecure: false,
                tls_params: None,
            }
        } else {
            redis::ConnectionAddr::Tcp(settings.host.clone(), settings.port)
        };
        let info = redis::ConnectionInfo {
            addr,
            redis: redis::RedisConnectionInfo {
                db: settings.db,
                username: settings.user.clone(),
                password: settings.password.clone(),
                ..Default::default()
            },
        };
        let client = if settings.tls {
            let read = |what: &str, path: &std::path::Path| {
                std::fs::read(path).map_err(|e| format!("redis {what} '{}': {e}", path.display()))
            };
            let client_tls = match &settings.client_cert {
                Some((cert, key)) => Some(redis::ClientTlsConfig {
                    client_cert: read("cert", cert)?,
                    client_key: read("key", key)?,
                }),
                None => None,
            };
            let root_cert = match &settings.ca_cert {
                Some(path) => Some(read("cacert", path)?),
                None => None,
            };
            redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls,
                    root_cert,
                },
            )
        } else {
            redis::Client::open(info)
        }
        .map_err(|e| format!("redis: {e}"))?;
        Ok(Self {
            client,
            settings,
            connection: tokio::sync::Mutex::new(Connection {
                manager: None,
                last_try: None,
            }),
            errors: Default::default(),
            last_error: Mutex::new(None),
            storing: Default::default(),
        })
    }

    /// Calls to Redis that failed or timed out so far.
    pub fn errors(&self) -> u64 {
        self.errors.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn failed(&self, what: &str, e: impl std::fmt::Display) {
        self.errors
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let message = format!("{what}: {e}");
        let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        // One line per kind of failure, not one per request.
        if last.as_deref() != Some(message.as_str()) {
            tracing::warn!(
                host = %self.settings.host,
                port = self.settings.port,
                "response cache in Redis: {message}; lookups are misses until it answers"
            );
            *last = Some(message);
        }
    }

    /// The connection, or `None` while Redis cannot be reached (tried again at most once a
    /// second).
    async fn connection(&self) -> Option<ConnectionManager> {
        let wait = Duration::from_millis(self.settings.wait_timeout_ms.max(1));
        let mut conn = tokio::time::timeout(wait, self.connection.lock())
            .await
            .ok()?;
        if let Some(m) = &conn.manager {
            return Some(m.clone());
        }
        if conn.last_try.is_some_and(|t| t.elapsed() < RECONNECT_EVERY) {
            return None;
        }
        conn.last_try = Some(Instant::now());
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(RedisSettings::timeout(self.settings.connect_timeout_ms))
            .set_response_timeout(RedisSettings::timeout(self.settings.socket_timeout_ms))
            .set_number_of_retries(1);
        let connect = ConnectionManager::new_with_config(self.client.clone(), config);
        let limit = RedisSettings::timeout(self.settings.connect_timeout_ms);
        match tokio::time::timeout(limit, connect).await {
            Ok(Ok(m)) => {
                *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
                conn.manager = Some(m.clone());
                Some(m)
            }
            Ok(Err(e)) => {
                self.failed("cannot connect", e);
                None
            }
            Err(_) => {
                self.failed("cannot connect", "timed out");
                None
            }
        }
    }

    fn redis_key(key: &super::cache_key::Key) -> String {
        let mut out = String::with_capacity(KEY_PREFIX.len() + 64);
        out.push_str(KEY_PREFIX);
        for b in key {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }

    /// The answer stored under `key`, if Redis has one that decodes.
    pub async fn get(&self, key: &super::cache_key::Key) -> Option<InferResponse> {
        let mut conn = self.connection().await?;
        let limit = RedisSettings::timeout(self.settings.socket_timeout_ms);
        let found: Option<Vec<u8>> =
            match tokio::time::timeout(limit, conn.get(Self::redis_key(key))).await {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => {
                    self.failed("lookup failed", e);
                    return None;
                }
                Err(_) => {
                    self.failed("lookup failed", "timed out");
                    return None;
                }
            };
        decode(&found?)
    }

    /// Stores `response` under `key` in the background, unless `STORES_IN_FLIGHT` answers are
    /// being stored already (then it is not kept: a later request misses).
    pub fn store(
        self: &std::sync::Arc<Self>,
        key: super::cache_key::Key,
        response: &InferResponse,
    ) {
        use std::sync::atomic::Ordering::AcqRel;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.storing.fetch_add(1, AcqRel) >= STORES_IN_FLIGHT {
            self.storing.fetch_sub(1, AcqRel);
            return;
        }
        let (cache, response) = (self.clone(), response.clone());
        runtime.spawn(async move {
            cache.insert(key, &response).await;
            cache.storing.fetch_sub(1, AcqRel);
        });
    }

    /// Stores `response` under `key` (failures are logged, never returned).
    async fn insert(&self, key: super::cache_key::Key, response: &InferResponse) {
        let Some(mut conn) = self.connection().await else {
            return;
        };
        let limit = RedisSettings::timeout(self.settings.socket_timeout_ms);
        let value = encode(response);
        let stored: Result<Result<(), _>, _> =
            tokio::time::timeout(limit, conn.set(Self::redis_key(&key), value)).await;
        match stored {
            Ok(Ok(())) => {}
            Ok(Err(e)) => self.failed("storing failed", e),
            Err(_) => self.failed("storing failed", "timed out"),
        }
    }
}

/// Version tag of the stored form.
const MAGIC: &[u8; 4] = b"WTR1";

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

/// An answer as stored: its parameters and outputs (the model, version and id come from the
/// request that finds it).
fn encode(response: &InferResponse) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        64 + response
            .outputs
            .iter()
            .map(|t| t.data.len() + 64)
            .sum::<usize>(),
    );
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(response.parameters.len() as u64).to_le_bytes());
    for (name, value) in &response.parameters {
        put_bytes(&mut out, name.as_bytes());
        match value {
            ParamValue::Bool(b) => {
                out.push(0);
                out.extend_from_slice(&u64::from(*b).to_le_bytes());
            }
            ParamValue::Int(i) => {
                out.push(1);
                out.extend_from_slice(&i.to_le_bytes());
            }
            ParamValue::Uint(u) => {
                out.push(2);
                out.extend_from_slice(&u.to_le_bytes());
            }
            ParamValue::Double(d) => {
                out.push(3);
                out.extend_from_slice(&d.to_le_bytes());
            }
            ParamValue::String(s) => {
                out.push(4);
                put_bytes(&mut out, s.as_bytes());
            }
        }
    }
    out.extend_from_slice(&(response.outputs.len() as u64).to_le_bytes());
    for t in &response.outputs {
        put_bytes(&mut out, t.name.as_bytes());
        put_bytes(&mut out, t.datatype.wire_name().as_bytes());
        out.extend_from_slice(&(t.shape.len() as u64).to_le_bytes());
        for d in &t.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        put_bytes(&mut out, &t.data);
    }
    out
}

/// Reads what [`encode`] wrote; `None` for anything else (another program's value, a
/// truncated or altered one), which the cache treats as a miss.
fn decode(bytes: &[u8]) -> Option<InferResponse> {
    struct Reader<'a>(&'a [u8]);
    impl<'a> Reader<'a> {
        fn take(&mut self, n: usize) -> Option<&'a [u8]> {
            if n > self.0.len() {
                return None;
            }
            let (head, rest) = self.0.split_at(n);
            self.0 = rest;
            Some(head)
        }
        fn u64(&mut self) -> Option<u64> {
            Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
        }
        fn len(&mut self) -> Option<usize> {
            // A length never exceeds what is left, so a forged one cannot make us allocate.
            usize::try_from(self.u64()?)
                .ok()
                .filter(|&n| n <= self.0.len())
        }
        fn bytes(&mut self) -> Option<&'a [u8]> {
            let n = self.len()?;
            self.take(n)
        }
        fn text(&mut self) -> Option<String> {
            String::from_utf8(self.bytes()?.to_vec()).ok()
        }
    }
    let mut r = Reader(bytes);
    if r.take(4)? != MAGIC {
        return None;
    }
    let mut parameters = Parameters::new();
    for _ in 0..r.len()? {
        let name = r.text()?;
        let value = match r.take(1)?[0] {
            0 => ParamValue::Bool(r.u64()? != 0),
            1 => ParamValue::Int(r.u64()? as i64),
            2 => ParamValue::Uint(r.u64()?),
            3 => ParamValue::Double(f64::from_bits(r.u64()?)),
            4 => ParamValue::String(r.text()?),
            _ => return None,
        };
        parameters.insert(name, value);
    }
    let mut outputs = Vec::new();
    for _ in 0..r.len()? {
        let name = r.text()?;
        let datatype = DataType::from_wire(&r.text()?)?;
        let dims = r.len()?;
        let shape = (0..dims)
            .map(|_| r.u64().map(|d| d as i64))
            .collect::<Option<Vec<i64>>>()?;
        let data = Bytes::copy_from_slice(r.bytes()?);
        let tensor = Tensor {
            name,
            datatype,
            shape,
            data,
        };
        tensor.validate_size().ok()?;
        outputs.push(tensor);
    }
    if !r.0.is_empty() {
        return None;
    }
    Some(InferResponse {
        model_name: String::new(),
        model_version: 0,
        id: String::new(),
        parameters,
        outputs,
        last: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_round_trip_and_anything_else_is_a_miss() {
        let mut parameters = Parameters::new();
        parameters.insert("p".into(), ParamValue::Double(0.5));
        parameters.insert("s".into(), ParamValue::String("x".into()));
        let answer = InferResponse {
            model_name: String::new(),
            model_version: 0,
            last: false,
            id: String::new(),
            parameters,
            outputs: vec![Tensor {
                name: "y".into(),
                datatype: DataType::Fp32,
                shape: vec![1, 2],
                data: vec![0u8; 8].into(),
            }],
        };
        let stored = encode(&answer);
        assert_eq!(decode(&stored), Some(answer));
        for cut in 0..stored.len() {
            assert_eq!(decode(&stored[..cut]), None, "cut at {cut}");
        }
        let mut forged = stored.clone();
        forged[4..12].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(decode(&forged), None);
        assert_eq!(decode(b"not ours"), None);
    }

    #[test]
    fn settings_are_tritons_and_refused_by_name() {
        let none = |_: &str| None;
        let (s, notes) =
            RedisSettings::parse(["host=localhost", "port=6379", "pool_size=4"], none).unwrap();
        assert_eq!((s.host.as_str(), s.port, s.db), ("localhost", 6379, 0));
        assert!(notes[0].contains("pool_size has no effect"));
        let env = |k: &str| (k == "TRITONCACHE_REDIS_PASSWORD").then(|| "pw".to_owned());
        let (s, _) = RedisSettings::parse(["host=h", "port=1"], env).unwrap();
        assert_eq!(s.password.as_deref(), Some("pw"));
        assert!(RedisSettings::parse(["host=h"], none)
            .unwrap_err()
            .contains("needs host and port"));
        let (s, _) = RedisSettings::parse(["host=h", "port=1", "tls_enabled=true"], none).unwrap();
        assert!(s.tls);
        assert!(
            RedisSettings::parse(["host=h", "port=1", "cacert=/ca.pem"], none)
                .unwrap_err()
                .contains("need tls_enabled=true")
        );
        assert!(
            RedisSettings::parse(["host=h", "port=1", "tls_enabled=1", "cert=/c.pem"], none)
                .unwrap_err()
                .contains("'cert' and 'key' go together")
        );
        assert!(
            RedisSettings::parse(["host=h", "port=1", "colour=red"], none)
                .unwrap_err()
                .contains("unknown redis setting 'colour'")
        );
    }
}
