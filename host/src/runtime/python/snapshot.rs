//! A model's interpreter as it stands after `model.py` and everything it imports are loaded,
//! before any instance's `initialize`: the state every further instance (and every restart
//! after a crash) starts from, instead of booting the interpreter and importing again.
//!
//! The snapshot is the interpreter's linear memory, kept in a sealed memory file; an instance
//! starts from it by mapping the file copy-on-write over its own memory, so that instances
//! share the pages none of them writes (the interpreter's code objects, modules, numpy's
//! tables) and a new instance is ready in a millisecond or two instead of the import's
//! hundreds. Nothing else of the interpreter changes between turns: its one mutable global
//! (the stack pointer) is back where it started when a turn returns, its function table is
//! fixed, and the host side (the WASI context) is built the same way for every instance —
//! the same folders opened in the same order, the clock running from the snapshot's origin.
//!
//! What makes a snapshot unsafe, and is checked before one is taken (a model that does it
//! starts every instance in full, as before): a file the import left open (its descriptor
//! would not exist in the new instance). What instances share, and is reset after a start:
//! the state of `random` and `numpy.random` seeded during the import (each instance reseeds
//! from the system's entropy, as separate processes would differ). What cannot differ by
//! construction: anything instance-specific, since the import runs before `initialize(args)`
//! tells the model which instance it is.

use std::{fs::File, io::Write, os::fd::AsFd, time::Instant};

use crate::error::{Error, Result};

/// The interpreter's memory after `model.py` was imported.
pub struct MemorySnapshot {
    /// Sealed: nothing can change it once taken.
    file: File,
    /// Bytes of linear memory it holds (a whole number of wasm pages).
    len: usize,
    /// The monotonic clock's origin of the interpreter it was taken from: instances started
    /// from it keep that clock, so that time read during the import never runs backwards.
    pub(super) clock_origin: Instant,
}

impl std::fmt::Debug for MemorySnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemorySnapshot")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl MemorySnapshot {
    /// Keeps a copy of `memory` (an interpreter's whole linear memory, between turns).
    pub(super) fn capture(memory: &[u8], clock_origin: Instant) -> Result<Self> {
        use rustix::fs::{fcntl_add_seals, memfd_create, MemfdFlags, SealFlags};
        let failed = |e: &dyn std::fmt::Display| {
            Error::internal(format!("cannot keep the interpreter's snapshot: {e}"))
        };
        let fd = memfd_create(
            "wasmtron-python-snapshot",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| failed(&e))?;
        let mut file = File::from(fd);
        file.write_all(memory).map_err(|e| failed(&e))?;
        fcntl_add_seals(
            &file,
            SealFlags::WRITE | SealFlags::GROW | SealFlags::SHRINK | SealFlags::SEAL,
        )
        .map_err(|e| failed(&e))?;
        Ok(Self {
            file,
            len: memory.len(),
            clock_origin,
        })
    }

    /// Bytes of linear memory the snapshot holds.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Maps the snapshot copy-on-write over `memory`, which must be a live linear memory of at
    /// least [`Self::len`] bytes that nothing reads or writes meanwhile: its first `len` bytes
    /// then read as the snapshot, and writes go to pages of its own.
    pub(super) fn map_over(&self, memory: &mut [u8]) -> Result<()> {
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        if memory.len() < self.len {
            return Err(Error::internal(format!(
                "the interpreter's memory ({} bytes) is smaller than its snapshot ({} bytes)",
                memory.len(),
                self.len
            )));
        }
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: the range is the start of a linear memory this thread holds exclusively
        // (`&mut`), inside wasmtime's reservation for it, page-aligned (wasm pages are 64 KiB
        // and the memory's base is mapped at a page boundary). MAP_FIXED replaces the pages
        // there with a private, copy-on-write view of the sealed file, readable and writable
        // as the memory's pages were; wasmtime unmaps the whole reservation when the instance
        // goes, this mapping with it.
        let mapped = unsafe {
            mmap(
                memory.as_mut_ptr().cast(),
                self.len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::FIXED,
                self.file.as_fd(),
                0,
            )
        }
        .map_err(|e| Error::internal(format!("cannot map the interpreter's snapshot: {e}")))?;
        if mapped.cast::<u8>() != memory.as_mut_ptr() {
            return Err(Error::internal(
                "the interpreter's snapshot was mapped elsewhere than asked",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapped_snapshot_reads_as_taken_and_writes_stay_private() {
        let page = rustix::param::page_size();
        let taken: Vec<u8> = (0..2 * page).map(|i| (i % 251) as u8).collect();
        let snapshot = MemorySnapshot::capture(&taken, Instant::now()).unwrap();
        assert_eq!(snapshot.len(), taken.len());
        // Two "instances": page-aligned anonymous memory, as wasmtime's is.
        let first = aligned(3 * page);
        let second = aligned(3 * page);
        snapshot.map_over(first).unwrap();
        snapshot.map_over(second).unwrap();
        assert_eq!(&first[..taken.len()], &taken[..]);
        first[7] = 0xAA;
        assert_eq!(
            second[7], taken[7],
            "a write in one instance shows in no other"
        );
        assert_eq!(first[7], 0xAA);
        // What lies past the snapshot is the memory's own.
        assert!(first[taken.len()..].iter().all(|&b| b == 0));
        assert!(
            snapshot.map_over(aligned(page)).is_err(),
            "too small a memory"
        );
    }

    fn aligned(len: usize) -> &'static mut [u8] {
        use rustix::mm::{mmap_anonymous, MapFlags, ProtFlags};
        // SAFETY: a fresh anonymous mapping, leaked for the test's life.
        unsafe {
            let p = mmap_anonymous(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
            .unwrap();
            std::slice::from_raw_parts_mut(p.cast(), len)
        }
    }
}
