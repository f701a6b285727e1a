//! The `GRPCInferenceService` methods: each checks the caller, then calls the server core.

use futures::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use crate::frontends::{
    restricted::ApiGroup,
    shared_memory::{Kind as MemoryKind, Location},
};
use crate::response_order::ResponseOrder;
use crate::{
    names::ModelName,
    proto::inference::{
        grpc_inference_service_server::GrpcInferenceService,
        model_repository_parameter::ParameterChoice as RepoParam,
        repository_index_response::ModelIndex,
    },
    scheduling::{
        model_manager::LoadOverride,
        views::{
            model_config, model_metadata, model_ready, model_statistics, EXTENSIONS, SERVER_VERSION,
        },
    },
    tenancy::ModelAction,
};

use super::*;
use super::{
    streaming::{sequence_key, SequenceOrder, StreamContext, StreamResult, STREAM_IN_FLIGHT},
    unary::infer_one,
};

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
        let ready = model_ready(&self.server, &caller, &r.name, &r.version)
            .await
            .map_err(to_status)?;
        Ok(Response::new(ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        r: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        self.caller(&r, ApiGroup::Metadata)?;
        Ok(Response::new(ServerMetadataResponse {
            name: self.server.id().to_owned(),
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
        model_metadata(&self.server, &caller, &r.name, &r.version)
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
        let result = self
            .server
            .serve(&caller, |door| async move {
                // The one door: the caller's right, then NOT_FOUND for a model (version) that
                // is not loaded, before anything else in the request is looked at, as Triton
                // answers.
                let target = door.resolve(&r.model_name, &r.model_version)?;
                let _admission = door.caller().admit(prost::Message::encoded_len(&r))?;
                infer_one(
                    &self.server,
                    &self.shared_memory,
                    self.max_message_size,
                    &self.tracing,
                    &context,
                    target,
                    r,
                )
                .await
            })
            .await;
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
        let stream = StreamContext {
            tenancy: self.tenancy.clone(),
            key,
            first,
            server: self.server.clone(),
            shm: self.shared_memory.clone(),
            max_bytes: self.max_message_size,
            tracing: self.tracing.clone(),
            context: TraceContext::of(r.metadata()),
            grpc_errors: r
                .metadata()
                .get("triton_grpc_error")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.eq_ignore_ascii_case("true")),
            responses: ResponseOrder::new(),
        };
        let mut order = SequenceOrder::default();
        // Requests on one stream run at once, as on Triton: responses leave in the order they
        // were produced (each tagged with its request's id), whatever the request; a
        // sequence's requests keep the order they were sent in; errors travel in-band (with
        // `triton_grpc_error: true`, the first ends the stream).
        let responses = r
            .into_inner()
            .map(move |item| match item {
                Ok(req) => {
                    let stream = stream.clone();
                    let sequence = sequence_key(&req);
                    order.start(sequence, move |queued| stream.answer(req, queued))
                }
                Err(status) => futures::stream::once(async { Err(status) }).boxed(),
            })
            .flatten_unordered(STREAM_IN_FLIGHT);
        Ok(Response::new(Box::pin(responses)))
    }

    async fn model_config(
        &self,
        r: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        let caller = self.caller(&r, ApiGroup::ModelConfig)?;
        let r = r.into_inner();
        model_config(&self.server, &caller, &r.name, &r.version)
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
        let model_stats =
            model_statistics(&self.server, &caller, &r.name, &r.version).map_err(to_status)?;
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
        require(
            &caller,
            ModelAction::Load,
            self.server.models().rights_name(&r.model_name),
        )?;
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
        let adapter = self.server.models().adapter_ref(&r.model_name).is_some();
        if !overrides.files.is_empty() && overrides.config_json.is_none() && !adapter {
            return Err(Status::invalid_argument(format!(
                "failed to load '{}': 'file:' parameters need a 'config' parameter as well",
                r.model_name
            )));
        }
        self.server
            .models()
            .check_load(&caller, &r.model_name, &overrides)
            .map_err(to_status)?;
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
        require(
            &caller,
            ModelAction::Load,
            self.server.models().rights_name(&r.model_name),
        )?;
        let unload_dependents = matches!(
            r.parameters
                .get("unload_dependents")
                .and_then(|p| p.parameter_choice.as_ref()),
            Some(RepoParam::BoolParam(true))
        );
        self.server
            .models()
            .check_unload(&caller, &r.model_name, unload_dependents)
            .map_err(to_status)?;
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
        let model = crate::frontends::trace::model_of(&self.server, model).map_err(to_status)?;
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
        use crate::frontends::logging::{self, Setting};
        use crate::proto::inference::{
            log_settings_request::setting_value::ParameterChoice as In,
            log_settings_response::{setting_value::ParameterChoice as Out, SettingValue},
        };
        let mut changes = Vec::new();
        for (name, value) in r.into_inner().settings {
            let setting = match value.parameter_choice {
                Some(In::BoolParam(b)) => Setting::Bool(b),
                Some(In::Uint32Param(n)) => Setting::Uint(n),
                Some(In::StringParam(t)) => Setting::Text(t),
                None => {
                    return Err(Status::invalid_argument(format!(
                        "log setting '{name}' has no value"
                    )))
                }
            };
            changes.push((name, setting));
        }
        logging::levels().update(&changes).map_err(to_status)?;
        let settings = logging::levels()
            .settings()
            .into_iter()
            .map(|(name, value)| {
                let choice = match value {
                    Setting::Bool(b) => Out::BoolParam(b),
                    Setting::Uint(n) => Out::Uint32Param(n),
                    Setting::Text(t) => Out::StringParam(t),
                };
                (
                    name.to_owned(),
                    SettingValue {
                        parameter_choice: Some(choice),
                    },
                )
            })
            .collect();
        Ok(Response::new(LogSettingsResponse { settings }))
    }
}
