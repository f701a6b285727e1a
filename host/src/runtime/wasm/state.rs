//! The store state of one stage instance: a WASI context whose only output is a bounded
//! in-memory pipe for stdout/stderr and whose only file system is a read-only view of the
//! model's own version directory, under the limits of [`crate::runtime::sandbox::limits`].

use std::path::Path;

use wasmtime_wasi::{
    p2::pipe::MemoryOutputPipe, FsPerms, ResourceTable, WasiCtx, WasiCtxBuilder, WasiCtxView,
    WasiView,
};

use crate::{
    error::{Error, Result},
    runtime::sandbox::limits::{MemoryCap, SandboxLimits},
};

/// Everything a stage's store holds.
pub struct StageState {
    wasi: WasiCtx,
    /// WASI's handles and the arrays the stage holds (`wasmtron:stage/ops`).
    pub(super) table: ResourceTable,
    /// The memory limiter.
    pub limits: MemoryCap,
    /// The stage's stdout and stderr, bounded.
    pub output: MemoryOutputPipe,
    /// Model name, for log lines.
    pub model: String,
    /// Calls into other models (BLS).
    pub caller: Option<std::sync::Arc<dyn crate::runtime::backend::ModelCaller>>,
    /// When the current `init` or `execute` call runs out of time; calls into other models
    /// carry it, so they neither outlive the caller nor leave work behind.
    pub call_deadline: Option<std::time::Instant>,
    /// When the current call exceeds the stage's own `execution_timeout_ms` (the epoch
    /// callback interrupts it then).
    pub execution_ends: std::time::Instant,
    /// During `execute`: cancelled once every request of the batch is (nobody waits for the
    /// answer); the epoch callback then interrupts the stage, and calls it makes carry it.
    pub cancel: Option<crate::cancellation::Cancellation>,
    /// The model has one instance, so a call into itself could never be served.
    pub single_instance: bool,
    /// Decoupled models, during `execute`: sends one response to the request at an index.
    pub respond: Option<Responder>,
    /// During `execute`: the tenants of the batch's requests, on whose behalf calls into
    /// other models run.
    pub callers: Vec<crate::tenancy::Caller>,
    /// During `execute`: the inputs of each request of the batch (`ops.input`,
    /// `ops.decode-input-image`; `ops.set-output` checks indices against it).
    pub batch_inputs: Option<Vec<Vec<crate::tensor::Tensor>>>,
    /// Outputs set with `ops.set-output` during `execute`: (request index, tensor).
    pub set_outputs: Vec<(u32, crate::tensor::Tensor)>,
    /// During `execute`: the first call into another model that the callers may not make.
    /// The batch then fails with it whatever the stage answers, so that a stage cannot turn
    /// a refusal into a success (or tell a tenant what another tenant's model would say).
    pub refused_call: Option<crate::error::Error>,
}

/// Sends a response (checked outputs) to the request at an index of the current batch.
pub type Responder =
    Box<dyn FnMut(u32, Vec<crate::tensor::Tensor>) -> crate::error::Result<()> + Send>;

/// Where a stage sees its model's version directory (read-only), as Triton's Python models
/// read files shipped next to `model.py` (a vocabulary, labels, a character set).
pub const MODEL_FILES_DIR: &str = "/model";

impl StageState {
    /// A fresh state: no environment, no arguments, no network; output captured; `files`
    /// (the model's version directory) readable at [`MODEL_FILES_DIR`] and nothing else.
    pub fn new(
        model: &str,
        limits: &SandboxLimits,
        caller: Option<std::sync::Arc<dyn crate::runtime::backend::ModelCaller>>,
        files: &Path,
    ) -> Result<Self> {
        let output = MemoryOutputPipe::new((limits.stderr_limit_kb as usize) << 10);
        let mut wasi = WasiCtxBuilder::new();
        wasi.stdout(output.clone()).stderr(output.clone());
        wasi.preopened_dir(files, MODEL_FILES_DIR, FsPerms::ReadOnly)
            .map_err(|e| {
                Error::internal(format!(
                    "model '{model}': cannot open '{}' for the stage: {e}",
                    files.display()
                ))
            })?;
        let wasi = wasi.build();
        Ok(Self {
            wasi,
            table: ResourceTable::new(),
            limits: MemoryCap::new(limits.memory_bytes()),
            output,
            model: model.to_owned(),
            caller,
            call_deadline: None,
            execution_ends: std::time::Instant::now(),
            cancel: None,
            single_instance: false,
            respond: None,
            callers: Vec::new(),
            refused_call: None,
            batch_inputs: None,
            set_outputs: Vec::new(),
        })
    }

    /// What the stage printed so far, lossily decoded and trimmed.
    pub fn printed(&self) -> String {
        String::from_utf8_lossy(&self.output.contents())
            .trim()
            .to_owned()
    }
}

impl WasiView for StageState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}
