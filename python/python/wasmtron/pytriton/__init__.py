"""A drop-in for PyTriton (``nvidia-pytriton``): the same modules and names, served by the
wasmtron server in this process instead of a ``tritonserver`` child process. Replace
``pytriton`` with ``wasmtron.pytriton`` in the import lines and nothing else::

    from wasmtron.pytriton.decorators import batch
    from wasmtron.pytriton.model_config import ModelConfig, Tensor
    from wasmtron.pytriton.triton import Triton

Modules: :mod:`.triton` (``Triton``, ``TritonConfig``), :mod:`.model_config` (``ModelConfig``,
``Tensor``, ``DynamicBatcher``, ``QueuePolicy``, ``TimeoutAction``, ``DeviceKind``),
:mod:`.decorators` (``batch``, ``sample``, ``group_by_values``, ``first_value``,
``fill_optionals``), :mod:`.client` (``ModelClient``, ``AsyncioModelClient``,
``FuturesModelClient``, ``DecoupledModelClient``) and :mod:`.exceptions`.
"""
