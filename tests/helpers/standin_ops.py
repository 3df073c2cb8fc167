"""How the stand-in CUDA device (tests/helpers/standin_cuda.py) classifies an ATen op: which
ops may take a CPU tensor next to device tensors on CUDA, which read device values on the host
inside torch's C++ (a sync), which return one of their arguments, which allocate only.

The sync ops are those torch tags as having a data-dependent output (`.item()`, `equal`) or a
data-dependent shape (`nonzero`, `bincount`, `unique`, `masked_select`, `repeat_interleave`
without `output_size`, indexing with a boolean mask), with `histc` over its own range.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import torch

_aten = torch.ops.aten

# Copies between devices: legal across devices; a device-to-host one is a read.
COPIES = {_aten.copy_.default, _aten._to_copy.default, _aten._copy_from.default,
          _aten._copy_from_and_resize.default}
# CPU index tensors into a device tensor: CUDA copies them over.
INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
            _aten._index_put_impl_.default}
# No kernel on CUDA (nothing to replay in a captured graph).
ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_strided.default,
               _aten.empty_like.default, _aten.new_empty.default,
               _aten.new_empty_strided.default}
# Elementwise ops that take a 0-dim CPU tensor without the pointwise tag.
_SCALAR_OK = {_aten.masked_fill.Tensor, _aten.masked_fill_.Tensor, _aten.fill_.Tensor,
              _aten.fill.Tensor}
# Reads untagged in torch: is_nonzero is bool(t); histc reads its range when min == max.
_UNTAGGED_READS = {_aten.is_nonzero.default}
PINNING = {_aten.is_pinned, _aten._pin_memory, _aten.pin_memory}
# In-place changes of a tensor's shape or storage: a wrapper's own metadata would go stale.
METADATA_WRITES = {_aten.resize_.default, _aten.set_.source_Storage_storage_offset,
                   _aten.set_.source_Tensor, _aten.as_strided_.default,
                   _aten.unsqueeze_.default, _aten.squeeze_.dim, _aten.t_.default,
                   _aten.transpose_.default}


def flat(tree: Any) -> Iterator[Any]:
    """The leaves of nested lists, tuples and dicts (an op's arguments or results)."""
    if isinstance(tree, (list, tuple)):
        for x in tree:
            yield from flat(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from flat(x)
    else:
        yield tree


@cache
def written_args(func: Any) -> tuple[str | None, ...]:
    """Per return of `func`: the name of the argument it returns (in-place and out= ops)."""
    names = []
    for ret in func._schema.returns:
        name = None
        if ret.alias_info is not None and ret.alias_info.is_write:
            for a in func._schema.arguments:
                if a.alias_info is not None and a.alias_info.before_set == ret.alias_info.before_set:
                    name = a.name
        names.append(name)
    return tuple(names)


def arg(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """An op's argument by its schema name (its default when not given)."""
    if name in kwargs:
        return kwargs[name]
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else a.default_value
    raise KeyError(name)


@cache
def pointwise(func: Any) -> bool:
    """Whether CUDA takes a 0-dim CPU tensor in `func` as a number (elementwise ops)."""
    if torch.Tag.pointwise in func.tags or func in _SCALAR_OK:
        return True
    name = func.overloadpacket.__name__  # add_ takes scalars as add does
    base = getattr(_aten, name[:-1], None) if name.endswith("_") else None
    return base is not None and any(torch.Tag.pointwise in getattr(base, o).tags
                                    for o in base.overloads())


def reads_inside(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a device op reads its values on the host to size or return its result."""
    if func in INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)
    if func.overloadpacket is _aten.repeat_interleave:
        return kwargs.get("output_size") is None
    if func.overloadpacket is _aten.histc:
        return arg(func, args, kwargs, "min") == arg(func, args, kwargs, "max")
    tags = func.tags
    return (torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags
            or func in _UNTAGGED_READS)
