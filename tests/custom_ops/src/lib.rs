//! A custom operator library as ONNX Runtime loads them (`RegisterCustomOpsLibrary`, Triton's
//! `model_operations { op_library_filename }`): the domain `wasmtron.test` with one operator,
//! `Double`, that writes `2 * x` for an FP32 tensor of any shape. Built by `make` for the
//! tests; it is native code run inside the server, which is why the server loads such
//! libraries only when told to (`--allow-custom-op-libraries`).

#![allow(non_snake_case)]

use std::{
    ffi::{c_char, c_int, c_void},
    ptr::{null, null_mut},
};

use ort_sys::{
    ONNXTensorElementDataType, OrtApi, OrtApiBase, OrtCustomOp, OrtCustomOpDomain,
    OrtCustomOpInputOutputCharacteristic, OrtKernelContext, OrtKernelInfo, OrtMemType,
    OrtSessionOptions, OrtStatus, OrtStatusPtr, OrtTensorTypeAndShapeInfo, OrtValue,
};

const DOMAIN: &[u8] = b"wasmtron.test\0";
const NAME: &[u8] = b"Double\0";
/// The oldest C API this library needs (custom operators have not changed since).
const API_VERSION: u32 = 17;

struct Kernel {
    api: *const OrtApi,
}

unsafe extern "system" fn create_kernel(
    _: *const OrtCustomOp,
    api: *const OrtApi,
    _: *const OrtKernelInfo,
) -> *mut c_void {
    Box::into_raw(Box::new(Kernel { api })).cast()
}

unsafe extern "system" fn name(_: *const OrtCustomOp) -> *const c_char {
    NAME.as_ptr().cast()
}

unsafe extern "system" fn provider(_: *const OrtCustomOp) -> *const c_char {
    null() // the CPU
}

unsafe extern "system" fn float(_: *const OrtCustomOp, _: usize) -> ONNXTensorElementDataType {
    ONNXTensorElementDataType::ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT
}

unsafe extern "system" fn one(_: *const OrtCustomOp) -> usize {
    1
}

/// Whether a C API call failed (its status is released).
unsafe fn failed(api: &OrtApi, status: OrtStatusPtr) -> bool {
    if status.0.is_null() {
        false
    } else {
        (api.ReleaseStatus)(status.0);
        true
    }
}

unsafe extern "system" fn compute(kernel: *mut c_void, context: *mut OrtKernelContext) {
    let api = &*(*(kernel as *const Kernel)).api;
    let mut input: *const OrtValue = null();
    if failed(api, (api.KernelContext_GetInput)(context, 0, &mut input)) || input.is_null() {
        return;
    }
    let mut info: *mut OrtTensorTypeAndShapeInfo = null_mut();
    if failed(api, (api.GetTensorTypeAndShape)(input, &mut info)) {
        return;
    }
    let (mut rank, mut count) = (0usize, 0usize);
    let mut ok = !failed(api, (api.GetDimensionsCount)(info, &mut rank));
    let mut dims = vec![0i64; rank];
    ok = ok && !failed(api, (api.GetDimensions)(info, dims.as_mut_ptr(), rank));
    ok = ok && !failed(api, (api.GetTensorShapeElementCount)(info, &mut count));
    (api.ReleaseTensorTypeAndShapeInfo)(info);
    if !ok {
        return;
    }
    let mut output: *mut OrtValue = null_mut();
    if failed(
        api,
        (api.KernelContext_GetOutput)(context, 0, dims.as_ptr(), rank, &mut output),
    ) {
        return;
    }
    let (mut x, mut y): (*mut c_void, *mut c_void) = (null_mut(), null_mut());
    if failed(api, (api.GetTensorMutableData)(input.cast_mut(), &mut x))
        || failed(api, (api.GetTensorMutableData)(output, &mut y))
        || (count > 0 && (x.is_null() || y.is_null()))
    {
        return;
    }
    if count == 0 {
        return;
    }
    let x = std::slice::from_raw_parts(x as *const f32, count);
    let y = std::slice::from_raw_parts_mut(y as *mut f32, count);
    for (out, v) in y.iter_mut().zip(x) {
        *out = 2.0 * v;
    }
}

unsafe extern "system" fn required(
    _: *const OrtCustomOp,
    _: usize,
) -> OrtCustomOpInputOutputCharacteristic {
    OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED
}

unsafe extern "system" fn default_memory(_: *const OrtCustomOp, _: usize) -> OrtMemType {
    OrtMemType::OrtMemTypeDefault
}

unsafe extern "system" fn arity(_: *const OrtCustomOp) -> c_int {
    1
}

unsafe extern "system" fn first_version(_: *const OrtCustomOp) -> c_int {
    1
}

unsafe extern "system" fn last_version(_: *const OrtCustomOp) -> c_int {
    c_int::MAX
}

unsafe extern "system" fn destroy(kernel: *mut c_void) {
    drop(Box::from_raw(kernel as *mut Kernel));
}

/// The operator, as the C API of version [`API_VERSION`] describes one (ONNX Runtime reads
/// every field up to that version's; the `V2` kernel entry points and shape inference are
/// optional).
static DOUBLE: OrtCustomOp = OrtCustomOp {
    version: API_VERSION,
    CreateKernel: Some(create_kernel),
    GetName: Some(name),
    GetExecutionProviderType: Some(provider),
    GetInputType: Some(float),
    GetInputTypeCount: Some(one),
    GetOutputType: Some(float),
    GetOutputTypeCount: Some(one),
    KernelCompute: Some(compute),
    KernelDestroy: Some(destroy),
    GetInputCharacteristic: Some(required),
    GetOutputCharacteristic: Some(required),
    GetInputMemoryType: Some(default_memory),
    GetVariadicInputMinArity: Some(arity),
    GetVariadicInputHomogeneity: Some(arity),
    GetVariadicOutputMinArity: Some(arity),
    GetVariadicOutputHomogeneity: Some(arity),
    CreateKernelV2: None,
    KernelComputeV2: None,
    InferOutputShapeFn: None,
    GetStartVersion: Some(first_version),
    GetEndVersion: Some(last_version),
};

/// The entry point ONNX Runtime calls when the library is registered with a session.
///
/// # Safety
/// Called by ONNX Runtime with valid session options and its API base.
#[no_mangle]
pub unsafe extern "C" fn RegisterCustomOps(
    options: *mut OrtSessionOptions,
    base: *const OrtApiBase,
) -> *mut OrtStatus {
    let api = ((*base).GetApi)(API_VERSION);
    if api.is_null() {
        return null_mut();
    }
    let api = &*api;
    let mut domain: *mut OrtCustomOpDomain = null_mut();
    let status = (api.CreateCustomOpDomain)(DOMAIN.as_ptr().cast(), &mut domain);
    if !status.0.is_null() {
        return status.0;
    }
    // The domain lives as long as the process: sessions built later still use it.
    let status = (api.CustomOpDomain_Add)(domain, &DOUBLE);
    if !status.0.is_null() {
        return status.0;
    }
    (api.AddCustomOpDomain)(options, domain).0
}
