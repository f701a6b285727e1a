//! Giving freed memory back to the system.
//!
//! glibc's allocator keeps freed blocks below its mmap threshold (which grows to 32 MiB as
//! large blocks are freed) in its heaps, so a model's load (a protobuf of every weight, then
//! ONNX Runtime's packed copies) or a key/value cache that moved leave the process's resident
//! size at its peak. `malloc_trim` hands the free pages back; it walks the heaps, so it runs
//! only after such events, never per step.

/// Returns freed heap memory to the system (glibc only; elsewhere nothing).
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only touches the allocator's own free lists; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
