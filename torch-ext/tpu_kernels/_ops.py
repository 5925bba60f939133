# Op namespace of this copy of the package. `make build` rewrites this file in each Hub variant with a namespace
# unique to that build (_tpu_kernels_<backend>_<hash>), so two loaded builds never collide.
import torch

ops = torch.ops._tpu_kernels_dev


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix op by namespace."""
    return f"_tpu_kernels_dev::{op_name}"
