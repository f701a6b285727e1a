//! Tensor operations the host runs for stages (`wasmtron:stage/ops` in `wit/stage.wit`): image
//! decoding and geometry, layout, casts, normalisation and the usual postprocessing reductions,
//! on arrays held by the host. Pure functions of their arguments; the Wasm backend binds them
//! to the stage's handles, memory budget and deadline (`runtime::wasm::ops`).
//!
//! Every operation validates its arguments and fails with an `InvalidArg` error that names the
//! operation and the argument, and asks its [`Budget`] before allocating a result.

mod array;
mod image;
mod layout;
mod math;
mod nms;
mod resample;

pub use array::{Array, Budget};
pub use image::{
    center_crop, convert_color, crop, decode_image, letterbox, resize, resize_shorter_side, Color,
    Filter, DEFAULT_MAX_PIXELS,
};
pub use layout::{reshape, stack, transpose};
pub use math::{argmax, cast, normalize, sigmoid, softmax, top_k};
pub use nms::{nms, BoxFormat};

use crate::error::Error;

/// An argument error of operation `op`.
fn invalid(op: &str, message: impl std::fmt::Display) -> Error {
    Error::invalid(format!("ops.{op}: {message}"))
}

/// Resolves a NumPy-style axis (negative counts from the end) against `rank`.
fn axis_index(op: &str, axis: i32, rank: usize) -> crate::error::Result<usize> {
    let resolved = if axis < 0 {
        rank as i64 + i64::from(axis)
    } else {
        i64::from(axis)
    };
    usize::try_from(resolved)
        .ok()
        .filter(|a| *a < rank)
        .ok_or_else(|| {
            invalid(
                op,
                format!("axis {axis} is out of range for an array of rank {rank}"),
            )
        })
}
