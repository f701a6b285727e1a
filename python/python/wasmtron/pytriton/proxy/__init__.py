"""PyTriton's ``pytriton.proxy`` names that user code imports."""
