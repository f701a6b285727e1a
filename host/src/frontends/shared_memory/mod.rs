//! Shared memory (KServe's shared-memory extensions, as in Triton): a client on the same
//! machine registers a POSIX shared-memory object (`shm_open` key, i.e. a file under
//! `/dev/shm`) or, in a GPU build, CUDA device memory (a `cudaIpcMemHandle_t`) as a named
//! region, then sends inputs and asks for outputs by region, offset and size instead of in the
//! request body. Shared by the HTTP and gRPC frontends; one namespace for both kinds.
//!
//! Regions belong to the tenant that registered them (every caller's own namespace), and
//! registering one is for administrators when the server has tenants: the server would
//! otherwise open, for any tenant, shared memory that another tenant's client created.
//!
//! Another local user can plant what a key names, so a key is opened without following links
//! and must be a regular file with one name; each use opens it again (a region holds no
//! descriptor), checks it is still the file registered, and copies with `pread`/`pwrite` after
//! checking the object's size at that moment (an object truncated after registration gives an
//! error, not the SIGBUS a mapping would raise). What one request reads from shared memory is
//! bounded by the frontend's request size limit, and a caller holds at most
//! [`MAX_REGIONS`] regions.

use std::{
    collections::BTreeMap,
    fs::File,
    os::unix::fs::FileExt,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, PoisonError,
    },
};

use bytes::Bytes;

use crate::{
    error::{Code, Error, Result},
    inference::{InferResponse, ParamValue, Parameters, RequestedOutput},
    tenancy::Caller,
};

#[cfg(feature = "cuda")]
mod cuda;
mod in_use;
mod posix_object;

pub use in_use::HeldRegions;
use in_use::{Regions, Usage};
use posix_object::{check_key, open_object, ObjectId};

/// Most regions one caller (a tenant, or everyone without tenants) may hold at once.
pub const MAX_REGIONS: usize = 1024;
/// Longest region name, in bytes (names are kept while the region lives).
const MAX_REGION_NAME: usize = 1024;

/// Where POSIX shared-memory objects live on Linux (`shm_open(key)` opens `/dev/shm/key`).
const SHM_DIR: &str = "/dev/shm";

/// The request parameters of the extension.
const REGION: &str = "shared_memory_region";
const BYTE_SIZE: &str = "shared_memory_byte_size";
const OFFSET: &str = "shared_memory_offset";

/// A registered region, as reported by the status APIs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionStatus {
    /// The name requests use.
    pub name: String,
    /// Its size in bytes.
    pub byte_size: u64,
    /// What memory it is.
    pub location: Location,
}

/// The memory behind a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// System shared memory: the key it was opened with and where the region starts in it.
    System {
        /// The `shm_open` key.
        key: String,
        /// Offset of the region in the shared-memory object.
        offset: u64,
    },
    /// CUDA device memory on this device.
    Cuda {
        /// The CUDA device id.
        device_id: i64,
    },
}

/// Which of the two kinds a status or unregister call is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v2/systemsharedmemory`, `SystemSharedMemory*`.
    System,
    /// `/v2/cudasharedmemory`, `CudaSharedMemory*`.
    Cuda,
}

enum Backing {
    /// The shared-memory object (its key, and which file it was when registered) and where
    /// the region starts in it. Opened again for each use rather than held: a caller's
    /// regions would otherwise hold as many descriptors, and the process's limit is shared
    /// with every connection.
    System {
        key: String,
        object: ObjectId,
        start: u64,
    },
    #[cfg(feature = "cuda")]
    Cuda(cuda::IpcBuffer),
}

struct Region {
    status: RegionStatus,
    backing: Backing,
    usage: Mutex<Usage>,
}

impl Region {
    fn usage(&self) -> std::sync::MutexGuard<'_, Usage> {
        self.usage.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn kind(&self) -> Kind {
        match self.status.location {
            Location::System { .. } => Kind::System,
            Location::Cuda { .. } => Kind::Cuda,
        }
    }

    /// The object of a system region, opened again, and where `len` bytes at `offset` are in
    /// it: after checking that it is still the file registered (not replaced since) and still
    /// holds them (it may have been truncated since registration).
    fn position(
        &self,
        key: &str,
        object: ObjectId,
        start: u64,
        offset: usize,
        len: usize,
    ) -> Result<(File, u64)> {
        let (file, now, size) = open_object(key, &self.status.name)?;
        if now != object {
            return Err(Error::invalid(format!(
                "shared memory region '{}': the object behind key '{}' was replaced after \
                 registration; register it again",
                self.status.name,
                key.escape_debug()
            )));
        }
        let at = start + offset as u64;
        if at + len as u64 > size {
            return Err(Error::invalid(format!(
                "shared memory region '{}': its object now holds {size} bytes, too few for \
                 {len} bytes at offset {offset} (was it truncated after registration?)",
                self.status.name
            )));
        }
        Ok((file, at))
    }

    fn io_error(&self, e: std::io::Error) -> Error {
        Error::invalid(format!("shared memory region '{}': {e}", self.status.name))
    }

    /// Copies `len` bytes at `offset` out of the region (checked by the caller).
    fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut data = vec![0u8; len];
        match &self.backing {
            Backing::System { key, object, start } => {
                let (file, at) = self.position(key, *object, *start, offset, len)?;
                file.read_exact_at(&mut data, at)
                    .map_err(|e| self.io_error(e))?;
            }
            #[cfg(feature = "cuda")]
            Backing::Cuda(buffer) => buffer
                .read(offset, &mut data)
                .map_err(|e| Error::internal(format!("region '{}': {e}", self.status.name)))?,
        }
        Ok(data)
    }

    /// Copies `data` into the region at `offset` (checked by the caller).
    fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        match &self.backing {
            Backing::System { key, object, start } => {
                let (file, at) = self.position(key, *object, *start, offset, data.len())?;
                file.write_all_at(data, at).map_err(|e| self.io_error(e))?;
            }
            #[cfg(feature = "cuda")]
            Backing::Cuda(buffer) => buffer
                .write(offset, data)
                .map_err(|e| Error::internal(format!("region '{}': {e}", self.status.name)))?,
        }
        Ok(())
    }

    /// `len` bytes at `offset` within the region, or an error naming the tensor.
    /// Triton's words first: an offset past the region, then one whose end is past it.
    fn range(&self, what: &str, offset: u64, len: u64) -> Result<(usize, usize)> {
        let name = &self.status.name;
        let size = self.status.byte_size;
        let refuse = |triton: &str| {
            Error::invalid(format!(
                "{triton} for shared memory region: '{name}' ({what}: {len} bytes at offset \
                 {offset}; the region holds {size} bytes)"
            ))
        };
        if offset >= size && len > 0 {
            return Err(refuse("Invalid offset"));
        }
        let end = offset.checked_add(len).filter(|&e| e <= size);
        match (end, usize::try_from(offset), usize::try_from(len)) {
            (Some(_), Ok(o), Ok(l)) => Ok((o, l)),
            _ => Err(refuse("Invalid offset + byte size")),
        }
    }
}

type Key = (Option<String>, String);

/// The regions registered with this server.
pub struct SystemSharedMemory {
    regions: Arc<Regions>,
    /// Whether clients may register regions at all (`--allow-client-shm`).
    allowed: bool,
}

impl Default for SystemSharedMemory {
    fn default() -> Self {
        Self {
            regions: Arc::default(),
            allowed: true,
        }
    }
}

fn owner(caller: &Caller) -> Option<String> {
    caller.tenant().map(str::to_owned)
}

impl SystemSharedMemory {
    /// An empty registry that takes regions.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty registry that takes regions only when `allowed` (Triton's
    /// `--allow-client-shm`, off by default): otherwise every registration is refused, naming
    /// the flag.
    pub fn allowing(allowed: bool) -> Self {
        Self {
            allowed,
            ..Self::default()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Key, Arc<Region>>> {
        in_use::lock(&self.regions)
    }

    /// Maps `byte_size` bytes at `offset` of the shared-memory object `key` as region `name`.
    pub fn register(
        &self,
        caller: &Caller,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> Result<()> {
        let id = self.new_region(caller, Kind::System, name)?;
        check_key(name, key)?;
        let (_, object, size) = open_object(key, name)?;
        let end = offset.checked_add(byte_size);
        if byte_size == 0 || end.is_none_or(|e| e > size) {
            return Err(Error::invalid(format!(
                "failed to register shared memory region '{name}': invalid args: {byte_size} \
                 bytes at offset {offset} do not fit key '{key}', which holds {size} bytes"
            )));
        }
        usize::try_from(byte_size)
            .map_err(|_| Error::invalid(format!("region '{name}' is too large")))?;
        let region = Region {
            status: RegionStatus {
                name: name.to_owned(),
                byte_size,
                location: Location::System {
                    key: key.to_owned(),
                    offset,
                },
            },
            backing: Backing::System {
                key: key.to_owned(),
                object,
                start: offset,
            },
            usage: Mutex::default(),
        };
        tracing::info!(
            region = name,
            key,
            offset,
            byte_size,
            "registered system shared memory"
        );
        self.insert(id, region)
    }

    /// The caller may register a region of `kind` named `name` (checked again on insert).
    fn new_region(&self, caller: &Caller, kind: Kind, name: &str) -> Result<Key> {
        caller.require_admin(kind.api())?;
        self.require_allowed()?;
        if name.is_empty() {
            return Err(Error::invalid("a shared memory region needs a name"));
        }
        if name.len() > MAX_REGION_NAME {
            return Err(Error::invalid(format!(
                "a shared memory region name is at most {MAX_REGION_NAME} bytes; this one has {}",
                name.len()
            )));
        }
        let id = (owner(caller), name.to_owned());
        if self.lock().contains_key(&id) {
            return Err(already_registered(name));
        }
        Ok(id)
    }

    fn insert(&self, id: Key, region: Region) -> Result<()> {
        let mut regions = self.lock();
        if regions.contains_key(&id) {
            return Err(already_registered(&id.1));
        }
        if regions.keys().filter(|(o, _)| *o == id.0).count() >= MAX_REGIONS {
            return Err(Error::new(
                Code::ResourceExhausted,
                format!(
                    "cannot register shared memory region '{}': this caller holds {MAX_REGIONS} \
                     regions already; unregister some first",
                    id.1
                ),
            ));
        }
        regions.insert(id, Arc::new(region));
        Ok(())
    }

    /// Opens CUDA device memory exported by another process (`raw_handle`: the 64 bytes of
    /// its `cudaIpcMemHandle_t`) as region `name`. Needs a GPU build and an NVIDIA driver;
    /// says which is missing otherwise.
    pub fn register_cuda(
        &self,
        caller: &Caller,
        name: &str,
        raw_handle: &[u8],
        device_id: i64,
        byte_size: u64,
    ) -> Result<()> {
        let id = self.new_region(caller, Kind::Cuda, name)?;
        if let Err(why) = crate::runtime::gpu::device_count() {
            return Err(Error::unsupported(format!(
                "CUDA shared memory is not available: {why}"
            )));
        }
        #[cfg(feature = "cuda")]
        {
            let len = usize::try_from(byte_size)
                .map_err(|_| Error::invalid(format!("region '{name}' is too large")))?;
            let buffer = cuda::IpcBuffer::open(raw_handle, device_id, len).map_err(|e| {
                Error::invalid(format!("cannot register CUDA shared memory '{name}': {e}"))
            })?;
            tracing::info!(
                region = name,
                device_id,
                byte_size,
                "registered CUDA shared memory"
            );
            self.insert(
                id,
                Region {
                    status: RegionStatus {
                        name: name.to_owned(),
                        byte_size,
                        location: Location::Cuda { device_id },
                    },
                    backing: Backing::Cuda(buffer),
                    usage: Mutex::default(),
                },
            )
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (id, raw_handle, device_id, byte_size);
            Err(Error::unsupported(
                "CUDA shared memory is not available in this build",
            ))
        }
    }

    /// Unregisters the caller's region `name` of this kind, or every one of this kind when
    /// `None`. Unknown names are not an error (as in Triton). A region a request still uses
    /// stays, listed and usable, until the last such request ends, as on Triton.
    pub fn unregister(&self, caller: &Caller, kind: Kind, name: Option<&str>) -> Result<()> {
        self.require_allowed()?;
        caller.require_admin(kind.api())?;
        let owner = owner(caller);
        let mut regions = self.lock();
        regions.retain(|(o, n), r| {
            let named = name.is_none_or(|name| name == n);
            !(*o == owner && named && r.kind() == kind && r.usage().unregister())
        });
        Ok(())
    }

    /// Refuses every use of the API while clients may not register regions.
    fn require_allowed(&self) -> Result<()> {
        if self.allowed {
            Ok(())
        } else {
            Err(Error::unavailable(
                "Client shared memory is disabled. Start the server with \
                 '--allow-client-shm=true' to enable.",
            ))
        }
    }

    /// The caller's regions of this kind, or the one named (an error if it is not registered).
    pub fn status(
        &self,
        caller: &Caller,
        kind: Kind,
        name: Option<&str>,
    ) -> Result<Vec<RegionStatus>> {
        caller.require_admin(kind.api())?;
        let owner = owner(caller);
        let regions = self.lock();
        match name {
            Some(name) => regions
                .get(&(owner, name.to_owned()))
                .filter(|r| r.kind() == kind)
                .map(|r| vec![r.status.clone()])
                .ok_or_else(|| {
                    Error::not_found(format!("Unable to find {} region: '{name}'", kind.api()))
                }),
            None => Ok(regions
                .iter()
                .filter(|((o, _), r)| *o == owner && r.kind() == kind)
                .map(|(_, r)| r.status.clone())
                .collect()),
        }
    }

    fn region(&self, caller: &Caller, name: &str) -> Result<Arc<Region>> {
        self.lock()
            .get(&(owner(caller), name.to_owned()))
            .cloned()
            .ok_or_else(|| not_registered(name))
    }

    /// Region `name` of the caller, held for a request in `held`.
    fn hold(&self, caller: &Caller, name: &str, held: &mut HeldRegions) -> Result<Arc<Region>> {
        let key = (owner(caller), name.to_owned());
        let regions = self.lock();
        let region = regions
            .get(&key)
            .cloned()
            .ok_or_else(|| not_registered(name))?;
        held.push(&self.regions, key, region.clone());
        Ok(region)
    }

    /// A reader of one request's inputs from `caller`'s regions, which copies at most
    /// `max_bytes` in all (the frontend's request size limit: data in shared memory counts as
    /// if it were in the body).
    pub fn reader<'a>(&'a self, caller: &'a Caller, max_bytes: usize) -> SharedReader<'a> {
        SharedReader {
            memory: self,
            caller,
            left: AtomicU64::new(max_bytes as u64),
            max_bytes,
            held: Mutex::default(),
        }
    }

    /// Checks, before the model runs, that every output the client wants in shared memory
    /// names a registered region of the caller and fits in it; the regions stay the request's
    /// until the returned hold is dropped (after its last response).
    pub fn check_outputs(
        &self,
        caller: &Caller,
        requested: &[RequestedOutput],
    ) -> Result<HeldRegions> {
        let mut held = HeldRegions::default();
        for output in requested {
            let what = format!("output '{}'", output.name);
            if let Some(target) = RegionRange::of(&what, &output.parameters)? {
                let region = self.hold(caller, &target.region, &mut held)?;
                region.range(&what, target.offset, target.size)?;
            }
        }
        Ok(held)
    }

    /// Writes every output the client asked to receive in shared memory into its region (the
    /// frontends then answer with [`output_parameters`] instead of the data).
    pub fn write_outputs(
        &self,
        caller: &Caller,
        requested: &[RequestedOutput],
        response: &InferResponse,
    ) -> Result<()> {
        for output in requested {
            let what = format!("output '{}'", output.name);
            let Some(target) = RegionRange::of(&what, &output.parameters)? else {
                continue;
            };
            let Some(tensor) = response.outputs.iter().find(|t| t.name == output.name) else {
                continue;
            };
            let len = tensor.data.len() as u64;
            if len > target.size {
                return Err(Error::invalid(format!(
                    "{what}: shared_memory_byte_size {} is too small for the result of {len} \
                     bytes (shape {:?}, {})",
                    target.size,
                    tensor.shape,
                    tensor.datatype.wire_name()
                )));
            }
            let region = self.region(caller, &target.region)?;
            region.range(&what, target.offset, target.size)?;
            let (offset, _) = region.range(&what, target.offset, len)?;
            region.write(offset, &tensor.data)?;
        }
        Ok(())
    }
}

/// Reads one request's inputs from shared memory; see [`SystemSharedMemory::reader`].
pub struct SharedReader<'a> {
    memory: &'a SystemSharedMemory,
    caller: &'a Caller,
    left: AtomicU64,
    max_bytes: usize,
    held: Mutex<HeldRegions>,
}

impl SharedReader<'_> {
    /// The regions the inputs were read from, held for the rest of the request.
    pub fn into_held(self) -> HeldRegions {
        self.held
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The data of an input that names a region in its parameters (a copy, so that the client
    /// may reuse the region once the request is sent), or `None` when it does not.
    pub fn input(&self, input: &str, params: &Parameters) -> Result<Option<Bytes>> {
        let what = format!("input '{input}'");
        let Some(target) = RegionRange::of(&what, params)? else {
            return Ok(None);
        };
        let region = {
            let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
            self.memory.hold(self.caller, &target.region, &mut held)?
        };
        let (offset, len) = region.range(&what, target.offset, target.size)?;
        let Some(left) = self.left.load(Ordering::Relaxed).checked_sub(len as u64) else {
            return Err(Error::invalid(format!(
                "{what}: the request's inputs in shared memory come to more than {} bytes, the \
                 largest request this server accepts",
                self.max_bytes
            )));
        };
        self.left.store(left, Ordering::Relaxed);
        Ok(Some(region.read(offset, len)?.into()))
    }
}

impl Kind {
    fn api(self) -> &'static str {
        match self {
            Kind::System => "system shared memory",
            Kind::Cuda => "CUDA shared memory",
        }
    }
}

fn already_registered(name: &str) -> Error {
    Error::new(
        Code::AlreadyExists,
        format!("shared memory region '{name}' already in manager; unregister it first"),
    )
}

fn not_registered(name: &str) -> Error {
    Error::not_found(format!(
        "Unable to find shared memory region: '{name}' (it is not registered)"
    ))
}

/// Where a tensor's data is in shared memory, from its parameters.
struct RegionRange {
    region: String,
    size: u64,
    offset: u64,
}

impl RegionRange {
    fn of(what: &str, params: &Parameters) -> Result<Option<Self>> {
        let Some(region) = params.get(REGION) else {
            return Ok(None);
        };
        let ParamValue::String(region) = region else {
            return Err(Error::invalid(format!(
                "{what}: parameter '{REGION}' must be a string"
            )));
        };
        let number = |key: &str, required: bool| -> Result<u64> {
            match params.get(key) {
                None if !required => Ok(0),
                None => Err(Error::invalid(format!(
                    "{what}: parameter '{REGION}' needs '{key}' as well"
                ))),
                Some(v) => v
                    .as_i64()
                    .and_then(|n| u64::try_from(n).ok())
                    .or(match v {
                        ParamValue::Uint(u) => Some(*u),
                        _ => None,
                    })
                    .ok_or_else(|| {
                        Error::invalid(format!(
                            "{what}: parameter '{key}' must be a non-negative integer"
                        ))
                    }),
            }
        };
        Ok(Some(Self {
            region: region.clone(),
            size: number(BYTE_SIZE, true)?,
            offset: number(OFFSET, false)?,
        }))
    }
}

/// Whether a requested output goes to shared memory, and the parameters the response reports
/// for it (`shared_memory_region`, `shared_memory_byte_size`).
pub fn output_parameters(
    requested: &[RequestedOutput],
    name: &str,
    len: usize,
) -> Option<Parameters> {
    let output = requested.iter().find(|o| o.name == name)?;
    let region = output.parameters.get(REGION)?.clone();
    Some(Parameters::from([
        (REGION.to_owned(), region),
        (BYTE_SIZE.to_owned(), ParamValue::Int(len as i64)),
    ]))
}

/// Finds the data of an input sent in shared memory: given the input's name and parameters,
/// `Some(data)` when they name a region, `None` when the data is in the request.
pub type SharedInputs<'a> = &'a dyn Fn(&str, &Parameters) -> Result<Option<Bytes>>;

/// [`SharedInputs`] where no shared memory is available (a stage run from the command line,
/// the fuzz targets): an input naming a region is refused.
pub fn no_shared_inputs(input: &str, params: &Parameters) -> Result<Option<Bytes>> {
    if params.contains_key(REGION) {
        return Err(Error::unsupported(format!(
            "input '{input}': shared memory is not available here"
        )));
    }
    Ok(None)
}

#[cfg(test)]
mod tests;
