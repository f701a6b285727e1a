//! Where an ONNX session's inputs are gathered and its outputs land, and the IO binding that
//! runs it: plain host memory on CPU instances, CUDA pinned (page-locked) host memory on GPU
//! instances, so the copies to and from the card are DMA transfers instead of staged ones.
//!
//! Every run binds its inputs and the requested outputs afresh. Outputs are bound to a
//! device, never to a buffer kept from an earlier run: answers hold their output memory
//! without copying it (`onnx::OutputMemory`), so a buffer ONNX Runtime reused would change
//! data already handed to a client.

use ort::{
    memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType},
    session::{RunOptions, Session},
    value::DynValue,
};

use super::gpu::Placement;
use crate::error::{Error, Result};

/// The host memory of one execution instance's inputs and outputs.
pub(super) struct Staging {
    /// Allocates the batch's input tensors (the requests are copied straight into them).
    inputs: Allocator,
    /// Where ONNX Runtime puts the outputs.
    outputs: MemoryInfo<'static>,
    /// Whether that memory is CUDA pinned memory.
    pinned: bool,
}

impl Staging {
    /// Plain host memory, ONNX Runtime's default CPU allocator.
    pub fn host() -> Result<Self> {
        Ok(Self {
            inputs: Allocator::default(),
            outputs: cpu_memory(MemoryType::Default)?,
            pinned: false,
        })
    }

    /// The staging memory for a session placed at `placement`: pinned memory of its device
    /// on a GPU, plain host memory otherwise or where the session has no pinned allocator
    /// (logged, since the copies are then slower).
    pub fn for_session(session: &Session, placement: Placement, model: &str) -> Result<Self> {
        let Placement::Gpu(device) = placement else {
            return Self::host();
        };
        match pinned(session, device) {
            Ok(staging) => Ok(staging),
            Err(e) => {
                tracing::warn!(
                    model,
                    device,
                    "no CUDA pinned memory for the inputs and outputs ({e}); using pageable \
                     host memory"
                );
                Self::host()
            }
        }
    }

    /// Whether inputs and outputs live in CUDA pinned memory.
    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// The allocator of the input tensors.
    pub fn allocator(&self) -> &Allocator {
        &self.inputs
    }

    /// Runs `session` on `inputs` and returns the `outputs` asked for, in that order. Only
    /// those outputs are bound, so ONNX Runtime skips the work of the others.
    pub fn run(
        &self,
        session: &mut Session,
        inputs: Vec<(&str, DynValue)>,
        outputs: &[String],
        options: Option<&RunOptions>,
    ) -> Result<Vec<DynValue>> {
        let failed =
            |e: ort::Error| Error::internal(format!("ONNX Runtime failed to run the model: {e}"));
        // A binding per run: ONNX Runtime's binding is not `Send` and costs one small
        // allocation to create, and a fresh one never hands back an earlier run's buffers.
        let mut binding = session.create_binding().map_err(failed)?;
        for (name, value) in &inputs {
            binding.bind_input(*name, value).map_err(|e| {
                Error::internal(format!("cannot bind input '{name}' to ONNX Runtime: {e}"))
            })?;
        }
        for name in outputs {
            binding
                .bind_output_to_device(name.as_str(), &self.outputs)
                .map_err(|e| {
                    Error::internal(format!("cannot bind output '{name}' to ONNX Runtime: {e}"))
                })?;
        }
        let mut results = match options {
            Some(options) => session.run_binding_with_options(&binding, options),
            None => session.run_binding(&binding),
        }
        .map_err(failed)?;
        outputs
            .iter()
            .map(|name| {
                results.remove(name.as_str()).ok_or_else(|| {
                    Error::internal(format!("ONNX Runtime did not produce output '{name}'"))
                })
            })
            .collect()
    }
}

fn cpu_memory(kind: MemoryType) -> Result<MemoryInfo<'static>> {
    MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, kind)
        .map_err(|e| Error::internal(format!("ONNX Runtime has no host memory info: {e}")))
}

/// Pinned host memory of GPU `device`, from the allocator the session's CUDA provider
/// registered.
fn pinned(session: &Session, device: i32) -> std::result::Result<Staging, ort::Error> {
    let memory = |kind| {
        MemoryInfo::new(
            AllocationDevice::CUDA_PINNED,
            device,
            AllocatorType::Device,
            kind,
        )
    };
    Ok(Staging {
        inputs: Allocator::new(session, memory(MemoryType::CPUInput)?)?,
        outputs: memory(MemoryType::CPUOutput)?,
        pinned: true,
    })
}
