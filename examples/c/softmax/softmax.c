// A numeric stage in C: LOGITS (FP32 [batch, classes]) -> PROBS (FP32 [batch, classes]),
// a numerically stable softmax over the last dimension. Parameter in config.pbtxt:
// `temperature` (default 1.0; the logits are divided by it first).
//
// Build (what `make stages` runs):
//   componentize-c bindings --wit wit --world stage --out-dir gen
//   clang-19 --target=wasm32-wasi -mexec-model=reactor -O2 -Igen -o core.wasm \
//     softmax.c gen/stage.c gen/stage_component_type.o
//   componentize-c component core.wasm -o model.wasm
//
// Ownership (wit-bindgen's C rules): an export owns its arguments and frees them; what it
// returns is malloc'd and freed by the generated post-return function after the host copied it.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "stage.h"

static float temperature = 1.0f;

static bool string_equals(const stage_string_t *s, const char *text) {
  return s->len == strlen(text) && memcmp(s->ptr, text, s->len) == 0;
}

static void set_error(exports_wasmtron_stage_model_error_t *err, const char *message) {
  err->code = WASMTRON_STAGE_TYPES_ERROR_CODE_INVALID_ARGUMENT;
  stage_string_dup(&err->message, message);
}

bool exports_wasmtron_stage_model_init(stage_string_t *config_json,
                                       stage_list_tuple2_string_string_t *parameters,
                                       exports_wasmtron_stage_model_error_t *err) {
  bool ok = true;
  for (size_t i = 0; i < parameters->len; i++) {
    stage_tuple2_string_string_t *p = &parameters->ptr[i];
    if (!string_equals(&p->f0, "temperature")) continue;
    char text[64] = {0};
    memcpy(text, p->f1.ptr, p->f1.len < sizeof text - 1 ? p->f1.len : sizeof text - 1);
    char *end = NULL;
    temperature = strtof(text, &end);
    if (end == text || *end != '\0' || !(temperature > 0.0f)) {
      set_error(err, "parameter 'temperature' must be a number greater than 0");
      ok = false;
    }
  }
  stage_string_free(config_json);
  stage_list_tuple2_string_string_free(parameters);
  return ok;
}

// Softmax of one request; returns false with `err` set when the input does not fit.
static bool softmax(const exports_wasmtron_stage_model_request_t *request,
                    exports_wasmtron_stage_model_list_tensor_t *out,
                    exports_wasmtron_stage_model_error_t *err) {
  const wasmtron_stage_types_tensor_t *logits = NULL;
  for (size_t i = 0; i < request->inputs.len; i++)
    if (string_equals(&request->inputs.ptr[i].name, "LOGITS")) logits = &request->inputs.ptr[i];
  if (logits == NULL) {
    set_error(err, "missing input 'LOGITS'");
    return false;
  }
  if (logits->datatype != WASMTRON_STAGE_TYPES_DATATYPE_FP32 || logits->shape.len == 0) {
    set_error(err, "LOGITS must be an FP32 tensor with at least one dimension");
    return false;
  }
  size_t classes = (size_t)logits->shape.ptr[logits->shape.len - 1];
  size_t count = logits->data.len / sizeof(float);
  float *probs = malloc(count * sizeof(float) + 1);
  memcpy(probs, logits->data.ptr, count * sizeof(float));  // wasm is little-endian, like the wire
  for (size_t row = 0; classes > 0 && row < count / classes; row++) {
    float *x = probs + row * classes;
    float max = x[0];
    for (size_t c = 1; c < classes; c++) max = x[c] > max ? x[c] : max;
    float sum = 0.0f;
    for (size_t c = 0; c < classes; c++) {
      x[c] = expf((x[c] - max) / temperature);
      sum += x[c];
    }
    for (size_t c = 0; c < classes; c++) x[c] /= sum;
  }

  wasmtron_stage_types_tensor_t *tensor = calloc(1, sizeof *tensor);
  stage_string_dup(&tensor->name, "PROBS");
  tensor->datatype = WASMTRON_STAGE_TYPES_DATATYPE_FP32;
  tensor->shape.len = logits->shape.len;
  tensor->shape.ptr = malloc(logits->shape.len * sizeof(int64_t));
  memcpy(tensor->shape.ptr, logits->shape.ptr, logits->shape.len * sizeof(int64_t));
  tensor->data.ptr = (uint8_t *)probs;
  tensor->data.len = count * sizeof(float);
  out->ptr = tensor;
  out->len = 1;
  return true;
}

void exports_wasmtron_stage_model_execute(exports_wasmtron_stage_model_list_request_t *requests,
                                          exports_wasmtron_stage_model_list_result_list_tensor_error_t *ret) {
  ret->len = requests->len;
  ret->ptr = calloc(requests->len + 1, sizeof *ret->ptr);
  for (size_t i = 0; i < requests->len; i++) {
    exports_wasmtron_stage_model_result_list_tensor_error_t *result = &ret->ptr[i];
    result->is_err = !softmax(&requests->ptr[i], &result->val.ok, &result->val.err);
  }
  exports_wasmtron_stage_model_list_request_free(requests);
}
