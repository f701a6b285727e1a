// {name}: OUTPUT0 = softmax(INPUT0 / temperature) over the last axis.
//
// Built by `wasmtron stage build` with componentize-js; the SDK is the file imported below,
// which the build writes. The guide: docs/stages.md, "Writing a stage in JavaScript".
import { stage, ops, StageError } from "../.wasmtron/js/wasmtron-stage.js";

const settings = { temperature: 1 };

export const model = stage({
  setup(config) {
    settings.temperature = Number(config.parameter("temperature", "1"));
    if (!(settings.temperature > 0)) throw StageError.invalid("parameter 'temperature' must be greater than 0");
  },

  infer({ INPUT0 }) {
    const scaled = ops.normalize(INPUT0, [0], [settings.temperature]);
    return { OUTPUT0: ops.softmax(scaled, -1) };
  },
});
