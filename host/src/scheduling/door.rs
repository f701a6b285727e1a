//! The one door through which every request enters the core. A frontend's request is served
//! through [`Server::serve`]: the door ([`Door`]) checks the caller's right and looks the
//! model up once ([`Door::resolve`]), giving the [`Target`] the request is decoded against and
//! run on ([`Server::infer_on`], [`Server::infer_stream_on`]); the door accounts the request
//! to the caller's tenant (under the model it resolved) and records how it ended. Requests a
//! stage, an ensemble step or the in-process package makes by name enter through
//! `Server::infer` ([`Server::lookup_for`]), which checks every caller they are made for.

use std::{
    future::Future,
    sync::{Arc, Mutex, PoisonError},
};

use super::{model_manager::ModelVersion, server::Server};
use crate::{
    error::{Error, Result},
    inference::{InferRequest, InferResponse},
    proto::inference::ModelConfig,
    tenancy::{Caller, ModelAction, Tracked},
};

/// A model version a caller may run requests on, looked up once ([`Door::resolve`]). A
/// frontend decodes the request against [`Target::config`] and runs it with
/// [`Server::infer_on`] or [`Server::infer_stream_on`], which record whom it runs for and use
/// this version without looking the model up again.
#[derive(Clone)]
pub struct Target {
    pub(super) model: Arc<ModelVersion>,
    caller: Caller,
}

impl Target {
    /// The version's completed configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.model.name
    }

    /// The version requests to it run on.
    pub fn version(&self) -> i64 {
        self.model.version
    }

    /// Whom requests to it run for.
    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    /// Marks `request` as run for the caller, so that the stages it reaches call other models
    /// only within the caller's permissions.
    pub(super) fn stamp(&self, request: &mut InferRequest) {
        if let Caller::Tenant(_) = &self.caller {
            request.callers = vec![self.caller.clone()];
        }
    }
}

impl std::borrow::Borrow<ModelConfig> for Target {
    fn borrow(&self) -> &ModelConfig {
        self.config()
    }
}

/// A client's request at the core's door: whom it is for, and (with tenants) its accounting,
/// which names the model once the door has resolved it. Cheap to clone: a decoder that learns
/// the model from the body (OpenAI's API) takes a clone off the async runtime.
#[derive(Clone)]
pub struct Door {
    server: Arc<Server>,
    caller: Caller,
    /// The tenant's accounting of the request; none without tenants.
    tracked: Option<Arc<Mutex<Tracked>>>,
}

impl Door {
    /// Whom the request is for.
    pub fn caller(&self) -> &Caller {
        &self.caller
    }

    /// The model the request names, at the version a path or message names (empty: the
    /// version policy's choice): the caller's right first (a tenant learns nothing of models
    /// it may not run), then the version's spelling, then the model, looked up once.
    pub fn resolve(&self, model: &str, version: &str) -> Result<Target> {
        let resolved = self
            .caller
            .require(ModelAction::Infer, model)
            .and_then(|()| {
                let version = crate::names::parse_version(model, version)?;
                self.server.models().get(model, version)
            });
        if let Some(tracked) = &self.tracked {
            // Only a loaded model's name becomes a label: clients choose names, and every
            // label value is kept for good.
            let known = match &resolved {
                Ok(_) => true,
                Err(e) => {
                    // A version spelled wrong: the caller may run the model (the right is
                    // checked first), which may well exist.
                    e.code == crate::error::Code::InvalidArg
                        && self.server.models().get(model, None).is_ok()
                }
            };
            if known {
                tracked
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .name_model(model);
            }
        }
        Ok(Target {
            model: resolved?,
            caller: self.caller.clone(),
        })
    }

    /// Records how the request ended (once; later calls change nothing). [`Server::serve`]
    /// does this; a frontend whose request is not one future (a message on a stream) does it
    /// itself.
    pub fn finish(&self, outcome: std::result::Result<(), crate::error::Code>) {
        if let Some(tracked) = &self.tracked {
            tracked
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .finish(outcome);
        }
    }
}

impl Server {
    /// Serves one client request through the door: `work` resolves the model with the
    /// [`Door`] it is given, decodes, runs and encodes; the door accounts the request to the
    /// caller's tenant and records how `work` ended (a stream counts as answered once it
    /// starts; its later errors travel in-band). Dropping the future before it ends records
    /// the request as cancelled.
    pub async fn serve<T, E, F, Fut>(self: &Arc<Self>, caller: &Caller, work: F) -> Result<T, E>
    where
        F: FnOnce(Door) -> Fut,
        Fut: Future<Output = std::result::Result<T, E>>,
        E: AsRef<Error>,
    {
        let door = self.door(caller);
        let result = work(door.clone()).await;
        door.finish(result.as_ref().map(|_| ()).map_err(|e| e.as_ref().code));
        result
    }

    /// [`Server::infer`] on a resolved target, for its caller.
    pub async fn infer_on(
        &self,
        target: &Target,
        mut request: InferRequest,
    ) -> Result<InferResponse> {
        target.stamp(&mut request);
        self.infer_with(target.model.clone(), request).await
    }

    /// The door for one request of `caller`, for a frontend whose request is not one future
    /// (a message on a stream): [`Door::resolve`], then [`Door::finish`].
    pub fn door(self: &Arc<Self>, caller: &Caller) -> Door {
        Door {
            server: self.clone(),
            caller: caller.clone(),
            tracked: matches!(caller, Caller::Tenant(_))
                .then(|| Arc::new(Mutex::new(caller.track("")))),
        }
    }

    /// The target for a request the in-process package makes by name (no tenant): the model
    /// at `version` (`None`: the version policy's choice), looked up once.
    pub fn target(&self, model: &str, version: Option<i64>) -> Result<Target> {
        Ok(Target {
            model: self.models().get(model, version)?,
            caller: Caller::Anyone,
        })
    }
}

impl AsRef<Error> for Error {
    fn as_ref(&self) -> &Error {
        self
    }
}
