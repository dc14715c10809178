"""A Slang function's signature as pydiff needs it, read once from SlangPy's reflection.

sig = Signature.reflect("f", module.native.layout.find_function_by_name("f"))
sig.return_type, sig.differentiable            # 'float', True
[(p.name, p.io, p.tensor_kind, p.access) for p in sig.params]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import slangpy as spy

from .errors import warn_once

_IO = {"inn": "in", "out": "out", "inout": "inout"}


@dataclass(frozen=True)
class FieldInfo:
    """One field of a struct parameter: its name and Slang type, whether it is a tensor
    (bound as given, never converted), and its own fields when it is a struct (else None).
    A tensor field's ``tensor_kind`` and ``access`` are a tensor parameter's (``ParamInfo``):
    a ``DiffTensor`` field ("diff") gets its gradient through its own buffers, whether or
    not the struct is IDifferentiable."""

    name: str
    type_name: str
    tensor: bool = False
    fields: tuple["FieldInfo", ...] | None = None
    tensor_kind: str | None = None
    access: str | None = None
    #: marked ``no_diff`` in the source (lint_nodiff): a diff tensor field gets no gradient
    no_diff: bool = False

    @property
    def diff_tensor(self) -> bool:
        """A differentiable tensor field (``DiffTensor``, ``RWDiffTensor``, ...)."""
        return self.tensor_kind in ("diff", "idiff")


@dataclass(frozen=True)
class ParamInfo:
    """One parameter: its name, Slang type, direction and, for tensors, kind and access."""

    name: str
    type_name: str
    io: str  # "in", "out" or "inout"
    no_diff: bool
    differentiable: bool  # a vectorisable value whose derivative flows (float, float3, ...)
    tensor_kind: str | None  # "diff" (concrete DiffTensor), "idiff" (interface), "plain",
    #                          "fwd" (pydiff's FwdDiffTensor/RWFwdDiffTensor: forward mode too)
    access: str | None  # "read", "write", "read_write" for tensor parameters

    fwd_dims: int = 0  # N of FwdDiffTensor<N>
    #: fields of a struct parameter that get no gradient, as dotted paths (all fields of a
    #: struct that is not IDifferentiable; no_diff and integer fields of one that is, also
    #: nested: 'inner.b'); a top-level name means the whole field
    no_grad_fields: tuple[str, ...] = ()
    #: the type is a generic parameter of the function (``T x`` in ``f<T : IFloat>``): its
    #: element type is the argument's (call_shape.result_type specialises the result too)
    generic: bool = False
    #: the fields of a struct parameter, as reflected (None: not a struct); a dict argument
    #: is checked and converted field by field against them (struct_values)
    struct_fields: tuple[FieldInfo, ...] | None = None
    #: a diff tensor parameter (interface or concrete) marked ``no_diff``: its loads still
    #: add gradients into whatever gradient buffer is bound, so the backward binds a
    #: throwaway one (``no_diff`` itself stays False for tensors: it means a value's
    #: differential elsewhere)
    no_diff_tensor: bool = False

    @property
    def is_diff_tensor(self) -> bool:
        return self.tensor_kind in ("diff", "idiff", "fwd")

    @property
    def reads_value(self) -> bool:
        """The call reads the argument's values."""
        if self.tensor_kind is not None:
            return self.access in ("read", "read_write")
        return self.io in ("in", "inout")

    @property
    def writes_value(self) -> bool:
        """The call writes into the argument (an output, in-place or read-write tensor)."""
        if self.tensor_kind is not None:
            return self.access in ("write", "read_write")
        return self.io in ("out", "inout")

    @property
    def in_place(self) -> bool:
        return self.reads_value and self.writes_value

    @property
    def reads_gradient(self) -> bool:
        """The backward reads an upstream gradient (grad_in) for this parameter."""
        if self.is_diff_tensor:
            return self.access in ("write", "read_write")
        return self.differentiable and self.io in ("out", "inout")

    @property
    def writes_gradient(self) -> bool:
        """The backward adds a gradient (into grad_out) for this parameter."""
        if self.is_diff_tensor:
            return self.access in ("read", "read_write")
        return self.differentiable and self.io in ("in", "inout")


def _tensor_info(t: Any) -> tuple[str | None, str | None]:
    kind = getattr(t, "tensor_type", None)
    if kind is None:
        return None, None
    kind_name = str(kind).split(".")[-1]
    access = str(t.access).split(".")[-1]
    if kind_name == "idiff_tensor":
        return "idiff", access
    if kind_name == "diff_tensor":
        return "diff", access
    return "plain", access


_FWD_TENSOR = re.compile(r"(?:^|\W)(RW)?FwdDiffTensor<\s*(\d+)\s*>$")


def describe_function(reflected: Any) -> list[ParamInfo]:
    """One ParamInfo per parameter of a reflected SlangPy function, in order."""
    out = []
    for p in reflected.parameters:
        t = p.type
        kind, access = _tensor_info(t)
        fwd = _FWD_TENSOR.search(t.full_name)
        if fwd:
            kind, access = "fwd", ("read_write" if fwd.group(1) else "read")
            no_diff = spy.ModifierID.nodiff in p.modifiers
            io = _IO.get(str(p.io_type).split(".")[-1], "in")
            out.append(
                ParamInfo(p.name, t.full_name, io, no_diff, False, kind, access, int(fwd.group(2)))
            )
            continue
        no_diff = spy.ModifierID.nodiff in p.modifiers and kind is None
        io = _IO.get(str(p.io_type).split(".")[-1], "in")
        differentiable = (
            kind is None
            and not no_diff
            # a generic parameter (T : IFloat / __BuiltinFloatingPointType / IDifferentiable)
            # reflects as not differentiable before specialisation: its gradient would be a
            # silent zero (issue 15); it is differentiable whenever the argument is
            and (bool(p.differentiable) or bool(getattr(t, "is_generic", False)))
            and bool(reflected.differentiable)
        )
        fields = _no_grad_paths(t, differentiable) if kind is None else ()
        generic = bool(getattr(t, "is_generic", False))
        out.append(
            ParamInfo(
                p.name,
                t.full_name,
                io,
                no_diff,
                differentiable,
                kind,
                access,
                0,
                fields,
                generic,
                struct_fields(t) if kind is None else None,
            )
        )
    return out


def struct_fields(t: Any, depth: int = 0) -> tuple[FieldInfo, ...] | None:
    """The fields of a reflected struct type (nested structs' too), None for other types.

    >>> [f.name for f in struct_fields(fn.module.native.layout.find_type_by_name("P"))]
    ['a', 'b']
    """
    if not isinstance(t, spy.reflection.StructType) or depth > 8:
        return None
    return tuple(
        FieldInfo(
            name,
            var.type.full_name,
            getattr(var.type, "tensor_type", None) is not None,
            struct_fields(var.type, depth + 1),
            *_tensor_info(var.type),
        )
        for name, var in (t.fields or {}).items()
    )


def _no_grad_paths(t: Any, differentiable: bool, depth: int = 0) -> tuple[str, ...]:
    """Dotted paths of a struct type's fields that get no gradient: a whole field ('inner')
    when nothing of it flows (the struct is not IDifferentiable, or the field is no_diff or
    an integer), else the paths inside a differentiable struct field ('inner.b')."""
    fields = getattr(t, "fields", None) or {}
    deriv = getattr(t, "derivative", None) if differentiable else None
    flowing = (getattr(deriv, "fields", None) or {}) if deriv is not None else {}
    out: list[str] = []
    for name, var in fields.items():
        if name not in flowing:
            out.append(name)
        elif depth < 8 and getattr(var.type, "fields", None):
            out += [f"{name}.{sub}" for sub in _no_grad_paths(var.type, True, depth + 1)]
    return tuple(sorted(out))


def _marked_fields(
    type_name: str, fields: tuple[FieldInfo, ...] | None, marked: dict[str, set[str]]
) -> tuple[FieldInfo, ...] | None:
    """``fields`` (of the struct ``type_name``) with ``no_diff`` set on those ``marked``
    names for it, nested structs' too."""
    if not fields or not marked:
        return fields
    names = marked.get(re.sub(r"<.*", "", type_name).strip(), set())
    return tuple(
        replace(
            f,
            no_diff=f.name in names,
            fields=_marked_fields(f.type_name, f.fields, marked),
        )
        for f in fields
    )


def field_at(p: ParamInfo, path: str) -> FieldInfo | None:
    """The reflected field at dotted ``path`` ('inner.t') of struct parameter ``p``; None
    where ``p`` is no struct or has no such field."""
    fields = p.struct_fields
    found = None
    for name in path.split("."):
        found = next((f for f in fields or () if f.name == name), None)
        if found is None:
            return None
        fields = found.fields
    return found


def _tensors_wanting_grad(p: ParamInfo, value: Any, rel: str) -> list[str]:
    if isinstance(value, dict):
        return [w for k, v in value.items() for w in _tensors_wanting_grad(p, v, f"{rel}.{k}")]
    if isinstance(value, (list, tuple)):
        return [w for i, v in enumerate(value) for w in _tensors_wanting_grad(p, v, f"{rel}[{i}]")]
    if not getattr(value, "requires_grad", False):
        return []
    found = field_at(p, rel)
    if found is not None and found.diff_tensor:
        return []  # a DiffTensor field adds into its own gradient buffers (struct_grads)
    return [f"{p.name}.{rel}"]


def fields_without_gradient(p: ParamInfo, value: Any, path: str = "") -> list[str]:
    """The paths ('p.b', 'q.inner.a') in a struct argument (a dict, nested for nested
    structs) of tensors that require a gradient but sit in fields that get none: their
    gradient would silently stay zero. ``path`` is the field path inside the struct.
    ``DiffTensor`` fields are not among them: their gradient flows whatever the struct."""
    if not isinstance(value, dict):
        return []
    out = []
    for key, v in value.items():
        rel = f"{path}.{key}" if path else str(key)
        if rel in p.no_grad_fields:
            out += _tensors_wanting_grad(p, v, rel)
        elif isinstance(v, dict):
            out += fields_without_gradient(p, v, rel)
    return out


@dataclass(frozen=True)
class Signature:
    """What every call of one shader function needs to know, read once at load time.

    ``params``: one ParamInfo each; ``return_type``: the Slang type name ('void' when none);
    ``differentiable``: the function is [Differentiable]; ``written``: indices of the
    parameters the call writes into; ``has_diff_inout``: a differentiable ``inout`` value
    (its backward goes through a generated in/out wrapper); ``has_fwd_tensor``: a
    ``FwdDiffTensor`` parameter (its gradient added through a fixed-point accumulator).

    >>> sig = fn.signature
    >>> sig.return_type, [p.name for p in sig.params if p.differentiable]
    ('float', ['x'])
    """

    name: str
    params: list[ParamInfo]
    return_type: str
    differentiable: bool
    written: tuple[int, ...] = field(init=False)
    has_diff_inout: bool = field(init=False)
    has_fwd_tensor: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "written", tuple(i for i, p in enumerate(self.params) if p.writes_value)
        )
        object.__setattr__(
            self,
            "has_diff_inout",
            any(p.io == "inout" and p.differentiable for p in self.params),
        )
        fwd = any(p.tensor_kind == "fwd" for p in self.params)
        object.__setattr__(self, "has_fwd_tensor", fwd)

    @classmethod
    def reflect(cls, name: str, reflected: Any) -> "Signature":
        """The signature of a SlangPy reflected function (``layout.find_function_by_name``)."""
        ret = reflected.return_type
        return cls(
            name,
            describe_function(reflected),
            ret.full_name if ret is not None else "void",
            bool(reflected.differentiable),
        )

    def with_no_diff_tensors(
        self, marked: set[str], fields: dict[str, set[str]] | None = None
    ) -> "Signature":
        """This signature with ``no_diff_tensor`` set on the diff tensor parameters named in
        ``marked`` and ``no_diff`` on the struct fields ``fields`` names per struct (what the
        source marks ``no_diff``: lint_nodiff; reflection cannot tell).

        >>> sig.with_no_diff_tensors({"y"}).params[2].no_diff_tensor   # IWDiffTensor y
        True
        """
        params = [
            replace(
                p,
                no_diff_tensor=p.name in marked and p.tensor_kind in ("diff", "idiff"),
                struct_fields=_marked_fields(p.type_name, p.struct_fields, fields or {}),
            )
            for p in self.params
        ]
        return replace(self, params=params)

    def __str__(self) -> str:
        params = ", ".join(f"{p.type_name} {p.name}" for p in self.params)
        return f"{self.return_type} {self.name}({params})"


def stem(name: str) -> str:
    """A Slang identifier for the names pydiff derives from a function's (its generated
    wrappers and their modules): a namespaced or static function's ``A::f`` gives ``A_f``.

    >>> stem("A::f"), stem("f")
    ('A_f', 'f')
    """
    return re.sub(r"\W", "_", name)


def overloaded(fn: "FunctionTarget") -> bool:
    """Whether ``fn``'s name has several overloads in its module (or no reflection says):
    a call that binds arguments itself (a call plan, a generated kernel) would pick by the
    converted values, not as SlangPy picks, so those leave such functions to SlangPy.

    >>> overloaded(m.h)     # True for float h(int a, float x) beside float h(float a, ...)
    """
    try:
        reflected = fn.module.native.layout.find_function_by_name(fn.name)
        return reflected is None or bool(reflected.is_overloaded)
    except Exception:  # no reflection to tell
        return True


class ModuleTarget(Protocol):
    """What the call layer reads of a loaded module (pydiff.Module provides it)."""

    name: str
    file: str
    device: Any
    import_spec: str
    traps: dict[str, list]


class FunctionTarget(Protocol):
    """What the call layer reads of a shader function (pydiff.ShaderFunction provides it):
    its names, signature, module and the SlangPy function underneath."""

    name: str
    label: str  # "module.function"
    call_label: str  # how a forward call is named as a tensor's last writer
    bwds_label: str  # how a backward is named (zeroing policies, errors)
    signature: Signature
    module: ModuleTarget
    native: Any  # the SlangPy function
    native_bwds: Any  # its SlangPy backward
    plans: dict  # call plans per argument layout (call_plan): forward calls
    bwds_plans: dict  # and .bwds

    @property
    def params(self) -> list[ParamInfo]: ...

    def bwds_kernel(self, no_grad: tuple[str, ...], wrapper: bool = False) -> Any: ...

    def check_traps(self, forward: bool = False) -> None: ...


def warn_struct_fields(fn: FunctionTarget, bound: list) -> None:
    """Tensors requiring gradients in struct fields that get none: say so once per site."""
    for p, value in bound:
        for where in fields_without_gradient(p, value) if p.no_grad_fields else ():
            if p.differentiable:
                why = "the field is no_diff, an integer or a struct that is not IDifferentiable"
                fix = (
                    "Make the field a float type without no_diff (every struct holding it "
                    "declared ': IDifferentiable')"
                )
            else:
                why = f"{p.type_name} is not IDifferentiable"
                fix = (
                    f"Declare 'struct {p.type_name} : IDifferentiable' (and every struct it "
                    "nests) with float fields"
                )
            warn_once(
                f"{fn.label}: '{where}' requires a gradient but gets none ({why}): it stays "
                f"unchanged. {fix}, or pass the tensor detached"
            )
