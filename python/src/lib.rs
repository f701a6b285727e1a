//! The wasmtron server as a Python extension module (`wasmtron._wasmtron`): the whole server
//! core runs in the calling process, on its own tokio runtime, and Python calls it directly,
//! with no network hop. This layer only translates: tensors arrive and leave as
//! `(name, datatype, shape, bytes)` tuples (the `wasmtron` package converts them from and to
//! NumPy), errors leave as exceptions named after Triton's in-process API. The GIL is
//! released while the server works, so Python threads infer concurrently.

use std::{sync::Arc, time::Duration};

mod bound;
mod buffer;

use pyo3::{
    create_exception,
    exceptions::PyException,
    prelude::*,
    types::{PyBytes, PyDict},
};
use wasmtron::{
    error::{Code, Error},
    frontends::{
        listeners::{Endpoint, ListenerOptions, Listeners},
        restricted::Restrictions,
    },
    inference::{InferRequest, InferResponse, ParamValue, Parameters, RequestedOutput},
    repository::remote::open_repositories,
    runtime::RuntimeOptions,
    scheduling::{
        model_manager::LoadOverride,
        server::{ControlMode, Server, ServerOptions},
        views,
    },
    tenancy::Caller,
    tensor::{DataType, Tensor},
};

create_exception!(
    wasmtron,
    WasmtronError,
    PyException,
    "An error the server answered with."
);
create_exception!(
    wasmtron,
    InvalidArgumentError,
    WasmtronError,
    "The request is malformed or does not fit the model (HTTP 400)."
);
create_exception!(
    wasmtron,
    NotFoundError,
    WasmtronError,
    "No such model, version or tensor (HTTP 404)."
);
create_exception!(
    wasmtron,
    UnavailableError,
    WasmtronError,
    "The model or server cannot take the request now (HTTP 503)."
);
create_exception!(
    wasmtron,
    UnsupportedError,
    WasmtronError,
    "A feature the server does not offer (HTTP 501)."
);
create_exception!(
    wasmtron,
    AlreadyExistsError,
    WasmtronError,
    "Something already exists."
);
create_exception!(
    wasmtron,
    CancelledError,
    WasmtronError,
    "The request was cancelled."
);
create_exception!(
    wasmtron,
    InternalError,
    WasmtronError,
    "A failure inside the server or a model (HTTP 500)."
);

/// The Python exception for a server error, its message unchanged.
fn to_py(err: Error) -> PyErr {
    let message = err.message;
    match err.code {
        Code::InvalidArg => InvalidArgumentError::new_err(message),
        Code::NotFound => NotFoundError::new_err(message),
        Code::Unavailable | Code::ResourceExhausted => UnavailableError::new_err(message),
        Code::Unsupported => UnsupportedError::new_err(message),
        Code::AlreadyExists => AlreadyExistsError::new_err(message),
        Code::Cancelled => CancelledError::new_err(message),
        Code::Unauthenticated | Code::PermissionDenied | Code::Internal | Code::Unknown => {
            InternalError::new_err(message)
        }
    }
}

/// A tensor as it crosses into Python: name, Triton datatype, shape, row-major bytes (BYTES
/// elements length-prefixed as on the wire).
type PyTensor = (String, String, Vec<i64>, Vec<u8>);

/// An output on its way to Python: its bytes lent as a buffer (BYTES tensors: a `bytes`).
type PyOutput<'py> = (String, String, Vec<i64>, Bound<'py, PyAny>);

/// A response on its way to Python: model, version, request id, parameters, outputs.
type PyResponse<'py> = (String, i64, String, Bound<'py, PyDict>, Vec<PyOutput<'py>>);

/// One entry of the repository index: name, version (None: no version loaded), state, reason.
type IndexRow = (String, Option<i64>, String, String);

/// The server core, in-process. `wasmtron.Server` wraps it with the NumPy-facing API.
#[pyclass(module = "wasmtron._wasmtron")]
struct CoreServer {
    runtime: tokio::runtime::Runtime,
    options: ServerOptions,
    /// The repositories as given: directories, or object stores (`s3://`, `gs://`, `as://`)
    /// copied locally at start.
    repositories: Vec<String>,
    server: Option<Arc<Server>>,
    /// HTTP/gRPC/metrics listeners, when `start` opened any.
    listeners: Option<Listeners>,
    /// The tenants of the server config file, if one was given: remote callers need their
    /// keys; in-process callers are the embedding program and are not checked.
    tenancy: Option<Arc<wasmtron::tenancy::Tenancy>>,
}

impl CoreServer {
    fn running(&self) -> PyResult<&Arc<Server>> {
        self.server.as_ref().ok_or_else(|| {
            UnavailableError::new_err("the server is not started (call start() first)")
        })
    }
}

#[pymethods]
impl CoreServer {
    /// `model_control_mode`: "none", "poll" or "explicit"; `load_models`: what explicit mode
    /// loads at start ("*" for all); `config`: the server config file (TOML: tenants, keys,
    /// quotas), as the binary's `--config`.
    #[new]
    #[pyo3(signature = (model_repository, model_control_mode="none", load_models=Vec::new(), strict_readiness=true, onnxruntime_library=None, config=None, load_threads=4))]
    fn new(
        model_repository: Vec<String>,
        model_control_mode: &str,
        load_models: Vec<String>,
        strict_readiness: bool,
        onnxruntime_library: Option<String>,
        config: Option<String>,
        load_threads: usize,
    ) -> PyResult<Self> {
        let control_mode = match model_control_mode {
            "none" => ControlMode::None,
            "poll" => ControlMode::Poll,
            "explicit" => ControlMode::Explicit,
            other => {
                return Err(InvalidArgumentError::new_err(format!(
                    "model_control_mode '{other}' is not one of none, poll, explicit"
                )))
            }
        };
        if model_repository.is_empty() {
            return Err(InvalidArgumentError::new_err(
                "model_repository names no directory",
            ));
        }
        let tenancy = config
            .map(|path| wasmtron::tenancy::Tenancy::load(std::path::Path::new(&path)))
            .transpose()
            .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?
            .map(Arc::new);
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.clamp(1, 4))
            .thread_name("wasmtron-py")
            .enable_all()
            .build()
            .map_err(|e| InternalError::new_err(format!("cannot start the runtime: {e}")))?;
        let defaults = ServerOptions::default();
        let options = ServerOptions {
            control_mode,
            load_models,
            strict_readiness,
            load_threads: load_threads.max(1),
            runtime: RuntimeOptions {
                onnx: wasmtron::runtime::onnx::OnnxSettings {
                    library: onnxruntime_library.map(Into::into),
                    ..defaults.runtime.onnx.clone()
                },
                ..defaults.runtime
            },
            // In-process callers have no flag for it; a shorter poll than the binary's.
            poll_interval: Duration::from_secs(5),
            ..ServerOptions::default()
        }
        // With tenants, executions are shared among them by weight, as in the binary.
        .with_tenancy(tenancy.clone(), Some(threads));
        Ok(Self {
            runtime,
            options,
            repositories: model_repository,
            server: None,
            listeners: None,
            tenancy,
        })
    }

    /// Loads the repository and starts serving in this process; with ports (0: a free one),
    /// also opens the HTTP, gRPC and metrics listeners on `address`, with API groups that
    /// need a header (`--http-restricted-api`, `--grpc-restricted-protocol` values). Started
    /// twice, the second call does nothing (and refuses ports).
    #[pyo3(signature = (http_port=None, grpc_port=None, metrics_port=None, address="127.0.0.1",
                        http_restricted_api=Vec::new(), grpc_restricted_protocol=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        py: Python<'_>,
        http_port: Option<u16>,
        grpc_port: Option<u16>,
        metrics_port: Option<u16>,
        address: &str,
        http_restricted_api: Vec<String>,
        grpc_restricted_protocol: Vec<String>,
    ) -> PyResult<()> {
        if self.server.is_some() {
            if http_port.is_some() || grpc_port.is_some() || metrics_port.is_some() {
                return Err(AlreadyExistsError::new_err(
                    "the server is already started: give the ports to the first start()",
                ));
            }
            return Ok(());
        }
        let mut options = self.options.clone();
        let repositories = self.repositories.clone();
        let endpoint = |port: Option<u16>| port.map(|p| Endpoint::new(address, p));
        let http_restrictions =
            Restrictions::parse(&http_restricted_api, "http_restricted_api", "")
                .map_err(InvalidArgumentError::new_err)?;
        let grpc_restrictions = Restrictions::parse(
            &grpc_restricted_protocol,
            "grpc_restricted_protocol",
            "triton-grpc-protocol-",
        )
        .map_err(InvalidArgumentError::new_err)?;
        let listening = ListenerOptions {
            http: endpoint(http_port),
            grpc: endpoint(grpc_port),
            metrics: endpoint(metrics_port),
            tenancy: self.tenancy.clone(),
            http_restrictions,
            grpc_restrictions,
            ..Default::default()
        };
        let any =
            listening.http.is_some() || listening.grpc.is_some() || listening.metrics.is_some();
        let runtime = &self.runtime;
        let (server, listeners) = py
            .detach(|| {
                runtime.block_on(async {
                    let (remote, local) = open_repositories(&repositories, &std::env::temp_dir())
                        .await
                        .map_err(|e| Error::unavailable(e.to_string()))?;
                    options.model_repositories = local;
                    options.remote_repositories = remote;
                    let server = Server::start(options).await?;
                    if !any {
                        return Ok((server, None));
                    }
                    match Listeners::open(server.clone(), listening).await {
                        Ok(listeners) => Ok((server, Some(listeners))),
                        Err(e) => {
                            server.drain(Duration::from_secs(5)).await;
                            Err(e)
                        }
                    }
                })
            })
            .map_err(to_py)?;
        self.server = Some(server);
        self.listeners = listeners;
        Ok(())
    }

    /// Where the listeners listen: `{"http": "127.0.0.1:8000", ...}` for those open.
    fn addresses(&self) -> std::collections::HashMap<String, String> {
        let mut out = std::collections::HashMap::new();
        if let Some(bound) = self.listeners.as_ref().map(Listeners::addresses) {
            for (what, addr) in [
                ("http", bound.http),
                ("grpc", bound.grpc),
                ("metrics", bound.metrics),
            ] {
                if let Some(addr) = addr {
                    out.insert(what.to_owned(), addr.to_string());
                }
            }
        }
        out
    }

    /// Stops taking requests, waits up to `timeout` seconds for those accepted, closes the
    /// listeners, then unloads.
    #[pyo3(signature = (timeout=30.0))]
    fn stop(&mut self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let wait = Duration::from_secs_f64(timeout.max(0.0));
        Ok(py.detach(|| self.shut_down(wait)))
    }

    /// Whether the server is started and its models are ready.
    fn ready(&self) -> bool {
        self.server.as_ref().is_some_and(|s| s.is_ready())
    }

    /// Whether `name` (at `version`, or its latest) is loaded and healthy.
    #[pyo3(signature = (name, version=None))]
    fn model_ready(&self, name: &str, version: Option<i64>) -> bool {
        self.server
            .as_ref()
            .is_some_and(|s| s.models().is_ready(name, version))
    }

    /// The repository index: (name, version or None, state, reason) per model.
    fn index(&self) -> PyResult<Vec<IndexRow>> {
        let server = self.running()?;
        Ok(server
            .models()
            .index(false)
            .into_iter()
            .map(|e| (e.name, e.version, e.state.as_str().to_owned(), e.reason))
            .collect())
    }

    /// Loads (or reloads) a model; explicit control mode only. `config`: a configuration in
    /// JSON used instead of `config.pbtxt`; `files`: model files by relative path (the
    /// `file:<path>` load parameters of the repository extension).
    #[pyo3(signature = (name, config=None, files=Vec::new()))]
    fn load(
        &self,
        py: Python<'_>,
        name: &str,
        config: Option<String>,
        files: Vec<(String, Vec<u8>)>,
    ) -> PyResult<()> {
        let server = self.running()?.clone();
        server.check_model_control().map_err(to_py)?;
        let mut load = LoadOverride {
            config_json: config,
            ..LoadOverride::default()
        };
        for (path, content) in files {
            load.add_file(&path, content).map_err(to_py)?;
        }
        py.detach(|| self.runtime.block_on(server.models().load(name, load)))
            .map_err(to_py)
    }

    /// Unloads a model; explicit control mode only.
    #[pyo3(signature = (name, unload_dependents=false))]
    fn unload(&self, py: Python<'_>, name: &str, unload_dependents: bool) -> PyResult<()> {
        let server = self.running()?.clone();
        server.check_model_control().map_err(to_py)?;
        py.detach(|| {
            self.runtime
                .block_on(server.models().unload(name, unload_dependents))
        })
        .map_err(to_py)
    }

    /// The Prometheus metrics, as the metrics endpoint serves them.
    fn metrics(&self) -> PyResult<String> {
        Ok(wasmtron::scheduling::views::metrics::text(
            self.running()?,
            None,
            false,
            false,
        ))
    }

    /// Runs one request and returns an iterator of its responses: every response of a
    /// decoupled model as it is sent, or the one response of any other model. The stream
    /// says which (`decoupled`), so the package can mark the final response as Triton does.
    #[pyo3(signature = (model, version, inputs, outputs=Vec::new(), parameters=None, request_id=None))]
    fn infer_stream<'py>(
        &self,
        model: &str,
        version: i64,
        inputs: Vec<PyTensor>,
        outputs: Vec<String>,
        parameters: Option<Bound<'py, PyDict>>,
        request_id: Option<String>,
    ) -> PyResult<ResponseStream> {
        let server = self.running()?.clone();
        let mut request = request(model, version, inputs, outputs, parameters)?;
        if let Some(id) = request_id {
            request.id = id;
        }
        let _entered = self.runtime.enter();
        // The model looked up once; a name that is not loaded is answered in the stream.
        let (items, decoupled) = match server.target(&request.model_name, request.model_version) {
            Ok(target) => (
                server.infer_stream_on(&target, request),
                wasmtron::runtime::is_decoupled(target.config()),
            ),
            Err(_) => (server.infer_stream(request), false),
        };
        Ok(ResponseStream {
            items: Some(items),
            runtime: self.runtime.handle().clone(),
            decoupled,
        })
    }

    /// The server's metadata as JSON (`GET /v2`: name, version, extensions).
    fn metadata(&self) -> String {
        serde_json::json!({
            "name": self.options.server_id,
            "version": views::SERVER_VERSION,
            "extensions": views::EXTENSIONS,
        })
        .to_string()
    }

    /// Whether the server is started and not shutting down.
    fn live(&self) -> bool {
        self.server.is_some()
    }

    /// Serves Python callables as model `config_json["name"]` (one instance per callable),
    /// through the model's scheduler like any model. Each callable is the package's
    /// `_call_bound` wrapper.
    fn bind(&self, py: Python<'_>, config_json: &str, calls: Vec<Py<PyAny>>) -> PyResult<()> {
        let server = self.running()?.clone();
        let config = wasmtron::repository::config::parse_json(config_json)
            .map_err(|e| InvalidArgumentError::new_err(format!("bind: {e}")))?;
        let outputs: Vec<(String, DataType)> = config
            .output
            .iter()
            .filter_map(|o| Some((o.name.clone(), DataType::from_config_value(o.data_type)?)))
            .collect();
        let instances: Vec<Box<dyn wasmtron::runtime::ModelInstance>> = calls
            .into_iter()
            .map(|call| {
                Box::new(bound::BoundFunction {
                    model: config.name.clone(),
                    call,
                    outputs: outputs.clone(),
                }) as Box<dyn wasmtron::runtime::ModelInstance>
            })
            .collect();
        let runtime = &self.runtime;
        py.detach(|| runtime.block_on(server.models().add_model(config, instances)))
            .map_err(to_py)
    }

    /// The model's configuration as JSON, as `GET /v2/models/<name>/config` answers it.
    #[pyo3(signature = (name, version=None))]
    fn model_config(&self, name: &str, version: Option<i64>) -> PyResult<String> {
        let version = version.map(|v| v.to_string()).unwrap_or_default();
        let config =
            views::model_config(self.running()?, &Caller::Anyone, name, &version).map_err(to_py)?;
        Ok(wasmtron::repository::config::to_json(&config).to_string())
    }

    /// The model's metadata as JSON, as `GET /v2/models/<name>` answers it (name, versions,
    /// platform, inputs and outputs with the batch dimension as -1).
    #[pyo3(signature = (name, version=""))]
    fn model_metadata(&self, name: &str, version: &str) -> PyResult<String> {
        let m = views::model_metadata(self.running()?, &Caller::Anyone, name, version)
            .map_err(to_py)?;
        Ok(views::metadata_json(&m).to_string())
    }

    /// The statistics extension's JSON for `name` (all models when empty), as
    /// `GET /v2/models/<name>/stats` answers it.
    #[pyo3(signature = (name="", version=""))]
    fn statistics(&self, name: &str, version: &str) -> PyResult<String> {
        let stats = views::model_statistics(self.running()?, &Caller::Anyone, name, version)
            .map_err(to_py)?;
        Ok(views::stats_json(stats).to_string())
    }
}

/// The responses of one streamed request; iterating blocks (without the GIL) for the next.
#[pyclass(module = "wasmtron._wasmtron")]
struct ResponseStream {
    items: Option<tokio::sync::mpsc::Receiver<wasmtron::error::Result<InferResponse>>>,
    runtime: tokio::runtime::Handle,
    /// Whether the model is decoupled (0..N responses) rather than answering once.
    #[pyo3(get)]
    decoupled: bool,
}

#[pymethods]
impl ResponseStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next response: (model, version, request id, parameters, outputs).
    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<PyResponse<'py>>> {
        let Some(items) = self.items.as_mut() else {
            return Ok(None);
        };
        let runtime = &self.runtime;
        match py.detach(|| runtime.block_on(items.recv())) {
            Some(Ok(response)) => Ok(Some((
                response.model_name,
                response.model_version,
                response.id,
                from_parameters(py, &response.parameters)?,
                to_outputs(py, response.outputs)?,
            ))),
            Some(Err(err)) => {
                self.items = None;
                Err(to_py(err))
            }
            None => {
                self.items = None;
                Ok(None)
            }
        }
    }

    /// Stops the request: the model's remaining responses are not waited for.
    fn close(&mut self) {
        self.items = None;
    }
}

impl CoreServer {
    /// Readiness off, new requests refused, accepted ones waited for up to `wait`, then the
    /// listeners closed (remote callers' answers are sent before), as the binary shuts down.
    /// Returns whether every accepted request finished.
    fn shut_down(&mut self, wait: Duration) -> bool {
        let Some(server) = self.server.take() else {
            return true;
        };
        let listeners = self.listeners.take();
        self.runtime.block_on(async {
            server.mark_unready();
            if let Some(listeners) = &listeners {
                listeners.set_not_serving().await;
            }
            let drained = server.drain(wait).await;
            if let Some(listeners) = listeners {
                listeners.close(Duration::from_secs(5)).await;
            }
            drained
        })
    }
}

impl Drop for CoreServer {
    /// A server dropped while serving (garbage-collected, or the interpreter exiting) drains
    /// what it accepted before its runtime goes.
    ///
    /// The GIL is let go while draining: a bound Python function still running needs it to
    /// finish (the package's finalizer normally stops the server before this runs).
    fn drop(&mut self) {
        if self.server.is_none() {
            return;
        }
        Python::attach(|py| py.detach(|| self.shut_down(Duration::from_secs(30))));
    }
}

/// A request from what Python passed.
fn request(
    model: &str,
    version: i64,
    inputs: Vec<PyTensor>,
    outputs: Vec<String>,
    parameters: Option<Bound<'_, PyDict>>,
) -> PyResult<InferRequest> {
    let mut tensors = Vec::with_capacity(inputs.len());
    for (name, datatype, shape, data) in inputs {
        let datatype = DataType::from_wire(&datatype).ok_or_else(|| {
            InvalidArgumentError::new_err(format!(
                "input '{name}' has unknown datatype '{datatype}'"
            ))
        })?;
        tensors.push(Tensor {
            name,
            datatype,
            shape,
            data: data.into(),
        });
    }
    let parameters = parameters
        .map(|p| to_parameters(&p))
        .transpose()?
        .unwrap_or_default();
    let outputs = outputs
        .into_iter()
        .map(|name| RequestedOutput {
            name,
            parameters: Default::default(),
        })
        .collect();
    Ok(InferRequest::new(model, (version >= 0).then_some(version))
        .with_parameters(parameters)
        .with_inputs(tensors)
        .with_outputs(outputs))
}

/// Outputs as Python sees them: numeric tensors lend their memory (no copy); BYTES tensors
/// are copied, since Python makes objects of their elements anyway.
fn to_outputs(py: Python<'_>, outputs: Vec<Tensor>) -> PyResult<Vec<PyOutput<'_>>> {
    outputs
        .into_iter()
        .map(|t| {
            let data = tensor_data(py, t.datatype, t.data)?;
            Ok((t.name, t.datatype.wire_name().to_owned(), t.shape, data))
        })
        .collect()
}

/// A tensor's bytes for Python: a [`buffer::TensorBuffer`] over them, or `bytes` for BYTES.
pub(crate) fn tensor_data(
    py: Python<'_>,
    datatype: DataType,
    data: bytes::Bytes,
) -> PyResult<Bound<'_, PyAny>> {
    if datatype == DataType::Bytes {
        return Ok(PyBytes::new(py, &data).into_any());
    }
    Ok(Bound::new(py, buffer::TensorBuffer::new(data))?.into_any())
}

/// Request parameters from a dict of bool, int, float or str values.
fn to_parameters(dict: &Bound<'_, PyDict>) -> PyResult<Parameters> {
    let mut out = Parameters::new();
    for (key, value) in dict.iter() {
        let key: String = key.extract()?;
        // bool before int: a Python bool is an int too.
        let value = if let Ok(b) = value.extract::<bool>() {
            ParamValue::Bool(b)
        } else if let Ok(i) = value.extract::<i64>() {
            ParamValue::Int(i)
        } else if let Ok(f) = value.extract::<f64>() {
            ParamValue::Double(f)
        } else if let Ok(s) = value.extract::<String>() {
            ParamValue::String(s)
        } else {
            return Err(InvalidArgumentError::new_err(format!(
                "parameter '{key}' must be a bool, int, float or str"
            )));
        };
        out.insert(key, value);
    }
    Ok(out)
}

/// Response parameters as a dict of bool, int, float or str values.
fn from_parameters<'py>(py: Python<'py>, parameters: &Parameters) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    for (key, value) in parameters.iter() {
        match value {
            ParamValue::Bool(b) => out.set_item(key, *b)?,
            ParamValue::Int(i) => out.set_item(key, *i)?,
            ParamValue::Uint(u) => out.set_item(key, *u)?,
            ParamValue::Double(f) => out.set_item(key, *f)?,
            ParamValue::String(s) => out.set_item(key, s)?,
        }
    }
    Ok(out)
}

/// Sends the server's log to stderr (or `file`, appended) at `level` ("error", "warn",
/// "info", "debug"), as `Options(log_info=True, ...)` asks; `RUST_LOG` overrides. Without a
/// call the in-process server logs nothing. Only the first call in a process takes effect.
#[pyfunction]
#[pyo3(signature = (level, file=None))]
fn init_logging(level: &str, file: Option<String>) -> PyResult<bool> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| format!("{level},ort=warn").into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let installed = match file {
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|e| InvalidArgumentError::new_err(format!("log_file '{path}': {e}")))?;
            builder
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(file))
                .try_init()
        }
        None => builder.with_writer(std::io::stderr).try_init(),
    };
    Ok(installed.is_ok())
}

#[pymodule]
fn _wasmtron(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CoreServer>()?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add_class::<ResponseStream>()?;
    m.add_class::<buffer::TensorBuffer>()?;
    let py = m.py();
    m.add("WasmtronError", py.get_type::<WasmtronError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("AlreadyExistsError", py.get_type::<AlreadyExistsError>())?;
    m.add("CancelledError", py.get_type::<CancelledError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
