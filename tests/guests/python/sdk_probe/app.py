"""Test stage for the Python SDK: a `@batch` function (the batch's rows joined, the outputs
split back), errors raised with codes, `infer()` into another model, `context()`.

X (FP32 [batch, n]) -> ROW_SUM (FP32 [batch, 1]) and ROWS_SEEN (INT64 [batch, 1]: how many
rows the function saw at once). Request parameter `fail` (an error code) raises StageError
with that code; `call` (a model name) sends X to that model's INPUT0 and returns its OUTPUT0
summed per row instead.
"""
from wasmtron_stage import StageError, Tensor, batch, config, context, infer, log, setup, stage


@setup
def configure(cfg):
    log.info(f"{cfg.name}: max_batch_size {cfg.max_batch_size}")


@stage
@batch
def run(X: Tensor):
    params = context().parameters
    if "fail" in params:
        raise StageError(f"asked to fail with {params['fail']}", code=params["fail"])
    rows, n = X.shape
    if "call" in params:
        X = infer(params["call"], {"INPUT0": X}, ["OUTPUT0"])["OUTPUT0"]
    values = X.view()
    sums = [sum(values[r, c] for c in range(n)) for r in range(rows)]
    return {
        "ROW_SUM": Tensor.from_values("ROW_SUM", "FP32", (rows, 1), sums),
        "ROWS_SEEN": Tensor.from_values("ROWS_SEEN", "INT64", (rows, 1), [rows] * rows),
    }
