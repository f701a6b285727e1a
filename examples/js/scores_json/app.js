// A JSON post-processing stage in JavaScript (componentize-js).
//
// SCORES (FP32 [batch, classes]) -> JSON (BYTES [batch, 1]): one JSON document per row,
//   {"top":[{"label":"cat","index":3,"score":0.9132}, ...]}
// Parameters in config.pbtxt: `labels` (comma-separated class names, default: the index),
// `top_k` (default 3) and `digits` (decimals kept in scores, default 4).
//
// Build: componentize-js app.js --wit ../../../wit --world-name stage -d http fetch-event -o model.wasm
import { log } from "wasmtron:stage/host@0.1.0";

// Read once by `init`; the module lives as long as the instance.
const settings = { name: "scores_json", labels: [], topK: 3, digits: 4 };

// A failed request is `{ tag: "err", val: { code, message } }` inside execute's result list.
const invalid = (message) => ({ tag: "err", val: { code: "invalid-argument", message } });

function positiveInt(params, key, fallback) {
  if (!params.has(key)) return fallback;
  const value = Number(params.get(key));
  if (!Number.isInteger(value) || value < 0) {
    // Thrown from a function returning `result<_, error>`, this becomes its `err`.
    throw { code: "invalid-argument", message: `parameter '${key}' must be a non-negative integer` };
  }
  return value;
}

// BYTES tensors hold each element as a 4-byte little-endian length followed by the bytes.
function packBytes(strings) {
  const encoded = strings.map((s) => new TextEncoder().encode(s));
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

function summarise(scores) {
  const scale = 10 ** settings.digits;
  return scores
    .map((score, index) => ({ index, score }))
    .sort((a, b) => b.score - a.score || a.index - b.index)
    .slice(0, settings.topK)
    .map(({ index, score }) => ({
      label: settings.labels[index] ?? String(index),
      index,
      score: Math.round(score * scale) / scale,
    }));
}

function executeOne(request) {
  const input = request.inputs.find((t) => t.name === "SCORES");
  if (!input) return invalid("missing input 'SCORES'");
  if (input.datatype !== "fp32") return invalid(`SCORES must be FP32, got ${input.datatype}`);
  const shape = Array.from(input.shape, Number);
  const rows = shape.length > 1 ? shape[0] : 1;
  const classes = shape[shape.length - 1] ?? 0;
  const view = new DataView(input.data.buffer, input.data.byteOffset, input.data.byteLength);
  const documents = [];
  for (let row = 0; row < rows; row++) {
    const scores = [];
    for (let c = 0; c < classes; c++) scores.push(view.getFloat32((row * classes + c) * 4, true));
    documents.push(JSON.stringify({ top: summarise(scores) }));
  }
  const outShape = shape.length > 1 ? [BigInt(rows), 1n] : [1n];
  return {
    tag: "ok",
    val: [{ name: "JSON", datatype: "bytes", shape: BigInt64Array.from(outShape), data: packBytes(documents) }],
  };
}

export const model = {
  init(configJson, parameters) {
    const params = new Map(parameters);
    settings.name = JSON.parse(configJson).name ?? settings.name;
    settings.labels = params.has("labels") ? params.get("labels").split(",") : [];
    settings.topK = positiveInt(params, "top_k", 3);
    settings.digits = positiveInt(params, "digits", 4);
    log("info", `${settings.name}: top ${settings.topK} of ${settings.labels.length} labels`);
  },

  execute(requests) {
    return requests.map(executeOne);
  },
};
