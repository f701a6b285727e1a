// {name}: OUTPUT0 = softmax(INPUT0 / temperature) over the last axis.
//
// Built by `wasmtron stage build` (componentize-c bindings, clang-19 for wasm32-wasi,
// componentize-c component). The guide: docs/stages.md, "Writing a stage in C". Ownership follows
// wit-bindgen's C rules: an export owns its arguments and frees them; what it returns is
// malloc'd and freed after the host copied it.
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
      set_error(err, "parameter 'temperature' must be greater than 0");
      ok = false;
    }
  }
  stage_string_free(config_json);
  stage_list_tuple2_string_string_free(parameters);
  return ok;
}

static bool softmax(const exports_wasmtron_stage_model_request_t *request,
                    exports_wasmtron_stage_model_list_tensor_t *out,
                    exports_wasmtron_stage_model_error_t *err) {
  const wasmtron_stage_types_tensor_t *input = NULL;
  for (size_t i = 0; i < request->inputs.len; i++)
    if (string_equals(&request->inputs.ptr[i].name, "INPUT0")) input = &request->inputs.ptr[i];
  if (input == NULL || input->shape.len == 0) {
    set_error(err, "INPUT0 must be an FP32 tensor with at least one dimension");
    return false;
  }
  size_t classes = (size_t)input->shape.ptr[input->shape.len - 1];
  size_t count = input->data.len / sizeof(float);
  float *x = malloc(count * sizeof(float) + 1);
  memcpy(x, input->data.ptr, count * sizeof(float));  // wasm is little-endian, like the wire
  for (size_t row = 0; classes > 0 && row < count / classes; row++) {
    float *r = x + row * classes;
    float max = -INFINITY;
    for (size_t c = 0; c < classes; c++) r[c] = r[c] / temperature, max = r[c] > max ? r[c] : max;
    float sum = 0.0f;
    for (size_t c = 0; c < classes; c++) sum += (r[c] = expf(r[c] - max));
    for (size_t c = 0; c < classes; c++) r[c] /= sum;
  }
  wasmtron_stage_types_tensor_t *tensor = calloc(1, sizeof *tensor);
  stage_string_dup(&tensor->name, "OUTPUT0");
  tensor->datatype = WASMTRON_STAGE_TYPES_DATATYPE_FP32;
  tensor->shape.len = input->shape.len;
  tensor->shape.ptr = malloc(input->shape.len * sizeof(int64_t));
  memcpy(tensor->shape.ptr, input->shape.ptr, input->shape.len * sizeof(int64_t));
  tensor->data.ptr = (uint8_t *)x;
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
