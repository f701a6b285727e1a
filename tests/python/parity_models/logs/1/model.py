import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Echoes X and logs at each of Triton's levels, both ways pb_utils offers."""

    def initialize(self, args):
        pb_utils.Logger.log("logs: initialize at INFO", pb_utils.Logger.INFO)

    def execute(self, requests):
        logger = pb_utils.Logger
        logger.log_info("logs: execute at INFO")
        logger.log_warn("logs: execute at WARNING")
        logger.log_error("logs: execute at ERROR")
        logger.log_verbose("logs: execute at VERBOSE")
        logger.log("logs: execute at ERROR by level", logger.ERROR)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
