//! `wasmtron:stage/ops` for stages: host arrays live in the store's resource table, their
//! bytes count against the stage's memory cap (`sandbox::limits::MemoryCap`), and no operation starts
//! after the call's deadline. The operations themselves are `runtime::tensor_ops`.

use wasmtime::component::Resource;

use super::{
    bindings::wasmtron::stage::{ops as wit_ops, types as wit},
    from_wit_datatype, from_wit_tensor,
    state::StageState,
    to_wit_datatype, to_wit_error,
};
use crate::{
    error::{Error, Result},
    runtime::tensor_ops::{self as ops, Array, Budget},
};

type Handle = Resource<Array>;
type WitResult<T> = std::result::Result<T, wit::Error>;

fn color(c: wit_ops::Color) -> ops::Color {
    match c {
        wit_ops::Color::Rgb => ops::Color::Rgb,
        wit_ops::Color::Bgr => ops::Color::Bgr,
        wit_ops::Color::Gray => ops::Color::Gray,
    }
}

fn filter(f: wit_ops::Filter) -> ops::Filter {
    match f {
        wit_ops::Filter::Nearest => ops::Filter::Nearest,
        wit_ops::Filter::Bilinear => ops::Filter::Bilinear,
    }
}

impl StageState {
    /// An array the stage passed in.
    fn array(&self, handle: &Handle) -> Result<&Array> {
        self.table
            .get(handle)
            .map_err(|e| Error::invalid(format!("ops: not an array handle: {e}")))
    }

    /// Input `name` of request `index` of the batch being executed.
    fn request_input(&self, op: &str, index: u32, name: &str) -> Result<&crate::tensor::Tensor> {
        let Some(batch) = self.batch_inputs.as_ref() else {
            return Err(Error::invalid(format!(
                "ops.{op}: request inputs are available only during execute"
            )));
        };
        let request = batch.get(index as usize).ok_or_else(|| {
            Error::invalid(format!(
                "ops.{op}: request {index} is not in the batch of {}",
                batch.len()
            ))
        })?;
        request.iter().find(|t| t.name == name).ok_or_else(|| {
            Error::invalid(format!("ops.{op}: request {index} has no input '{name}'"))
        })
    }

    /// Runs one operation within the deadline and the memory cap.
    fn run<T>(&mut self, op: impl FnOnce(&Self, &mut Budget) -> Result<T>) -> Result<T> {
        if self
            .call_deadline
            .is_some_and(|d| std::time::Instant::now() >= d)
        {
            return Err(Error::unavailable(
                "ops: the stage's execution deadline has passed (parameter execution_timeout_ms)",
            ));
        }
        let mut budget = Budget::new(self.limits.available());
        op(self, &mut budget)
    }

    /// Hands an array to the stage, counting its bytes until it is dropped.
    fn hold(&mut self, array: Array) -> Result<Handle> {
        let bytes = array.data.len();
        let handle = self
            .table
            .push(array)
            .map_err(|e| Error::resource_exhausted(format!("ops: too many arrays held: {e}")))?;
        self.limits.held_bytes += bytes;
        Ok(handle)
    }

    fn produce(
        &mut self,
        op: impl FnOnce(&Self, &mut Budget) -> Result<Array>,
    ) -> WitResult<Handle> {
        self.run(op)
            .and_then(|array| self.hold(array))
            .map_err(to_wit_error)
    }
}

impl wit_ops::HostArray for StageState {
    fn from_data(
        &mut self,
        datatype: wit::Datatype,
        shape: Vec<i64>,
        data: Vec<u8>,
    ) -> WitResult<Handle> {
        self.produce(|_, budget| {
            budget.take("array.from-data", data.len())?;
            Array::from_data(from_wit_datatype(datatype), &shape, data)
        })
    }

    fn from_tensor(&mut self, tensor: wit::Tensor) -> WitResult<Handle> {
        let tensor = from_wit_tensor(tensor);
        self.produce(|_, budget| {
            budget.take("array.from-tensor", tensor.data.len())?;
            Array::from_data(tensor.datatype, &tensor.shape, tensor.data.to_vec()).map_err(|e| {
                Error::new(e.code, format!("{} (tensor '{}')", e.message, tensor.name))
            })
        })
    }

    fn datatype(&mut self, handle: Handle) -> wit::Datatype {
        self.array(&handle)
            .map(|a| to_wit_datatype(a.datatype))
            .unwrap_or(wit::Datatype::Uint8)
    }

    fn shape(&mut self, handle: Handle) -> Vec<i64> {
        self.array(&handle)
            .map(Array::shape_i64)
            .unwrap_or_default()
    }

    fn data(&mut self, handle: Handle) -> Vec<u8> {
        self.array(&handle)
            .map(|a| a.data.clone())
            .unwrap_or_default()
    }

    fn to_tensor(&mut self, handle: Handle, name: String) -> wit::Tensor {
        match self.array(&handle) {
            Ok(a) => wit::Tensor {
                name,
                datatype: to_wit_datatype(a.datatype),
                shape: a.shape_i64(),
                data: a.data.clone(),
            },
            Err(_) => wit::Tensor {
                name,
                datatype: wit::Datatype::Uint8,
                shape: vec![0],
                data: Vec::new(),
            },
        }
    }

    fn reshape(&mut self, handle: Handle, shape: Vec<i64>) -> WitResult<Handle> {
        self.produce(|s, budget| ops::reshape(s.array(&handle)?, &shape, budget))
    }

    fn drop(&mut self, handle: Handle) -> wasmtime::Result<()> {
        let array = self.table.delete(handle)?;
        self.limits.held_bytes = self.limits.held_bytes.saturating_sub(array.data.len());
        Ok(())
    }
}

impl wit_ops::Host for StageState {
    fn decode_image(
        &mut self,
        data: Vec<u8>,
        c: wit_ops::Color,
        max_pixels: u64,
    ) -> WitResult<Handle> {
        self.produce(|_, budget| ops::decode_image(&data, color(c), max_pixels, budget))
    }

    fn convert_color(
        &mut self,
        image: Handle,
        from: wit_ops::Color,
        to: wit_ops::Color,
    ) -> WitResult<Handle> {
        self.produce(|s, b| ops::convert_color(s.array(&image)?, color(from), color(to), b))
    }

    fn resize(
        &mut self,
        image: Handle,
        height: u32,
        width: u32,
        f: wit_ops::Filter,
    ) -> WitResult<Handle> {
        self.produce(|s, b| ops::resize(s.array(&image)?, height, width, filter(f), b))
    }

    fn resize_shorter_side(
        &mut self,
        image: Handle,
        size: u32,
        f: wit_ops::Filter,
    ) -> WitResult<Handle> {
        self.produce(|s, b| ops::resize_shorter_side(s.array(&image)?, size, filter(f), b))
    }

    fn letterbox(
        &mut self,
        image: Handle,
        height: u32,
        width: u32,
        f: wit_ops::Filter,
        pad: f32,
    ) -> WitResult<Handle> {
        self.produce(|s, b| ops::letterbox(s.array(&image)?, height, width, filter(f), pad, b))
    }

    fn crop(
        &mut self,
        image: Handle,
        top: u32,
        left: u32,
        height: u32,
        width: u32,
    ) -> WitResult<Handle> {
        self.produce(|s, b| ops::crop(s.array(&image)?, top, left, height, width, b))
    }

    fn center_crop(&mut self, image: Handle, height: u32, width: u32) -> WitResult<Handle> {
        self.produce(|s, b| ops::center_crop(s.array(&image)?, height, width, b))
    }

    fn transpose(&mut self, a: Handle, axes: Vec<u32>) -> WitResult<Handle> {
        self.produce(|s, b| ops::transpose(s.array(&a)?, &axes, b))
    }

    fn cast(&mut self, a: Handle, datatype: wit::Datatype) -> WitResult<Handle> {
        self.produce(|s, b| ops::cast(s.array(&a)?, from_wit_datatype(datatype), b))
    }

    fn normalize(
        &mut self,
        a: Handle,
        scale: f32,
        mean: Vec<f32>,
        std: Vec<f32>,
        axis: i32,
    ) -> WitResult<Handle> {
        self.produce(|s, b| ops::normalize(s.array(&a)?, scale, &mean, &std, axis, b))
    }

    fn softmax(&mut self, a: Handle, axis: i32) -> WitResult<Handle> {
        self.produce(|s, b| ops::softmax(s.array(&a)?, axis, b))
    }

    fn sigmoid(&mut self, a: Handle) -> WitResult<Handle> {
        self.produce(|s, b| ops::sigmoid(s.array(&a)?, b))
    }

    fn argmax(&mut self, a: Handle, axis: i32) -> WitResult<Handle> {
        self.produce(|s, b| ops::argmax(s.array(&a)?, axis, b))
    }

    fn top_k(&mut self, a: Handle, k: u32, axis: i32) -> WitResult<wit_ops::TopKResult> {
        let (values, indices) = self
            .run(|s, b| ops::top_k(s.array(&a)?, k, axis, b))
            .map_err(to_wit_error)?;
        let values = self.hold(values).map_err(to_wit_error)?;
        let indices = self.hold(indices).map_err(to_wit_error)?;
        Ok(wit_ops::TopKResult { values, indices })
    }

    fn nms(
        &mut self,
        boxes: Handle,
        scores: Handle,
        format: wit_ops::BoxFormat,
        iou_threshold: f32,
        score_threshold: f32,
        max_outputs: u32,
    ) -> WitResult<Handle> {
        let format = match format {
            wit_ops::BoxFormat::Corners => ops::BoxFormat::Corners,
            wit_ops::BoxFormat::Center => ops::BoxFormat::Center,
        };
        self.produce(|s, b| {
            ops::nms(
                s.array(&boxes)?,
                s.array(&scores)?,
                format,
                iou_threshold,
                score_threshold,
                max_outputs,
                b,
            )
        })
    }

    fn input(&mut self, request: u32, name: String) -> WitResult<Handle> {
        self.produce(|s, budget| {
            let tensor = s.request_input("input", request, &name)?;
            budget.take("input", tensor.data.len())?;
            Array::from_data(tensor.datatype, &tensor.shape, tensor.data.to_vec())
                .map_err(|e| Error::new(e.code, format!("{} (input '{name}')", e.message)))
        })
    }

    fn decode_input_image(
        &mut self,
        request: u32,
        name: String,
        element: u32,
        c: wit_ops::Color,
        max_pixels: u64,
    ) -> WitResult<Handle> {
        self.produce(|s, budget| {
            let op = "decode-input-image";
            let tensor = s.request_input(op, request, &name)?;
            if tensor.datatype != crate::tensor::DataType::Bytes {
                return Err(Error::invalid(format!(
                    "ops.{op}: input '{name}' is {}, not BYTES",
                    tensor.datatype
                )));
            }
            let data = crate::tensor::bytes_elements(&tensor.data)
                .nth(element as usize)
                .ok_or_else(|| {
                    Error::invalid(format!("ops.{op}: input '{name}' has no element {element}"))
                })?;
            ops::decode_image(data, color(c), max_pixels, budget)
        })
    }

    fn set_output(&mut self, request: u32, name: String, value: Handle) -> WitResult<()> {
        let len = self.batch_inputs.as_ref().map(Vec::len);
        let Some(len) = len else {
            return Err(to_wit_error(Error::invalid(
                "ops.set-output: outputs can be set only during execute",
            )));
        };
        if request as usize >= len {
            return Err(to_wit_error(Error::invalid(format!(
                "ops.set-output: request {request} is not in the batch of {len}"
            ))));
        }
        let tensor = self
            .run(|s, budget| {
                let a = s.array(&value)?;
                budget.take("set-output", a.data.len())?;
                Ok(crate::tensor::Tensor {
                    name,
                    datatype: a.datatype,
                    shape: a.shape_i64(),
                    data: a.data.clone().into(),
                })
            })
            .map_err(to_wit_error)?;
        // Counted like a held array until execute ends.
        self.limits.held_bytes += tensor.data.len();
        self.set_outputs
            .retain(|(r, t)| *r != request || t.name != tensor.name);
        self.set_outputs.push((request, tensor));
        Ok(())
    }

    fn stack(&mut self, arrays: Vec<Handle>) -> WitResult<Handle> {
        self.produce(|s, b| {
            let arrays = arrays
                .iter()
                .map(|h| s.array(h))
                .collect::<Result<Vec<&Array>>>()?;
            ops::stack(&arrays, b)
        })
    }
}
