"""Where the compiled ops library is: TPFUSE_TORCH_LIBRARY, else next to this package."""

import os


def library_path() -> str:
    explicit = os.environ.get("TPFUSE_TORCH_LIBRARY")
    if explicit:
        return explicit
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtpfuse_torch.so")
    if not os.path.exists(here):
        raise ImportError(
            "tpfuse: libtpfuse_torch.so is not installed beside the package; install with "
            "`pip install .` or set TPFUSE_TORCH_LIBRARY to a built one"
        )
    return here
