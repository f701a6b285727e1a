import json

import sender_steps


class TritonPythonModel:
    """Answers through its response sender, by returning, or both, as each request asks."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = config.get("model_transaction_policy", {}).get("decoupled", False)

    def execute(self, requests):
        return sender_steps.run(requests, self.decoupled)
