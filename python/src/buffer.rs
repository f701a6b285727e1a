//! Tensor memory lent to Python without a copy: a read-only buffer (the buffer protocol of
//! the stable ABI, CPython 3.11+) over the server's own bytes, which `np.frombuffer` wraps.
//! The array keeps this object alive, and it keeps the bytes (an ONNX Runtime output, a slice
//! of a batch, a request's input) alive.

use std::{
    ffi::{c_int, c_void},
    ptr,
};

use bytes::Bytes;
use pyo3::{exceptions::PyBufferError, ffi, prelude::*};

/// Bytes of one tensor, readable from Python through the buffer protocol.
#[pyclass(module = "wasmtron._wasmtron", frozen)]
pub struct TensorBuffer {
    data: Bytes,
}

impl TensorBuffer {
    pub fn new(data: Bytes) -> Self {
        Self { data }
    }
}

#[pymethods]
impl TensorBuffer {
    fn __len__(&self) -> usize {
        self.data.len()
    }

    /// Fills `view` as a one-dimensional, read-only buffer of unsigned bytes.
    ///
    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("no view to fill"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("tensor memory is read-only"));
        }
        let (buf, len) = {
            let data = &slf.get().data;
            (data.as_ptr(), data.len())
        };
        // SAFETY: `view` is CPython's to fill (checked non-null); `obj` takes a reference to
        // this object, which owns `buf` for as long as the view exists; `shape` and `strides`
        // point into the view itself, as CPython allows for one-dimensional buffers.
        unsafe {
            (*view).obj = slf.into_any().into_ptr();
            (*view).buf = buf.cast_mut().cast::<c_void>();
            (*view).len = len as ffi::Py_ssize_t;
            (*view).readonly = 1;
            (*view).itemsize = 1;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                c"B".as_ptr().cast_mut()
            } else {
                ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                &mut (*view).len
            } else {
                ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                &mut (*view).itemsize
            } else {
                ptr::null_mut()
            };
            (*view).suboffsets = ptr::null_mut();
            (*view).internal = ptr::null_mut();
        }
        Ok(())
    }

    /// Nothing to release: the reference in `view.obj` is dropped by CPython.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
