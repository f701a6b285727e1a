//! Test harness: starts the real `wasmtron` binary on ephemeral loopback ports, learns the
//! ports from its "Started ..." lines, and kills it on drop.
#![allow(dead_code)]

use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{mpsc, Arc, Mutex},
    time::{Duration, Instant},
};

/// Generous: the machine may be loaded and a debug build loads models slowly.
/// Models load before the server listens; a Python stage compiles for ~30 s in a debug build.
pub const STARTUP: Duration = Duration::from_secs(300);

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

pub fn example_repository() -> PathBuf {
    workspace().join("model_repository")
}

/// Adds a copy of the probe stage (tests/guests/probe) as `name` with the given `mode` and
/// extra config.pbtxt parameters.
pub fn add_probe(repo: &Path, name: &str, mode: &str, params: &[(&str, &str)]) {
    let src = workspace().join("tests/models/probe");
    assert!(
        src.join("1/model.wasm").exists(),
        "probe stage not built; run `make stages`"
    );
    let dst = repo.join(name);
    copy_dir(&src, &dst);
    let mut config = std::fs::read_to_string(dst.join("config.pbtxt")).unwrap();
    config = config.replace(
        "string_value: \"echo\"",
        &format!("string_value: \"{mode}\""),
    );
    for (k, v) in params {
        config.push_str(&format!(
            "parameters [ {{ key: \"{k}\", value: {{ string_value: \"{v}\" }} }} ]\n"
        ));
    }
    std::fs::write(dst.join("config.pbtxt"), config).unwrap();
}

/// Replaces (or creates) `<repo>/<name>` with a copy of `source`'s files (from the example
/// repository or the test models) and `config`.
pub fn add_model(repo: &Path, name: &str, source: &str, config: &str) {
    copy_dir(&model_source(source), &repo.join(name));
    std::fs::write(repo.join(name).join("config.pbtxt"), config).unwrap();
}

/// A fresh repository in a temp dir holding copies of the named models from the example
/// repository or `tests/models`.
pub fn temp_repository(models: &[&str]) -> TempDir {
    let dir = TempDir::new();
    for m in models {
        copy_dir(&model_source(m), &dir.path().join(m));
    }
    dir
}

/// The directory of model `name` in the example repository or `tests/models`.
fn model_source(name: &str) -> PathBuf {
    [
        example_repository().join(name),
        workspace().join("tests/models").join(name),
    ]
    .into_iter()
    .find(|p| p.is_dir())
    .unwrap_or_else(|| panic!("model {name} not found; run `make models`"))
}

pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let target = dst.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!(
            "wasmtron-test-{}-{n}-{}",
            std::process::id(),
            nanos()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

pub struct TestServer {
    child: Option<Child>,
    pub http: String,
    pub grpc: String,
    pub metrics: String,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl TestServer {
    /// Starts the server on `repo` with extra arguments and waits until it listens.
    pub fn start(repo: &Path, extra: &[&str]) -> Self {
        Self::start_with_env(repo, extra, &[])
    }

    /// [`Self::start`] with environment variables set for the server.
    pub fn start_with_env(repo: &Path, extra: &[&str], vars: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wasmtron"));
        cmd.envs(vars.iter().copied());
        cmd.arg("--model-repository")
            .arg(repo)
            .args([
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--metrics-port",
                "0",
            ])
            .args(["--http-address", "127.0.0.1", "--grpc-address", "127.0.0.1"])
            .args(["--metrics-address", "127.0.0.1"])
            // Repositories with models meant to fail keep the others serving, unless a test
            // asks for Triton's default itself (the last value of a flag wins).
            .arg("--exit-on-error=false")
            .args(extra)
            // Compiled stages are shared by all tests (keyed by content), never written to $HOME.
            .env(
                "WASMTRON_CACHE_DIR",
                Path::new(env!("CARGO_TARGET_TMPDIR")).join("wasm-cache"),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start wasmtron");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line
                    .strip_prefix("Started ")
                    .and_then(|rest| rest.split(" at ").nth(1))
                {
                    let _ = tx.send((line.clone(), addr.trim().to_owned()));
                }
                sink.lock().unwrap().push(line);
            }
        });
        let mut server = TestServer {
            child: Some(child),
            http: String::new(),
            grpc: String::new(),
            metrics: String::new(),
            log,
        };
        let deadline = Instant::now() + STARTUP;
        while server.http.is_empty() || server.grpc.is_empty() || server.metrics.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((line, addr)) => {
                    if line.contains("HTTPService") {
                        server.http = format!("http://{addr}");
                    } else if line.contains("GRPCInferenceService") {
                        server.grpc = format!("http://{addr}");
                    } else if line.contains("Metrics") {
                        server.metrics = format!("http://{addr}");
                    }
                }
                Err(_) => panic!("server did not start; log:\n{}", server.log_text()),
            }
        }
        server
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self, wait: Duration) -> Option<std::process::ExitStatus> {
        let pid = self.pid();
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        let deadline = Instant::now() + wait;
        let child = self.child.as_mut().unwrap();
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.http)
    }

    /// The Prometheus text from the metrics port.
    pub fn metrics_text(&self) -> String {
        http()
            .get(format!("{}/metrics", self.metrics))
            .send()
            .unwrap()
            .text()
            .unwrap()
    }

    /// The statistics extension's entry for `model` (its only or highest version).
    pub fn model_stats(&self, model: &str) -> serde_json::Value {
        let body: serde_json::Value = http()
            .get(self.url(&format!("/v2/models/{model}/stats")))
            .send()
            .unwrap()
            .json()
            .unwrap();
        body["model_stats"][0].clone()
    }

    /// The value of metric `name` for `model` (summed over versions and other labels).
    pub fn metric(&self, name: &str, model: &str) -> f64 {
        let label = format!("model=\"{model}\"");
        self.metrics_text()
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(&label))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// POSTs a JSON body; returns the status and the JSON answer (`Null` when there is none).
pub fn post_json(s: &TestServer, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let resp = http().post(s.url(path)).json(body).send().unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().unwrap_or(serde_json::Value::Null))
}

/// One JSON inference request over HTTP.
pub fn infer(s: &TestServer, model: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    post_json(s, &format!("/v2/models/{model}/infer"), body)
}

/// Asserts that an answer is an error with `status` whose message contains `expected`.
pub fn assert_error(answer: (u16, serde_json::Value), status: u16, expected: &str) {
    let (got, body) = answer;
    assert_eq!(got, status, "{body}");
    let message = body["error"].as_str().unwrap_or_default();
    assert!(
        message.contains(expected),
        "{message}\n  expected: {expected}"
    );
}

/// Images as the BYTES elements of `IMAGE` ([n, 1]) in a binary-extension request; returns
/// the body and the value for `Inference-Header-Content-Length`.
pub fn image_body(images: &[&[u8]]) -> (Vec<u8>, usize) {
    let mut binary = Vec::new();
    for image in images {
        binary.extend_from_slice(&(image.len() as u32).to_le_bytes());
        binary.extend_from_slice(image);
    }
    let header = serde_json::json!({"inputs": [{"name": "IMAGE", "shape": [images.len(), 1],
        "datatype": "BYTES", "parameters": {"binary_data_size": binary.len()}}]});
    binary_body(&header, &binary)
}

/// POSTs images (see [`image_body`]) to a model; the outputs come back as JSON.
pub fn post_image_body(
    s: &TestServer,
    model: &str,
    images: &[&[u8]],
) -> reqwest::blocking::Response {
    let (body, len) = image_body(images);
    http()
        .post(s.url(&format!("/v2/models/{model}/infer")))
        .header("Inference-Header-Content-Length", len.to_string())
        .body(body)
        .send()
        .unwrap()
}

/// [`post_image_body`], expecting success.
pub fn post_images(s: &TestServer, model: &str, images: &[&[u8]]) -> serde_json::Value {
    let resp = post_image_body(s, model, images);
    assert_eq!(resp.status(), 200);
    resp.json().unwrap()
}

/// A blocking HTTP client with a generous timeout.
pub fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// JSON body for the `simple` model: INPUT0 = 0..16, INPUT1 = ones.
pub fn simple_request() -> serde_json::Value {
    serde_json::json!({
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": (0..16).collect::<Vec<i32>>()},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": vec![1; 16]},
        ]
    })
}

/// A binary-extension body: the JSON header followed by `binary`; returns the body and the
/// value for `Inference-Header-Content-Length`.
pub fn binary_body(header: &serde_json::Value, binary: &[u8]) -> (Vec<u8>, usize) {
    let mut body = serde_json::to_vec(header).unwrap();
    let len = body.len();
    body.extend_from_slice(binary);
    (body, len)
}

/// Polls `f` until it returns true or the timeout passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}
