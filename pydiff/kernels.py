"""Compute kernels of pydiff's Slang library, specialised per shape and dispatched directly:
the fast path of a few ops and the optimizers, where SlangPy's generated per-element
kernels leave too much speed behind (typed float4 loads, register blocking).

Each device owns one ``KernelCache`` (``device.kernels``); it takes SlangPy buffers, not
pydiff tensors, so it sits below them. Kernels are built outside the lock dispatches take.

    k = device.kernels.get("ops/matmul.slang", "mm_nt", M=256, N=64, K=64, RB=4, CB=8, TG=32)
    device.kernels.dispatch(k, 512, a=x_buffer, b=w_buffer, bias=b_buffer, c=out, beta=0.0)
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import slangpy as spy

from . import capturing, kernel_sources
from .bound_objects import BoundObjects, HeldObject
from .command_queue import CommandQueue
from .errors import PydiffError, env_choice, env_int

# Compiled kernels are specialised per layout, not per batch size (matmul's N and its blocking;
# M and K are uniforms): a loop over changing layer widths compiles new ones; the least
# recently used beyond this many are dropped (rebuilt on demand), and their memory with them.
KERNELS_MAX = 128


def paired_float4_stores(adapter_name: str) -> bool:
    """Whether pydiff's float4 kernels write through ``RWStructuredBuffer<uint64_t2>`` views
    (a float4 as two 64-bit words) rather than ``RWStructuredBuffer<float4>``: on lavapipe,
    which writes each lane's components one scalar store at a time, each with its own bounds
    check, two stores instead of four made AdamW over 10M parameters 10-20% faster and the
    generated polynomial's forward + backward 10%. GPUs store a float4 at once: unchanged.
    ``PYDIFF_FLOAT4_STORES=float4`` (or ``paired``) forces one form (tests of both).

    >>> paired_float4_stores("llvmpipe (LLVM 15.0.6, 256 bits)")
    True
    >>> paired_float4_stores("NVIDIA H200")
    False
    """
    forced = env_choice("PYDIFF_FLOAT4_STORES", ("auto", "paired", "float4"))
    if forced in ("float4", "paired"):
        return forced == "paired"
    return "llvmpipe" in adapter_name


def float4_out_source(paired: bool) -> str:
    """Slang declarations every float4 kernel is compiled with: ``Float4Out``, the type of a
    written float4 buffer, and ``store4(buffer, index, value)``, which writes a float4 into it
    bit for bit (NaN payloads and -0 included) in either form; ``Float4Load`` and ``load4``
    read one the same way (two 64-bit words: AdamW over 10M floats 17% faster on lavapipe)."""
    if not paired:  # no 64-bit integers in a GPU's kernels
        return (
            "typealias Float4Out = RWStructuredBuffer<float4>;\n"
            "void store4(RWStructuredBuffer<float4> b, uint i, float4 v) { b[i] = v; }\n"
            "typealias Float4Load = Float4In;\nfloat4 load4(Float4In b, uint i) { return b[i]; }\n"
        )
    return (
        "typealias Float4Out = RWStructuredBuffer<uint64_t2>;\n"
        "void store4(RWStructuredBuffer<uint64_t2> b, uint i, float4 v)\n{\n"
        "    uint4 u = asuint(v);\n"
        "    b[i] = uint64_t2(uint64_t(u.x) | (uint64_t(u.y) << 32), "
        "uint64_t(u.z) | (uint64_t(u.w) << 32));\n}\n"
        "typealias Float4Load = StructuredBuffer<uint64_t2>;\n"
        "float4 load4(StructuredBuffer<uint64_t2> b, uint i)\n{\n    uint64_t2 a = b[i];\n"
        "    return asfloat(uint4(uint(a.x), uint(a.x >> 32), uint(a.y), uint(a.y >> 32)));\n}\n"
    )


def float4_chunk(adapter_name: str) -> int:
    """Consecutive float4s each thread of the elementwise and optimizer kernels handles: 4 on
    lavapipe (fewer invocations, each paying for its indices: 2/3 of the CPU time of one), 1
    on a GPU, where a warp's neighbouring threads must read neighbouring float4s (4 halved
    the bandwidth on an H200). ``PYDIFF_FLOAT4_CHUNK`` overrides it (tests of both layouts).

    >>> float4_chunk("llvmpipe (LLVM 15.0.6, 256 bits)"), float4_chunk("NVIDIA H200")
    (4, 1)
    """
    return env_int("PYDIFF_FLOAT4_CHUNK", 4 if "llvmpipe" in adapter_name else 1, minimum=1)


class KernelCache:
    """The compiled kernels of one device and the shader objects bound for recent dispatches."""

    def __init__(
        self,
        native_device: spy.Device,
        shader_dir: Path,
        queue: CommandQueue,
        typed_loads: bool = True,
    ):
        self.native = native_device
        self.shader_dir = shader_dir
        self.queue = queue
        # One source per kernel for every backend: inputs are declared `Float4In`, a typed
        # Buffer<float4> where the backend loads those faster (Vulkan), else structured.
        self.float4_in = "Buffer<float4>" if typed_loads else "StructuredBuffer<float4>"
        #: Written float4 buffers take two 64-bit stores per float4 (``paired_float4_stores``).
        self.paired_stores = paired_float4_stores(native_device.info.adapter_name)
        #: A GPU, not lavapipe: the matrix kernels take small register blocks (many threads)
        #: there, and the narrow layer's one-kernel backward (8 threads walking the batch) is
        #: left to two products.
        #: ``PYDIFF_KERNEL_SHAPES=gpu`` takes the GPU's shapes on lavapipe (their tests).
        forced = env_choice("PYDIFF_KERNEL_SHAPES", ("auto", "gpu")) == "gpu"
        self.gpu = forced or "llvmpipe" not in native_device.info.adapter_name
        self.chunk = float4_chunk(native_device.info.adapter_name)
        self._kernels: OrderedDict = OrderedDict()
        self._sorted: dict = {}
        #: The shader objects bound for recent dispatches, kept for reuse (under ``_lock``).
        self.bound_objects = BoundObjects(native_device)
        #: Callers' memos of which kernel a call takes (``products.fast_product``'s plans):
        #: falsy (no kernel fits) or a tuple led by its kernel's key, dropped with it (``_evict``).
        self.plans: dict = {}
        #: ``products.sizes_fixed``'s counts: uses of each shape, and the shapes whose kernels
        #: take their sizes as constants (no kernels held: they outlive evictions).
        self.shape_uses: dict = {}
        self.fixed_shapes: set = set()
        # Threads share the kernels and bound objects: the lock keeps a lookup from racing an
        # eviction, and a bound object's uniforms from being set by two threads at once.
        self._lock = threading.RLock()
        self._building = threading.Lock()  # (kernels are built under it, not under ``_lock``)

    def get(self, file: str, entry: str, **defines: int) -> Any:
        """The compute kernel ``entry`` of shaders/``file`` with ``defines``, built once (the
        ``KERNELS_MAX`` most recently used are kept)."""
        return self.get_keyed(file, entry, **defines)[1]

    def touch(self, key: tuple) -> bool:
        """Count a use of the kernel of ``key`` (from ``get_keyed``) for the eviction order,
        as ``get`` does; False when it was evicted (a memo that holds it must build anew)."""
        with self._lock:
            if key not in self._kernels:
                return False
            self._kernels.move_to_end(key)
            return True

    def get_keyed(self, file: str, entry: str, **defines: int) -> tuple[tuple, Any]:
        """``get``, with the key that ``touch`` takes."""
        # A call site passes its defines in one order: its unsorted key finds the sorted one
        # without sorting (15 defines per matrix product); bounded like the kernels.
        fast = (file, entry, *defines.items())
        key = self._sorted.get(fast)
        if key is None:
            key = (file, entry, tuple(sorted(defines.items())))
            if len(self._sorted) >= 4 * KERNELS_MAX:
                self._sorted.clear()
            self._sorted[fast] = key
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is not None:
                self._kernels.move_to_end(key)
                return key, kernel
        # (not under _lock, which every dispatch takes inside the queue's lock: a build there
        with self._building:  # stalled every thread's kernels for the compile, 50-500 ms)
            kernel = self._kernels.get(key)  # (another thread's build, meanwhile)
            if kernel is None:
                kernel = self._build(file, entry, defines)
                with self._lock:
                    self._kernels[key] = kernel
                    while len(self._kernels) > KERNELS_MAX:
                        self._evict(*self._kernels.popitem(last=False))
        return key, kernel

    def sizes(self) -> dict[str, int]:
        """How much each cache holds: kernels, bound objects and the bytes of their buffers."""
        return {
            "kernels": len(self._kernels),
            "objects": len(self.bound_objects.entries),
            "object_bytes": self.bound_objects.bytes,
        }

    def _build(self, file: str, entry: str, defines: dict[str, int]) -> Any:
        # PYDIFF_KERNEL selects a file's compute entry points (its SlangPy functions are
        # parts of the pydiff module); ENTRY_<name> compiles only the one asked for (no
        # warnings from the others' loops that run zero times for these shapes).
        macros = {**defines, "PYDIFF_KERNEL": 1, f"ENTRY_{entry}": 1}
        text = (self.shader_dir / file).read_text()
        source = (
            "".join(f"#define {k} {int(v)}\n" for k, v in sorted(macros.items()))
            + f"typealias Float4In = {self.float4_in};\n"
            + float4_out_source(self.paired_stores)
            + text
        )
        name = f"pydiff_kernel_{entry}_{hashlib.sha1(source.encode()).hexdigest()[:12]}"
        # Each kernel in a Slang session of its own, dropped with it: a session keeps every
        # module loaded into it until it closes (about 1.5 MB of RSS per module and program on
        # lavapipe), so kernels built in the device's session piled up past KERNELS_MAX and
        # past empty_cache (+1.6 GB over 350 batch sizes). A session adds about 25 ms to a
        # build of 50-100 ms; a program keeps its session alive while a kernel or object does.
        desc = self.native.slang_session.desc
        try:
            session = self.native.create_slang_session(
                compiler_options=desc.compiler_options,
                add_default_include_paths=desc.add_default_include_paths,
                cache_path=desc.cache_path,
            )
            return kernel_sources.build_kernel(session, self.native, name, source, entry)
        except Exception as exc:  # a bug in pydiff's own shaders, not the user's
            raise PydiffError(
                f"pydiff kernel {file}:{entry} {defines} failed to build:\n{exc}"
            ) from None

    def _evict(self, key: tuple, kernel: Any) -> None:
        """Forget an evicted kernel's bound objects and plans (other plans stay: past
        ``KERNELS_MAX`` kernels only the evicted one's products are planned again)."""
        # (fast_product writes plans without this lock: list() copies them in one step, and
        # pop tolerates a plan another thread cleared meanwhile)
        for name, plan in list(self.plans.items()):
            if plan and plan[0] == key:
                self.plans.pop(name, None)
        self.bound_objects.forget(kernel)  # (they keep it alive)

    def new_held(self) -> HeldObject:
        """A list for ``dispatch(held=)`` that ``release_objects`` (``empty_cache``) empties,
        releasing the buffers its object binds.

        >>> launch.held = device.kernels.new_held()
        """
        with self._lock:
            return self.bound_objects.new_held()

    def release_objects(self) -> None:
        """Drop the cached shader objects and those of ``new_held``'s lists (and the device
        memory they keep alive)."""
        with self._lock:
            self.bound_objects.release()

    def release(self) -> None:
        """Drop the compiled kernels (and their Slang sessions: their memory), the plans
        holding them and the cached shader objects; kernels are rebuilt on demand."""
        with self._lock:
            self.release_objects()
            self._kernels.clear()
            self._sorted.clear()
            self.plans.clear()
            self.shape_uses.clear()
            self.fixed_shapes.clear()

    def dispatch(
        self,
        kernel: Any,
        threads: int,
        *,
        encoder: Any = None,
        dynamic: Callable[[], dict] | None = None,
        held: list | None = None,
        **bindings: Any,
    ) -> None:
        """Append ``threads`` threads to ``encoder``, to this context's open batch, or else to
        the device's deferred list (``device.queue``: submitted at the next flush, which every
        host read, write and SlangPy call makes), holding the bound buffers until then.
        ``dynamic`` returns uniforms that may change from step to step (a captured step
        re-reads them on replay); they are bound now too. ``held``: a list the caller keeps
        for this dispatch site, holding its bound object (see ``bound_objects``)."""
        if dynamic is not None:
            bindings.update(dynamic())
        buffers, scalars = [], []
        for item in bindings.items():
            (buffers if isinstance(item[1], spy.Buffer) else scalars).append(item)
        self.dispatch_split(
            kernel, threads, buffers, scalars, encoder=encoder, dynamic=dynamic, held=held
        )

    def dispatch_split(
        self,
        kernel: Any,
        threads: int,
        buffers: list,
        scalars: list,
        *,
        encoder: Any = None,
        dynamic: Callable[[], dict] | None = None,
        held: list | None = None,
        held_max: int | None = None,
    ) -> None:
        """``dispatch`` with its bindings given apart, in the same order at every call of a
        site: ``buffers`` ``(name, spy.Buffer)`` and ``scalars`` ``(name, value)`` pairs.
        ``held_max``: keep ``held``'s object only while no buffer is past that many bytes (a
        site whose buffers may be large and short-lived: its object would pin them); larger
        ones take the shared cache, as without ``held``.

        >>> kernels.dispatch_split(k, n, [("x", buf)], [("scale", 2.0)], held=site_list)
        """
        rec = capturing.recording()
        if rec is not None:
            rec.record_dispatch(self.queue, kernel, threads, buffers, scalars, dynamic)
        # The batch's encoder is fetched and recorded into under the queue's lock (another
        # thread's submission may take it: command_queue); the queue's lock before the cache's.
        queue = self.queue
        with queue.lock:
            if encoder is None:
                encoder = queue.encoder()
            if encoder is not None:
                self._record(kernel, threads, encoder, buffers, scalars, held, held_max)
                return
            # outside a batch: deferred, its bindings (their buffers) held until submitted
            deferred = queue.deferred_encoder()
            self._record(kernel, threads, deferred, buffers, scalars, held, held_max)
            queue.deferred_added(buffers)

    def _record(
        self,
        kernel: Any,
        threads: int,
        encoder: Any,
        buffers: list,
        scalars: list,
        held: Any = None,
        held_max: int | None = None,
    ) -> None:
        with self._lock:
            root = self.bound_objects.bound(kernel, buffers, scalars, held, held_max)
            if root is None:
                kernel.dispatch([threads, 1, 1], command_encoder=encoder, **dict(buffers + scalars))
                return
            compute = encoder.begin_compute_pass()
            compute.bind_pipeline(kernel.pipeline, root)
            compute.dispatch([threads, 1, 1])
            compute.end()
