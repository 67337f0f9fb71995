"""Triton kernels for the GPU path of every layer, each tested against a torch reference.

On CPU they run only through Triton's interpreter (`TRITON_INTERPRET=1`), which the tests use on
small shapes; the model's CPU path stays torch.
"""
