//! System shared memory (KServe's shared-memory extension, as in Triton): a client on the
//! same machine registers a POSIX shared-memory object (`shm_open` key, i.e. a file under
//! `/dev/shm`) as a named region, then sends inputs and asks for outputs by region, offset and
//! size instead of in the request body. Shared by the HTTP and gRPC frontends.
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
    /// The shared-memory key it was opened with.
    pub key: String,
    /// Where the region starts in the shared-memory object.
    pub offset: u64,
    /// Its size in bytes.
    pub byte_size: u64,
}

struct Region {
    status: RegionStatus,
    map: MmapRaw,
}

impl Region {
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
        caller.require_admin("system shared memory")?;
        if name.is_empty() {
            return Err(Error::invalid("a shared memory region needs a name"));
        }
        let id = (owner(caller), name.to_owned());
        if self.lock().contains_key(&id) {
            return Err(already_registered(name));
        }
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
                key: key.to_owned(),
                offset,
                byte_size,
            },
            map,
        };
        let mut regions = self.lock();
        if regions.contains_key(&id) {
            return Err(already_registered(name));
        }
        regions.insert(id, Arc::new(region));
        tracing::info!(
            region = name,
            key,
            offset,
            byte_size,
            "registered system shared memory"
        );
        Ok(())
    }

    /// Unregisters region `name`, or every region of the caller when `None`. Unknown names
    /// are not an error (as in Triton). Requests already using a region finish with it.
    pub fn unregister(&self, caller: &Caller, name: Option<&str>) -> Result<()> {
        caller.require_admin("system shared memory")?;
        let owner = owner(caller);
        let mut regions = self.lock();
        match name {
            Some(name) => {
                regions.remove(&(owner, name.to_owned()));
            }
            None => regions.retain(|(o, _), _| *o != owner),
        }
        Ok(())
    }

    /// The caller's regions, or the one named (an error if it is not registered).
    pub fn status(&self, caller: &Caller, name: Option<&str>) -> Result<Vec<RegionStatus>> {
        caller.require_admin("system shared memory")?;
        let owner = owner(caller);
        let regions = self.lock();
        match name {
            Some(name) => regions
                .get(&(owner, name.to_owned()))
                .map(|r| vec![r.status.clone()])
                .ok_or_else(|| not_registered(name)),
            None => Ok(regions
                .iter()
                .filter(|((o, _), _)| *o == owner)
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
        let mut data = vec![0u8; len];
        // SAFETY: `range` keeps offset..offset+len inside the mapping, which lives as long as
        // `region`. The client may write the memory concurrently (a race it owns, as in
        // Triton); copying raw bytes with no references into the mapping keeps that sound.
        unsafe {
            std::ptr::copy_nonoverlapping(region.map.as_ptr().add(offset), data.as_mut_ptr(), len);
        }
        Ok(Some(data.into()))
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
            let (offset, len) = region.range(&what, target.offset, len)?;
            // SAFETY: as in `input`, the range lies inside the mapping held by `region`.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    tensor.data.as_ptr(),
                    region.map.as_mut_ptr().add(offset),
                    len,
                );
            }
        }
        Ok(())
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
        "no system shared memory region named '{name}' is registered"
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
        let status = shm.status(&anyone, None).unwrap();
        assert_eq!(status[0].byte_size, 32);
        shm.unregister(&anyone, None).unwrap();
        assert!(shm.status(&anyone, Some("r")).is_err());
        std::fs::remove_file(path).unwrap();
    }
}
