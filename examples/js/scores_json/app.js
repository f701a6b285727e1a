// A JSON post-processing stage in JavaScript on the stage SDK (guest-sdk/js): the ranking runs
// as a host tensor operation (top-k), the formatting in JavaScript.
//
// SCORES (FP32 [batch, classes]) -> JSON (BYTES [batch, 1]): one JSON document per row,
//   {"top":[{"label":"cat","index":3,"score":0.9132}, ...]}
// Parameters in config.pbtxt: `labels` (comma-separated class names, default: the index),
// `top_k` (default 3) and `digits` (decimals kept in scores, default 4).
//
// Build: wasmtron stage build examples/js/scores_json (or `make stages`).
import { stage, ops, log, StageError, Tensor } from "../../../guest-sdk/js/wasmtron-stage.js";

// Read once by `setup`; the module lives as long as the instance.
const settings = { labels: [], topK: 3, digits: 4 };

function nonNegative(config, key, fallback) {
  const value = Number(config.parameter(key, String(fallback)));
  if (!Number.isInteger(value) || value < 0) {
    throw StageError.invalid(`parameter '${key}' must be a non-negative integer`);
  }
  return value;
}

export const model = stage({
  setup(config) {
    const labels = config.parameter("labels");
    settings.labels = labels === undefined ? [] : labels.split(",");
    settings.topK = nonNegative(config, "top_k", 3);
    settings.digits = nonNegative(config, "digits", 4);
    log.info(`${config.name || "scores_json"}: top ${settings.topK} of ${settings.labels.length} labels`);
  },

  infer({ SCORES }) {
    if (SCORES.dtype !== "FP32") throw StageError.invalid(`SCORES must be FP32, got ${SCORES.dtype}`);
    const rows = SCORES.shape.length > 1 ? SCORES.shape[0] : 1;
    const classes = SCORES.shape[SCORES.shape.length - 1] ?? 0;
    const k = Math.min(settings.topK, classes);
    const documents = [];
    if (k === 0) {
      for (let row = 0; row < rows; row++) documents.push(JSON.stringify({ top: [] }));
    } else {
      const { values, indices } = ops.topK(ops.reshape(SCORES, [rows, classes]), k);
      const scores = Tensor.fromArray("v", values).values();
      const index = Tensor.fromArray("i", indices).values();
      const scale = 10 ** settings.digits;
      for (let row = 0; row < rows; row++) {
        const top = [];
        for (let r = row * k; r < (row + 1) * k; r++) {
          const i = Number(index[r]);
          top.push({ label: settings.labels[i] ?? String(i), index: i, score: Math.round(scores[r] * scale) / scale });
        }
        documents.push(JSON.stringify({ top }));
      }
    }
    const shape = SCORES.shape.length > 1 ? [rows, 1] : [1];
    return { JSON: Tensor.fromStrings("JSON", shape, documents) };
  },
});
