// Write Wasmtron stages in JavaScript (componentize-js).
//
// A stage is an object with an `infer(inputs, context)` function from input tensors to output
// tensors, in PyTriton's spirit:
//
//   import { stage, ops } from "./wasmtron-stage.js";
//   export const model = stage({
//     infer({ SCORES }) {
//       const { values, indices } = ops.topK(SCORES, 5);
//       return { INDICES: indices };
//     },
//   });
//
// `infer` gets one request's inputs by name (`Tensor`s) and returns an object of outputs
// (`Tensor`s or host arrays); `batch: true` gives it every request of a dynamic batch at once,
// joined along the first axis. `setup(config)` runs once per instance. Host arrays made during
// a request are released when it ends: keep data across requests as Tensors, or make the
// arrays in `setup`. Import this file with a
// relative path: componentize-js bundles relative imports. Host tensor operations (`ops`) run
// natively in the server, so per-element work costs what compiled Rust costs.
import { infer as hostInfer, log as hostLog, respond as hostRespond } from "wasmtron:stage/host@0.1.1";
import * as hostOps from "wasmtron:stage/ops@0.1.1";

const FORMATS = {
  BOOL: [Uint8Array, 1], UINT8: [Uint8Array, 1], UINT16: [Uint16Array, 2], UINT32: [Uint32Array, 4],
  UINT64: [BigUint64Array, 8], INT8: [Int8Array, 1], INT16: [Int16Array, 2], INT32: [Int32Array, 4],
  INT64: [BigInt64Array, 8], FP16: [null, 2], FP32: [Float32Array, 4], FP64: [Float64Array, 8],
  BF16: [null, 2], BYTES: [null, 0],
};

function dtypeName(dtype) {
  if (dtype in FORMATS) return dtype;
  let name = String(dtype).toUpperCase();
  if (name.startsWith("TYPE_")) name = name.slice(5);
  if (name === "STRING") name = "BYTES";
  if (!(name in FORMATS)) throw new TypeError(`unknown datatype ${dtype}; one of ${Object.keys(FORMATS).join(", ")}`);
  return name;
}

const count = (shape) => shape.reduce((n, d) => n * d, 1);

// WIT datatype names (lower case) to Triton's, looked up rather than computed: StarlingMonkey
// interprets, so per-request string work shows in every call.
const FROM_WIT = Object.fromEntries(Object.keys(FORMATS).map((k) => [k.toLowerCase(), k]));
const TO_WIT = Object.fromEntries(Object.keys(FORMATS).map((k) => [k, k.toLowerCase()]));

/** A failure reported to the client; `code` maps to the HTTP status / gRPC code. */
export class StageError extends Error {
  constructor(message, code = "internal") {
    super(message);
    this.code = code;
  }
  static invalid(message) { return new StageError(message, "invalid-argument"); }
  static notFound(message) { return new StageError(message, "not-found"); }
  static unavailable(message) { return new StageError(message, "unavailable"); }
  static unsupported(message) { return new StageError(message, "unsupported"); }
}

// A result<_, error> from the host arrives as a thrown value carrying the error record.
function hostError(e) {
  const value = e && e.payload !== undefined ? e.payload : e;
  if (value && typeof value.code === "string" && typeof value.message === "string") {
    return new StageError(value.message, value.code);
  }
  return e;
}

// Host arrays made while a request runs. componentize-js never releases a resource whose
// object is collected, so the SDK releases these when the request ends (their bytes count
// against the stage's memory limit, and the store's handles are finite). Arrays made in
// `setup` are kept for the instance's life.
let scope = null;

function track(value) {
  if (scope !== null && value && typeof value === "object") {
    if (typeof value[Symbol.dispose] === "function") scope.push(value);
    else if (value.values && value.indices) scope.push(value.values, value.indices);
  }
  return value;
}

function releaseScope() {
  const arrays = scope || [];
  scope = null;
  for (const a of arrays) {
    try {
      a[Symbol.dispose]();
    } catch {
      // Already released by the stage itself.
    }
  }
}

function call(fn, ...args) {
  try {
    return track(fn(...args));
  } catch (e) {
    throw hostError(e);
  }
}

/** BYTES tensor data: each element as a 4-byte little-endian length, then its bytes. */
export function packStrings(items) {
  const encoded = items.map((s) => (typeof s === "string" ? new TextEncoder().encode(s) : s));
  const out = new Uint8Array(encoded.reduce((n, e) => n + 4 + e.length, 0));
  const view = new DataView(out.buffer);
  let offset = 0;
  for (const e of encoded) {
    view.setUint32(offset, e.length, true);
    out.set(e, offset + 4);
    offset += 4 + e.length;
  }
  return out;
}

/** A named tensor: `dtype` is Triton's name ("FP32"), `data` the little-endian bytes. */
export class Tensor {
  constructor(name, dtype, shape, data) {
    this.name = name;
    this.dtype = dtypeName(dtype);
    this.shape = Array.from(shape, Number);
    this.data = data instanceof Uint8Array ? data : new Uint8Array(data);
    // [request index, input name] for a request's input: host operations then read it from
    // the request instead of receiving its bytes again.
    this.origin = undefined;
  }

  /** A tensor of `dtype` from a flat array of numbers (BigInts for 64-bit integers). */
  static fromValues(name, dtype, shape, values) {
    const dt = dtypeName(dtype);
    if (dt === "BYTES") return Tensor.fromStrings(name, shape, values);
    const [Typed] = FORMATS[dt];
    if (!Typed) throw new TypeError(`${dt} tensors cannot be built from numbers`);
    if (values.length !== count(shape)) {
      throw new RangeError(`tensor '${name}': shape [${shape}] needs ${count(shape)} values, got ${values.length}`);
    }
    const typed = Typed.from(values);
    return new Tensor(name, dt, shape, new Uint8Array(typed.buffer));
  }

  /** A BYTES tensor; strings are UTF-8 encoded. */
  static fromStrings(name, shape, items) {
    if (items.length !== count(shape)) {
      throw new RangeError(`tensor '${name}': shape [${shape}] needs ${count(shape)} strings, got ${items.length}`);
    }
    return new Tensor(name, "BYTES", shape, packStrings(items));
  }

  /** A tensor holding a copy of a host array. */
  static fromArray(name, array) {
    return Tensor.fromWit(array.toTensor(name));
  }

  /** The elements as a typed array (Float32Array for FP32, BigInt64Array for INT64, ...). */
  values() {
    const [Typed, size] = FORMATS[this.dtype];
    if (!Typed) throw new TypeError(`tensor '${this.name}': ${this.dtype} has no typed array`);
    const { buffer, byteOffset, byteLength } = this.data;
    if (byteOffset % size === 0) return new Typed(buffer, byteOffset, byteLength / size);
    return new Typed(this.data.slice().buffer);
  }

  /** The elements of a BYTES tensor, as strings (UTF-8) or, with `raw`, as Uint8Arrays. */
  strings(raw = false) {
    if (this.dtype !== "BYTES") throw new TypeError(`tensor '${this.name}' is ${this.dtype}, not BYTES`);
    const view = new DataView(this.data.buffer, this.data.byteOffset, this.data.byteLength);
    const items = [];
    const decoder = new TextDecoder();
    for (let offset = 0; offset < this.data.length;) {
      const length = view.getUint32(offset, true);
      const item = this.data.subarray(offset + 4, offset + 4 + length);
      items.push(raw ? item : decoder.decode(item));
      offset += 4 + length;
    }
    return items;
  }

  /** Number of elements. */
  count() {
    return count(this.shape);
  }

  /** A host array holding the elements, for `ops` (a request's input is read from the request). */
  toArray() {
    if (this.origin) return call(hostOps.input, ...this.origin);
    return call(hostOps.Array.fromTensor, this.toWit());
  }

  toWit(name = this.name) {
    return { name, datatype: TO_WIT[this.dtype], shape: BigInt64Array.from(this.shape, BigInt), data: this.data };
  }

  static fromWit(t) {
    return new Tensor(t.name, FROM_WIT[t.datatype], Array.from(t.shape, Number), t.data);
  }
}

const asArray = (value) => (value instanceof Tensor ? value.toArray() : value);

/** Host tensor operations; they take host arrays or Tensors and return host arrays. */
export const ops = {
  /** A host array from raw little-endian bytes. */
  fromData: (dtype, shape, data) => call(hostOps.Array.fromData, dtypeName(dtype).toLowerCase(), BigInt64Array.from(shape, BigInt), data),
  /** PNG/JPEG bytes, or element `element` of a BYTES tensor, as uint8 [height, width, channels]. */
  decodeImage: (source, { color = "rgb", maxPixels = 0, element = 0 } = {}) => {
    if (source instanceof Tensor) {
      if (source.origin) return call(hostOps.decodeInputImage, source.origin[0], source.origin[1], element, color, BigInt(maxPixels));
      source = source.strings(true)[element];
    }
    return call(hostOps.decodeImage, source, color, BigInt(maxPixels));
  },
  convertColor: (image, from, to) => call(hostOps.convertColor, asArray(image), from, to),
  resize: (image, height, width, filter = "bilinear") => call(hostOps.resize, asArray(image), height, width, filter),
  resizeShorterSide: (image, size, filter = "bilinear") => call(hostOps.resizeShorterSide, asArray(image), size, filter),
  letterbox: (image, height, width, filter = "bilinear", pad = 114) => call(hostOps.letterbox, asArray(image), height, width, filter, pad),
  crop: (image, top, left, height, width) => call(hostOps.crop, asArray(image), top, left, height, width),
  centerCrop: (image, height, width) => call(hostOps.centerCrop, asArray(image), height, width),
  transpose: (a, axes) => call(hostOps.transpose, asArray(a), Uint32Array.from(axes)),
  cast: (a, dtype) => call(hostOps.cast, asArray(a), dtypeName(dtype).toLowerCase()),
  normalize: (a, mean, std, scale = 1, axis = -1) => call(hostOps.normalize, asArray(a), scale, Float32Array.from(mean), Float32Array.from(std), axis),
  softmax: (a, axis = -1) => call(hostOps.softmax, asArray(a), axis),
  sigmoid: (a) => call(hostOps.sigmoid, asArray(a)),
  argmax: (a, axis = -1) => call(hostOps.argmax, asArray(a), axis),
  /** `{ values, indices }` of the k largest along `axis`, largest first. */
  topK: (a, k, axis = -1) => call(hostOps.topK, asArray(a), k, axis),
  nms: (boxes, scores, { iouThreshold = 0.5, scoreThreshold = 0, maxOutputs = 0, format = "corners" } = {}) =>
    call(hostOps.nms, asArray(boxes), asArray(scores), format, iouThreshold, scoreThreshold, maxOutputs),
  stack: (arrays) => call(hostOps.stack, arrays.map(asArray)),
  reshape: (a, shape) => call((x) => x.reshape(BigInt64Array.from(shape, BigInt)), asArray(a)),
};

/** Lines in the server log, tagged with the model name. */
export const log = {
  error: (m) => hostLog("error", String(m)),
  warn: (m) => hostLog("warn", String(m)),
  info: (m) => hostLog("info", String(m)),
  debug: (m) => hostLog("debug", String(m)),
};

/** The model configuration, read once per instance. */
export class Config {
  constructor(configJson, parameters) {
    this.json = configJson ? JSON.parse(configJson) : {};
    this.parameters = new Map(parameters);
    this.name = this.json.name ?? "";
    this.maxBatchSize = Number(this.json.max_batch_size ?? 0);
  }

  /** A config.pbtxt parameter as a string, or `fallback`. */
  parameter(key, fallback = undefined) {
    return this.parameters.has(key) ? this.parameters.get(key).trim() : fallback;
  }

  /** An integer parameter; a bad value is an invalid-argument error naming it. */
  intParameter(key, fallback) {
    if (!this.parameters.has(key)) return fallback;
    const value = Number(this.parameters.get(key));
    if (!Number.isInteger(value)) throw StageError.invalid(`parameter '${key}' must be an integer, got "${this.parameters.get(key)}"`);
    return value;
  }
}

function toWitTensor(name, value) {
  if (value instanceof Tensor) return value.toWit(name);
  if (value && typeof value.toTensor === "function") return value.toTensor(name);
  throw new TypeError(`output '${name}' must be a Tensor or a host array`);
}

// The outputs to return, in the requested order. With the request's `index`, host arrays
// become outputs through `ops.set-output` and never pass through this stage's memory.
function outputsFor(produced, wanted, index = undefined) {
  if (produced === undefined || produced === null) return [];
  const returned = [];
  for (const name of wanted) {
    if (!(name in produced)) throw new StageError(`the stage function returned no output '${name}'`);
    const value = produced[name];
    if (index !== undefined && !(value instanceof Tensor) && value && typeof value.toTensor === "function") {
      call(hostOps.setOutput, index, name, value);
    } else {
      returned.push(toWitTensor(name, value));
    }
  }
  return returned;
}

function witError(e) {
  if (e instanceof StageError) return { code: e.code, message: e.message };
  const host = hostError(e);
  if (host instanceof StageError) return { code: host.code, message: host.message };
  return { code: "internal", message: `${e && e.name ? e.name : "Error"}: ${e && e.message ? e.message : String(e)}` };
}

function contextOf(index, request) {
  return {
    index,
    id: request.id,
    requestedOutputs: request.requestedOutputs,
    parameters: Object.fromEntries(request.parameters.map((p) => [p.key, p.value.val])),
    /** Decoupled models: sends one response to this request now. */
    respond(outputs) {
      call(hostRespond, index, outputsFor(outputs, request.requestedOutputs));
    },
  };
}

function joinRows(name, tensors) {
  const first = tensors[0];
  const rest = first.shape.slice(1).join(",");
  if (tensors.some((t) => t.dtype !== first.dtype || t.shape.slice(1).join(",") !== rest)) {
    throw StageError.invalid(`input '${name}': requests of one batch differ beyond the first axis`);
  }
  const counts = tensors.map((t) => t.shape[0]);
  const data = new Uint8Array(tensors.reduce((n, t) => n + t.data.length, 0));
  let at = 0;
  for (const t of tensors) {
    data.set(t.data, at);
    at += t.data.length;
  }
  return [new Tensor(name, first.dtype, [counts.reduce((a, b) => a + b, 0), ...first.shape.slice(1)], data), counts];
}

function splitRows(tensor, counts) {
  const rows = tensor.shape[0];
  const rest = tensor.shape.slice(1);
  if (counts.reduce((a, b) => a + b, 0) !== rows) throw new StageError(`output '${tensor.name}' has ${rows} rows for a batch of ${counts.reduce((a, b) => a + b, 0)}`);
  if (tensor.dtype === "BYTES") {
    const items = tensor.strings(true);
    const per = count(rest);
    let at = 0;
    return counts.map((n) => {
      const piece = Tensor.fromStrings(tensor.name, [n, ...rest], items.slice(at, at + n * per));
      at += n * per;
      return piece;
    });
  }
  const rowBytes = rows ? tensor.data.length / rows : 0;
  let at = 0;
  return counts.map((n) => {
    const piece = new Tensor(tensor.name, tensor.dtype, [n, ...rest], tensor.data.subarray(at, at + n * rowBytes));
    at += n * rowBytes;
    return piece;
  });
}

/**
 * Defines the stage; export the result as `model`. `definition`: `infer(inputs, context)`
 * (required), `setup(config)` (optional), `batch` (optional, default false).
 */
export function stage(definition) {
  if (typeof definition.infer !== "function") throw new TypeError("stage({ infer }) needs an infer function");
  return {
    init(configJson, parameters) {
      const config = new Config(configJson, parameters);
      try {
        if (definition.setup) definition.setup(config);
      } catch (e) {
        throw witError(e);
      }
    },

    execute(requests) {
      if (definition.batch && requests.length > 0) {
        scope = [];
        try {
          const inputs = {};
          let counts = [];
          for (const { name } of requests[0].inputs) {
            const tensors = requests.map((r) => {
              const t = r.inputs.find((x) => x.name === name);
              if (!t) throw StageError.invalid(`input '${name}' is missing from a request of the batch`);
              return Tensor.fromWit(t);
            });
            [inputs[name], counts] = joinRows(name, tensors);
          }
          const produced = definition.infer(inputs, contextOf(0, requests[0]));
          const pieces = {};
          for (const name of requests[0].requestedOutputs) {
            if (!(name in produced)) throw new StageError(`the stage function returned no output '${name}'`);
            const value = produced[name];
            pieces[name] = splitRows(value instanceof Tensor ? value : Tensor.fromWit(toWitTensor(name, value)), counts);
          }
          return requests.map((r, i) => ({ tag: "ok", val: r.requestedOutputs.map((n) => pieces[n][i].toWit(n)) }));
        } catch (e) {
          const err = witError(e);
          return requests.map(() => ({ tag: "err", val: err }));
        } finally {
          releaseScope();
        }
      }
      return requests.map((request, index) => {
        scope = [];
        try {
          const inputs = {};
          for (const t of request.inputs) {
            inputs[t.name] = Tensor.fromWit(t);
            inputs[t.name].origin = [index, t.name];
          }
          // The context only for functions that take it (building it costs in an interpreter).
          const context = definition.infer.length > 1 ? contextOf(index, request) : undefined;
          const produced = definition.infer(inputs, context);
          return { tag: "ok", val: outputsFor(produced, request.requestedOutputs, index) };
        } catch (e) {
          return { tag: "err", val: witError(e) };
        } finally {
          releaseScope();
        }
      });
    },
  };
}

/** Runs another model of this server (Triton's BLS); returns its outputs by name. */
export function infer(modelName, inputs, { outputs = [], version = undefined } = {}) {
  const tensors = Object.entries(inputs).map(([name, value]) => toWitTensor(name, value));
  const result = call(hostInfer, modelName, version === undefined ? undefined : BigInt(version), tensors, outputs);
  return Object.fromEntries(result.map((t) => [t.name, Tensor.fromWit(t)]));
}
