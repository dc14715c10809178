"""Slang modules and their functions: SlangPy calls with pydiff's gradient handling.

m = pydiff.load_module("polynomial.slang")
y = m.polynomial(2.0, 8.0, -1.0, x, _result="tensor")
m.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y.with_grads(ones=True))
"""

from __future__ import annotations

import difflib
import hashlib
import re
import weakref
import warnings
from typing import Any

import slangpy as spy

from . import capturing, double_math, forward_trace, lint, lint_macros, lint_sources
from . import capture_calls, host_results, module_session, overload_select, slang_compile
from . import kernel_sources, temporary_copies
from .builtin_names import definition_lines, overload_listing
from .backward_function import BackwardFunction
from .custom_backward import direct_inout_source, inout_wrapper_source
from .device import Device, resolve_device, shader_dir
from .errors import ShaderTrapError, ShaderTrapWarning, SlangCompileError, taken_wrapper_name
from .forward_call import forward_call
from .forward_mode import ForwardFunction
from .lint_nodiff import generic_base, marked_params, no_diff_definitions, no_diff_fields
from .lint_lanes import lane_effects
from .lint_statics import imported_names, thread_state
from .signature import ParamInfo, Signature, stem


#: Per device, the preprocessed texts of each module pydiff loaded (its own and its imports'),
#: by module name: what the thread-state and lane scans read for an import of that name.
_LOADED_TEXTS: "weakref.WeakKeyDictionary[Device, dict[str, list[str]]]" = (
    weakref.WeakKeyDictionary()
)


class Module:
    """A loaded Slang module; attribute access gives its functions.

    >>> m = pydiff.load_module("polynomial.slang")
    >>> m.polynomial                 # a pydiff.ShaderFunction
    >>> m.function_names()           # ['polynomial', ...]
    """

    def __init__(
        self,
        native: spy.Module,
        device: Device,
        name: str,
        source: str | None,
        file: str,
        import_spec: str,
        lint_source: bool = True,
        decl_module: Any = None,
    ):
        #: The SlangPy module underneath, its device, name and file ("<name>" for source).
        self.native = native
        self.device = device
        self.name = name
        self.file = file
        #: What a generated Slang module writes after ``import`` to use this one.
        self.import_spec = import_spec
        #: The module's own source text (None where pydiff was not given it), and the files
        #: it imports and includes (as the trap scan finds them; none without the scan).
        self.source = source
        self.source_files: list[str] = []
        #: Trap findings per function name (``.bwds`` of these is refused).
        self.traps = lint.TrapMap()
        #: Each definition's parameters and those marked no_diff, per function (lint_nodiff).
        self.no_diff_tensors = no_diff_definitions(source) if source is not None else {}
        self.no_diff_fields = no_diff_fields(source) if source is not None else {}
        #: Thread state (mutable statics, SlangPy's call id) and cross-lane or side-effecting
        #: functions (lint_lanes): generated kernels keep off them.
        self.thread_state: list[str] = []
        self.lane_effects: dict[str, tuple[str, str]] = {}
        self._function_names: list[str] | None = None
        if decl_module is not None:  # a file compiled again: its path gives the first version
            self._decl_loader = lambda: decl_module
        elif file.startswith("<"):
            self._decl_loader = lambda: device.native.load_module_from_source(name, source)
        else:
            self._decl_loader = lambda: device.native.load_module(file)
        self._functions: dict[str, ShaderFunction] = {}
        if source is not None:  # (lint=False too: the imports' statics and lanes count)
            options = device.native.desc.compiler_options  # imports: found as Slang does
            scan = lint_sources.scan_module(source, file, options.include_paths, options.defines)
            # Modules pydiff loaded before, which an import may name with no file to find
            # (load_module_from_source): their texts, as the scan would have read them.
            loaded = _LOADED_TEXTS.setdefault(device, {})
            texts = [scan.own_text, *scan.imported_texts]
            texts += [t for n in imported_names(*texts) if n != name for t in loaded.get(n, ())]
            loaded[name] = texts
            # (the raw text too: a macro defined `static` in a branch the scan cannot decide)
            self.thread_state = thread_state(source, *texts)
            self.lane_effects = lane_effects(*texts)
        if source is not None and lint_source:
            doubles = double_math.findings(device, source, file, options.defines, scan)
            for f in scan.own + [f for f in scan.imported if not f.crashes_hvp] + doubles:
                consequence = (
                    " (.bwds of it will raise)" if f.refuses_bwds
                    else " (forward mode of it and of its callers will raise)" if f.wrong_jvp
                    else " (hvp/hessian of it and of its callers will raise)" if f.crashes_hvp
                    else ""
                )  # fmt: skip
                warnings.warn(f"{f}{consequence}", ShaderTrapWarning, stacklevel=3)
            merged = double_math.with_findings(scan.traps, doubles)
            self.traps = double_math.DoubleTraps(merged, device, source, file, options.defines)
            self.source_files = list(scan.files)
            self.no_diff_tensors = no_diff_definitions(scan.own_text, scan.imported_texts)
            self.no_diff_fields = no_diff_fields(scan.own_text, scan.imported_texts)

    def function_names(self) -> list[str]:
        """Names of the functions declared in this module's own source (not its imports)."""
        if self._function_names is None:
            try:
                decl = self._decl_loader().module_decl
                kind = spy.DeclReflection.Kind.func
                self._function_names = sorted({c.name for c in decl.children_of_kind(kind)})
            except Exception:  # reflection is a convenience for error messages only
                self._function_names = []
        return self._function_names

    def __getattr__(self, name: str) -> "ShaderFunction":
        if name.startswith("__"):
            raise AttributeError(name)
        fn = self._functions.get(name)
        if fn is not None:
            return fn
        reflected = self.native.layout.find_function_by_name(name)
        if reflected is None:
            names = self.function_names()
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            listing = f" (it has: {', '.join(names)})" if names and not close else ""
            raise AttributeError(
                f"module '{self.name}' ({self.file}) has no function '{name}'{hint}{listing}"
            )
        if self.source is not None and name not in self.function_names():
            if not module_session.reachable(self.device, self.import_spec, name):
                raise module_session.unreachable_error(self.name, self.file, self.source, name)
        native = getattr(self.native, name)
        if reflected.is_overloaded:
            fn = OverloadedFunction(
                [ShaderFunction(self, name, native, o) for o in reflected.overloads]
            )
        else:
            fn = ShaderFunction(self, name, native, reflected)
        self._functions[name] = fn
        setattr(self, name, fn)  # later lookups skip __getattr__ (hot path)
        return fn

    def __repr__(self) -> str:
        return f"<pydiff.Module {self.name} from {self.file} on {self.device.type}>"


# `import pydiff;` as Slang reads it: a statement wherever it stands (after another on the
# same line too), not in a comment (blanked first); `import "pydiff.slang";` alike.
IMPORTS_PYDIFF = re.compile(r'(?<![\w.])import\s+(?:pydiff|"pydiff(?:\.slang)?")\s*;')


def links(source: str, dev: Device) -> list:
    """Modules SlangPy must import into its generated kernels: pydiff's library when the
    source imports it (its types, e.g. FwdDiffTensor, appear in the kernel's parameters)."""
    if not IMPORTS_PYDIFF.search(lint_macros.blank_comments(source)):
        return []
    return [dev.library]


def load_module_from_source(name: str, source: str, device: Device | str | None = None) -> Module:
    """Compile Slang source text as a module called ``name``.

    >>> src = "[Differentiable] float sq(float x) { return x*x; }"
    >>> m = pydiff.load_module_from_source("sq", src)
    >>> m.sq(3.0)
    9.0
    """
    if not re.fullmatch(r"[A-Za-z_]\w*", name):
        raise ValueError(f"name={name!r}: a module name must be a Slang identifier")
    module_session.check_name(name, f"pydiff.load_module_from_source({name!r}, ...)")
    dev = resolve_device(device)
    module_session.check_imports(source, f"<{name}>", dev)
    native = slang_compile.load_source(dev.native, name, source, links(source, dev))
    return Module(native, dev, name, source, f"<{name}>", name)


class ShaderFunction:
    """A function of a loaded module: call it to run forward, ``.bwds`` for the backward.

    Public fields: ``name``, ``module``, ``native`` (the SlangPy function), ``signature``
    (its ``Signature``), ``label`` ("module.function"), and ``native_bwds``.

    >>> y = m.polynomial(2.0, 8.0, -1.0, x, _result="tensor")
    >>> m.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y.with_grads(ones=True))
    >>> x.grad.numpy()
    """

    def __init__(self, module: Module, name: str, native: Any, reflected: Any):
        self.module = module
        self.name = name
        self.native = native
        self.signature = Signature.reflect(name, reflected)  # (read once: on every call's path)
        # (reflection cannot tell them; f<2> has f's; an overload its own: marked_params)
        params, base = [p.name for p in self.signature.params], generic_base(name)
        marked, unsure, line = marked_params(module.no_diff_tensors, base, params)
        self.signature = self.signature.with_no_diff_tensors(marked, module.no_diff_fields)
        if unsure:  # (an #if the scan cannot decide: which definition Slang kept is unknown)
            lint.no_diff_undecided(module.traps, module.file, line, base, unsure)
        self.label = f"{module.name}.{name}"
        self.call_label = f"{self.label} (forward call)"
        self.bwds_label = f"{self.label}.bwds"
        self.native_bwds = native.bwds
        self._inout_wrapper: Any = None
        self._layouts: dict[tuple[bool, tuple[str, ...]], Any] = {}
        self._generated: dict[tuple, ShaderFunction] = {}
        self.bwds = BackwardFunction(self)  # (an attribute: no property's frame per call)
        #: Call plans per argument layout (call_plan): forward calls and ``.bwds``.
        self.plans: dict = {}
        self.bwds_plans: dict = {}

    @property
    def differentiable(self) -> bool:
        return self.signature.differentiable

    @property
    def params(self) -> list[ParamInfo]:
        return self.signature.params

    def __repr__(self) -> str:
        sig = ", ".join(f"{p.type_name} {p.name}" for p in self.params)
        return f"<pydiff.ShaderFunction {self.module.name}.{self.name}({sig})>"

    # -- forward ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        temporary_copies.refuse_written(self, args, kwargs)  # (m.f(x[1:3]) writing a copy)
        if capturing.recording() is not None:  # the plan's generated kernel, or refused
            return capture_calls.forward(self, args, kwargs)
        if forward_trace.active() is not None:  # inside pydiff.jvp: the result's tangent too
            return forward_trace.shader_call(self, args, kwargs)
        if "_result" in kwargs and (run := host_results.through_tensor(self, kwargs)):
            return run(forward_call, args)  # a bool or int8_t result into NumPy
        return forward_call(self, args, kwargs)  # (flushes before SlangPy's call)

    @property
    def fwds(self) -> ForwardFunction:
        """The forward-mode version: ``y, dy = fn.fwds(x.with_tangent(u))`` (see pydiff.jvp)."""
        return ForwardFunction(self)

    def bwds_kernel(self, no_grad: tuple[str, ...], wrapper: bool = False) -> Any:
        """The backward kernel for a call whose listed parameters carry no gradient.

        SlangPy keys its kernel cache on dtype and dimensions only; a prelude comment naming
        the gradient layout gives each layout its own kernel (nothing else changes).
        ``wrapper`` selects the generated ``inout`` wrapper instead of the function itself.
        """
        key = (wrapper, no_grad)
        node = self._layouts.get(key)
        if node is None:
            base = self._inout() if wrapper else self.native
            node = base.prelude(f"// pydiff gradient layout: none for {', '.join(no_grad)}").bwds
            self._layouts[key] = node
        return node

    def check_traps(self, forward: bool = False) -> None:
        """Raise ShaderTrapError if the load-time scan found a trap in this function (with
        ``forward``: only one that crashes the forward call too)."""
        found = self.module.traps.get(self.name, ())
        found = [f for f in found if (f.crashes_call if forward else f.refuses_bwds)]
        if found:
            lines = "\n  ".join(str(f) for f in found)
            device = all(f.kind == "double-intrinsic" for f in found)  # not SlangPy's doing
            raise ShaderTrapError(
                f"{self.module.name}.{self.name}{'' if forward else '.bwds'} refused: "
                + ("this device computes wrong values (or cannot compile)"
                   if device else "SlangPy 0.43 would return wrong values or gradients, "
                   "or crash the process,")
                + f" on:\n  {lines}"
            )  # fmt: skip

    def generated(self, kind: str, source: str) -> "ShaderFunction":
        """Compile generated Slang ``source`` defining ``<name>__pydiff_<kind>`` (a wrapper of
        this function: forward mode, directional derivative, ...) once, as a ShaderFunction."""
        if (key := (kind, source)) not in self._generated:  # (by source too: two wrappers
            # can share a kind, dir_fixed_a_fixed_b for fixed {a_fixed_b} and {a, b}: s48)
            name = taken_wrapper_name(self.module, f"{stem(self.name)}__pydiff_{kind}", self.label)
            digest = hashlib.sha1(source.encode()).hexdigest()[:12]
            try:
                with warnings.catch_warnings():  # (its scan finds this module's traps again:
                    warnings.simplefilter("ignore", ShaderTrapWarning)  # said when it loaded)
                    module = load_module_from_source(
                        f"pydiff_{kind}_{stem(self.name)}_{digest}",
                        source,
                        device=self.module.device,
                    )
            except SlangCompileError as exc:
                if kind.startswith("dir") and "E41022" in str(exc):  # hvp: reverse of forward
                    g = re.search(r"non-backward-differentiable function `([^`]+)`", str(exc))
                    at = definition_lines(self.module, self.name)  # (the trap scan missed it)
                    raise SlangCompileError(
                        (f"{self.module.file}:{at[0]}: " if at else "")
                        + f"hvp: {self.label}: its forward derivative "
                        f"{g.group(1) + '() ' if g else ''}is not differentiable in reverse "
                        "mode (a [ForwardDerivative] function must itself be "
                        f"[Differentiable] for second derivatives)\n{exc}",
                        file=self.module.file if at else exc.file,
                        line=at[0] if at else exc.line,
                    ) from None
                raise
            self._generated[key] = getattr(module, name)
        return self._generated[key]

    def _inout(self) -> Any:
        """The SlangPy function of the generated ``inout`` wrapper (see inout_wrapper_source)."""
        if self._inout_wrapper is None:
            src = direct_inout_source(self) or inout_wrapper_source(self)
            name = f"pydiff_inout_{self.name}_{hashlib.sha1(src.encode()).hexdigest()[:12]}"
            try:
                native = kernel_sources.spy_module(self.module.device.native, name, src)
            except spy.SlangCompileError as exc:
                raise slang_compile.compile_error(
                    exc, f"<inout wrapper of {self.name}>", name
                ) from None
            self._inout_wrapper = getattr(native, f"{stem(self.name)}__pydiff_inout")
        return self._inout_wrapper


class OverloadedFunction:
    """A name with several overloads: each call goes to the one whose parameters fit.

    >>> m.g(x)          # float g(float a)
    >>> m.g(x, y)       # float g(float a, float b)
    """

    def __init__(self, overloads: list[ShaderFunction]):
        self.overloads = overloads
        self.bwds, self.fwds = _OverloadedMode(self, "bwds"), _OverloadedMode(self, "fwds")

    @property
    def name(self) -> str:
        return self.overloads[0].name

    def select(self, args: tuple, kwargs: dict) -> ShaderFunction:
        if (fn := overload_select.select(self.overloads, args, kwargs)) is not None:
            return fn  # (by arity, then by the tensors' element types: as SlangPy picks)
        names = {k for k in kwargs if not k.startswith("_")}
        count = len(args) + len(names)
        raise TypeError(
            f"{self.overloads[0].label}: no overload takes {count} argument(s)"
            f"{' named ' + ', '.join(sorted(names)) if names else ''}; "
            + overload_listing(self.overloads)
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        temporary_copies.refuse_written(fn := self.select(args, kwargs), args, kwargs)
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<pydiff overloaded function {self.name} ({len(self.overloads)} overloads)>"


class _OverloadedMode:
    """``.bwds`` / ``.fwds`` of an overloaded function: the selected overload's."""

    def __init__(self, fn: OverloadedFunction, mode: str):
        self._fn, self._mode = fn, mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._fn.select(args, kwargs), self._mode)(*args, **kwargs)


def library(device: Device) -> Module:
    """pydiff's own shader library (shaders/pydiff.slang, ``device.library``) as a Module:
    its functions called from Python validate, record on tapes and have ``.bwds``.

    >>> lib = pydiff.module.library(dev)
    >>> y = lib.op_exp(x, _result="tensor")
    """

    def wrap() -> Module:
        path = str(shader_dir() / "pydiff.slang")
        return Module(device.library, device, "pydiff", None, path, "pydiff")

    return device.cached("pydiff.module.library", wrap)
