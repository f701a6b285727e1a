//! CUDA shared memory: device memory another process exported (`cudaIpcGetMemHandle`),
//! opened in this process through the NVIDIA driver, checked against the size of the
//! allocation the driver reports, and copied to and from the host.

use cudarc::driver::{result, sys};

use crate::runtime::gpu::driver;

/// Device memory another process exported with `cudaIpcGetMemHandle`, opened in this
/// process (CUDA shared memory), and the primary context it lives in.
pub(super) struct IpcBuffer {
    ptr: sys::CUdeviceptr,
    context: sys::CUcontext,
    device: sys::CUdevice,
    len: usize,
}

// SAFETY: the pointer is a device address, valid in the context from any thread once the
// context is made current there (every method does).
unsafe impl Send for IpcBuffer {}
unsafe impl Sync for IpcBuffer {}

impl IpcBuffer {
    /// Opens a 64-byte `cudaIpcMemHandle_t` on `device_id`.
    pub(super) fn open(handle: &[u8], device_id: i64, len: usize) -> Result<Self, String> {
        driver()?;
        let mut raw = sys::CUipcMemHandle_st { reserved: [0; 64] };
        if handle.len() != raw.reserved.len() {
            return Err(format!(
                "raw_handle has {} bytes; a cudaIpcMemHandle_t has 64",
                handle.len()
            ));
        }
        for (dst, src) in raw.reserved.iter_mut().zip(handle) {
            *dst = *src as std::ffi::c_char;
        }
        let ordinal = i32::try_from(device_id).map_err(|_| "bad device_id".to_owned())?;
        let device =
            result::device::get(ordinal).map_err(|e| format!("device {device_id}: {e}"))?;
        // SAFETY: `device` came from `device::get`; the context is released in Drop.
        let context = unsafe { result::primary_ctx::retain(device) }
            .map_err(|e| format!("device {device_id}: {e}"))?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the context is valid; the handle is the 64 bytes the client sent, which
        // the driver checks.
        let opened = unsafe {
            result::ctx::set_current(context).and_then(|()| {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    raw,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
                .result()
            })
        };
        if let Err(e) = opened {
            // SAFETY: retained above.
            let _ = unsafe { result::primary_ctx::release(device) };
            return Err(format!("cannot open the CUDA IPC handle: {e}"));
        }
        let buffer = Self {
            ptr,
            context,
            device,
            len,
        };
        // The client's byte_size is a claim: the driver says how large the allocation
        // behind the handle really is, and a region may not reach past it (else offsets
        // would read or corrupt other GPU memory).
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: the context is current (set above); `ptr` was just opened in it.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr).result() }
            .map_err(|e| format!("cannot read the size of the CUDA allocation: {e}"))?;
        let available = (base as usize + size).saturating_sub(ptr as usize);
        if len > available {
            // Dropping `buffer` closes the handle and releases the context.
            return Err(format!(
                "byte_size {len} is larger than the CUDA allocation behind the handle \
                 ({available} bytes)"
            ));
        }
        Ok(buffer)
    }

    /// Copies `dst.len()` bytes at `offset` to the host.
    pub(super) fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        self.check(offset, dst.len())?;
        // SAFETY: the range lies inside the opened allocation.
        unsafe {
            result::ctx::set_current(self.context)
                .and_then(|()| result::memcpy_dtoh_sync(dst, self.ptr + offset as u64))
        }
        .map_err(|e| format!("copy from the GPU failed: {e}"))
    }

    /// Copies `src` to `offset` on the device.
    pub(super) fn write(&self, offset: usize, src: &[u8]) -> Result<(), String> {
        self.check(offset, src.len())?;
        // SAFETY: the range lies inside the opened allocation.
        unsafe {
            result::ctx::set_current(self.context)
                .and_then(|()| result::memcpy_htod_sync(self.ptr + offset as u64, src))
        }
        .map_err(|e| format!("copy to the GPU failed: {e}"))
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(format!(
                "{len} bytes at {offset} run past {} bytes",
                self.len
            )),
        }
    }
}

impl Drop for IpcBuffer {
    fn drop(&mut self) {
        // SAFETY: opened and retained in `open`.
        unsafe {
            let _ = result::ctx::set_current(self.context);
            let _ = sys::cuIpcCloseMemHandle(self.ptr).result();
            let _ = result::primary_ctx::release(self.device);
        }
    }
}
