//! `inference.GRPCInferenceService` over tonic, wire-compatible with Triton's clients, plus the
//! standard `grpc.health.v1` service. RPCs for features this server does not offer answer
//! UNIMPLEMENTED.

use std::{pin::Pin, sync::Arc};

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::{
    check_load, check_unload, model_config, model_metadata, model_statistics, on_behalf_of,
    parse_version,
    restricted::{ApiGroup, Restrictions},
    shared_memory::{
        output_parameters, Kind as MemoryKind, Location, SharedInputs, SystemSharedMemory,
    },
    trace::Tracing,
    EXTENSIONS, SERVER_NAME, SERVER_VERSION,
};
use crate::{
    error::{Code, Error},
    inference::{InferRequest, InferResponse, ParamValue, Parameters, RequestedOutput},
    names::ModelName,
    proto::inference::{
        grpc_inference_service_server::GrpcInferenceService, infer_parameter::ParameterChoice,
        model_infer_request::InferInputTensor, model_infer_response::InferOutputTensor,
        model_repository_parameter::ParameterChoice as RepoParam,
        repository_index_response::ModelIndex, *,
    },
    scheduling::{model_manager::LoadOverride, server::Server},
    tenancy::{Caller, ModelAction, Tenancy},
    tensor::{push_bytes_element, DataType, Tensor},
};

pub use crate::proto::inference::grpc_inference_service_server::GrpcInferenceServiceServer;

/// The gRPC service implementation.
pub struct GrpcService {
    server: Arc<Server>,
    tenancy: Option<Arc<Tenancy>>,
    restrictions: Restrictions,
    shared_memory: Arc<SystemSharedMemory>,
    tracing: Arc<Tracing>,
    /// Largest request message: also the most one request may read from shared memory.
    max_message_size: usize,
}

impl GrpcService {
    /// A service over the server core, open to everyone.
    pub fn new(server: Arc<Server>) -> Self {
        Self {
            server,
            tenancy: None,
            restrictions: Restrictions::default(),
            shared_memory: Arc::new(SystemSharedMemory::new()),
            tracing: Arc::new(Tracing::default()),
            max_message_size: 64 * 1024 * 1024,
        }
    }

    /// The largest request message (`--grpc-max-message-size`); a request's inputs in shared
    /// memory are held to it as well.
    pub fn with_max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// Which requests are traced, shared with the HTTP frontend.
    pub fn with_tracing(mut self, tracing: Arc<Tracing>) -> Self {
        self.tracing = tracing;
        self
    }

    /// The system shared-memory regions, shared with the HTTP frontend.
    pub fn with_shared_memory(mut self, shared_memory: Arc<SystemSharedMemory>) -> Self {
        self.shared_memory = shared_memory;
        self
    }

    /// Protocol groups that need a shared-secret header (`--grpc-restricted-protocol`).
    pub fn with_restrictions(mut self, restrictions: Restrictions) -> Self {
        self.restrictions = restrictions;
        self
    }

    /// The service for the tenants of `tenancy`: every call but the health checks needs an
    /// API key in the `authorization` metadata (`Bearer <key>`).
    pub fn with_tenancy(mut self, tenancy: Option<Arc<Tenancy>>) -> Self {
        self.tenancy = tenancy;
        self
    }

    /// Refuses a request to a restricted `group` without the group's header.
    fn restrict<T>(&self, request: &Request<T>, group: ApiGroup) -> Result<(), Status> {
        let metadata = request.metadata();
        self.restrictions
            .check(group, |name| {
                metadata.get(name).and_then(|v| v.to_str().ok())
            })
            .map_err(to_status)
    }

    /// The caller's shared-memory regions of `kind` (the one named, unless `name` is empty).
    fn regions<T>(
        &self,
        r: Request<T>,
        kind: MemoryKind,
        name: impl FnOnce(T) -> String,
    ) -> Result<Vec<crate::frontends::shared_memory::RegionStatus>, Status> {
        let caller = self.caller(&r, ApiGroup::SharedMemory)?;
        let name = name(r.into_inner());
        self.shared_memory
            .status(&caller, kind, (!name.is_empty()).then_some(name.as_str()))
            .map_err(to_status)
    }

    /// Unregisters the caller's region `name` of `kind` (all of them when empty).
    fn unregister_regions<T>(
        &self,
        r: Request<T>,
        kind: MemoryKind,
        name: impl FnOnce(T) -> String,
    ) -> Result<(), Status> {
        let caller = self.caller(&r, ApiGroup::SharedMemory)?;
        let name = name(r.into_inner());
        self.shared_memory
            .unregister(&caller, kind, (!name.is_empty()).then_some(name.as_str()))
            .map_err(to_status)
    }

    /// Who sent `request` to an API of `group`, after the group's restriction header.
    fn caller<T>(&self, request: &Request<T>, group: ApiGroup) -> Result<Caller, Status> {
        self.restrict(request, group)?;
        let Some(tenancy) = &self.tenancy else {
            return Ok(Caller::Anyone);
        };
        let key = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        tenancy.authenticate(key).map_err(to_status)
    }
}

/// [`Caller::require`] as a gRPC status.
fn require(caller: &Caller, action: ModelAction, model: &str) -> Result<(), Status> {
    caller.require(action, model).map_err(to_status)
}

/// Maps an error to a gRPC status.
pub fn to_status(err: Error) -> Status {
    let code = match err.code {
        Code::InvalidArg => tonic::Code::InvalidArgument,
        Code::NotFound => tonic::Code::NotFound,
        Code::Unavailable => tonic::Code::Unavailable,
        Code::Unsupported => tonic::Code::Unimplemented,
        Code::AlreadyExists => tonic::Code::AlreadyExists,
        Code::Cancelled => tonic::Code::Cancelled,
        Code::Internal => tonic::Code::Internal,
        Code::Unauthenticated => tonic::Code::Unauthenticated,
        Code::PermissionDenied => tonic::Code::PermissionDenied,
        Code::ResourceExhausted => tonic::Code::ResourceExhausted,
    };
    Status::new(code, err.message)
}

fn params_from_proto(map: std::collections::HashMap<String, InferParameter>) -> Parameters {
    map.into_iter()
        .filter_map(|(k, v)| {
            let value = match v.parameter_choice? {
                ParameterChoice::BoolParam(b) => ParamValue::Bool(b),
                ParameterChoice::Int64Param(i) => ParamValue::Int(i),
                ParameterChoice::StringParam(s) => ParamValue::String(s),
                ParameterChoice::DoubleParam(d) => ParamValue::Double(d),
                ParameterChoice::Uint64Param(u) => ParamValue::Uint(u),
            };
            Some((k, value))
        })
        .collect()
}

fn params_to_proto(params: &Parameters) -> std::collections::HashMap<String, InferParameter> {
    params
        .iter()
        .map(|(k, v)| {
            let choice = match v {
                ParamValue::Bool(b) => ParameterChoice::BoolParam(*b),
                ParamValue::Int(i) => ParameterChoice::Int64Param(*i),
                ParamValue::Uint(u) => ParameterChoice::Uint64Param(*u),
                ParamValue::Double(d) => ParameterChoice::DoubleParam(*d),
                ParamValue::String(s) => ParameterChoice::StringParam(s.clone()),
            };
            (
                k.clone(),
                InferParameter {
                    parameter_choice: Some(choice),
                },
            )
        })
        .collect()
}

/// Converts typed `contents` to raw little-endian bytes for the tensor's datatype.
fn contents_to_bytes(input: &InferInputTensor, datatype: DataType) -> Result<Vec<u8>, Error> {
    let c = input.contents.clone().unwrap_or_default();
    let name = &input.name;
    let range = |v: &dyn std::fmt::Display| {
        Error::invalid(format!(
            "input '{name}': value {v} does not fit datatype {datatype}"
        ))
    };
    let mut out = Vec::new();
    macro_rules! narrow {
        ($src:expr, $t:ty) => {
            for v in &$src {
                let x = <$t>::try_from(*v).map_err(|_| range(v))?;
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match datatype {
        DataType::Bool => out.extend(c.bool_contents.iter().map(|&b| u8::from(b))),
        DataType::Int8 => narrow!(c.int_contents, i8),
        DataType::Int16 => narrow!(c.int_contents, i16),
        DataType::Int32 => narrow!(c.int_contents, i32),
        DataType::Int64 => narrow!(c.int64_contents, i64),
        DataType::Uint8 => narrow!(c.uint_contents, u8),
        DataType::Uint16 => narrow!(c.uint_contents, u16),
        DataType::Uint32 => narrow!(c.uint_contents, u32),
        DataType::Uint64 => narrow!(c.uint64_contents, u64),
        DataType::Fp32 => c
            .fp32_contents
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DataType::Fp64 => c
            .fp64_contents
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        DataType::Bytes => c
            .bytes_contents
            .iter()
            .for_each(|b| push_bytes_element(&mut out, b)),
        DataType::Fp16 | DataType::Bf16 => {
            return Err(Error::invalid(format!(
                "input '{name}': datatype {datatype} must be sent in raw_input_contents"
            )))
        }
    }
    Ok(out)
}

/// Decodes a `ModelInferRequest`. Inputs in shared memory (found by `shared`) have no entry
/// in `raw_input_contents`, as tritonclient sends them; every other input has one, in order.
pub fn decode_request(
    req: ModelInferRequest,
    shared: SharedInputs<'_>,
) -> Result<InferRequest, Error> {
    let version = parse_version(&req.model_name, &req.model_version)?;
    let raw = !req.raw_input_contents.is_empty();
    let mut in_shared_memory = Vec::with_capacity(req.inputs.len());
    for input in &req.inputs {
        let params = params_from_proto(input.parameters.clone());
        in_shared_memory.push(shared(&input.name, &params)?);
    }
    let inline = in_shared_memory.iter().filter(|d| d.is_none()).count();
    if raw && req.raw_input_contents.len() != inline {
        return Err(Error::invalid(format!(
            "raw_input_contents has {} entries but the request has {inline} inputs not in shared memory; give one per such input, in order",
            req.raw_input_contents.len(),
        )));
    }
    let mut raw_contents = req.raw_input_contents.into_iter();
    let mut inputs = Vec::with_capacity(req.inputs.len());
    for (input, shared_data) in req.inputs.into_iter().zip(in_shared_memory) {
        let datatype = DataType::from_wire(&input.datatype).ok_or_else(|| {
            Error::invalid(format!(
                "input '{}' has unknown datatype '{}'",
                input.name, input.datatype
            ))
        })?;
        let data = if let Some(data) = shared_data {
            if input.contents.is_some() {
                return Err(Error::invalid(format!(
                    "input '{}' names a shared memory region and also has 'contents'; send one or the other",
                    input.name
                )));
            }
            data
        } else if raw {
            if input.contents.is_some() {
                return Err(Error::invalid(format!(
                    "input '{}' has 'contents' while the request uses raw_input_contents; use one or the other",
                    input.name
                )));
            }
            raw_contents.next().unwrap_or_default()
        } else {
            contents_to_bytes(&input, datatype)?.into()
        };
        inputs.push(Tensor {
            name: input.name,
            datatype,
            shape: input.shape,
            data,
        });
    }
    Ok(InferRequest {
        model_name: req.model_name,
        model_version: version,
        id: req.id,
        parameters: params_from_proto(req.parameters),
        inputs,
        outputs: req
            .outputs
            .into_iter()
            .map(|o| RequestedOutput {
                name: o.name,
                parameters: params_from_proto(o.parameters),
            })
            .collect(),
        deadline: None,
        responses: None,
        step_durations: None,
        callers: Vec::new(),
        from_stage: false,
        trace: Default::default(),
    })
}

/// Encodes a response with every output in `raw_output_contents`, except those written to
/// shared memory: their entry is empty (so that the entries stay aligned with `outputs`) and
/// their parameters name the region.
pub fn encode_response(resp: InferResponse, requested: &[RequestedOutput]) -> ModelInferResponse {
    let mut outputs = Vec::with_capacity(resp.outputs.len());
    let mut raw = Vec::with_capacity(resp.outputs.len());
    for t in resp.outputs {
        let shared = output_parameters(requested, &t.name, t.data.len());
        outputs.push(InferOutputTensor {
            parameters: shared.as_ref().map(params_to_proto).unwrap_or_default(),
            name: t.name,
            datatype: t.datatype.wire_name().to_owned(),
            shape: t.shape,
            contents: None,
        });
        raw.push(if shared.is_some() {
            bytes::Bytes::new()
        } else {
            t.data
        });
    }
    ModelInferResponse {
        model_name: resp.model_name,
        model_version: resp.model_version.to_string(),
        id: resp.id,
        parameters: params_to_proto(&resp.parameters),
        outputs,
        raw_output_contents: raw,
    }
}

fn unimplemented<T>(what: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!(
        "{what} is not supported by this server"
    )))
}

/// The W3C trace context a call's metadata carries (`traceparent`, `tracestate`).
#[derive(Clone, Default)]
struct TraceContext(Vec<(&'static str, String)>);

impl TraceContext {
    fn of(metadata: &tonic::metadata::MetadataMap) -> Self {
        Self(
            ["traceparent", "tracestate"]
                .into_iter()
                .filter_map(|k| Some((k, metadata.get(k)?.to_str().ok()?.to_owned())))
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<String> {
        self.0
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.clone())
    }
}

/// Fails with NOT_FOUND when the request names no loaded model (version), before anything
/// else in it is looked at, as Triton answers.
fn known_model(server: &Server, req: &ModelInferRequest) -> Result<(), Error> {
    let version = parse_version(&req.model_name, &req.model_version)?;
    server.models().get(&req.model_name, version).map(drop)
}

async fn infer_one(
    server: &Server,
    shm: &SystemSharedMemory,
    max_bytes: usize,
    tracing: &Tracing,
    context: &TraceContext,
    caller: &Caller,
    req: ModelInferRequest,
) -> Result<ModelInferResponse, Error> {
    known_model(server, &req)?;
    let reader = shm.reader(caller, max_bytes);
    let shared = |input: &str, params: &Parameters| reader.input(input, params);
    let mut request = decode_request(req, &shared)?;
    on_behalf_of(caller, &mut request);
    request.trace = tracing.request_span(&request.model_name, "grpc", &|k| context.get(k));
    let _trace = request.trace.clone();
    if let Some(o) = request
        .outputs
        .iter()
        .find(|o| o.parameters.contains_key("classification"))
    {
        return Err(Error::unsupported(format!(
            "output '{}': the classification extension is not supported",
            o.name
        )));
    }
    let requested = request.outputs.clone();
    shm.check_outputs(caller, &requested)?;
    let response = server.infer(request).await?;
    shm.write_outputs(caller, &requested, &response)?;
    Ok(encode_response(response, &requested))
}

type StreamResult = Pin<Box<dyn Stream<Item = Result<ModelStreamInferResponse, Status>> + Send>>;

fn stream_error(id: String, err: Error) -> ModelStreamInferResponse {
    ModelStreamInferResponse {
        error_message: err.message,
        infer_response: Some(ModelInferResponse {
            id,
            ..Default::default()
        }),
    }
}

/// The responses of one request on a `ModelStreamInfer` stream. For decoupled models each
/// response says `triton_final_response: false`, and with the request parameter
/// `triton_enable_empty_final_response` an empty response with `triton_final_response: true`
/// marks the end, as Triton does.
fn stream_one(
    server: Arc<Server>,
    shm: Arc<SystemSharedMemory>,
    max_bytes: usize,
    tracing: &Tracing,
    context: &TraceContext,
    caller: &Caller,
    req: ModelInferRequest,
) -> futures::stream::BoxStream<'static, Result<ModelStreamInferResponse, Status>> {
    let id = req.id.clone();
    let reader = shm.reader(caller, max_bytes);
    let shared = |input: &str, params: &Parameters| reader.input(input, params);
    let decoded = known_model(&server, &req)
        .and_then(|()| decode_request(req, &shared))
        .and_then(|r| shm.check_outputs(caller, &r.outputs).map(|()| r));
    let mut request = match decoded {
        Ok(r) => r,
        Err(err) => return futures::stream::once(async move { Ok(stream_error(id, err)) }).boxed(),
    };
    on_behalf_of(caller, &mut request);
    request.trace = tracing.request_span(&request.model_name, "grpc", &|k| context.get(k));
    let decoupled = server
        .models()
        .get(&request.model_name, request.model_version)
        .is_ok_and(|m| crate::runtime::is_decoupled(&m.config));
    let empty_final = matches!(
        request.parameters.get("triton_enable_empty_final_response"),
        Some(ParamValue::Bool(true))
    );
    let final_flag = |last: bool| {
        let mut p = Parameters::new();
        p.insert("triton_final_response".into(), ParamValue::Bool(last));
        params_to_proto(&p)
    };
    let (model, version) = (request.model_name.clone(), request.model_version);
    let final_id = id.clone();
    let requested = request.outputs.clone();
    let caller = caller.clone();
    let items = server.infer_stream(request);
    let responses = tokio_stream_from(items).map(move |item| {
        let item = item.and_then(|resp| {
            shm.write_outputs(&caller, &requested, &resp)?;
            Ok(resp)
        });
        Ok(match item {
            Ok(resp) => {
                let mut resp = encode_response(resp, &requested);
                if decoupled {
                    resp.parameters.extend(final_flag(false));
                }
                ModelStreamInferResponse {
                    error_message: String::new(),
                    infer_response: Some(resp),
                }
            }
            Err(err) => stream_error(id.clone(), err),
        })
    });
    let end = (decoupled && empty_final).then(|| {
        Ok(ModelStreamInferResponse {
            error_message: String::new(),
            infer_response: Some(ModelInferResponse {
                model_name: model,
                model_version: version.map(|v| v.to_string()).unwrap_or_default(),
                id: final_id,
                parameters: final_flag(true),
                ..Default::default()
            }),
        })
    });
    responses.chain(futures::stream::iter(end)).boxed()
}

/// A tokio receiver as a stream.
fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl Stream<Item = T> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tonic::async_trait]
impl GrpcInferenceService for GrpcService {
    async fn server_live(
        &self,
        r: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        self.restrict(&r, ApiGroup::Health)?;
        Ok(Response::new(ServerLiveResponse {
            live: self.server.is_live(),
        }))
    }

    async fn server_ready(
        &self,
        r: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        self.restrict(&r, ApiGroup::Health)?;
        Ok(Response::new(ServerReadyResponse {
            ready: self.server.is_ready(),
        }))
    }

    async fn model_ready(
        &self,
        r: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::Health)?;
        let r = r.into_inner();
        require(&caller, ModelAction::See, &r.name)?;
        let version = parse_version(&r.name, &r.version).map_err(to_status)?;
        Ok(Response::new(ModelReadyResponse {
            ready: self.server.models().is_ready(&r.name, version),
        }))
    }

    async fn server_metadata(
        &self,
        r: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        self.caller(&r, ApiGroup::Metadata)?;
        Ok(Response::new(ServerMetadataResponse {
            name: SERVER_NAME.to_owned(),
            version: SERVER_VERSION.to_owned(),
            extensions: EXTENSIONS.iter().map(|s| s.to_string()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        r: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::Metadata)?;
        let r = r.into_inner();
        require(&caller, ModelAction::See, &r.name)?;
        model_metadata(&self.server, &r.name, &r.version)
            .map(Response::new)
            .map_err(to_status)
    }

    async fn model_infer(
        &self,
        r: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::Inference)?;
        let context = TraceContext::of(r.metadata());
        let r = r.into_inner();
        let track = super::track(&self.server, &caller, &r.model_name);
        let result = async {
            caller.require(ModelAction::Infer, &r.model_name)?;
            let _admission = caller.admit(prost::Message::encoded_len(&r))?;
            infer_one(
                &self.server,
                &self.shared_memory,
                self.max_message_size,
                &self.tracing,
                &context,
                &caller,
                r,
            )
            .await
        }
        .await;
        track.finish(result.as_ref().map(|_| ()).map_err(|e| e.code));
        result.map(Response::new).map_err(to_status)
    }

    type ModelStreamInferStream = StreamResult;

    async fn model_stream_infer(
        &self,
        r: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let first = self.caller(&r, ApiGroup::Inference)?;
        // The key is checked again for every request on the stream: one revoked (or whose
        // permissions changed) by a reload stops working on streams already open.
        let key: Option<String> = r
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let tenancy = self.tenancy.clone();
        let server = self.server.clone();
        let shm = self.shared_memory.clone();
        let max_bytes = self.max_message_size;
        let tracing = self.tracing.clone();
        let context = TraceContext::of(r.metadata());
        let incoming = r.into_inner();
        // Requests on one stream are answered in order, each with all of its responses (0..N
        // for a decoupled model); errors travel in-band as Triton does.
        let responses = incoming.flat_map(move |item| match item {
            Ok(req) => {
                let caller = match &tenancy {
                    Some(tenancy) => match tenancy.authenticate(key.as_deref()) {
                        Ok(caller) => caller,
                        Err(e) => {
                            let id = req.id;
                            return futures::stream::once(async move { Ok(stream_error(id, e)) })
                                .boxed();
                        }
                    },
                    None => first.clone(),
                };
                // Accounted once admitted (or refused); its errors travel in-band.
                let track = super::track(&server, &caller, &req.model_name);
                let admitted = caller
                    .require(ModelAction::Infer, &req.model_name)
                    .and_then(|()| caller.admit(prost::Message::encoded_len(&req)));
                track.finish(admitted.as_ref().map(|_| ()).map_err(|e| e.code));
                match admitted {
                    // The admission lives as long as this request's responses.
                    Ok(admission) => stream_one(
                        server.clone(),
                        shm.clone(),
                        max_bytes,
                        &tracing,
                        &context,
                        &caller,
                        req,
                    )
                    .map(move |item| {
                        let _held = &admission;
                        item
                    })
                    .boxed(),
                    Err(e) => {
                        let id = req.id;
                        futures::stream::once(async move { Ok(stream_error(id, e)) }).boxed()
                    }
                }
            }
            Err(status) => futures::stream::once(async { Err(status) }).boxed(),
        });
        Ok(Response::new(Box::pin(responses)))
    }

    async fn model_config(
        &self,
        r: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::ModelConfig)?;
        let r = r.into_inner();
        require(&caller, ModelAction::See, &r.name)?;
        model_config(&self.server, &r.name, &r.version)
            .map(|config| {
                Response::new(ModelConfigResponse {
                    config: Some(config),
                })
            })
            .map_err(to_status)
    }

    async fn model_statistics(
        &self,
        r: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::Statistics)?;
        let r = r.into_inner();
        if !r.name.is_empty() {
            require(&caller, ModelAction::See, &r.name)?;
        }
        let mut model_stats =
            model_statistics(&self.server, &r.name, &r.version).map_err(to_status)?;
        model_stats.retain(|s| caller.may(ModelAction::See, &s.name));
        Ok(Response::new(ModelStatisticsResponse { model_stats }))
    }

    async fn repository_index(
        &self,
        r: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::ModelRepository)?;
        let models = self
            .server
            .models()
            .index(r.into_inner().ready)
            .into_iter()
            .filter(|e| caller.may(ModelAction::See, &e.name))
            .map(|e| ModelIndex {
                name: e.name,
                version: e.version.map(|v| v.to_string()).unwrap_or_default(),
                state: e.state.as_str().to_owned(),
                reason: e.reason,
            })
            .collect();
        Ok(Response::new(RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        r: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::ModelRepository)?;
        self.server.check_model_control().map_err(to_status)?;
        let r = r.into_inner();
        ModelName::parse(&r.model_name).map_err(to_status)?;
        require(&caller, ModelAction::Load, &r.model_name)?;
        let mut overrides = LoadOverride::default();
        for (key, value) in r.parameters {
            match (key.as_str(), value.parameter_choice) {
                ("config", Some(RepoParam::StringParam(s))) => overrides.config_json = Some(s),
                (k, Some(RepoParam::BytesParam(b))) if k.starts_with("file:") => {
                    overrides
                        .add_file(&k["file:".len()..], b)
                        .map_err(to_status)?;
                }
                ("config", _) => {
                    return Err(Status::invalid_argument(
                        "load parameter 'config' must be a string",
                    ))
                }
                _ => {}
            }
        }
        if !overrides.files.is_empty() && overrides.config_json.is_none() {
            return Err(Status::invalid_argument(format!(
                "failed to load '{}': 'file:' parameters need a 'config' parameter as well",
                r.model_name
            )));
        }
        check_load(&self.server, &caller, &r.model_name, &overrides).map_err(to_status)?;
        self.server
            .models()
            .load(&r.model_name, overrides)
            .await
            .map_err(to_status)?;
        Ok(Response::new(RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        r: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::ModelRepository)?;
        self.server.check_model_control().map_err(to_status)?;
        let r = r.into_inner();
        require(&caller, ModelAction::Load, &r.model_name)?;
        let unload_dependents = matches!(
            r.parameters
                .get("unload_dependents")
                .and_then(|p| p.parameter_choice.as_ref()),
            Some(RepoParam::BoolParam(true))
        );
        check_unload(&caller, &r.model_name, unload_dependents).map_err(to_status)?;
        self.server
            .models()
            .unload(&r.model_name, unload_dependents)
            .await
            .map_err(to_status)?;
        Ok(Response::new(RepositoryModelUnloadResponse {}))
    }

    async fn system_shared_memory_status(
        &self,
        r: Request<SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<SystemSharedMemoryStatusResponse>, Status> {
        let regions = self.regions(r, MemoryKind::System, |r| r.name)?;
        Ok(Response::new(SystemSharedMemoryStatusResponse {
            regions: regions
                .into_iter()
                .filter_map(|r| {
                    let Location::System { key, offset } = r.location else {
                        return None;
                    };
                    let status = system_shared_memory_status_response::RegionStatus {
                        name: r.name.clone(),
                        key,
                        offset,
                        byte_size: r.byte_size,
                    };
                    Some((r.name, status))
                })
                .collect(),
        }))
    }

    async fn system_shared_memory_register(
        &self,
        r: Request<SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<SystemSharedMemoryRegisterResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::SharedMemory)?;
        let r = r.into_inner();
        self.shared_memory
            .register(&caller, &r.name, &r.key, r.offset, r.byte_size)
            .map_err(to_status)?;
        Ok(Response::new(SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        r: Request<SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<SystemSharedMemoryUnregisterResponse>, Status> {
        self.unregister_regions(r, MemoryKind::System, |r| r.name)?;
        Ok(Response::new(SystemSharedMemoryUnregisterResponse {}))
    }

    async fn cuda_shared_memory_status(
        &self,
        r: Request<CudaSharedMemoryStatusRequest>,
    ) -> Result<Response<CudaSharedMemoryStatusResponse>, Status> {
        let regions = self.regions(r, MemoryKind::Cuda, |r| r.name)?;
        Ok(Response::new(CudaSharedMemoryStatusResponse {
            regions: regions
                .into_iter()
                .filter_map(|r| {
                    let Location::Cuda { device_id } = r.location else {
                        return None;
                    };
                    let status = cuda_shared_memory_status_response::RegionStatus {
                        name: r.name.clone(),
                        device_id: u64::try_from(device_id).unwrap_or_default(),
                        byte_size: r.byte_size,
                    };
                    Some((r.name, status))
                })
                .collect(),
        }))
    }

    async fn cuda_shared_memory_register(
        &self,
        r: Request<CudaSharedMemoryRegisterRequest>,
    ) -> Result<Response<CudaSharedMemoryRegisterResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::SharedMemory)?;
        let r = r.into_inner();
        self.shared_memory
            .register_cuda(&caller, &r.name, &r.raw_handle, r.device_id, r.byte_size)
            .map_err(to_status)?;
        Ok(Response::new(CudaSharedMemoryRegisterResponse {}))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        r: Request<CudaSharedMemoryUnregisterRequest>,
    ) -> Result<Response<CudaSharedMemoryUnregisterResponse>, Status> {
        self.unregister_regions(r, MemoryKind::Cuda, |r| r.name)?;
        Ok(Response::new(CudaSharedMemoryUnregisterResponse {}))
    }

    async fn trace_setting(
        &self,
        r: Request<TraceSettingRequest>,
    ) -> Result<Response<TraceSettingResponse>, Status> {
        self.caller(&r, ApiGroup::Trace)?
            .require_admin("the trace and logging APIs")
            .map_err(to_status)?;
        let r = r.into_inner();
        let model = (!r.model_name.is_empty()).then_some(r.model_name.as_str());
        let settings = if r.settings.is_empty() {
            self.tracing.settings(model)
        } else {
            // An empty value list clears a setting, as in Triton.
            let changes = r
                .settings
                .into_iter()
                .map(|(k, v)| (k, (!v.value.is_empty()).then_some(v.value)))
                .collect();
            self.tracing.update(model, changes).map_err(to_status)?
        };
        Ok(Response::new(TraceSettingResponse {
            settings: settings
                .into_iter()
                .map(|(k, value)| (k, trace_setting_response::SettingValue { value }))
                .collect(),
        }))
    }

    async fn log_settings(
        &self,
        r: Request<LogSettingsRequest>,
    ) -> Result<Response<LogSettingsResponse>, Status> {
        self.caller(&r, ApiGroup::Logging)?
            .require_admin("the trace and logging APIs")
            .map_err(to_status)?;
        unimplemented("log settings")
    }
}
