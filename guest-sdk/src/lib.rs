//! Write Wasmtron stages in Rust.
//!
//! A stage is a WebAssembly component that implements the `wasmtron:stage` world
//! (`wit/stage.wit`). With this crate it is a type implementing [`Stage`] and one macro:
//!
//! ```ignore
//! use wasmtron_guest::{export_stage, Config, Request, Result, Stage, Tensor};
//!
//! struct Doubler;
//!
//! impl Stage for Doubler {
//!     fn init(_config: &Config) -> Result<Self> {
//!         Ok(Doubler)
//!     }
//!     fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
//!         let x = request.input("INPUT0")?;
//!         let doubled: Vec<f32> = x.to_f32()?.iter().map(|v| v * 2.0).collect();
//!         Ok(vec![Tensor::from_f32("OUTPUT0", &x.shape, &doubled)])
//!     }
//! }
//!
//! export_stage!(Doubler);
//! ```
//!
//! Build with `cargo build --target wasm32-wasip2 --release` (crate type `cdylib`) and put the
//! `.wasm` file at `<repository>/<model>/1/model.wasm` next to a config.pbtxt that says
//! `backend: "wasm"`.

/// Bindings generated from `wit/stage.wit`.
#[allow(missing_docs, clippy::all)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../wit",
        world: "stage",
        pub_export_macro: true,
        export_macro_name: "__export_stage_world",
        default_bindings_module: "wasmtron_guest::bindings",
    });
}

pub use bindings::wasmtron::stage::host::LogLevel;
pub use bindings::wasmtron::stage::types::{
    Datatype, Error as WitError, ErrorCode, ParamValue, Parameter, Request, Tensor,
};

/// A stage failure: a code (mapped to the HTTP status / gRPC code) and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// Classification.
    pub code: ErrorCode,
    /// What went wrong.
    pub message: String,
}

impl Error {
    /// The request does not fit (HTTP 400).
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::InvalidArgument,
            message: message.into(),
        }
    }
    /// A failure inside the stage (HTTP 500).
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            code: ErrorCode::Internal,
            message: message.into(),
        }
    }
}

impl From<Error> for WitError {
    fn from(e: Error) -> Self {
        WitError {
            code: e.code,
            message: e.message,
        }
    }
}

impl From<WitError> for Error {
    fn from(e: WitError) -> Self {
        Error {
            code: e.code,
            message: e.message,
        }
    }
}

/// Result of stage code.
pub type Result<T, E = Error> = core::result::Result<T, E>;

/// What `init` receives: the model configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The model configuration as JSON (as `GET /v2/models/<name>/config` returns it).
    pub json: String,
    /// `parameters` of config.pbtxt.
    pub parameters: Vec<(String, String)>,
}

impl Config {
    /// A `parameters` value of config.pbtxt.
    pub fn parameter(&self, key: &str) -> Option<&str> {
        self.parameters
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// A `parameters` value parsed as `T` (surrounding spaces ignored), or `default` when the
    /// parameter is absent; a value that does not parse is an error naming the parameter.
    pub fn parameter_or<T>(&self, key: &str, default: T) -> Result<T>
    where
        T: core::str::FromStr,
        T::Err: core::fmt::Display,
    {
        match self.parameter(key) {
            None => Ok(default),
            Some(text) => text.trim().parse().map_err(|e| {
                Error::invalid(format!(
                    "parameter '{key}' of config.pbtxt: cannot use \"{text}\": {e}"
                ))
            }),
        }
    }
}

/// Where the server shows a stage its model's version directory, read-only: the files shipped
/// next to `model.wasm` (a vocabulary, labels, a character set). Nothing else is readable.
pub const MODEL_FILES_DIR: &str = "/model";

/// Reads a file shipped in the model's version directory (`<repository>/<model>/<version>/`).
pub fn read_model_file(name: &str) -> Result<Vec<u8>> {
    std::fs::read(format!("{MODEL_FILES_DIR}/{name}")).map_err(|e| {
        Error::invalid(format!(
            "cannot read '{name}' from the model's version directory: {e}"
        ))
    })
}

/// A stage: created once per instance, then asked to execute requests.
pub trait Stage: Sized + 'static {
    /// Called once per instance before the first request.
    fn init(config: &Config) -> Result<Self>;
    /// Produces the request's `requested_outputs`, in that order.
    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>>;

    /// Executes the requests the server batched together (models with `max_batch_size` > 0
    /// and a batcher), one result per request in order. The default runs [`Stage::execute`]
    /// on each; override it to do the work once for the whole batch, such as one call of a
    /// model for every request's rows.
    fn execute_batch(&mut self, requests: &[Request]) -> Vec<Result<Vec<Tensor>>> {
        requests
            .iter()
            .enumerate()
            .map(|(i, request)| {
                __set_current_request(i);
                self.execute(request)
            })
            .collect()
    }
}

impl Request {
    /// The input tensor with this name.
    pub fn input(&self, name: &str) -> Result<&Tensor> {
        self.inputs
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| Error::invalid(format!("missing input '{name}'")))
    }
    /// The one value of an optional input, as a whole number (INT32 or INT64): `None` when
    /// the client did not send it; an error naming the input when it holds more than one
    /// value or another datatype.
    pub fn scalar_i64(&self, name: &str) -> Result<Option<i64>> {
        let Some(t) = self.scalar(name)? else {
            return Ok(None);
        };
        match t.datatype {
            Datatype::Int32 => t.to_i32().map(|v| Some(i64::from(v[0]))),
            Datatype::Int64 => t.to_i64().map(|v| Some(v[0])),
            _ => Err(Error::invalid(format!(
                "input '{name}' must be INT32 or INT64"
            ))),
        }
    }

    /// The one value of an optional input, as a float (FP32 or FP64); as [`Self::scalar_i64`].
    pub fn scalar_f32(&self, name: &str) -> Result<Option<f32>> {
        let Some(t) = self.scalar(name)? else {
            return Ok(None);
        };
        match t.datatype {
            Datatype::Fp32 => t.to_f32().map(|v| Some(v[0])),
            Datatype::Fp64 => t.to_f64().map(|v| Some(v[0] as f32)),
            _ => Err(Error::invalid(format!(
                "input '{name}' must be FP32 or FP64"
            ))),
        }
    }

    /// The one element of an optional BYTES input, as UTF-8 text; as [`Self::scalar_i64`].
    pub fn scalar_text(&self, name: &str) -> Result<Option<String>> {
        let Some(t) = self.scalar(name)? else {
            return Ok(None);
        };
        let elements = t
            .bytes_elements()
            .map_err(|e| Error::invalid(format!("input '{name}': {}", e.message)))?;
        let text = core::str::from_utf8(elements[0])
            .map_err(|_| Error::invalid(format!("input '{name}' is not UTF-8")))?;
        Ok(Some(text.to_owned()))
    }

    /// An optional input that must hold exactly one element.
    fn scalar(&self, name: &str) -> Result<Option<&Tensor>> {
        let Some(t) = self.inputs.iter().find(|t| t.name == name) else {
            return Ok(None);
        };
        if t.element_count() != 1 {
            return Err(Error::invalid(format!(
                "input '{name}' must hold one value, got shape {:?}",
                t.shape
            )));
        }
        Ok(Some(t))
    }

    /// A request parameter sent by the client.
    pub fn parameter(&self, key: &str) -> Option<&ParamValue> {
        self.parameters
            .iter()
            .find(|p| p.key == key)
            .map(|p| &p.value)
    }
    /// Like [`Request::select`], for stages that set some outputs with [`ops::set_output`]:
    /// returns the requested outputs found in `produced` and leaves the rest to the host,
    /// which reports any still missing.
    pub fn select_set(&self, mut produced: Vec<Tensor>) -> Vec<Tensor> {
        self.requested_outputs
            .iter()
            .filter_map(|name| {
                let i = produced.iter().position(|t| &t.name == name)?;
                Some(produced.swap_remove(i))
            })
            .collect()
    }

    /// Keeps only the requested outputs, in the requested order.
    pub fn select(&self, mut produced: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.requested_outputs
            .iter()
            .map(|name| {
                let i = produced
                    .iter()
                    .position(|t| &t.name == name)
                    .ok_or_else(|| {
                        Error::internal(format!("stage does not produce output '{name}'"))
                    })?;
                Ok(produced.swap_remove(i))
            })
            .collect()
    }
}

macro_rules! numeric {
    ($from:ident, $to:ident, $t:ty, $dt:ident) => {
        /// Builds a tensor from values of this type.
        pub fn $from(name: &str, shape: &[i64], values: &[$t]) -> Tensor {
            const N: usize = core::mem::size_of::<$t>();
            // Fixed-size chunks of a zeroed buffer: compiles to a plain copy on little-endian
            // targets, where pushing element by element re-checks the capacity each time.
            let mut data = vec![0u8; values.len() * N];
            for (chunk, v) in data.chunks_exact_mut(N).zip(values) {
                chunk.copy_from_slice(&v.to_le_bytes());
            }
            Tensor {
                name: name.to_owned(),
                datatype: Datatype::$dt,
                shape: shape.to_vec(),
                data,
            }
        }
        /// The elements, if the tensor has this datatype.
        pub fn $to(&self) -> Result<Vec<$t>> {
            self.expect(Datatype::$dt)?;
            const N: usize = core::mem::size_of::<$t>();
            Ok(self
                .data
                .chunks_exact(N)
                .map(|c| {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    <$t>::from_le_bytes(a)
                })
                .collect())
        }
    };
}

impl Tensor {
    numeric!(from_f32, to_f32, f32, Fp32);
    numeric!(from_f64, to_f64, f64, Fp64);
    numeric!(from_i32, to_i32, i32, Int32);
    numeric!(from_i64, to_i64, i64, Int64);
    numeric!(from_u8, to_u8, u8, Uint8);

    /// Fails unless the tensor has `datatype`.
    pub fn expect(&self, datatype: Datatype) -> Result<()> {
        if self.datatype == datatype {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "tensor '{}' is {:?}, expected {:?}",
                self.name, self.datatype, datatype
            )))
        }
    }

    /// Builds a BYTES tensor from byte strings.
    pub fn from_bytes_elements<I, B>(name: &str, shape: &[i64], items: I) -> Tensor
    where
        I: IntoIterator<Item = B>,
        B: AsRef<[u8]>,
    {
        let mut data = Vec::new();
        for item in items {
            let item = item.as_ref();
            data.extend_from_slice(&(item.len() as u32).to_le_bytes());
            data.extend_from_slice(item);
        }
        Tensor {
            name: name.to_owned(),
            datatype: Datatype::Bytes,
            shape: shape.to_vec(),
            data,
        }
    }

    /// The elements of a BYTES tensor.
    pub fn bytes_elements(&self) -> Result<Vec<&[u8]>> {
        self.expect(Datatype::Bytes)?;
        let mut out = Vec::new();
        let mut rest = &self.data[..];
        while !rest.is_empty() {
            let malformed =
                || Error::invalid(format!("tensor '{}' has malformed BYTES data", self.name));
            let len = rest.get(..4).ok_or_else(malformed)?;
            let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
            let item = rest.get(4..4 + len).ok_or_else(malformed)?;
            out.push(item);
            rest = &rest[4 + len..];
        }
        Ok(out)
    }

    /// Number of elements the shape describes.
    pub fn element_count(&self) -> usize {
        self.shape.iter().map(|&d| d.max(0) as usize).product()
    }
}

/// Services of the host.
pub mod host {
    use super::{bindings::wasmtron::stage::host, LogLevel, Result, Tensor};

    /// Writes a line to the server log.
    pub fn log(level: LogLevel, message: &str) {
        host::log(level, message);
    }

    /// Runs another model on the server and returns its outputs (all of them when
    /// `outputs` is empty).
    pub fn infer(
        model: &str,
        version: Option<i64>,
        inputs: &[Tensor],
        outputs: &[&str],
    ) -> Result<Vec<Tensor>> {
        let outputs: Vec<String> = outputs.iter().map(|s| s.to_string()).collect();
        host::infer(model, version, inputs, &outputs).map_err(Into::into)
    }

    /// Decoupled models: sends one response to the request being executed, at once. Return
    /// an empty list from `execute` to end the request without a further response.
    pub fn respond(outputs: &[Tensor]) -> Result<()> {
        host::respond(super::current_request(), outputs).map_err(Into::into)
    }
}

/// Tensor operations the host runs natively (`wasmtron:stage/ops`): image decoding and
/// geometry, layout, casts, normalisation, softmax, top-k, non-maximum suppression. Arrays stay
/// on the host between operations; `Array::to_tensor` copies one out. Semantics: docs/stages.md,
/// "Host tensor operations".
pub mod ops {
    use super::{bindings::wasmtron::stage::ops as raw, Datatype, Result, Tensor};
    pub use raw::{Array, BoxFormat, Color, Filter};

    /// A host array holding a copy of a tensor's elements.
    pub fn array(tensor: &Tensor) -> Result<Array> {
        Array::from_tensor(tensor).map_err(Into::into)
    }
    /// PNG or JPEG bytes as uint8 [height, width, channels]; `max_pixels` 0: 40 million.
    pub fn decode_image(data: &[u8], color: Color, max_pixels: u64) -> Result<Array> {
        raw::decode_image(data, color, max_pixels).map_err(Into::into)
    }
    /// A uint8 image in another color.
    pub fn convert_color(image: &Array, from: Color, to: Color) -> Result<Array> {
        raw::convert_color(image, from, to).map_err(Into::into)
    }
    /// Resized to exactly `height` x `width` (Pillow's resize).
    pub fn resize(image: &Array, height: u32, width: u32, filter: Filter) -> Result<Array> {
        raw::resize(image, height, width, filter).map_err(Into::into)
    }
    /// Resized so that the shorter side is `size`, keeping the aspect ratio.
    pub fn resize_shorter_side(image: &Array, size: u32, filter: Filter) -> Result<Array> {
        raw::resize_shorter_side(image, size, filter).map_err(Into::into)
    }
    /// Fitted into `height` x `width`, centred, padded with `pad`.
    pub fn letterbox(
        image: &Array,
        height: u32,
        width: u32,
        filter: Filter,
        pad: f32,
    ) -> Result<Array> {
        raw::letterbox(image, height, width, filter, pad).map_err(Into::into)
    }
    /// The region at (`top`, `left`).
    pub fn crop(image: &Array, top: u32, left: u32, height: u32, width: u32) -> Result<Array> {
        raw::crop(image, top, left, height, width).map_err(Into::into)
    }
    /// The centred region (torchvision's CenterCrop).
    pub fn center_crop(image: &Array, height: u32, width: u32) -> Result<Array> {
        raw::center_crop(image, height, width).map_err(Into::into)
    }
    /// Axes permuted: `[2, 0, 1]` turns HWC into CHW.
    pub fn transpose(a: &Array, axes: &[u32]) -> Result<Array> {
        raw::transpose(a, axes).map_err(Into::into)
    }
    /// Elements converted to `datatype` (saturating).
    pub fn cast(a: &Array, datatype: Datatype) -> Result<Array> {
        raw::cast(a, datatype).map_err(Into::into)
    }
    /// fp32 `(x * scale - mean[c]) / std[c]` along `axis`.
    pub fn normalize(a: &Array, scale: f32, mean: &[f32], std: &[f32], axis: i32) -> Result<Array> {
        raw::normalize(a, scale, mean, std, axis).map_err(Into::into)
    }
    /// fp32 softmax along `axis`.
    pub fn softmax(a: &Array, axis: i32) -> Result<Array> {
        raw::softmax(a, axis).map_err(Into::into)
    }
    /// fp32 logistic sigmoid.
    pub fn sigmoid(a: &Array) -> Result<Array> {
        raw::sigmoid(a).map_err(Into::into)
    }
    /// int64 index of the largest value along `axis`.
    pub fn argmax(a: &Array, axis: i32) -> Result<Array> {
        raw::argmax(a, axis).map_err(Into::into)
    }
    /// (values fp32, indices int64) of the `k` largest along `axis`, largest first.
    pub fn top_k(a: &Array, k: u32, axis: i32) -> Result<(Array, Array)> {
        raw::top_k(a, k, axis)
            .map(|r| (r.values, r.indices))
            .map_err(Into::into)
    }
    /// int64 indices of the boxes kept by non-maximum suppression, best first.
    pub fn nms(
        boxes: &Array,
        scores: &Array,
        format: BoxFormat,
        iou_threshold: f32,
        score_threshold: f32,
        max_outputs: u32,
    ) -> Result<Array> {
        raw::nms(
            boxes,
            scores,
            format,
            iou_threshold,
            score_threshold,
            max_outputs,
        )
        .map_err(Into::into)
    }
    /// Arrays of one shape joined along a new first axis.
    pub fn stack(arrays: &[&Array]) -> Result<Array> {
        raw::stack(arrays).map_err(Into::into)
    }
    /// The input `name` of the request being executed, as a host array (numeric inputs).
    pub fn input(name: &str) -> Result<Array> {
        raw::input(super::current_request(), name).map_err(Into::into)
    }
    /// Decodes element `element` of the BYTES input `name` of the request being executed.
    pub fn decode_input_image(
        name: &str,
        element: u32,
        color: Color,
        max_pixels: u64,
    ) -> Result<Array> {
        raw::decode_input_image(super::current_request(), name, element, color, max_pixels)
            .map_err(Into::into)
    }
    /// Makes `value` the output `name` of the request being executed, without copying it
    /// through the stage: leave that output out of what `execute` returns (see
    /// [`Request::select_set`](super::Request::select_set)).
    pub fn set_output(name: &str, value: &Array) -> Result<()> {
        raw::set_output(super::current_request(), name, value).map_err(Into::into)
    }
}

::std::thread_local! {
    static CURRENT_REQUEST: ::core::cell::Cell<u32> = const { ::core::cell::Cell::new(0) };
}

/// Index of the request `execute` is working on, within its batch.
fn current_request() -> u32 {
    CURRENT_REQUEST.with(|c| c.get())
}

#[doc(hidden)]
pub fn __set_current_request(index: usize) {
    CURRENT_REQUEST.with(|c| c.set(index as u32));
}

/// Exports a [`Stage`] implementation as the component's `wasmtron:stage/model`.
#[macro_export]
macro_rules! export_stage {
    ($stage:ty) => {
        #[doc(hidden)]
        pub struct __WasmtronStageExport;

        ::std::thread_local! {
            static __WASMTRON_STAGE: ::core::cell::RefCell<::core::option::Option<$stage>> =
                const { ::core::cell::RefCell::new(::core::option::Option::None) };
        }

        impl $crate::bindings::exports::wasmtron::stage::model::Guest for __WasmtronStageExport {
            fn init(
                config_json: ::std::string::String,
                parameters: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
            ) -> ::core::result::Result<(), $crate::WitError> {
                let config = $crate::Config { json: config_json, parameters };
                let stage = <$stage as $crate::Stage>::init(&config).map_err($crate::WitError::from)?;
                __WASMTRON_STAGE.with(|s| *s.borrow_mut() = ::core::option::Option::Some(stage));
                Ok(())
            }

            fn execute(
                requests: ::std::vec::Vec<$crate::Request>,
            ) -> ::std::vec::Vec<::core::result::Result<::std::vec::Vec<$crate::Tensor>, $crate::WitError>> {
                __WASMTRON_STAGE.with(|s| {
                    let mut s = s.borrow_mut();
                    let ::core::option::Option::Some(stage) = s.as_mut() else {
                        return requests
                            .iter()
                            .map(|_| Err($crate::Error::internal("stage used before init").into()))
                            .collect();
                    };
                    let mut results = <$stage as $crate::Stage>::execute_batch(stage, &requests);
                    // One result per request, whatever the stage returned.
                    results.resize_with(requests.len(), || {
                        Err($crate::Error::internal("the stage returned no result for this request"))
                    });
                    results.truncate(requests.len());
                    results
                        .into_iter()
                        .map(|r| r.map_err($crate::WitError::from))
                        .collect()
                })
            }
        }

        $crate::bindings::__export_stage_world!(__WasmtronStageExport with_types_in $crate::bindings);
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_parse_with_defaults_and_name_the_bad_one() {
        let config = Config {
            json: String::new(),
            parameters: vec![("k".into(), " 5 ".into()), ("bad".into(), "five".into())],
        };
        assert_eq!(config.parameter_or("k", 1u32).unwrap(), 5);
        assert_eq!(config.parameter_or("absent", 7u32).unwrap(), 7);
        let err = config.parameter_or("bad", 1u32).unwrap_err();
        assert_eq!(err.code, ErrorCode::InvalidArgument);
        assert!(
            err.message.contains("'bad'") && err.message.contains("five"),
            "{}",
            err.message
        );
    }

    #[test]
    fn scalars_of_optional_inputs_are_read_or_refused_by_name() {
        let request = Request {
            id: String::new(),
            inputs: vec![
                Tensor::from_i32("steps", &[1, 1], &[20]),
                Tensor::from_f64("scale", &[1], &[7.5]),
                Tensor::from_bytes_elements("prompt", &[1, 1], [b"a cat".as_slice()]),
                Tensor::from_i64("pair", &[2], &[1, 2]),
                Tensor::from_bytes_elements("bad", &[1], [[0xff_u8].as_slice()]),
            ],
            requested_outputs: vec![],
            parameters: vec![],
        };
        assert_eq!(request.scalar_i64("steps").unwrap(), Some(20));
        assert_eq!(request.scalar_i64("absent").unwrap(), None);
        assert_eq!(request.scalar_f32("scale").unwrap(), Some(7.5));
        assert_eq!(
            request.scalar_text("prompt").unwrap().as_deref(),
            Some("a cat")
        );
        let err = request.scalar_i64("pair").unwrap_err();
        assert!(
            err.message.contains("'pair' must hold one value"),
            "{}",
            err.message
        );
        assert!(request
            .scalar_f32("steps")
            .unwrap_err()
            .message
            .contains("'steps'"));
        assert!(request
            .scalar_text("bad")
            .unwrap_err()
            .message
            .contains("UTF-8"));
    }

    #[test]
    fn numeric_tensors_are_little_endian_and_round_trip() {
        let t = Tensor::from_f32("x", &[1, 2], &[1.0, -2.5]);
        assert_eq!(t.datatype, Datatype::Fp32);
        assert_eq!(t.data, [0, 0, 128, 63, 0, 0, 32, 192]);
        assert_eq!(t.to_f32().unwrap(), [1.0, -2.5]);
        let t = Tensor::from_i64("y", &[3], &[1, -1, i64::MAX]);
        assert_eq!(&t.data[..9], [1, 0, 0, 0, 0, 0, 0, 0, 255]);
        assert_eq!(t.to_i64().unwrap(), [1, -1, i64::MAX]);
        assert!(t.to_f32().is_err());
    }
}
