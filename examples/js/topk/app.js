// The JavaScript twin of examples/rust/topk, on the host's tensor operations: classifier scores
// (SCORES, FP32 [batch, C]) -> the top-k classes per row as Triton's classification extension
// formats them ("score:index:label" in LABELS, BYTES [batch, k]) and as indices (INDICES,
// INT64 [batch, k]). Parameters in config.pbtxt: `k` (default 1) and `labels` (comma-separated).
//
// Build: wasmtron stage build examples/js/topk (or `make stages`).
import { stage, ops, StageError, Tensor } from "../../../guest-sdk/js/wasmtron-stage.js";

const settings = { k: 1, labels: [] };

export const model = stage({
  setup(config) {
    settings.k = config.intParameter("k", 1);
    if (settings.k < 1) throw StageError.invalid("parameter 'k' must be a positive integer");
    const labels = config.parameter("labels");
    settings.labels = labels === undefined ? [] : labels.split(",").map((l) => l.trim());
  },

  infer({ SCORES }) {
    if (SCORES.shape.length !== 2) throw StageError.invalid("SCORES must be [batch, classes]");
    const [rows, classes] = SCORES.shape;
    const k = Math.min(settings.k, classes);
    const { values, indices } = ops.topK(SCORES, k);
    const scores = Tensor.fromArray("v", values).values();
    const picked = Tensor.fromArray("INDICES", indices);
    const index = picked.values();
    const labels = new Array(rows * k);
    for (let i = 0; i < rows * k; i++) {
      const c = Number(index[i]);
      labels[i] = `${scores[i].toFixed(6)}:${c}:${settings.labels[c] ?? ""}`;
    }
    return { LABELS: Tensor.fromStrings("LABELS", [rows, k], labels), INDICES: picked };
  },
});
