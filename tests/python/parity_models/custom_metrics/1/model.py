import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Echoes X and counts, in a custom metric family, the rows and nanoseconds it served."""

    def initialize(self, args):
        self.family = pb_utils.MetricFamily(
            name="parity_rows_served", description="rows this model answered",
            kind=pb_utils.MetricFamily.COUNTER)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.rows = self.family.Metric(labels=labels)
        self.busy = pb_utils.MetricFamily(
            name="parity_busy_ns", description="time in execute",
            kind=pb_utils.MetricFamily.GAUGE).Metric(labels=labels)

    def execute(self, requests):
        started = time.perf_counter_ns()
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            self.rows.increment(x.shape[0])
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        self.busy.set(time.perf_counter_ns() - started)
        return out
