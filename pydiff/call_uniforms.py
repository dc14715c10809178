"""The size SlangPy estimates for a call's uniforms, corrected where it would exceed Vulkan's
push constants.

SlangPy 0.43 passes a call's arguments as entry-point uniforms (push constants on Vulkan: no
buffer per dispatch; a small tape step on lavapipe took half the time) when its estimate
of their size is at most the device's ``max_entry_point_uniform_size`` (128 on Vulkan), and
in a ParameterBlock (a uniform buffer) otherwise. The estimate counts a tensor as its
element (4 bytes for float), where the uniform holds its shape, strides and offset (8 N + 4
bytes for N dimensions, once more per gradient a backward binds), and a grid argument as
``int[N]`` where it holds two. So a 4-D binary op's backward, 276 bytes, is estimated at 72:
past the drivers' 256 (lavapipe, NVIDIA), slang-rhi refuses the program, printing "Total
push constant size (276) exceeds the maximum allowed (256)", and SlangPy builds it again
with a ParameterBlock.

``install()`` (run on import) replaces the estimate: where the true size is over
``PUSH_CONSTANT_BUDGET`` bytes the true size is reported, so SlangPy takes the
ParameterBlock at once; at or under it SlangPy's own estimate stands, keeping push
constants, and their speed, for calls of 129-256 bytes that those drivers take (a driver
with Vulkan's minimum of 128 refuses those, and SlangPy falls back as before).

    >>> call_uniforms.uniform_size(bound_call, 4)      # 276 for mul's backward on 4-D
"""

from __future__ import annotations

from typing import Any

#: The most bytes of push constants pydiff lets SlangPy try (Vulkan guarantees 128;
#: lavapipe, NVIDIA and current AMD and Intel drivers give 256).
PUSH_CONSTANT_BUDGET = 256

#: Gradient buffers a backward binds beside a tensor's values, by the derivative's access.
_GRADS = {"none": 0, "read": 1, "write": 1, "readwrite": 2}


def _node_size(node: Any) -> int:
    """Bytes of one argument's uniform: a tensor's shape, strides and offset per buffer bound
    (its values, and its gradients in a backward), else the larger of SlangPy's two types."""
    marshall = node.python
    dims = getattr(marshall, "dims", None)
    if type(marshall).__name__ == "TensorMarshall" and isinstance(dims, int):
        return (8 * dims + 4) * (1 + _GRADS[node.access[1].name])
    sizes = [0]
    for t in (node.vector_type, getattr(marshall, "slang_type", None)):
        if t is not None:
            sizes.append(t.uniform_layout.size)
    return max(sizes)


def uniform_size(call: Any, call_dimensionality: int) -> int:
    """The bytes of a bound call's entry-point uniforms: each argument's (those SlangPy puts
    in a ParameterBlock of their own excluded), ``_thread_count`` and three ``int[N]`` shape
    arrays."""
    total = 12 + 12 * max(call_dimensionality, 0)
    return total + sum(_node_size(n) for n in call.values() if not n.create_param_block)


def install() -> None:
    """Replace SlangPy's estimate (see the module's docstring); once."""
    from slangpy.core import calldata

    slangpys = calldata.estimate_entrypoint_arguments_size
    if getattr(slangpys, "pydiff_corrected", False):
        return

    def estimate(call: Any, call_dimensionality: int) -> int:
        theirs = slangpys(call, call_dimensionality)
        try:
            size = uniform_size(call, call_dimensionality)
        except (AttributeError, KeyError, TypeError):  # an argument kind not modelled here
            return theirs
        return size if size > PUSH_CONSTANT_BUDGET else theirs

    estimate.pydiff_corrected = True  # type: ignore[attr-defined]
    calldata.estimate_entrypoint_arguments_size = estimate
