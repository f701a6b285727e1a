"""The component's entry module (`componentize-py ... componentize wasmtron_stage.component`):
imports the stage author's `app` module, whose decorators register the stage, and exports
`Model`."""
import app  # noqa: F401  (registers the @stage function)

from wasmtron_stage import Model  # noqa: F401
