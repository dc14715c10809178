"""Issue 16's figures on a GPU, against PyTorch on the same GPU, in one run.

    python benchmarks/bench_gpu.py [--device cuda] [--large 24] [--params 10000000]

Cases (each timed in alternating rounds, synchronised after every call, medians):
- the polynomial of samples/polynomial.slang, forward + ``.bwds`` on 2^large floats: pydiff
  (generated kernels), pydiff on SlangPy's path, raw SlangPy, PyTorch eager autograd and
  PyTorch computing the values and the closed-form gradient in place;
- the 256 x 64 x 64 x 10 MLP step (benchmarks/mlp_step.py): pydiff eager, pydiff.capture
  replayed, PyTorch eager (AdamW, foreach), PyTorch replaying a CUDA graph of the step;
- AdamW over ``--params`` floats: pydiff's fused kernel against torch.optim.AdamW(fused=True),
  and both against a device-to-device copy (GB/s, bytes read + written).

Without CUDA (lavapipe) PyTorch runs on the CPU, so the script can be tried anywhere; the
figures mean something on a GPU. Timings only; the tests never assert on speed.
"""

from __future__ import annotations

import argparse
import os
import traceback
from pathlib import Path

import numpy as np
import slangpy as spy

import pydiff
from pydiff import optim
from pydiff.products import elementwise_kernel

from mlp_step import make_mlp_step
from timing import describe, interleaved

SOURCE = Path(__file__).resolve().parent.parent / "samples" / "polynomial.slang"


def report(title: str, times: dict, base: str, unit: str = "ms") -> None:
    scale = 1e3 if unit == "ms" else 1e6
    print(f"\n{title} (median / best; ratio = time / {base}'s):")
    ref = times[base][0]
    for name, (med, low) in times.items():
        print(f"  {name:<36}{med * scale:>9.3f} {unit}{low * scale:>9.3f} {unit}{med / ref:>8.2f}x")


def polynomial(dev, torch, tdev: str, log2: int, rounds: int) -> None:
    n = 1 << log2
    m = pydiff.load_module(SOURCE, device=dev)
    raw = spy.Module.load_from_file(dev.native, str(SOURCE))
    xs = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    ones = np.ones(n, np.float32)
    x = pydiff.tensor(xs, device=dev, requires_grad=True)
    y = pydiff.zeros((n,), device=dev).with_grads(grad_in=pydiff.tensor(ones, device=dev))
    rx = spy.Tensor.from_numpy(dev.native, xs).with_grads(zero=True)
    ry = spy.Tensor.zeros(dev.native, (n,), "float").with_grads(zero=True)
    ry.grad.copy_from_numpy(ones)

    def sync():
        dev.native.wait_for_idle()

    def ours():
        m.polynomial(2.0, 8.0, -1.0, x, _result=y)
        m.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y)
        sync()

    def slangpy_path():
        os.environ["PYDIFF_GENERATED"] = "0"
        try:
            ours()
        finally:
            del os.environ["PYDIFF_GENERATED"]

    def raw_slangpy():
        raw.polynomial(2.0, 8.0, -1.0, rx, _result=ry)
        raw.polynomial.bwds(2.0, 8.0, -1.0, rx, _result=ry)
        sync()

    fns = {"pydiff": ours, "pydiff, SlangPy's path": slangpy_path, "raw SlangPy": raw_slangpy}
    if torch is not None:
        tsync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
        tx = torch.from_numpy(xs).to(tdev).requires_grad_(True)
        tup = torch.from_numpy(ones).to(tdev)
        out, tmp, grad = torch.empty_like(tup), torch.empty_like(tup), torch.zeros_like(tup)
        xd = tx.detach()

        def torch_autograd():
            tx.grad = None
            (2.0 * tx * tx + 8.0 * tx - 1.0).backward(tup)
            tsync()

        def torch_in_place():
            torch.mul(xd, 2.0, out=out).add_(8.0).mul_(xd).sub_(1.0)
            torch.mul(xd, 4.0, out=tmp).add_(8.0).mul_(tup)
            grad.add_(tmp)
            tsync()

        fns[f"PyTorch ({tdev}) eager autograd"] = torch_autograd
        fns[f"PyTorch ({tdev}) in place, closed form"] = torch_in_place
    times = interleaved(fns, rounds=rounds, inner=5, warmup=3, pause=0.05)
    report(f"polynomial forward + .bwds, 2^{log2} floats", times, "pydiff")


def mlp(dev, torch, tdev: str, rounds: int) -> None:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((256, 64)).astype(np.float32)
    Y = rng.integers(0, 10, 256)
    xb, yb = pydiff.tensor(X, device=dev), pydiff.tensor(Y.astype(np.int32), device=dev)
    _, eager = make_mlp_step(xb, yb)
    _, to_capture = make_mlp_step(xb, yb)
    to_capture()
    captured = pydiff.capture(to_capture)
    fns = {
        "pydiff eager": lambda: (eager(), dev.native.wait_for_idle()),
        "pydiff captured (replay)": lambda: (captured.replay(), dev.native.wait_for_idle()),
    }
    if torch is not None:
        tsync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
        layers = [torch.nn.Linear(64, 64).to(tdev), torch.nn.Linear(64, 10).to(tdev)]
        params = [p for layer in layers for p in layer.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3)
        tx = torch.from_numpy(X).to(tdev)
        ty = torch.from_numpy(Y.astype(np.int64)).to(tdev)

        def step():
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(layers[1](torch.relu(layers[0](tx))), ty)
            loss.backward()
            opt.step()

        fns[f"PyTorch ({tdev}) eager"] = lambda: (step(), tsync())
        if tdev == "cuda":
            graph_opt = torch.optim.AdamW(params, lr=1e-3, capturable=True)

            def graph_step():
                graph_opt.zero_grad(set_to_none=False)
                loss = torch.nn.functional.cross_entropy(layers[1](torch.relu(layers[0](tx))), ty)
                loss.backward()
                graph_opt.step()

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    graph_step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_step()
            fns["PyTorch (cuda) CUDA graph replay"] = lambda: (graph.replay(), tsync())
    times = interleaved(fns, rounds=rounds, inner=20, warmup=5, pause=0.05)
    report("MLP step 256x64x64x10, AdamW", times, "pydiff eager", unit="us")


def adamw(dev, torch, tdev: str, n: int, rounds: int) -> None:
    rng = np.random.default_rng(0)
    p = pydiff.tensor(rng.standard_normal(n).astype(np.float32), device=dev, requires_grad=True)
    p.grad.copy_from_numpy(rng.standard_normal(n).astype(np.float32))
    opt = optim.AdamW([p], lr=1e-3)
    src = pydiff.tensor(np.ones(n, np.float32), device=dev)
    dst = pydiff.zeros((n,), device=dev)

    def sync():
        dev.native.wait_for_idle()

    fns = {
        "pydiff AdamW (fused kernel)": lambda: (opt.step(), sync()),
        "pydiff copy (copy4 kernel)": lambda: (
            elementwise_kernel("copy4", src, x=src, y=dst),
            sync(),
        ),
    }
    moved = {"pydiff AdamW (fused kernel)": 28, "pydiff copy (copy4 kernel)": 8}
    if torch is not None:
        tsync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
        tp = torch.zeros(n, device=tdev, requires_grad=True)
        tp.grad = torch.randn(n, device=tdev)
        fused = {"fused": True} if tdev == "cuda" else {}
        topt = torch.optim.AdamW([tp], lr=1e-3, **fused)
        ts, td = torch.ones(n, device=tdev), torch.empty(n, device=tdev)
        name = f"PyTorch ({tdev}) AdamW{' fused' if fused else ''}"
        fns[name] = lambda: (topt.step(), tsync())
        fns[f"PyTorch ({tdev}) copy_"] = lambda: (td.copy_(ts), tsync())
        moved[name], moved[f"PyTorch ({tdev}) copy_"] = 28, 8
    times = interleaved(fns, rounds=rounds, inner=10, warmup=3, pause=0.05)
    copy_name = f"PyTorch ({tdev}) copy_" if torch is not None else "pydiff copy (copy4 kernel)"
    copy_bw = 8 * n / times[copy_name][0]
    print(
        f"\nAdamW and copies over {n / 1e6:.0f}M floats (GB/s from medians; share of "
        f"{copy_name}'s bandwidth):"
    )
    for label, (med, _) in times.items():
        bw = moved[label] * n / med
        print(f"  {label:<36}{med * 1e3:>8.3f} ms {bw / 1e9:>8.1f} GB/s {bw / copy_bw:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--large", type=int, default=24, help="log2 of the polynomial's size")
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--only", nargs="*", default=["polynomial", "mlp", "adamw"])
    args = ap.parse_args()
    dev = pydiff.create_device(args.device)
    pydiff.set_default_device(dev)
    try:
        import torch

        tdev = "cuda" if dev.type == "cuda" and torch.cuda.is_available() else "cpu"
        print(
            f"device: {describe(dev)}; PyTorch {torch.__version__} on {tdev}"
            + (f" ({torch.cuda.get_device_name()})" if tdev == "cuda" else "")
        )
    except ImportError:
        torch, tdev = None, "none"
        print(f"device: {describe(dev)}; PyTorch not installed")
    cases = {
        "polynomial": lambda: polynomial(dev, torch, tdev, args.large, args.rounds),
        "mlp": lambda: mlp(dev, torch, tdev, args.rounds),
        "adamw": lambda: adamw(dev, torch, tdev, args.params, args.rounds),
    }
    for name in args.only:
        try:
            cases[name]()
        except Exception:  # one case failing must not hide the others' figures
            print(f"\n{name}: FAILED")
            traceback.print_exc()


if __name__ == "__main__":
    main()
