//! Shared memory (KServe's shared-memory extensions, as in Triton): a client on the same
//! machine registers a POSIX shared-memory object (`shm_open` key, i.e. a file under
//! `/dev/shm`) or, in a GPU build, CUDA device memory (a `cudaIpcMemHandle_t`) as a named
//! region, then sends inputs and asks for outputs by region, offset and size instead of in the
//! request body. Shared by the HTTP and gRPC frontends; one namespace for both kinds.
//!
//! Regions belong to the tenant that registered them (every caller's own namespace), and
//! registering one is for administrators when the server has tenants: the server would
//! otherwise open, for any tenant, shared memory that another tenant's client created.

use std::{
    collections::BTreeMap,
    fs::OpenOptions,
    path::PathBuf,
    sync::{Arc, Mutex, PoisonError},
};

use bytes::Bytes;
use memmap2::{MmapOptions, MmapRaw};

use crate::{
    error::{Code, Error, Result},
    inference::{InferResponse, ParamValue, Parameters, RequestedOutput},
    tenancy::Caller,
};

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
    System(MmapRaw),
    #[cfg(feature = "cuda")]
    Cuda(crate::runtime::gpu::IpcBuffer),
}

struct Region {
    status: RegionStatus,
    backing: Backing,
}

impl Region {
    fn kind(&self) -> Kind {
        match self.status.location {
            Location::System { .. } => Kind::System,
            Location::Cuda { .. } => Kind::Cuda,
        }
    }

    /// Copies `len` bytes at `offset` out of the region (checked by the caller).
    fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        let mut data = vec![0u8; len];
        match &self.backing {
            // SAFETY: `range` keeps offset..offset+len inside the mapping, which lives as long
            // as `self`. The client may write the memory concurrently (a race it owns, as in
            // Triton); copying raw bytes with no references into the mapping keeps that sound.
            Backing::System(map) => unsafe {
                std::ptr::copy_nonoverlapping(map.as_ptr().add(offset), data.as_mut_ptr(), len);
            },
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
            // SAFETY: as in `read`.
            Backing::System(map) => unsafe {
                std::ptr::copy_nonoverlapping(
                    data.as_ptr(),
                    map.as_mut_ptr().add(offset),
                    data.len(),
                );
            },
            #[cfg(feature = "cuda")]
            Backing::Cuda(buffer) => buffer
                .write(offset, data)
                .map_err(|e| Error::internal(format!("region '{}': {e}", self.status.name)))?,
        }
        Ok(())
    }

    /// `len` bytes at `offset` within the region, or an error naming the tensor.
    fn range(&self, what: &str, offset: u64, len: u64) -> Result<(usize, usize)> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.status.byte_size);
        match (end, usize::try_from(offset), usize::try_from(len)) {
            (Some(_), Ok(o), Ok(l)) => Ok((o, l)),
            _ => Err(Error::invalid(format!(
                "{what}: {len} bytes at offset {offset} do not fit shared memory region '{}' \
                 of {} bytes",
                self.status.name, self.status.byte_size
            ))),
        }
    }
}

type Key = (Option<String>, String);

/// The regions registered with this server.
#[derive(Default)]
pub struct SystemSharedMemory {
    regions: Mutex<BTreeMap<Key, Arc<Region>>>,
}

fn owner(caller: &Caller) -> Option<String> {
    caller.tenant().map(str::to_owned)
}

/// The file behind a key: one name directly in `/dev/shm` (`/name` or `name`), as `shm_open`
/// accepts it; anything that could name another file is refused.
fn shm_path(key: &str) -> Result<PathBuf> {
    let name = key.strip_prefix('/').unwrap_or(key);
    if name.is_empty() || name.contains('/') || name == "." || name == ".." || name.contains('\0') {
        return Err(Error::invalid(format!(
            "shared memory key '{key}' is not a POSIX shared memory name (one '/name', as \
             given to shm_open)"
        )));
    }
    Ok(PathBuf::from(SHM_DIR).join(name))
}

impl SystemSharedMemory {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<Key, Arc<Region>>> {
        self.regions.lock().unwrap_or_else(PoisonError::into_inner)
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
        let path = shm_path(key)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                Error::invalid(format!(
                    "cannot open shared memory key '{key}' for region '{name}': {e}"
                ))
            })?;
        let size = file.metadata().map(|m| m.len()).map_err(|e| {
            Error::invalid(format!(
                "cannot read the size of shared memory key '{key}': {e}"
            ))
        })?;
        let end = offset.checked_add(byte_size);
        if byte_size == 0 || end.is_none_or(|e| e > size) {
            return Err(Error::invalid(format!(
                "shared memory region '{name}': {byte_size} bytes at offset {offset} do not fit \
                 key '{key}', which holds {size} bytes"
            )));
        }
        let len = usize::try_from(byte_size)
            .map_err(|_| Error::invalid(format!("region '{name}' is too large to map")))?;
        let map = MmapOptions::new()
            .offset(offset)
            .len(len)
            .map_raw(&file)
            .map_err(|e| {
                Error::invalid(format!(
                    "cannot map shared memory key '{key}' for '{name}': {e}"
                ))
            })?;
        let region = Region {
            status: RegionStatus {
                name: name.to_owned(),
                byte_size,
                location: Location::System {
                    key: key.to_owned(),
                    offset,
                },
            },
            backing: Backing::System(map),
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
        if name.is_empty() {
            return Err(Error::invalid("a shared memory region needs a name"));
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
            let buffer =
                crate::runtime::gpu::IpcBuffer::open(raw_handle, device_id, len).map_err(|e| {
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
    /// `None`. Unknown names are not an error (as in Triton). Requests already using a region
    /// finish with it.
    pub fn unregister(&self, caller: &Caller, kind: Kind, name: Option<&str>) -> Result<()> {
        caller.require_admin(kind.api())?;
        let owner = owner(caller);
        let mut regions = self.lock();
        match name {
            Some(name) => {
                let id = (owner, name.to_owned());
                if regions.get(&id).is_some_and(|r| r.kind() == kind) {
                    regions.remove(&id);
                }
            }
            None => regions.retain(|(o, _), r| *o != owner || r.kind() != kind),
        }
        Ok(())
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
                .ok_or_else(|| not_registered(name)),
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

    /// The data of an input that names a region in its parameters (a copy, so that the client
    /// may reuse the region once the request is sent), or `None` when it does not.
    pub fn input(
        &self,
        caller: &Caller,
        input: &str,
        params: &Parameters,
    ) -> Result<Option<Bytes>> {
        let Some(target) = Target::of(&format!("input '{input}'"), params)? else {
            return Ok(None);
        };
        let region = self.region(caller, &target.region)?;
        let (offset, len) =
            region.range(&format!("input '{input}'"), target.offset, target.size)?;
        Ok(Some(region.read(offset, len)?.into()))
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
            let Some(target) = Target::of(&what, &output.parameters)? else {
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
            let (offset, _) = region.range(&what, target.offset, len)?;
            region.write(offset, &tensor.data)?;
        }
        Ok(())
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
        format!("shared memory region '{name}' is already registered; unregister it first"),
    )
}

fn not_registered(name: &str) -> Error {
    Error::not_found(format!(
        "no shared memory region named '{name}' is registered"
    ))
}

/// Where a tensor's data is in shared memory, from its parameters.
struct Target {
    region: String,
    size: u64,
    offset: u64,
}

impl Target {
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
mod tests {
    use super::*;

    #[test]
    fn keys_are_single_names_in_dev_shm() {
        assert_eq!(
            shm_path("/input0").unwrap(),
            PathBuf::from("/dev/shm/input0")
        );
        assert_eq!(shm_path("out").unwrap(), PathBuf::from("/dev/shm/out"));
        for bad in ["", "/", "/../etc/passwd", "/a/b", "..", "/.."] {
            let err = shm_path(bad).unwrap_err();
            assert!(
                err.message.contains("POSIX shared memory name"),
                "{bad}: {err:?}"
            );
        }
    }

    #[test]
    fn inputs_and_outputs_round_trip_through_a_region() {
        let key = format!("wasmtron-unit-{}", std::process::id());
        let path = PathBuf::from(SHM_DIR).join(&key);
        std::fs::write(&path, vec![0u8; 64]).unwrap();
        let shm = SystemSharedMemory::new();
        let anyone = Caller::Anyone;
        shm.register(&anyone, "r", &format!("/{key}"), 8, 32)
            .unwrap();
        let dup = shm.register(&anyone, "r", &key, 0, 8).unwrap_err();
        assert!(dup.message.contains("already registered"), "{dup:?}");

        let params = |region: &str, size: i64, offset: i64| {
            Parameters::from([
                (REGION.into(), ParamValue::String(region.into())),
                (BYTE_SIZE.into(), ParamValue::Int(size)),
                (OFFSET.into(), ParamValue::Int(offset)),
            ])
        };
        let response = InferResponse {
            model_name: "m".into(),
            model_version: 1,
            id: String::new(),
            parameters: Parameters::new(),
            outputs: vec![crate::tensor::Tensor {
                name: "y".into(),
                datatype: crate::tensor::DataType::Uint8,
                shape: vec![4],
                data: Bytes::from_static(&[1, 2, 3, 4]),
            }],
        };
        let requested = vec![RequestedOutput {
            name: "y".into(),
            parameters: params("r", 4, 4),
        }];
        shm.write_outputs(&anyone, &requested, &response).unwrap();
        let reported = output_parameters(&requested, "y", 4).unwrap();
        assert_eq!(reported[BYTE_SIZE], ParamValue::Int(4));
        // Region offset 8 + tensor offset 4: byte 12 of the object.
        assert_eq!(&std::fs::read(&path).unwrap()[12..16], &[1, 2, 3, 4]);
        let back = shm
            .input(&anyone, "x", &params("r", 4, 4))
            .unwrap()
            .unwrap();
        assert_eq!(&back[..], &[1, 2, 3, 4]);

        let past = shm.input(&anyone, "x", &params("r", 8, 30)).unwrap_err();
        assert!(
            past.message.contains("do not fit shared memory region 'r'"),
            "{past:?}"
        );
        let missing = shm.input(&anyone, "x", &params("nope", 4, 0)).unwrap_err();
        assert!(missing.message.contains("'nope'"), "{missing:?}");
        let status = shm.status(&anyone, Kind::System, None).unwrap();
        assert_eq!(status[0].byte_size, 32);
        assert!(shm.status(&anyone, Kind::Cuda, None).unwrap().is_empty());
        shm.unregister(&anyone, Kind::Cuda, None).unwrap();
        assert_eq!(shm.status(&anyone, Kind::System, None).unwrap().len(), 1);
        shm.unregister(&anyone, Kind::System, None).unwrap();
        assert!(shm.status(&anyone, Kind::System, Some("r")).is_err());
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn cuda_regions_say_what_is_missing_on_a_cpu_host() {
        if crate::runtime::gpu::device_count().is_ok() {
            return; // a GPU build on a GPU host
        }
        let shm = SystemSharedMemory::new();
        let err = shm
            .register_cuda(&Caller::Anyone, "g", &[0; 64], 0, 64)
            .unwrap_err();
        assert_eq!(err.code, Code::Unsupported);
        assert!(
            err.message
                .starts_with("CUDA shared memory is not available"),
            "{err:?}"
        );
        #[cfg(feature = "cuda")]
        assert!(err.message.contains("NVIDIA driver"), "{err:?}");
        #[cfg(not(feature = "cuda"))]
        assert!(err.message.contains("--features cuda"), "{err:?}");
    }
}
